//! The rules on the exporter's golden graphs (real PyTorch joint graphs, `tests/golden/`).
//! Each test names the behaviour it pins; the full text plans are in `tests/golden/plans/`.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use ir::{
    plan::{Collectives, Format},
    wire::plan::{self as named, Plan},
    Graph,
};
use planner::{
    config::{parse_keep, PlanConfig},
    cost::HwProfile,
    plan::plan,
};

fn golden(name: &str) -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(format!("{name}.pb"));
    ir::io::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn keep(units: &[&str]) -> PlanConfig {
    PlanConfig {
        keep: parse_keep(&units.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap(),
        ..PlanConfig::default()
    }
}

/// The plan, in its named form (what the plan files hold).
fn run(graph: &Graph, config: &PlanConfig) -> Plan {
    ir::plan::wire::to_wire(&plan(graph, config, &HwProfile::default()).unwrap(), graph)
}

fn has_errors(p: &Plan) -> bool {
    p.diagnostics.iter().any(|d| d.level == "error")
}

fn replayed_ops(p: &Plan) -> Vec<&str> {
    let ops: BTreeMap<&str, &str> = p
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.op.as_str()))
        .collect();
    p.replay
        .iter()
        .flat_map(|r| r.nodes.iter().map(|n| ops[n.as_str()]))
        .collect()
}

fn diagnostic<'p>(p: &'p Plan, code: &str, unit: &str) -> Option<&'p named::Diagnostic> {
    p.diagnostics
        .iter()
        .find(|d| d.code == code && d.unit.as_deref() == Some(unit))
}

const JOINT: [&str; 8] = [
    "dense",
    "moe_ep2",
    "moe_ep2_compiled",
    "moe_ep4",
    "glm_dsa_ep2",
    "glm_dsa_ep2_compiled",
    "moe_domino",
    "moe_ep2_unbalanced",
];

#[test]
fn r6_save_dsa_indexer_keeps_the_eager_topk_and_replay_never_runs_it() {
    let g = golden("glm_dsa_ep2_compiled");
    let p = run(&g, &keep(&["save_dsa_indexer"]));
    let topk: Vec<_> = p
        .nodes
        .iter()
        .filter(|n| n.op == "aten.topk.default" && n.unit.as_deref() == Some("SAVE_DSA_INDEXER"))
        .collect();
    assert!(!topk.is_empty(), "the indexer's top-k is kept");
    assert!(topk.iter().all(|n| n.decision == "save"));
    // Replay dispatches no eager aten.topk; the MoE router's top-k runs inside the compiled
    // `_pre_moe_forward` region, a fused kernel that never dispatches aten ops one by one.
    let compiled: BTreeMap<&str, bool> = g
        .nodes()
        .values()
        .map(|n| (n.name.as_str(), n.compiled_region.is_some()))
        .collect();
    let eager_topk: Vec<&String> = p
        .replay
        .iter()
        .flat_map(|r| &r.nodes)
        .filter(|n| !compiled[n.as_str()])
        .filter(|n| {
            p.nodes
                .iter()
                .any(|d| d.name == **n && d.op == "aten.topk.default")
        })
        .collect();
    assert!(
        eager_topk.is_empty(),
        "replay runs eager aten.topk: {eager_topk:?}"
    );
    let without = run(&g, &keep(&[]));
    let replayed_topk = replayed_ops(&without)
        .iter()
        .filter(|o| **o == "aten.topk.default")
        .count();
    assert!(
        replayed_topk > 2,
        "without the unit the indexer's top-k replays"
    );
    assert!(diagnostic(&p, "interval-inert", "SAVE_DSA_INDEXER").is_none());
    assert!(diagnostic(&p, "marker-missing", "SAVE_DSA_INDEXER").is_none());
}

#[test]
fn r6_under_the_ep_compile_config_only_dispatch_keeps_ops() {
    let p = run(&golden("moe_ep2_compiled"), &keep(&["all"]));
    let dispatch = p
        .units
        .iter()
        .find(|u| u.unit == "SAVE_MOE_DISPATCH")
        .unwrap();
    assert!(dispatch.kept_ops > 0);
    assert!(diagnostic(&p, "interval-inert", "SAVE_MOE_DISPATCH").is_none());
    for unit in ["SAVE_ATTN", "SAVE_MOE_GATE", "SAVE_MLP"] {
        let d = diagnostic(&p, "interval-inert", unit)
            .unwrap_or_else(|| panic!("{unit} must be reported inert: {:?}", p.diagnostics));
        assert!(d.message.contains("compiled region"), "{}", d.message);
        assert!(
            p.units.iter().all(|u| u.unit != unit),
            "{unit} keeps nothing"
        );
    }
    // SAVE_MLP's markers fire in eager; what it encloses is the compiled shared experts.
    let mlp = diagnostic(&p, "interval-inert", "SAVE_MLP").unwrap();
    assert!(mlp.message.contains("opened in"), "{}", mlp.message);
    assert!(
        mlp.message.contains("its contents run in compiled region"),
        "{}",
        mlp.message
    );
    assert!(
        mlp.message.contains("_shared_experts_forward"),
        "{}",
        mlp.message
    );
}

#[test]
fn r9_keeping_nothing_saves_only_layer_inputs_parameters_and_graph_inputs() {
    for name in JOINT {
        let g = golden(name);
        let p = run(&g, &keep(&[]));
        assert!(p.nodes.iter().all(|n| n.decision != "save"), "{name}");
        for s in &p.saved {
            assert!(
                matches!(
                    s.kind.as_str(),
                    "layer-input" | "not-checkpointed" | "parameter" | "graph-input"
                ),
                "{name}: {} saved as {}",
                s.value,
                s.kind
            );
            if s.kind == "not-checkpointed" {
                assert_eq!(
                    s.layer, None,
                    "{name}: {} is inside a checkpointed layer",
                    s.value
                );
            }
        }
        assert!(p.saved.iter().any(|s| s.kind == "layer-input"), "{name}");
    }
}

#[test]
fn r5_collectives_re_run_by_default_and_functional_ones_are_saved_on_request() {
    let g = golden("moe_ep2");
    let default = run(&g, &keep(&[]));
    let is_sync = |n: &&named::NodeDecision| {
        n.op.starts_with("_c10d_functional.")
            || n.op.starts_with("c10d.")
            || n.op == "aten._to_copy.default"
    };
    assert!(default
        .nodes
        .iter()
        .filter(is_sync)
        .filter(|n| n.op != "aten._to_copy.default")
        .all(|n| n.decision != "save"));
    assert!(replayed_ops(&default).contains(&"_c10d_functional.all_to_all_single.default"));
    let save = run(
        &g,
        &PlanConfig {
            collectives: Collectives::Save,
            ..keep(&[])
        },
    );
    let saved_ops: Vec<&str> = save
        .nodes
        .iter()
        .filter(|n| n.reason == "saved-collective")
        .map(|n| n.op.as_str())
        .collect();
    assert!(
        saved_ops.contains(&"_c10d_functional.all_to_all_single.default"),
        "{saved_ops:?}"
    );
    assert!(
        saved_ops.contains(&"aten._to_copy.default"),
        "{saved_ops:?}"
    );
    assert!(!replayed_ops(&save).contains(&"_c10d_functional.all_to_all_single.default"));
}

/// The forward nodes a plan replays.
fn replayed_nodes(p: &Plan) -> BTreeSet<&str> {
    p.replay
        .iter()
        .flat_map(|r| r.nodes.iter().map(String::as_str))
        .collect()
}

/// The values a plan saves for backward.
fn saved_values(p: &Plan) -> BTreeSet<&str> {
    p.saved.iter().map(|s| s.value.as_str()).collect()
}

#[test]
fn a_gpu_runs_host_copy_of_routing_counts_is_saved_on_request_and_replayed_by_default() {
    // The joint graph of a GPU run, exported with fake CUDA tensors: per MoE layer the routing
    // counts are copied to the host (a sync) and the mask made from them comes back (no sync).
    let g = golden("moe_ep2_cuda");
    let to_host: Vec<&ir::Node> = g
        .nodes()
        .values()
        .filter(|n| n.is_device_to_host_copy())
        .collect();
    assert_eq!(to_host.len(), 2, "one per MoE layer");
    let outputs: BTreeSet<&str> = to_host
        .iter()
        .map(|n| g.value(n.outputs[0]).name.as_str())
        .collect();
    let default = run(&g, &keep(&[]));
    let save = run(
        &g,
        &PlanConfig {
            collectives: Collectives::Save,
            ..keep(&[])
        },
    );
    let decision = |p: &'_ Plan, name: &str| {
        let d = p.nodes.iter().find(|d| d.name == name).expect("decided");
        (d.decision.clone(), d.reason.clone())
    };
    for copy in &to_host {
        let name = copy.name.as_str();
        assert_eq!(
            decision(&save, name),
            ("save".into(), "saved-collective".into())
        );
        assert!(!replayed_nodes(&save).contains(name), "{name}");
        assert_eq!(decision(&default, name).0, "recompute");
        assert!(replayed_nodes(&default).contains(name), "{name}");
    }
    assert!(outputs.is_subset(&saved_values(&save)), "{outputs:?}");
    assert!(outputs.is_disjoint(&saved_values(&default)), "{outputs:?}");
    // The copy back to the device is no sync: `--collectives save` leaves it to its layer.
    let to_device: Vec<&str> = save
        .nodes
        .iter()
        .filter(|n| n.op == "aten._to_copy.default" && n.reason != "saved-collective")
        .map(|n| n.decision.as_str())
        .collect();
    assert_eq!(to_device, ["recompute"; 2]);
}

#[test]
fn r5_a_fresh_buffer_filled_in_place_is_recomputed_with_its_writes_not_kept() {
    let p = run(&golden("moe_ep2_inplace"), &keep(&["all"]));
    assert!(!has_errors(&p));
    let d = p
        .diagnostics
        .iter()
        .find(|d| d.code == "kept-output-written-in-place")
        .expect("reported");
    assert!(d.message.contains("aten.index_add_"), "{}", d.message);
    let demoted: Vec<&str> = p
        .nodes
        .iter()
        .filter(|n| n.reason == "written-in-place")
        .map(|n| n.op.as_str())
        .collect();
    assert_eq!(
        demoted, ["aten.new_zeros.default"; 2],
        "one buffer per layer"
    );
}

#[test]
fn r4_unbalanced_markers_plan_with_a_warning() {
    let p = run(&golden("moe_ep2_unbalanced"), &keep(&["all"]));
    assert!(!has_errors(&p));
    assert!(p
        .diagnostics
        .iter()
        .any(|d| d.code == "interval-unbalanced"));
}

/// Per unit and layer: the sorted ops each micro-batch keeps.
fn kept_per_micro_batch(g: &Graph, p: &Plan) -> BTreeMap<(String, u32, u32), Vec<String>> {
    let micro_batch: BTreeMap<&str, u32> = g
        .nodes()
        .values()
        .map(|n| (n.name.as_str(), n.micro_batch))
        .collect();
    let mut kept: BTreeMap<(String, u32, u32), Vec<String>> = BTreeMap::new();
    for n in p.nodes.iter().filter(|n| n.decision == "save") {
        if let (Some(unit), Some(layer)) = (&n.unit, n.layer) {
            kept.entry((unit.to_string(), layer, micro_batch[n.name.as_str()]))
                .or_default()
                .push(n.op.to_string());
        }
    }
    for ops in kept.values_mut() {
        ops.sort();
    }
    kept
}

#[test]
fn r10_the_domino_path_keeps_the_same_ops_per_unit_as_the_single_batch_path() {
    let (single, domino) = (golden("moe_ep2"), golden("moe_domino"));
    let config = keep(&["all"]);
    let one = kept_per_micro_batch(&single, &run(&single, &config));
    let two = kept_per_micro_batch(&domino, &run(&domino, &config));
    assert!(!one.is_empty());
    let micro_batches: Vec<u32> = two.keys().map(|k| k.2).collect();
    assert!(
        micro_batches.contains(&1),
        "the domino golden runs two micro-batches"
    );
    for ((unit, layer, mb), ops) in &two {
        assert_eq!(
            Some(ops),
            one.get(&(unit.clone(), *layer, 0)),
            "{unit} layer {layer} micro-batch {mb}"
        );
    }
    for (unit, layer, _) in one.keys() {
        assert!(
            two.contains_key(&(unit.clone(), *layer, 1)),
            "{unit} layer {layer}"
        );
    }
}

#[test]
fn r11_a_plan_is_deterministic_and_refused_for_another_graph() {
    let g = golden("glm_dsa_ep2");
    let config = keep(&["all"]);
    let hw = HwProfile::default();
    let a = plan(&g, &config, &hw).unwrap().encode(&g, Format::Protobuf);
    let again = golden("glm_dsa_ep2");
    let b = plan(&again, &config, &hw)
        .unwrap()
        .encode(&again, Format::Protobuf);
    assert_eq!(a, b);
    let p = plan(&g, &config, &hw).unwrap();
    assert!(p.check_graph(&g).is_ok());
    let other = golden("glm_dsa_ep2_compiled");
    let err = p
        .check_graph(&other)
        .expect_err("a plan for another graph is refused");
    assert!(err.to_string().contains("re-plan"), "{err}");
}

/// The ops of forward nodes whose reason is `reason`.
fn ops_with_reason<'p>(p: &'p Plan, reason: &str) -> Vec<&'p str> {
    p.nodes
        .iter()
        .filter(|n| n.reason == reason)
        .map(|n| n.op.as_str())
        .collect()
}

#[test]
fn r5_huggingface_routing_written_in_place_plans_cleanly_with_every_unit_kept() {
    let g = golden("moe_hf_router");
    for config in [
        keep(&["all"]),
        keep(&[]),
        PlanConfig {
            recompute_ratio: 0.0,
            ..keep(&[])
        },
    ] {
        let p = run(&g, &config);
        assert!(!has_errors(&p), "{:?}", p.diagnostics);
    }
    let p = run(&g, &keep(&["all"]));
    let demoted = ops_with_reason(&p, "written-in-place");
    assert!(
        demoted.contains(&"aten.topk.default"),
        "the router's div_: {demoted:?}"
    );
    assert!(
        demoted.contains(&"aten.empty_like.default"),
        "index_put_ fills: {demoted:?}"
    );
    assert!(
        diagnostic(&p, "kept-output-written-in-place", "SAVE_MOE_GATE").is_some(),
        "{:?}",
        p.diagnostics
    );
    // A stable sort breaks ties by position: replaying it is no hazard.
    assert!(!p
        .diagnostics
        .iter()
        .any(|d| d.message.contains("sort.stable")));
}

#[test]
fn r8_keys_built_in_a_buffer_through_views_replay_with_their_slice_copies() {
    let g = golden("dsv3_kv_expand");
    let p = run(&g, &keep(&["all"]));
    assert!(!has_errors(&p), "{:?}", p.diagnostics);
    assert_eq!(
        ops_with_reason(&p, "written-in-place"),
        ["aten.new_empty.default"; 4]
    );
    let replayed = replayed_ops(&p);
    let copies = replayed
        .iter()
        .filter(|&&o| o == "aten.copy_.default")
        .count();
    assert!(
        copies > 0,
        "the slice copies replay with their buffer: {replayed:?}"
    );
    for config in [
        keep(&[]),
        PlanConfig {
            recompute_ratio: 0.0,
            ..keep(&[])
        },
    ] {
        assert!(!has_errors(&run(&g, &config)));
    }
}

#[test]
fn r12_real_dropout_is_saved_or_replayed_with_its_state_never_silently() {
    let g = golden("dense_dropout");
    let saved = run(&g, &keep(&["all"]));
    assert_eq!(
        ops_with_reason(&saved, "random").len(),
        4,
        "two dropouts per layer"
    );
    assert!(!replayed_ops(&saved).contains(&"aten.native_dropout.default"));
    let replay = run(
        &g,
        &PlanConfig {
            random_ops: ir::plan::RandomOps::Replay,
            ..keep(&["all"])
        },
    );
    assert_eq!(ops_with_reason(&replay, "random-replayed").len(), 4);
    assert!(replay
        .diagnostics
        .iter()
        .any(|d| d.code == "random-op-replayed"));
}
