//! One test per policy rule of docs/policy.md (R1–R12) on small hand-built joint graphs. Each
//! names the rule it proves and fails if that behaviour breaks.

use ir::{
    plan::{Collectives, Format},
    wire::plan::{Diagnostic, Plan},
};
use planner::{
    config::{parse_keep, PlanConfig},
    cost::HwProfile,
    plan::{plan, PlanError},
    policy,
};
use testkit::Builder;

const ATTN: (&str, &[(&str, &str)]) = ("SAVE_ATTN", &[("attn.begin", "attn.end")]);
const MLP: (&str, &[(&str, &str)]) = ("SAVE_MLP", &[("mlp.begin", "mlp.end")]);

fn config(keep: &[&str]) -> PlanConfig {
    PlanConfig {
        keep: parse_keep(&keep.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap(),
        ..PlanConfig::default()
    }
}

/// The plan of `graph`, in its named form (what the plan files hold).
fn plan_named(graph: &ir::Graph, config: &PlanConfig) -> Plan {
    let typed = plan(graph, config, &HwProfile::default()).expect("plans");
    ir::plan::wire::to_wire(&typed, graph)
}

fn run(b: &Builder, config: &PlanConfig) -> Plan {
    plan_named(&b.build(), config)
}

fn has_errors(plan: &Plan) -> bool {
    plan.diagnostics.iter().any(|d| d.level == "error")
}

fn decision<'p>(plan: &'p Plan, node: &str) -> (&'p str, &'p str, Option<&'p str>) {
    let n = plan
        .nodes
        .iter()
        .find(|n| n.name == node)
        .unwrap_or_else(|| panic!("no decision for {node}"));
    (n.decision.as_str(), n.reason.as_str(), n.unit.as_deref())
}

fn saved(plan: &Plan) -> Vec<(&str, &str)> {
    plan.saved
        .iter()
        .map(|s| (s.value.as_str(), s.kind.as_str()))
        .collect()
}

fn codes(plan: &Plan) -> Vec<(&str, Option<&str>)> {
    plan.diagnostics
        .iter()
        .map(|d| (d.code.as_str(), d.unit.as_deref()))
        .collect()
}

/// Backward reads every value in `reads` (plus the tangent), one node each.
fn backward(b: &mut Builder, reads: &[&str]) {
    b.backward_through("tangent", reads);
}

/// Layer `l`: x -> sin -> [attn.begin] -> sin(a) -> cos(b) -> [attn.end] -> sin(c) = out.
/// Returns (a, b, c, out) value names; node names are `n<k>` in order.
fn attn_layer(b: &mut Builder, l: u32, x: &str) -> [String; 4] {
    b.layer(Some(l));
    let a = b.op(x);
    let m = b.marker("attn.begin", &a);
    let bb = b.op(&m);
    let c = b.node("aten.cos.default", &[&bb]).1;
    let m2 = b.marker("attn.end", &c);
    let out = b.op(&m2);
    b.layer(None);
    [a, bb, c, out]
}

fn two_layers() -> (Builder, [String; 4], [String; 4]) {
    let mut b = Builder::new(2, &[ATTN, MLP]);
    let x = b.input("x");
    let l0 = attn_layer(&mut b, 0, &x);
    let l1 = attn_layer(&mut b, 1, &l0[3]);
    let reads: Vec<&str> = l0.iter().chain(l1.iter()).map(String::as_str).collect();
    backward(&mut b, &reads);
    (b, l0, l1)
}

#[test]
fn r1_units_resolve_to_marker_intervals_case_insensitively() {
    let (b, l0, _) = two_layers();
    let p = run(&b, &config(&["save_attn"]));
    // n3 = sin(attn.begin) is inside [attn.begin, attn.end) of layer 0.
    assert_eq!(
        decision(&p, "n3"),
        ("save", "kept-interval", Some("SAVE_ATTN"))
    );
    assert!(saved(&p).contains(&(l0[1].as_str(), "kept")));
}

#[test]
fn r2_and_r9_keeping_nothing_saves_only_layer_inputs() {
    let (b, l0, _) = two_layers();
    for keep in [&[][..], &["none"][..], &["NONE"][..]] {
        let p = run(&b, &config(keep));
        assert!(p.nodes.iter().all(|n| n.decision != "save"), "{keep:?}");
        // x (graph input) feeds layer 0; layer 0's output is layer 1's input.
        assert_eq!(
            saved(&p),
            vec![
                ("x", "graph-input"),
                (l0[3].as_str(), "layer-input"),
                ("tangent", "graph-input")
            ]
        );
        assert!(p.units.is_empty());
    }
}

#[test]
fn r2_unknown_unit_is_an_error_naming_the_valid_units() {
    let (b, _, _) = two_layers();
    let err =
        plan(&b.build(), &config(&["save_atn"]), &HwProfile::default()).expect_err("unknown unit");
    assert!(matches!(err, PlanError::Config(_)));
    let message = err.to_string();
    assert!(message.starts_with("unknown-unit: "), "{message}");
    assert!(message.contains("`SAVE_ATN`"), "{message}");
    assert!(message.contains("SAVE_ATTN, SAVE_MLP"), "{message}");
}

#[test]
fn r2_keep_all_warns_for_a_model_without_units() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    let l0 = attn_layer(&mut b, 0, &x);
    b.model("mtp", "main", &[]);
    b.layer(Some(0));
    let y = b.op(&l0[3]);
    b.layer(None);
    backward(&mut b, &[&y]);
    let p = run(&b, &config(&["all"]));
    assert_eq!(codes(&p), vec![("no-units-declared", None)]);
    assert_eq!(p.diagnostics[0].model, "mtp");
    assert_eq!(decision(&p, "n3").0, "save", "main still keeps its units");
}

#[test]
fn r3_recompute_ratio_checkpoints_only_the_first_layers() {
    let (b, _, l1) = two_layers();
    let p = run(
        &b,
        &PlanConfig {
            recompute_ratio: 0.5,
            ..config(&["save_attn"])
        },
    );
    // Layer 0 (index < floor(0.5 × 2) = 1) is checkpointed; layer 1 is not.
    assert_eq!(decision(&p, "n3").0, "save");
    assert_eq!(
        decision(&p, "n9"),
        ("no-checkpoint", "layer-not-checkpointed", None)
    );
    assert!(saved(&p).contains(&(l1[0].as_str(), "not-checkpointed")));
    assert!(p.replay.iter().all(|r| r.layer == 0));
}

#[test]
fn r4_only_ops_inside_an_open_kept_interval_are_kept() {
    let (b, _, _) = two_layers();
    let p = run(&b, &config(&["save_attn"]));
    assert_eq!(
        decision(&p, "n1"),
        ("recompute", "outside-kept-interval", None)
    );
    assert_eq!(decision(&p, "n2"), ("recompute", "marker", None));
    assert_eq!(decision(&p, "n4").0, "save");
    assert_eq!(
        decision(&p, "n6"),
        ("recompute", "outside-kept-interval", None)
    );
}

#[test]
fn r4_unbalanced_markers_are_safe_and_reported() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let e = b.marker("attn.end", &x); // n1: an end without a begin: ignored
    let a = b.op(&e); // n2: outside
    let m = b.marker("attn.begin", &a); // n3
    let c = b.op(&m); // n4: kept until the layer's end
    b.layer(None);
    backward(&mut b, &[&a, &c]);
    let p = run(&b, &config(&["save_attn"]));
    assert_eq!(decision(&p, "n2").1, "outside-kept-interval");
    assert_eq!(decision(&p, "n4").0, "save");
    let d = &p.diagnostics[0];
    assert_eq!(
        (d.code.as_str(), d.unit.as_deref()),
        ("interval-unbalanced", Some("SAVE_ATTN"))
    );
    assert!(
        d.message.contains("`attn.end`: end without a begin"),
        "{}",
        d.message
    );
    assert!(
        d.message.contains("`attn.begin`: begin without an end"),
        "{}",
        d.message
    );
}

#[test]
fn r4_an_end_repeated_on_each_output_of_a_region_closes_once_and_is_no_fault() {
    // A module or method returning two tensors gets the end marker on each of them.
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x); // n1
    let k = b.op(&m); // n2: kept
    let v = b.op(&m); // n3: kept
    let ek = b.marker("attn.end", &k); // n4
    let ev = b.marker("attn.end", &v); // n5: the same close, repeated
    let after = b.op(&ev); // n6: outside
    let stray = b.marker("attn.end", &after); // n7: still the same close
    b.layer(None);
    backward(&mut b, &[&ek, &stray]);
    let p = run(&b, &config(&["save_attn"]));
    assert_eq!(decision(&p, "n2").0, "save");
    assert_eq!(decision(&p, "n3").0, "save");
    assert_eq!(decision(&p, "n6").1, "outside-kept-interval");
    assert!(
        !p.diagnostics
            .iter()
            .any(|d| d.code == "interval-unbalanced"),
        "{:?}",
        p.diagnostics
    );
}

#[test]
fn r4_crossing_intervals_keep_if_any_is_open_credit_the_inner_one_and_are_reported() {
    let mut b = Builder::new(1, &[ATTN, MLP]);
    let x = b.input("x");
    b.layer(Some(0));
    let m1 = b.marker("attn.begin", &x); // n1
    let a = b.op(&m1); // n2: attn
    let m2 = b.marker("mlp.begin", &a); // n3
    let c = b.op(&m2); // n4: both open
    let m3 = b.marker("attn.end", &c); // n5
    let d = b.op(&m3); // n6: mlp only
    let m4 = b.marker("mlp.end", &d); // n7
    b.layer(None);
    backward(&mut b, &[&a, &c, &d, &m4]);
    let p = run(&b, &config(&["all"]));
    // n4 runs while both are open: credited to the interval opened last.
    assert_eq!(
        decision(&p, "n4"),
        ("save", "kept-interval", Some("SAVE_MLP"))
    );
    assert_eq!(
        decision(&p, "n6"),
        ("save", "kept-interval", Some("SAVE_MLP"))
    );
    assert_eq!(codes(&p), vec![("interval-overlap", Some("SAVE_ATTN"))]);
    let message = &p.diagnostics[0].message;
    assert!(message.contains("cross in layer 0"), "{message}");
}

#[test]
fn r4_nested_intervals_are_not_an_overlap_and_credit_the_inner_unit() {
    const INDEXER: (&str, &[(&str, &str)]) = ("SAVE_DSA_INDEXER", &[("idx.begin", "idx.end")]);
    let mut b = Builder::new(1, &[ATTN, INDEXER]);
    let x = b.input("x");
    b.layer(Some(0));
    let m1 = b.marker("attn.begin", &x); // n1
    let a = b.op(&m1); // n2: attention only
    let m2 = b.marker("idx.begin", &a); // n3
    let c = b.op(&m2); // n4: inside the indexer, inside attention
    let m3 = b.marker("idx.end", &c); // n5
    let d = b.op(&m3); // n6: attention only
    let m4 = b.marker("attn.end", &d); // n7
    b.layer(None);
    backward(&mut b, &[&a, &c, &d, &m4]);
    let p = run(&b, &config(&["all"]));
    assert_eq!(decision(&p, "n2").2, Some("SAVE_ATTN"));
    assert_eq!(decision(&p, "n4").2, Some("SAVE_DSA_INDEXER"));
    assert_eq!(decision(&p, "n6").2, Some("SAVE_ATTN"));
    assert_eq!(codes(&p), vec![], "nesting is not an overlap");
    let credited: Vec<(&str, u64)> = p
        .units
        .iter()
        .map(|u| (u.unit.as_str(), u.kept_ops))
        .collect();
    assert_eq!(credited, vec![("SAVE_ATTN", 2), ("SAVE_DSA_INDEXER", 1)]);
}

#[test]
fn r4_interval_contents_lists_each_interval_by_marker_position_nested_and_empty() {
    const INDEXER: (&str, &[(&str, &str)]) = ("SAVE_DSA_INDEXER", &[("idx.begin", "idx.end")]);
    let mut b = Builder::new(1, &[ATTN, INDEXER, MLP]);
    let x = b.input("x");
    b.layer(Some(0));
    let m1 = b.marker("attn.begin", &x); // n1
    let a = b.op(&m1); // n2
    let m2 = b.marker("idx.begin", &a); // n3
    let c = b.op(&m2); // n4
    let m3 = b.marker("idx.end", &c); // n5
    let m4 = b.marker("attn.end", &m3); // n6
    let m5 = b.marker("mlp.begin", &m4); // n7
    let m6 = b.marker("mlp.end", &m5); // n8: the MLP interval encloses nothing
    let d = b.op(&m6); // n9: outside every interval
    b.layer(None);
    backward(&mut b, &[&a, &c, &d]);
    let graph = b.build();
    let listed: Vec<(&str, Vec<&str>)> = policy::interval_contents(&graph)
        .iter()
        .map(|contents| {
            let names = contents
                .nodes
                .iter()
                .map(|&id| graph.node(id).name.as_str());
            (contents.begin, names.collect())
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            ("attn.begin", vec!["n2", "n4"]),
            ("idx.begin", vec!["n4"]),
            ("mlp.begin", vec![]),
        ]
    );
}

#[test]
fn r5_mutable_ops_and_collectives_are_never_kept_by_default() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x);
    let zeros = b.node("aten.zeros_like.default", &[&m]).1; // n2: kept
    let other = b.op(&m); // n3: kept
    let _ = b.node_with(
        "aten.add_.Tensor", // n4: writes the output of kept n3: see below
        &[&other, &m],
        None,
    );
    let a2a = b
        .node("_c10d_functional.all_to_all_single.default", &[&zeros])
        .1; // n5
    let w = b.node("_c10d_functional.wait_tensor.default", &[&a2a]).1; // n6
    let alltoall = b.node("c10d.alltoall_base_.default", &[&w]).1; // n7
    let end = b.marker("attn.end", &alltoall);
    b.layer(None);
    backward(&mut b, &[&w, &end]);
    let graph = b.build();
    let p = plan_named(&graph, &config(&["save_attn"]));
    assert_eq!(decision(&p, "n4"), ("recompute", "mutable", None));
    assert_eq!(decision(&p, "n5"), ("recompute", "collective", None));
    assert_eq!(decision(&p, "n6"), ("recompute", "collective", None));
    assert_eq!(decision(&p, "n7"), ("recompute", "mutable", None));
    // n4 writes `other`, the output of kept n3, and nothing resident: n3 is recomputed and
    // replays with n4 instead of being saved and written twice.
    assert_eq!(decision(&p, "n3"), ("recompute", "written-in-place", None));
    assert!(!has_errors(&p));
    assert_eq!(
        codes(&p),
        vec![("kept-output-written-in-place", Some("SAVE_ATTN"))]
    );

    let save = PlanConfig {
        collectives: Collectives::Save,
        ..config(&["save_attn"])
    };
    let p = plan_named(&graph, &save);
    // `--collectives save` would keep the all-to-all, but the mutating collective n7 writes
    // its buffer later (through the wait): it replays with its writer instead.
    assert_eq!(decision(&p, "n5"), ("recompute", "written-in-place", None));
    // wait_tensor aliases the collective's buffer: not saved on its own.
    assert_eq!(decision(&p, "n6"), ("recompute", "collective", None));
    assert_eq!(
        decision(&p, "n7"),
        ("recompute", "mutable", None),
        "mutating: never"
    );
}

/// One layer under SAVE_ATTN: `kept = sin(m)`, a reader of `kept`, then `writer` writes
/// `kept` in place (and, with `also_writes`, that tensor too); backward reads both.
fn written_kept_output(also_writes: Option<&str>) -> Plan {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    let extra = also_writes.map(|name| b.input(name));
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x); // n1
    let kept = b.op(&m); // n2: kept
    let sum = b.node("aten.sum.default", &[&kept]).1; // n3: kept, reads n2 before the write
    let mut written = vec![kept.as_str()];
    written.extend(extra.as_deref());
    // n4: writes n2's output in place (and the extra input)
    let written = b.write_in_place("mystery.normalise_.default", &written, &[&sum]);
    let end = b.marker("attn.end", &written); // n5
    b.layer(None);
    backward(&mut b, &[&kept, &sum, &end]);
    run(&b, &config(&["save_attn"]))
}

#[test]
fn r5_a_kept_op_whose_output_is_written_later_is_demoted_and_replays_with_its_writer() {
    let p = written_kept_output(None);
    assert!(!has_errors(&p));
    assert_eq!(decision(&p, "n2"), ("recompute", "written-in-place", None));
    // The reader of the unwritten value stays kept: it ran before the write.
    assert_eq!(decision(&p, "n3").0, "save");
    let replayed: Vec<&str> = p
        .replay
        .iter()
        .flat_map(|r| &r.nodes)
        .map(|n| n.as_str())
        .collect();
    assert!(
        replayed.contains(&"n2") && replayed.contains(&"n4"),
        "{replayed:?}"
    );
    let d = &p.diagnostics[0];
    assert_eq!(
        (d.code.as_str(), d.level.as_str()),
        ("kept-output-written-in-place", "info")
    );
    assert!(
        d.message
            .contains("`n4` (mystery.normalise_.default) writes its output"),
        "{}",
        d.message
    );
}

#[test]
fn r5_a_write_that_would_corrupt_a_resident_tensor_too_is_an_error_naming_the_op() {
    let p = written_kept_output(Some("running_stats"));
    assert!(has_errors(&p));
    let d = &p.diagnostics[0];
    assert_eq!(d.code, "inplace-in-kept-interval");
    assert!(
        d.message
            .contains("`n4` (mystery.normalise_.default) writes `v2`"),
        "{}",
        d.message
    );
}

#[test]
fn r5_collectives_save_keeps_functional_collectives_and_host_copies_outside_intervals() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a2a = b
        .node("_c10d_functional.all_to_all_single.default", &[&x])
        .1; // n1
    let (_, counts) = b.node("aten._to_copy.default", &[&a2a]); // n2
    b.layer(None);
    let mut wire = b.wire();
    wire.nodes[1].attributes.push(ir::wire::graph::Attribute {
        name: "device".into(),
        value: Some(ir::wire::graph::attribute::Value::Str("cpu".into())),
    });
    let mut b2 = b;
    backward(&mut b2, &[&counts]);
    let mut wire2 = b2.wire();
    wire2.nodes[1] = wire.nodes[1].clone();
    let graph = ir::Graph::from_wire(wire2).unwrap();
    let recompute = plan_named(&graph, &config(&[]));
    assert_eq!(
        decision(&recompute, "n2"),
        ("recompute", "outside-kept-interval", None)
    );
    let save = plan_named(
        &graph,
        &PlanConfig {
            collectives: Collectives::Save,
            ..config(&[])
        },
    );
    assert_eq!(decision(&save, "n1"), ("save", "saved-collective", None));
    assert_eq!(decision(&save, "n2"), ("save", "saved-collective", None));
    assert!(save.replay.is_empty(), "{:?}", save.replay);
}

#[test]
fn r6_compiled_contents_are_never_kept_and_the_unit_is_reported_inert() {
    let mut b = Builder::new(1, &[MLP]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("mlp.begin", &x); // eager markers...
    b.region("layers.0.shared_experts");
    let a = b.op(&m); // ...around compiled contents
    b.region("");
    let e = b.marker("mlp.end", &a);
    b.layer(None);
    backward(&mut b, &[&a, &e]);
    let p = run(&b, &config(&["save_mlp"]));
    assert_eq!(decision(&p, "n2"), ("recompute", "compiled", None));
    let d = &p.diagnostics[0];
    assert_eq!(
        (d.code.as_str(), d.unit.as_deref()),
        ("interval-inert", Some("SAVE_MLP"))
    );
    assert!(
        d.message
            .contains("its contents run in compiled region `layers.0.shared_experts`"),
        "{}",
        d.message
    );
}

#[test]
fn r6_markers_inside_a_compiled_region_never_fire() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    b.region("layers.0");
    let m = b.marker("attn.begin", &x);
    let a = b.op(&m);
    let e = b.marker("attn.end", &a);
    b.region("");
    b.layer(None);
    backward(&mut b, &[&a, &e]);
    let p = run(&b, &config(&["save_attn"]));
    assert!(p.nodes.iter().all(|n| n.decision != "save"));
    let found = codes(&p);
    assert!(
        found.contains(&("interval-inert", Some("SAVE_ATTN"))),
        "{found:?}"
    );
    assert!(
        found.contains(&("layer-compiled-as-one-region", None)),
        "{found:?}"
    );
    let inert = p
        .diagnostics
        .iter()
        .find(|d| d.code == "interval-inert")
        .unwrap();
    assert!(
        inert.message.contains("markers never fire"),
        "{}",
        inert.message
    );
}

#[test]
fn r7_diagnostics_are_per_model_and_deduplicated_per_diagnosis() {
    let mut b = Builder::new(2, &[MLP]);
    let x = b.input("x");
    let mut h = x.clone();
    let mut reads = Vec::new();
    for (model, layers) in [("main", [0, 1]), ("mtp", [0, 1])] {
        if model == "mtp" {
            b.model("mtp", "main", &[MLP]);
        }
        for l in layers {
            b.layer(Some(l));
            let m = b.marker("mlp.begin", &h);
            b.region("compiled");
            h = b.op(&m);
            b.region("");
            h = b.marker("mlp.end", &h);
            reads.push(h.clone());
        }
    }
    b.layer(None);
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    backward(&mut b, &reads);
    let p = run(&b, &config(&["save_mlp"]));
    let inert: Vec<&str> = p
        .diagnostics
        .iter()
        .filter(|d| d.code == "interval-inert")
        .map(|d| d.model.as_str())
        .collect();
    // One per model (two layers each), not one per layer, and the second model is not silenced.
    assert_eq!(inert, vec!["main", "mtp"]);
    assert!(p.diagnostics[0].message.contains("layers 0, 1"));
}

#[test]
fn r7_a_marker_missing_from_the_model_is_reported() {
    let (b, _, _) = two_layers();
    let p = run(&b, &config(&["save_mlp"]));
    let d = &p.diagnostics[0];
    assert_eq!(
        (d.code.as_str(), d.unit.as_deref()),
        ("marker-missing", Some("SAVE_MLP"))
    );
    assert!(
        d.message.contains("`mlp.begin`, `mlp.end`"),
        "{}",
        d.message
    );
}

#[test]
fn names_in_diagnostics_are_escaped_and_shortened_to_one_line() {
    let long = format!("mlp.begin\n\u{1b}[2J{}", "x".repeat(100_000));
    let unit: (&str, &[(&str, &str)]) = ("SAVE_MLP", &[(&long, "mlp.end")]);
    let mut b = Builder::new(1, &[unit]);
    let x = b.input("x");
    b.layer(Some(0));
    let y = b.op(&x);
    b.layer(None);
    backward(&mut b, &[&y]);
    let p = run(&b, &config(&["save_mlp"]));
    let d = &p.diagnostics[0];
    assert_eq!(d.code, "marker-missing");
    assert!(!d.message.chars().any(char::is_control), "{:?}", d.message);
    assert!(
        d.message.contains("mlp.begin\\n\\u{1b}[2J"),
        "{}",
        d.message
    );
    assert!(d.message.len() < 1_000, "{} bytes", d.message.len());
}

#[test]
fn r7_replaying_a_topk_is_reported_with_the_unit_that_would_save_it() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x);
    let t = b.node("aten.topk.default", &[&m]).1;
    let e = b.marker("attn.end", &t);
    b.layer(None);
    backward(&mut b, &[&t, &e]);
    let p = run(&b, &config(&[]));
    let d = &p.diagnostics[0];
    assert_eq!(d.code, "nondeterministic-replay");
    assert_eq!(d.unit.as_deref(), Some("SAVE_ATTN"));
    assert!(d.hint.contains("keep unit SAVE_ATTN"));
    let kept = run(&b, &config(&["save_attn"]));
    assert!(kept.diagnostics.is_empty(), "{:?}", kept.diagnostics);
    assert!(kept
        .replay
        .iter()
        .all(|r| !r.nodes.iter().any(|n| n == "n2")));
}

#[test]
fn r8_views_are_replayed_from_their_saved_base_and_each_replayed_op_runs_before_its_first_use() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x);
    let a = b.op(&m); // n2: kept
    let v = b.node("aten.view.default", &[&a]).1; // n3: a view of a kept value
    let e = b.marker("attn.end", &v);
    let c = b.op(&e); // n5: outside
    b.layer(None);
    let t = b.tangent("tangent");
    b.backward();
    let g1 = b.node("aten.mul.Tensor", &[&t, &t]).1; // n6: reads nothing of forward
    let g2 = b.node("aten.mul.Tensor", &[&v, &g1]).1; // n7: first use of the view
    let g3 = b.node("aten.mul.Tensor", &[&c, &g2]).1; // n8
    b.output(&g3);
    let p = run(&b, &config(&["save_attn"]));
    assert_eq!(decision(&p, "n3"), ("recompute", "view", None));
    let saved = saved(&p);
    assert!(saved.contains(&(a.as_str(), "kept")), "{saved:?}");
    assert!(
        !saved.iter().any(|(value, _)| *value == v),
        "a view is never saved: {saved:?}"
    );
    // The view just before n7 reads it; the end marker and n5 (which reads it) before n8.
    assert_eq!(
        replay_steps(&p),
        vec![("n7", vec!["n3"]), ("n8", vec!["n4", "n5"])]
    );
}

/// (before, nodes) of each replay step, in schedule order.
fn replay_steps(p: &Plan) -> Vec<(&str, Vec<&str>)> {
    p.replay
        .iter()
        .map(|r| {
            (
                r.before.as_str(),
                r.nodes.iter().map(String::as_str).collect(),
            )
        })
        .collect()
}

/// A layer `x -> n1 -> n3 -> n4`, with n2 reading n1's output before n3 does; backward reads
/// n4's output first and n2's second. With `write`, n3 writes n1's output in place.
fn read_before_write(write: bool) -> Builder {
    let mut b = Builder::new(1, &[]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    let r = b.op(&a); // n2: reads a before n3
    let w = if write {
        b.write_in_place("aten.mul_.Tensor", &[&a], &[&x]) // n3
    } else {
        b.node("aten.mul.Tensor", &[&a, &x]).1 // n3
    };
    let c = b.op(&w); // n4
    b.layer(None);
    let t = b.tangent("tangent");
    b.backward();
    let g1 = b.node("aten.mul.Tensor", &[&c, &t]).1; // n5
    let g2 = b.node("aten.mul.Tensor", &[&r, &g1]).1; // n6
    b.output(&g2);
    b
}

#[test]
fn each_replayed_op_runs_just_before_the_backward_node_that_needs_it() {
    let p = run(&read_before_write(false), &config(&[]));
    assert_eq!(
        replay_steps(&p),
        vec![("n5", vec!["n1", "n3", "n4"]), ("n6", vec!["n2"])]
    );
}

#[test]
fn a_replayed_read_of_a_tensor_written_in_place_keeps_its_place_before_the_write() {
    // n2 must read n1's output before n3 writes it: it replays with n3, not at its own use.
    let p = run(&read_before_write(true), &config(&[]));
    assert_eq!(replay_steps(&p), vec![("n5", vec!["n1", "n2", "n3", "n4"])]);
}

#[test]
fn r10_each_micro_batch_runs_its_own_marker_session() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    let mut reads = Vec::new();
    b.layer(Some(0));
    for mb in 0..2 {
        b.micro_batch(mb);
        let m = b.marker("attn.begin", &x);
        let a = b.op(&m);
        let e = b.marker("attn.end", &a);
        reads.extend([a, e]);
    }
    b.micro_batch(0).layer(None);
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    backward(&mut b, &reads);
    let p = run(&b, &config(&["save_attn"]));
    assert_eq!(decision(&p, "n2").0, "save");
    assert_eq!(decision(&p, "n5").0, "save");
    assert_eq!(p.units[0].kept_ops, 2);
    assert!(p.diagnostics.is_empty(), "{:?}", p.diagnostics);
}

#[test]
fn r11_output_is_deterministic_and_fingerprinted() {
    let (b, _, _) = two_layers();
    let graph = b.build();
    let hw = HwProfile::default();
    let json = |g: &ir::Graph| {
        let p = plan(g, &config(&["all"]), &hw).unwrap();
        String::from_utf8(p.encode(g, Format::Json)).unwrap()
    };
    let (one, two) = (json(&graph), json(&b.build()));
    assert_eq!(one, two);
    assert!(one.contains(&format!("\"fingerprint\": \"{}\"", graph.fingerprint())));
    assert_eq!(graph.fingerprint().len(), 32);
    let (mut other, _, _) = two_layers();
    other.output("x");
    assert_ne!(other.build().fingerprint(), graph.fingerprint());
}

#[test]
fn forward_only_graphs_get_decisions_but_no_partition() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    let l0 = attn_layer(&mut b, 0, &x);
    b.output(&l0[3]);
    let graph = b.build();
    let typed = plan(&graph, &config(&["save_attn"]), &HwProfile::default()).unwrap();
    let text = planner::render::text(&typed, &graph);
    let p = ir::plan::wire::to_wire(&typed, &graph);
    assert!(!p.joint);
    assert_eq!(decision(&p, "n3").0, "save");
    assert!(p.saved.is_empty() && p.replay.is_empty());
    assert!(text.contains("needs a joint forward+backward graph"));
}

#[test]
fn r12_random_ops_are_saved_by_default_or_replay_with_their_state_and_the_plan_says_which() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1
    let dropped = b.node("aten.native_dropout.default", &[&a]).1; // n2: outside any interval
    let c = b.op(&dropped); // n3
    b.layer(None);
    backward(&mut b, &[&dropped, &c]);
    let saved = run(&b, &config(&[]));
    assert_eq!(decision(&saved, "n2"), ("save", "random", None));
    assert_eq!(saved.config.as_ref().unwrap().random_ops, "save");
    assert_eq!(codes(&saved), vec![("random-op-saved", None)]);
    assert!(saved
        .replay
        .iter()
        .all(|r| !r.nodes.contains(&"n2".to_owned())));

    let replay = run(
        &b,
        &PlanConfig {
            random_ops: ir::plan::RandomOps::Replay,
            ..config(&[])
        },
    );
    assert_eq!(
        decision(&replay, "n2"),
        ("recompute", "random-replayed", None)
    );
    assert_eq!(replay.config.as_ref().unwrap().random_ops, "replay");
    assert_eq!(codes(&replay), vec![("random-op-replayed", None)]);
    let d = &replay.diagnostics[0];
    assert_eq!(d.level, "info");
    assert!(d.message.contains("must restore it"), "{}", d.message);
}

/// The `no-layers-annotated` warning of a model declaring `num_layers` whose ops carry no
/// layer index: every op stays outside layers, whatever `keep` says.
fn no_layers_warning(num_layers: u32, units: &[(&str, &[(&str, &str)])], keep: &str) -> Diagnostic {
    let mut b = Builder::new(num_layers, units);
    let x = b.input("x");
    let a = b.op(&x);
    let c = b.op(&a);
    backward(&mut b, &[&a, &c]);
    let p = run(&b, &config(&[keep]));
    assert!(p.nodes.iter().all(|n| n.decision == "no-checkpoint"));
    let d = p
        .diagnostics
        .into_iter()
        .find(|d| d.code == "no-layers-annotated")
        .expect("warned");
    assert_eq!(d.level, "warning");
    d
}

#[test]
fn a_model_with_layers_but_no_layer_annotations_is_a_warning_with_a_hint() {
    let d = no_layers_warning(2, &[ATTN], "all");
    assert!(d.message.contains("declares 2 layers"), "{}", d.message);
    assert!(d.hint.contains("layer_scope"), "{}", d.hint);
}

#[test]
fn a_model_that_declares_no_layers_is_a_warning_so_deny_warnings_refuses_it() {
    // What `rp.export` of a model nobody annotated produces: no layer declared, no op in one.
    let d = no_layers_warning(0, &[], "none");
    assert!(
        d.message.contains("declares no decoder layers"),
        "{}",
        d.message
    );
    assert!(d.hint.contains("recompute_planner.annotate"), "{}", d.hint);
}

#[test]
fn a_hint_never_recommends_keeping_a_unit_that_plan_would_reject() {
    let plan_for = |corrupting: bool| {
        let mut b = Builder::new(1, &[ATTN]);
        let x = b.input("x");
        let stats = b.input("running_stats");
        b.layer(Some(0));
        let m = b.marker("attn.begin", &x); // n1
        let kept = b.op(&m); // n2
        let written = if corrupting {
            b.write_in_place("mystery.normalise_.default", &[&kept, &stats], &[])
        } else {
            b.write_in_place("mystery.normalise_.default", &[&kept], &[&stats])
        }; // n3
        let top = b.node("aten.topk.default", &[&written]).1; // n4
        let end = b.marker("attn.end", &top);
        b.layer(None);
        backward(&mut b, &[&top, &end]);
        run(&b, &config(&[]))
    };
    let hint = |p: &Plan| {
        let d = p
            .diagnostics
            .iter()
            .find(|d| d.code == "nondeterministic-replay")
            .expect("topk replays");
        d.hint.clone()
    };
    assert!(hint(&plan_for(false)).starts_with("keep unit SAVE_ATTN"));
    let rejected = hint(&plan_for(true));
    assert!(!rejected.starts_with("keep unit"), "{rejected}");
    assert!(rejected.contains("keeping it is rejected"), "{rejected}");
}

#[test]
fn every_diagnostic_code_is_documented_with_its_level() {
    let doc = std::fs::read_to_string(testkit::repo_root().join("docs/diagnostics.md")).unwrap();
    for &code in ir::plan::Code::ALL {
        let level = planner::diagnostics::level_of(code);
        let heading = format!("### `{}` ({level})", code.name());
        assert!(
            doc.contains(&heading),
            "docs/diagnostics.md lacks `{heading}`"
        );
    }
}

/// `graph` with attribute `name` = `value` added to node `node`.
fn with_attribute(
    mut wire: ir::wire::graph::Graph,
    node: &str,
    name: &str,
    value: ir::wire::graph::attribute::Value,
) -> ir::Graph {
    let n = wire.nodes.iter_mut().find(|n| n.name == node).unwrap();
    n.attributes.push(ir::wire::graph::Attribute {
        name: name.to_owned(),
        value: Some(value),
    });
    ir::Graph::from_wire(wire).unwrap()
}

#[test]
fn a_stable_sort_replays_deterministically_and_a_zero_dropout_draws_nothing() {
    use ir::wire::graph::attribute::Value as A;
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let sorted = b.node("aten.sort.stable", &[&x]).1; // n1
    let dropped = b.node("aten.native_dropout.default", &[&sorted]).1; // n2
    b.layer(None);
    backward(&mut b, &[&sorted, &dropped]);
    let plain = plan_named(&b.build(), &config(&[]));
    assert_eq!(
        codes(&plain),
        vec![("nondeterministic-replay", None), ("random-op-saved", None)]
    );
    let stable = with_attribute(b.wire(), "n1", "stable", A::Bool(true));
    let zero = with_attribute(b.wire(), "n2", "p", A::Float(0.0));
    assert_eq!(
        codes(&plan_named(&stable, &config(&[]))),
        vec![("random-op-saved", None)]
    );
    assert_eq!(
        codes(&plan_named(&zero, &config(&[]))),
        vec![("nondeterministic-replay", None)]
    );
}

/// The fused attention kernels PyTorch dispatches to (CPU flash, math, CUDA flash, efficient,
/// cuDNN) and the composite op, as the exporter writes them: random by their schema.
const ATTENTION_OPS: &[&str] = &[
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten.scaled_dot_product_attention.default",
];

/// One checkpointed layer around attention `op` (node `n2`), random by its schema facts.
fn attention_layer(op: &str) -> Builder {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let q = b.op(&x); // n1
    let random = ir::wire::graph::SchemaFacts {
        random: true,
        ..Default::default()
    };
    let out = b.node_with(op, &[&q, &q, &q], Some(random)).1; // n2
    let y = b.op(&out); // n3
    b.layer(None);
    backward(&mut b, &[&q, &out, &y]);
    b
}

#[test]
fn attention_with_the_default_dropout_draws_nothing_and_whole_layer_recompute_saves_none_of_it() {
    use ir::wire::graph::attribute::Value as A;
    for &op in ATTENTION_OPS {
        let b = attention_layer(op);
        let causal = with_attribute(b.wire(), "n2", "is_causal", A::Bool(true));
        let explicit_zero = with_attribute(b.wire(), "n2", "dropout_p", A::Float(0.0));
        for graph in [b.build(), causal, explicit_zero] {
            let p = plan_named(&graph, &config(&["none"]));
            assert_eq!(decision(&p, "n2").0, "recompute", "{op}");
            let graph_inputs = vec![("x", "graph-input"), ("tangent", "graph-input")];
            assert_eq!(saved(&p), graph_inputs, "{op}");
            assert!(codes(&p).is_empty(), "{op}: {:?}", codes(&p));
        }
    }
}

#[test]
fn attention_with_dropout_is_random_and_saved_unless_replay_restores_its_generator_state() {
    use ir::wire::graph::attribute::Value as A;
    for &op in ATTENTION_OPS {
        let dropout = with_attribute(attention_layer(op).wire(), "n2", "dropout_p", A::Float(0.1));
        let p = plan_named(&dropout, &config(&["none"]));
        assert_eq!(decision(&p, "n2"), ("save", "random", None), "{op}");
        assert_eq!(codes(&p), vec![("random-op-saved", None)], "{op}");
        let replay = PlanConfig {
            random_ops: ir::plan::RandomOps::Replay,
            ..config(&["none"])
        };
        let p = plan_named(&dropout, &replay);
        assert_eq!(decision(&p, "n2").0, "recompute", "{op}");
    }
}

#[test]
fn r4_thousands_of_units_on_one_interval_are_one_interval_not_thousands_of_overlaps() {
    let names: Vec<String> = (0..4000).map(|u| format!("SAVE_U{u}")).collect();
    let interval: &[(&str, &str)] = &[("attn.begin", "attn.end")];
    let units: Vec<(&str, &[(&str, &str)])> =
        names.iter().map(|n| (n.as_str(), interval)).collect();
    let mut b = Builder::new(2, &units);
    let x = b.input("x");
    let mut h = x;
    let mut reads = Vec::new();
    for l in 0..2 {
        b.layer(Some(l));
        let m = b.marker("attn.begin", &h);
        let a = b.op(&m);
        let e = b.marker("attn.end", &a);
        h = b.op(&e);
        reads.push(a);
    }
    b.layer(None);
    backward(
        &mut b,
        &reads.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let p = run(&b, &config(&["all"]));
    // Identical intervals are nested in each other, never crossing: no overlap reported, and
    // the kept op is credited once.
    assert_eq!(codes(&p), vec![]);
    assert_eq!(p.units.len(), 1);
    assert_eq!(p.units[0].kept_ops, 2);
}

/// Replayed node names and saved value names of a named plan.
fn replayed_and_saved(p: &Plan) -> (Vec<&str>, Vec<&str>) {
    let replayed = p
        .replay
        .iter()
        .flat_map(|r| &r.nodes)
        .map(String::as_str)
        .collect();
    let saved = p.saved.iter().map(|s| s.value.as_str()).collect();
    (replayed, saved)
}

#[test]
fn eager_recompute_reruns_the_layer_prefix_and_caches_every_kept_output() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let v1 = b.op(&x); // n1
    let m = b.marker("attn.begin", &x); // n2
    let v3 = b.node("aten.topk.default", &[&m]).1; // n3: kept
    let v4 = b.op(&v3); // n4: kept
    let e = b.marker("attn.end", &v4); // n5
    let v6 = b.op(&e); // n6: after the last op backward reads
    b.layer(None);
    backward(&mut b, &[&v1, &v4, &v6]);
    let graph = b.build();
    let eager = PlanConfig {
        executor: ir::plan::Executor::Eager,
        ..config(&["all"])
    };
    let g = plan_named(&graph, &config(&["all"]));
    let e = plan_named(&graph, &eager);
    assert_eq!(e.config.as_ref().unwrap().executor, "eager");
    let (g_replayed, g_saved) = replayed_and_saved(&g);
    let (e_replayed, e_saved) = replayed_and_saved(&e);
    // The graph executor re-runs what backward reads; eager re-runs the prefix to the last op
    // backward reads (markers included), kept ops served from the cache.
    assert_eq!(g_replayed, ["n1", "n5", "n6"]);
    assert_eq!(e_replayed, ["n1", "n2", "n5", "n6"]);
    // The cache holds every kept output, backward-read or not.
    assert!(!g_saved.contains(&v3.as_str()) && e_saved.contains(&v3.as_str()));
    assert!(g_saved.contains(&v4.as_str()) && e_saved.contains(&v4.as_str()));
}

#[test]
fn eager_recompute_that_would_write_a_layer_input_again_is_an_error() {
    let mut b = Builder::new(1, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1 reads x before the write
    let written = b.node("aten.add_.Tensor", &[&x, &a]).1; // n2 writes the layer input x
    let c = b.op(&written); // n3
    b.layer(None);
    backward(&mut b, &[&a, &c]);
    let graph = b.build();
    let graph_plan = plan_named(&graph, &config(&[]));
    assert!(!has_errors(&graph_plan), "{:?}", graph_plan.diagnostics);
    let eager = plan_named(
        &graph,
        &PlanConfig {
            executor: ir::plan::Executor::Eager,
            ..config(&[])
        },
    );
    let d = eager
        .diagnostics
        .iter()
        .find(|d| d.code == "eager-replay-unfaithful")
        .expect("reported");
    assert_eq!(d.level, "error");
    assert!(d.message.contains("`x`"), "{}", d.message);
}

#[test]
fn eager_recompute_stops_before_what_the_next_checkpoint_saves() {
    let mut b = Builder::new(2, &[ATTN]);
    let x = b.input("x");
    b.layer(Some(0));
    let a = b.op(&x); // n1: backward reads it
    let bb = b.op(&a); // n2
    let c = b.op(&bb); // n3: the next layer's input, which its checkpoint saves
    b.layer(Some(1));
    let d = b.op(&c); // n4
    b.layer(None);
    backward(&mut b, &[&d, &c, &a]);
    let eager = PlanConfig {
        executor: ir::plan::Executor::Eager,
        ..config(&[])
    };
    let p = run(&b, &eager);
    let layer0: Vec<&str> = p
        .replay
        .iter()
        .filter(|r| r.layer == 0)
        .flat_map(|r| &r.nodes)
        .map(String::as_str)
        .collect();
    assert_eq!(layer0, ["n1"]);
}

#[test]
fn an_alias_saved_for_a_later_layer_is_not_written_again_by_replay() {
    // Layer 0 writes in place the `wait_tensor` alias of an all-to-all's output; layer 1 reads
    // that alias, so it is saved as layer 1's input while its storage's root is replayable.
    // Replaying the write would write the saved tensor twice: the writer stays resident.
    let mut b = Builder::new(2, &[ATTN]);
    let x = b.input("x");
    let w = b.param("w");
    b.layer(Some(0));
    let sent = b
        .node("_c10d_functional.all_to_all_single.default", &[&x])
        .1;
    let waited = b.node("_c10d_functional.wait_tensor.default", &[&sent]).1;
    let written = b.write_in_place("aten.add_.Tensor", &[&waited], &[&x]);
    let h = b.op(&written);
    b.layer(Some(1));
    let y = b.node("aten.mm.default", &[&waited, &w]).1;
    b.layer(None);
    backward(&mut b, &[&y, &h, &written]);
    for keep in [&[][..], &["all"][..]] {
        let p = run(&b, &config(keep));
        assert!(!has_errors(&p), "{keep:?}: {:?}", p.diagnostics);
    }
}

#[test]
fn a_diagnostic_names_runs_of_layers_as_ranges_and_stays_short() {
    let layers = 40;
    let mut b = Builder::new(layers, &[ATTN]);
    let mut h = b.input("x");
    let mut reads = Vec::new();
    for l in 0..layers {
        b.layer(Some(l));
        let m = b.marker("attn.begin", &h);
        let t = b.node("aten.topk.default", &[&m]).1;
        h = b.marker("attn.end", &t);
        reads.push(t);
    }
    b.layer(None);
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    backward(&mut b, &reads);
    let p = run(&b, &config(&[]));
    let d = p
        .diagnostics
        .iter()
        .find(|d| d.code == "nondeterministic-replay")
        .expect("replayed top-k is reported");
    assert!(
        d.message.contains("in layers 0-39 of model"),
        "{}",
        d.message
    );
}
