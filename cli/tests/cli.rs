//! The `planner` binary end to end: `inspect` and `convert` on the shipped fixture, and every
//! kind of malformed file exits 1 with one `error: ...` line naming the problem, never a panic.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Output},
};

const FIXTURE: &str = "two_layer_moe";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture(ext: &str) -> PathBuf {
    repo_root().join(format!("tests/fixtures/{FIXTURE}.{ext}"))
}

fn planner(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("the planner binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Holds `actual` to the golden file `tests/golden/inspect/NAME` (re-blessed with
/// `UPDATE_GOLDEN=1`).
fn check_golden(name: &str, actual: &str) {
    let path = repo_root().join("tests/golden/inspect").join(name);
    if let Err(diff) = testkit::check_golden(&path, actual) {
        panic!("{diff}");
    }
}

/// A scratch file that is removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, contents: &[u8]) -> Scratch {
        let dir = std::env::temp_dir().join(format!("planner-cli-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        fs::write(&path, contents).unwrap();
        Scratch(path)
    }

    fn empty_path(name: &str) -> Scratch {
        let s = Scratch::new(name, b"");
        fs::remove_file(&s.0).unwrap();
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Exit 1, a single `error: ` first line naming every culprit, and no panic.
fn assert_clean_error(out: &Output, culprits: &[&str]) {
    assert_exit_error(out, 1, culprits);
}

/// A usage error: exit 2, clap's `error:` line naming the culprits, no panic.
fn assert_usage_error(out: &Output, culprits: &[&str]) {
    assert_exit_error(out, 2, culprits);
}

fn assert_exit_error(out: &Output, status: i32, culprits: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(status), "stderr: {err}");
    assert!(err.starts_with("error: "), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    for culprit in culprits {
        assert!(
            err.contains(culprit),
            "`{err}` does not mention `{culprit}`"
        );
    }
}

#[test]
fn inspect_summarises_the_fixture() {
    let out = planner(&[&"inspect", &fixture("pb")]);
    assert!(out.status.success(), "{}", stderr(&out));
    check_golden(&format!("{FIXTURE}.txt"), &stdout(&out));
}

#[test]
fn inspect_reads_pb_and_json_alike() {
    let pb = planner(&[&"inspect", &fixture("pb"), &"--format", &"json"]);
    let json = planner(&[&"inspect", &fixture("json"), &"--format", &"json"]);
    assert!(pb.status.success() && json.status.success());
    assert_eq!(stdout(&pb), stdout(&json));
    let summary: serde_json::Value = serde_json::from_slice(&pb.stdout).expect("JSON summary");
    assert_eq!(summary["models"][0]["num_layers"], 2);
    assert!(summary["compiled_regions"]
        .as_array()
        .is_some_and(|r| !r.is_empty()));
    assert!(summary["collectives"]
        .as_array()
        .is_some_and(|c| !c.is_empty()));
}

#[test]
fn pb_to_json_to_pb_is_byte_identical() {
    let json = Scratch::empty_path("roundtrip.json");
    let pb = Scratch::empty_path("roundtrip.pb");
    assert!(planner(&[&"convert", &fixture("pb"), &json.0])
        .status
        .success());
    assert!(planner(&[&"convert", &json.0, &pb.0]).status.success());
    assert_eq!(fs::read(fixture("pb")).unwrap(), fs::read(&pb.0).unwrap());
}

#[test]
fn the_committed_json_is_the_canonical_form_of_the_committed_pb() {
    let json = Scratch::empty_path("canonical.json");
    assert!(planner(&[&"convert", &fixture("pb"), &json.0])
        .status
        .success());
    assert_eq!(
        fs::read_to_string(fixture("json")).unwrap(),
        fs::read_to_string(&json.0).unwrap()
    );
}

#[test]
fn an_empty_file_is_an_error() {
    for name in ["empty.pb", "empty.json"] {
        let file = Scratch::new(name, b"");
        assert_clean_error(&planner(&[&"inspect", &file.0]), &[name, "empty"]);
    }
}

#[test]
fn random_bytes_are_an_error() {
    // A fixed xorshift stream: arbitrary bytes, the same on every run.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let file = Scratch::new("random.pb", &bytes);
    assert_clean_error(&planner(&[&"inspect", &file.0]), &["random.pb", "protobuf"]);
}

#[test]
fn a_truncated_protobuf_is_an_error() {
    let bytes = fs::read(fixture("pb")).unwrap();
    let file = Scratch::new("truncated.pb", &bytes[..bytes.len() / 2]);
    assert_clean_error(
        &planner(&[&"inspect", &file.0]),
        &["truncated.pb", "protobuf"],
    );
}

#[test]
fn json_of_the_wrong_shape_is_an_error() {
    let cases: [(&str, &[u8], &str); 4] = [
        (
            "list.json",
            b"[1, 2, 3]",
            "expected struct recompute.ir.v1.Graph",
        ),
        ("field.json", br#"{"nodez": []}"#, "unknown field `nodez`"),
        ("type.json", br#"{"nodes": 5}"#, "line 1"),
        ("unclosed.json", b"{\"name\": \"g\", \"nodes\": [", "EOF"),
    ];
    for (name, contents, why) in cases {
        let file = Scratch::new(name, contents);
        assert_clean_error(&planner(&[&"inspect", &file.0]), &[name, "JSON", why]);
    }
}

#[test]
fn json_in_a_pb_file_gets_a_hint() {
    let file = Scratch::new("mislabelled.pb", &fs::read(fixture("json")).unwrap());
    assert_clean_error(&planner(&[&"inspect", &file.0]), &["looks like JSON"]);
}

#[test]
fn an_unknown_extension_is_an_error() {
    let file = Scratch::new("graph.onnx", b"whatever");
    assert_clean_error(
        &planner(&[&"inspect", &file.0]),
        &["graph.onnx", ".pb", ".json"],
    );
}

#[test]
fn a_missing_file_is_an_error() {
    let file = Scratch::empty_path("missing.pb");
    assert_clean_error(
        &planner(&[&"inspect", &file.0]),
        &["missing.pb", "cannot read"],
    );
}

#[test]
fn an_invalid_graph_is_an_error_naming_the_file_and_the_culprit() {
    let text = fs::read_to_string(fixture("json")).unwrap();
    let mut graph: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first = graph["nodes"][0]["name"].as_str().unwrap().to_owned();
    graph["nodes"][1]["name"] = first.clone().into();
    let file = Scratch::new("dup.json", graph.to_string().as_bytes());
    let culprit = format!("duplicate node name `{first}`");
    assert_clean_error(&planner(&[&"inspect", &file.0]), &["dup.json", &culprit]);
    let out = Scratch::empty_path("dup.pb");
    assert_clean_error(&planner(&[&"convert", &file.0, &out.0]), &[&culprit]);
    assert!(!out.0.exists(), "an invalid graph must not be written");
}

#[test]
fn convert_no_validate_turns_a_broken_graph_into_json() {
    let text = fs::read_to_string(fixture("json")).unwrap();
    let mut graph: serde_json::Value = serde_json::from_str(&text).unwrap();
    graph["nodes"][0]["model"] = "nowhere".into();
    let broken = Scratch::new("broken.json", graph.to_string().as_bytes());
    let pb = Scratch::empty_path("broken.pb");
    let out = planner(&[&"convert", &broken.0, &pb.0, &"--no-validate"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean_error(&planner(&[&"inspect", &pb.0]), &["`nowhere`"]);
}

#[test]
fn usage_errors_exit_2() {
    let out = planner(&[&"inspect"]);
    assert_eq!(out.status.code(), Some(2));
    let out = planner(&[&"frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}

fn golden_graph(name: &str) -> PathBuf {
    repo_root().join(format!("tests/golden/{name}.pb"))
}

#[test]
fn plan_writes_every_format_and_the_same_bytes_twice() {
    let graph = golden_graph("moe_ep2");
    for format in ["text", "json", "pb", "dot"] {
        let run = || planner(&[&"plan", &graph, &"--keep", &"all", &"--format", &format]);
        let (one, two) = (run(), run());
        assert!(one.status.success(), "{format}: {}", stderr(&one));
        assert!(!one.stdout.is_empty(), "{format}");
        assert_eq!(one.stdout, two.stdout, "{format} output is deterministic");
    }
    let json = planner(&[&"plan", &graph, &"--format", &"json"]);
    let plan: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    for key in [
        "planner_version",
        "graph",
        "config",
        "nodes",
        "saved",
        "replay",
        "units",
        "memory",
        "cost",
        "diagnostics",
    ] {
        assert!(plan.get(key).is_some(), "plan JSON lacks `{key}`");
    }
    assert_eq!(plan["graph"]["fingerprint"].as_str().unwrap().len(), 32);
    let dot = planner(&[&"plan", &graph, &"--keep", &"all", &"--format", &"dot"]);
    let dot = stdout(&dot);
    assert!(dot.starts_with("digraph"));
    assert!(dot.contains("label=\"main layer 1\""), "clustered by layer");
    assert!(dot.contains("label=\"main backward\""), "backward apart");
    assert!(dot.contains("subgraph cluster_legend"), "with a legend");
    assert!(dot.contains("#8fd18f"), "kept ops are coloured");
    assert!(dot.contains("penwidth=3"), "replayed ops are highlighted");
}

#[test]
fn diff_exits_1_on_decision_changes_and_reads_json_and_pb() {
    let graph = golden_graph("moe_ep2");
    let all = Scratch::empty_path("all.pb");
    let all_json = Scratch::empty_path("all.json");
    let none = Scratch::empty_path("none.json");
    assert!(planner(&[
        &"plan",
        &graph,
        &"--keep",
        &"all",
        &"--format",
        &"pb",
        &"-o",
        &all.0
    ])
    .status
    .success());
    assert!(planner(&[
        &"plan",
        &graph,
        &"--keep",
        &"all",
        &"--format",
        &"json",
        &"-o",
        &all_json.0
    ])
    .status
    .success());
    assert!(
        planner(&[&"plan", &graph, &"--format", &"json", &"-o", &none.0])
            .status
            .success()
    );
    let same = planner(&[&"diff", &all.0, &all_json.0]);
    assert_eq!(same.status.code(), Some(0), "{}", stdout(&same));
    assert!(stdout(&same).contains("no changes"));
    let changed = planner(&[&"diff", &none.0, &all.0]);
    assert_eq!(changed.status.code(), Some(1));
    let report = stdout(&changed);
    assert!(report.contains("decision changes"), "{report}");
    assert!(report.contains("-> save (kept-interval, SAVE_"), "{report}");
    // Keeping every unit also turns ops that stay recomputed from "outside the interval"
    // into "mutable" or "view" inside it: reported apart.
    assert!(report.contains("reason-only changes"), "{report}");
    assert!(
        report.contains("recompute (outside-kept-interval) -> recompute (view"),
        "{report}"
    );
}

#[test]
fn diff_reports_reason_only_changes_apart_and_fails_on_them_only_when_strict() {
    let none = Scratch::empty_path("none-reasons.json");
    let plan = planner(&[
        &"plan",
        &golden_graph("moe_ep2"),
        &"--format",
        &"json",
        &"-o",
        &none.0,
    ]);
    assert!(plan.status.success(), "{}", stderr(&plan));
    let text = fs::read_to_string(&none.0).unwrap();
    let edited = text.replacen(
        "\"reason\": \"outside-kept-interval\"",
        "\"reason\": \"mutable\"",
        1,
    );
    assert_ne!(edited, text);
    let other = Scratch::new("edited-reasons.json", edited.as_bytes());
    let lenient = planner(&[&"diff", &none.0, &other.0]);
    assert_eq!(lenient.status.code(), Some(0), "{}", stdout(&lenient));
    let report = stdout(&lenient);
    assert!(report.contains("0 decision changes"), "{report}");
    assert!(report.contains("1 reason-only changes"), "{report}");
    let strict = planner(&[&"diff", &none.0, &other.0, &"--strict"]);
    assert_eq!(strict.status.code(), Some(1));
}

#[test]
fn deny_warnings_exits_3_and_errors_exit_1() {
    let compiled = golden_graph("moe_ep2_compiled");
    let out = planner(&[&"plan", &compiled, &"--keep", &"all", &"--deny-warnings"]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let clean = planner(&[&"plan", &golden_graph("dense"), &"--deny-warnings"]);
    assert_eq!(clean.status.code(), Some(0), "{}", stderr(&clean));
    let corrupting = Scratch::new("corrupting-write.pb", &corrupting_write_graph());
    let inplace = planner(&[&"plan", &corrupting.0, &"--keep", &"all"]);
    assert_clean_error(
        &inplace,
        &["inplace-in-kept-interval", "mystery.normalise_", "hint:"],
    );
    assert!(inplace.stdout.is_empty(), "a rejected plan is not printed");
}

/// A kept op's output written in place by an op that also writes a graph input (a running
/// statistic): the write cannot replay, so keeping the op is an error.
fn corrupting_write_graph() -> Vec<u8> {
    let mut b = testkit::Builder::new(1, &[("SAVE_ATTN", &[("attn.begin", "attn.end")])]);
    let x = b.input("x");
    let stats = b.input("running_stats");
    b.layer(Some(0));
    let m = b.marker("attn.begin", &x);
    let kept = b.op(&m);
    let written = b.write_in_place("mystery.normalise_.default", &[&kept, &stats], &[]);
    let end = b.marker("attn.end", &written);
    b.layer(None);
    b.backward_through("t", &[&kept, &end]);
    ir::io::encode(&b.wire(), ir::io::Format::Protobuf).expect("protobuf encoding cannot fail")
}

#[test]
fn bad_plan_options_are_errors_before_any_work() {
    let graph = golden_graph("dense");
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--keep", &"all,save_attn"]),
        &["not a mix"],
    );
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--budget", &"1KiB"]),
        &["smallest peak the search found"],
    );
    let hw = Scratch::new("hw.json", br#"{"hbm_bytes_per_s": -1}"#);
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--hw", &hw.0]),
        &["hbm_bytes_per_s", "positive"],
    );
    let typo = Scratch::new("typo.json", br#"{"hbm_bytes_per_sec": 1}"#);
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--hw", &typo.0]),
        &["unknown field"],
    );
}

/// The device `graph`'s plan under `--hw hw` is for: the profile's name and memory.
fn planned_device(graph: &Path, hw: &dyn AsRef<std::ffi::OsStr>) -> (String, u64) {
    let out = planner(&[&"plan", &graph, &"--hw", hw, &"--format", &"json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    (
        plan["cost"]["hw"].as_str().unwrap().to_owned(),
        plan["memory"]["device_memory_bytes"].as_u64().unwrap(),
    )
}

#[test]
fn shipped_hardware_profiles_are_chosen_by_name() {
    // In any case; a name that is no shipped profile is read as a file.
    let graph = golden_graph("dense");
    let gib = 1u64 << 30;
    assert_eq!(
        planned_device(&graph, &"h100"),
        ("H100".to_owned(), 80 * gib)
    );
    assert_eq!(
        planned_device(&graph, &"MI300X"),
        ("MI300X".to_owned(), 192 * gib)
    );
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--hw", &"h300"]),
        &["cannot read hardware profile h300"],
    );
}

#[test]
fn pareto_draws_the_frontier() {
    let graph = golden_graph("dense");
    let table = planner(&[&"pareto", &graph]);
    assert!(table.status.success(), "{}", stderr(&table));
    assert!(stdout(&table).contains("pareto frontier for dense"));
    let svg = planner(&[&"pareto", &graph, &"--format", &"svg"]);
    assert!(stdout(&svg).starts_with("<svg"));
}

#[test]
fn numeric_options_out_of_range_are_usage_errors_however_spelled() {
    let graph = golden_graph("dense");
    for ratio in ["1.5", "-1", "nan", "inf", "x"] {
        let spaced = planner(&[&"plan", &graph, &"--recompute-ratio", &ratio]);
        assert_usage_error(&spaced, &["--recompute-ratio"]);
        let joined = planner(&[&"plan", &graph, &format!("--recompute-ratio={ratio}")]);
        assert_usage_error(&joined, &["--recompute-ratio"]);
    }
    for size in ["lots", "0", "-1GiB", "1e300", "12 parsecs"] {
        assert_usage_error(
            &planner(&[&"plan", &graph, &"--budget", &size]),
            &["--budget"],
        );
    }
    for steps in ["0", "4097", "18446744073709551616", "-3"] {
        assert_usage_error(
            &planner(&[&"pareto", &graph, &"--steps", &steps]),
            &["--steps"],
        );
    }
    assert_usage_error(
        &planner(&[
            &"plan",
            &graph,
            &"--deny-warnings",
            &"--allow",
            &"no-such-code",
        ]),
        &["unknown diagnostic code", "interval-inert"],
    );
}

#[test]
fn sizes_in_every_printed_unit_and_repeated_keep_values_are_accepted() {
    let graph = golden_graph("dense");
    let huge = planner(&[&"plan", &graph, &"--budget", &"1PiB"]);
    assert!(huge.status.success(), "{}", stderr(&huge));
    let repeated = planner(&[&"plan", &graph, &"--keep", &"all,all", &"--keep", &"ALL"]);
    assert!(repeated.status.success(), "{}", stderr(&repeated));
}

#[test]
fn output_never_overwrites_an_input() {
    let copy = Scratch::new("input.pb", &fs::read(golden_graph("dense")).unwrap());
    let before = fs::read(&copy.0).unwrap();
    assert_clean_error(
        &planner(&[&"plan", &copy.0, &"-o", &copy.0]),
        &["refusing", "input"],
    );
    let dotted = copy.0.parent().unwrap().join(".").join("input.pb");
    assert_clean_error(&planner(&[&"plan", &copy.0, &"-o", &dotted]), &["refusing"]);
    assert_clean_error(
        &planner(&[&"pareto", &copy.0, &"-o", &copy.0]),
        &["refusing"],
    );
    assert_clean_error(&planner(&[&"convert", &copy.0, &dotted]), &["refusing"]);
    assert_eq!(fs::read(&copy.0).unwrap(), before, "the graph is intact");
}

#[test]
fn output_onto_a_hard_link_of_the_input_is_refused() {
    let copy = Scratch::new("linked.pb", &fs::read(golden_graph("dense")).unwrap());
    let before = fs::read(&copy.0).unwrap();
    let link = Scratch::empty_path("hard-link.pb");
    fs::hard_link(&copy.0, &link.0).unwrap();
    let json_link = Scratch::empty_path("hard-link.json");
    fs::hard_link(&copy.0, &json_link.0).unwrap();
    assert_clean_error(
        &planner(&[&"plan", &copy.0, &"-o", &link.0]),
        &["refusing", "input"],
    );
    assert_clean_error(
        &planner(&[&"convert", &copy.0, &json_link.0]),
        &["refusing"],
    );
    assert_eq!(fs::read(&copy.0).unwrap(), before, "the graph is intact");
}

#[test]
fn the_output_format_follows_the_extension_unless_given() {
    let graph = golden_graph("dense");
    let json = Scratch::empty_path("inferred.json");
    assert!(planner(&[&"plan", &graph, &"-o", &json.0]).status.success());
    assert!(fs::read_to_string(&json.0).unwrap().starts_with('{'));
    let pb = Scratch::empty_path("inferred.pb");
    assert!(planner(&[&"plan", &graph, &"-o", &pb.0]).status.success());
    let bytes = fs::read(&pb.0).unwrap();
    assert!(ir::plan::Plan::decode(&bytes, ir::plan::Format::Protobuf).is_ok());
    let svg = Scratch::empty_path("frontier.svg");
    assert!(planner(&[&"pareto", &graph, &"-o", &svg.0])
        .status
        .success());
    assert!(fs::read_to_string(&svg.0).unwrap().starts_with("<svg"));
    let forced = Scratch::empty_path("forced.json");
    assert!(
        planner(&[&"plan", &graph, &"--format", &"text", &"-o", &forced.0])
            .status
            .success()
    );
    assert!(fs::read_to_string(&forced.0)
        .unwrap()
        .starts_with("plan for dense"));
}

/// `pareto --format json` with `pareto_args` (and `args`), then `plan --choices` with the
/// point `pick` chooses (and `args`): the plan reports the point's peak, replay and exposed
/// transfer time, and its per-layer choices.
fn assert_point_reproduced_by_choices(
    graph: &std::path::Path,
    pareto_args: &[&dyn AsRef<std::ffi::OsStr>],
    args: &[&dyn AsRef<std::ffi::OsStr>],
    pick: fn(&[serde_json::Value]) -> Option<&serde_json::Value>,
) {
    let front = planner(
        &[
            &[
                &"pareto" as &dyn AsRef<std::ffi::OsStr>,
                &graph,
                &"--format",
                &"json",
            ],
            pareto_args,
            args,
        ]
        .concat(),
    );
    assert!(front.status.success(), "{}", stderr(&front));
    let doc: serde_json::Value = serde_json::from_slice(&front.stdout).unwrap();
    let point = pick(doc["points"].as_array().unwrap()).expect("the point sought");
    let choice = Scratch::new("choice.json", point.to_string().as_bytes());
    let plan = planner(
        &[
            &[
                &"plan" as &dyn AsRef<std::ffi::OsStr>,
                &graph,
                &"--choices",
                &choice.0,
                &"--format",
                &"json",
            ],
            args,
        ]
        .concat(),
    );
    assert!(plan.status.success(), "{}", stderr(&plan));
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["memory"]["peak_bytes"], point["peak_bytes"]);
    for field in ["replay_time_s", "exposed_transfer_time_s"] {
        assert_eq!(plan["cost"][field], point[field], "{field}");
    }
    for field in ["layer_keep", "layer_offload"] {
        assert_eq!(plan["config"][field], point[field], "{field}");
    }
}

#[test]
fn a_pareto_point_is_reproduced_by_plan_choices() {
    let graph = golden_graph("glm_dsa_ep2");
    assert_point_reproduced_by_choices(&graph, &[], &[], |points| {
        assert!(points.len() > 2, "a trade-off with several points");
        points.get(points.len() / 2)
    });
    let unknown = Scratch::new(
        "unknown.json",
        br#"{"layer_keep": [{"model": "main", "layer": 0, "keep": ["SAVE_NOTHING"]}]}"#,
    );
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--choices", &unknown.0]),
        &["unit `SAVE_NOTHING`"],
    );
}

/// A `--budget-offload` answer states its per-layer offload in `layer_offload`, and `plan
/// --choices` on that plan reproduces it: the same device peak, bytes offloaded and choices.
/// Choices that offload a unit their layer does not keep are an error naming it.
#[test]
fn a_budget_offload_answer_is_reproduced_by_plan_choices() {
    let graph = golden_graph("glm_dsa_ep2");
    let hw = Scratch::new(
        "fast-host-link.json",
        br#"{"name": "fast-host-link", "host_bytes_per_s": 1e15, "asynchronous": true}"#,
    );
    let front = planner(&[&"pareto", &graph, &"--hw", &hw.0, &"--format", &"json"]);
    assert!(front.status.success(), "{}", stderr(&front));
    let doc: serde_json::Value = serde_json::from_slice(&front.stdout).unwrap();
    let fastest = doc["points"].as_array().unwrap().last().unwrap()["peak_bytes"]
        .as_u64()
        .unwrap();
    let budget = (fastest - 1).to_string();
    let answer = Scratch::empty_path("answer.json");
    let planned = planner(&[
        &"plan",
        &graph,
        &"--budget",
        &budget,
        &"--budget-offload",
        &"--hw",
        &hw.0,
        &"-q",
        &"-o",
        &answer.0,
    ]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let answer_doc: serde_json::Value =
        serde_json::from_slice(&fs::read(&answer.0).unwrap()).unwrap();
    assert!(
        !answer_doc["config"]["layer_offload"]
            .as_array()
            .unwrap()
            .is_empty(),
        "the answer just below the fastest point offloads"
    );
    let again = planner(&[
        &"plan",
        &graph,
        &"--choices",
        &answer.0,
        &"--hw",
        &hw.0,
        &"--format",
        &"json",
    ]);
    assert!(again.status.success(), "{}", stderr(&again));
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    for field in ["peak_bytes", "offloaded_bytes", "host_peak_bytes"] {
        assert_eq!(
            again["memory"][field], answer_doc["memory"][field],
            "{field}"
        );
    }
    for field in ["layer_keep", "layer_offload"] {
        assert_eq!(
            again["config"][field], answer_doc["config"][field],
            "{field}"
        );
    }
    let not_kept = Scratch::new(
        "not-kept.json",
        br#"{"layer_keep": [], "layer_offload": [{"model": "main", "layer": 0, "offload": ["SAVE_DSA_INDEXER"]}]}"#,
    );
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--choices", &not_kept.0]),
        &["offload `SAVE_DSA_INDEXER` in layer 0 of model `main`, which that layer does not keep"],
    );
    assert_offload_refused_in_layer_1_not_checkpointed(
        &graph,
        br#"{"layer_keep": [{"model": "main", "layer": 1, "keep": ["SAVE_ATTN"]}], "layer_offload": [{"model": "main", "layer": 1, "offload": ["SAVE_ATTN"]}]}"#,
        "offload `SAVE_ATTN` in layer 1 of model `main`, which is not checkpointed",
    );
}

/// `choices`, planned with layer 1 not checkpointed (`--recompute-ratio 0.5`), are refused
/// with `error`.
fn assert_offload_refused_in_layer_1_not_checkpointed(graph: &Path, choices: &[u8], error: &str) {
    let choices = Scratch::new("not-checkpointed.json", choices);
    assert_clean_error(
        &planner(&[
            &"plan",
            &graph,
            &"--choices",
            &choices.0,
            &"--recompute-ratio",
            &"0.5",
        ]),
        &[error],
    );
}

/// Choices that offload one layer's inputs move exactly the layer inputs that layer makes, and
/// state it back in `layer_offload`; in a layer that is not checkpointed they are an error.
#[test]
fn choices_offloading_a_layers_inputs_move_only_that_layers() {
    let graph = golden_graph("glm_dsa_ep2");
    let choices = Scratch::new(
        "inputs.json",
        br#"{"layer_keep": [], "layer_offload": [{"model": "main", "layer": 0, "layer_input": true}]}"#,
    );
    let planned = planner(&[
        &"plan",
        &graph,
        &"--choices",
        &choices.0,
        &"--format",
        &"json",
    ]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let plan: serde_json::Value = serde_json::from_slice(&planned.stdout).unwrap();
    let inputs: Vec<&serde_json::Value> = plan["saved"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "layer-input")
        .collect();
    let offloaded = |s: &&&serde_json::Value| s["offloaded"] == true;
    assert!(inputs.iter().any(|s| s["layer"] == 1), "{inputs:?}");
    assert!(inputs.iter().filter(offloaded).count() > 0, "{inputs:?}");
    assert!(
        inputs.iter().filter(offloaded).all(|s| s["layer"] == 0),
        "{inputs:?}"
    );
    assert!(plan["memory"]["offloaded_bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        plan["config"]["layer_offload"],
        serde_json::json!([{"model": "main", "layer": 0, "offload": [], "layer_input": true}])
    );
    assert_offload_refused_in_layer_1_not_checkpointed(
        &graph,
        br#"{"layer_keep": [], "layer_offload": [{"model": "main", "layer": 1, "layer_input": true}]}"#,
        "offload its layer inputs in layer 1 of model `main`, which is not checkpointed",
    );
    let twice = Scratch::new(
        "inputs-twice.json",
        br#"{"layer_keep": [], "layer_offload": [{"model": "main", "layer": 0, "layer_input": true}, {"model": "main", "layer": 0, "offload": []}]}"#,
    );
    assert_clean_error(
        &planner(&[&"plan", &graph, &"--choices", &twice.0]),
        &["`layer_offload` lists layer 0 of model `main` twice"],
    );
}

/// A `pareto --with-offload` point that offloads is reproduced by `plan --choices`: the same
/// peak, replay and exposed transfer time.
#[test]
fn an_offloading_pareto_point_is_reproduced_by_plan_choices() {
    let graph = golden_graph("glm_dsa_ep2");
    let hw = Scratch::new(
        "sync-link.json",
        br#"{"name": "sync-link", "host_bytes_per_s": 2e9, "asynchronous": false}"#,
    );
    assert_point_reproduced_by_choices(&graph, &[&"--with-offload"], &[&"--hw", &hw.0], |points| {
        points
            .iter()
            .find(|p| !p["layer_offload"].as_array().unwrap().is_empty())
    });
}

#[test]
fn allow_waives_named_warnings_under_deny_warnings() {
    let compiled = golden_graph("moe_ep2_compiled");
    let denied = planner(&[&"plan", &compiled, &"--keep", &"all", &"--deny-warnings"]);
    assert_eq!(denied.status.code(), Some(3));
    let allowed = planner(&[
        &"plan",
        &compiled,
        &"--keep",
        &"all",
        &"--deny-warnings",
        &"--allow",
        &"interval-inert",
        &"--allow",
        &"nondeterministic-replay",
    ]);
    assert_eq!(allowed.status.code(), Some(0), "{}", stderr(&allowed));
}

#[test]
fn the_version_and_every_option_have_help() {
    let version = planner(&[&"--version"]);
    assert_eq!(
        stdout(&version).trim(),
        format!("planner {}", env!("CARGO_PKG_VERSION"))
    );
    // `run` and `calibrate` are parsed, and documented, by every build (their help needs no
    // runtime).
    for command in testkit::PLANNER_COMMANDS {
        let help = stdout(&planner(&[&command, &"--help"]));
        // Every option or argument line is followed by its description: clap leaves a bare
        // name only when the doc comment is missing.
        let lines: Vec<&str> = help.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            // Options and arguments sit 2 or 6 columns in; possible values deeper.
            let indent = line.len() - t.len();
            if indent <= 6 && (t.starts_with('-') || t.starts_with('<')) {
                let described = t.split("  ").filter(|s| !s.trim().is_empty()).count() > 1
                    || lines.get(i + 1).is_some_and(|next| {
                        next.starts_with("          ") && !next.trim().is_empty()
                    });
                assert!(described, "`planner {command}`: `{t}` has no help text");
            }
        }
    }
}

#[test]
fn output_is_the_same_bytes_across_processes_and_thread_counts() {
    let graph = golden_graph("glm_dsa_ep2");
    let commands: [&[&dyn AsRef<std::ffi::OsStr>]; 3] = [
        &[&"plan", &graph, &"--keep", &"all", &"--format", &"json"],
        &[&"plan", &graph, &"--budget", &"80KiB", &"--format", &"pb"],
        &[&"pareto", &graph, &"--format", &"json"],
    ];
    for args in commands {
        let run = |threads: &str| {
            let out = Command::new(env!("CARGO_BIN_EXE_planner"))
                .args(args.iter().map(|a| a.as_ref()))
                .env("RAYON_NUM_THREADS", threads)
                .output()
                .expect("the planner runs");
            assert!(out.status.success(), "{}", stderr(&out));
            out.stdout
        };
        let one = run("1");
        assert!(!one.is_empty());
        assert!(one == run("4"), "1 vs 4 threads differ");
        assert!(one == run("3"), "1 vs 3 threads differ");
    }
}

#[test]
fn diff_refuses_empty_and_truncated_plans() {
    let good = Scratch::empty_path("good.pb");
    assert!(planner(&[&"plan", &golden_graph("dense"), &"-o", &good.0])
        .status
        .success());
    let empty = Scratch::new("empty.pb", b"");
    assert_clean_error(
        &planner(&[&"diff", &empty.0, &good.0]),
        &["empty.pb", "empty"],
    );
    let bytes = fs::read(&good.0).unwrap();
    let cut = Scratch::new("cut.pb", &bytes[..bytes.len() / 2]);
    assert_clean_error(
        &planner(&[&"diff", &good.0, &cut.0]),
        &["cut.pb", "protobuf"],
    );
    let stub = Scratch::new("stub.json", b"{}");
    assert_clean_error(
        &planner(&[&"diff", &stub.0, &good.0]),
        &["stub.json", "no graph"],
    );
}

// ---------------------------------------------------------------------------------------------
// Malformed input of every kind: the planner exits at once with one clean `error:` line. The
// cases also write the table of `docs/malformed-inputs.md` (re-blessed with UPDATE_GOLDEN=1).

use ir::wire::graph as pb;
use prost::Message as _;

/// A file a case needs, made in the case's directory.
enum Make {
    File(&'static str, Vec<u8>),
    /// A symbolic link to an absolute path (a device).
    Link(&'static str, &'static str),
    Fifo(&'static str),
    Dir(&'static str),
    /// A file of this size whose blocks are not on disk.
    Sparse(&'static str, u64),
}

/// One kind of malformed input: the files it takes, the command that meets it (run in the
/// case's directory), and words the one line the planner prints must hold.
struct Case {
    input: &'static str,
    make: Vec<Make>,
    args: Vec<String>,
    exit: i32,
    says: &'static [&'static str],
}

fn case(
    input: &'static str,
    make: Vec<Make>,
    args: &[&str],
    says: &'static [&'static str],
) -> Case {
    Case {
        input,
        make,
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        exit: 1,
        says,
    }
}

/// The fixture, decoded.
fn fixture_wire() -> pb::Graph {
    pb::Graph::decode(fs::read(fixture("pb")).unwrap().as_slice()).unwrap()
}

/// The fixture broken by `edit`, as a `.pb` named `name`.
fn broken_fixture(name: &'static str, edit: impl FnOnce(&mut pb::Graph)) -> Make {
    let mut graph = fixture_wire();
    edit(&mut graph);
    Make::File(name, graph.encode_to_vec())
}

/// A graph `inspect` on the file `name` made by `edit`, which must say `says`.
fn graph_case(
    input: &'static str,
    name: &'static str,
    edit: impl FnOnce(&mut pb::Graph),
    says: &'static [&'static str],
) -> Case {
    case(
        input,
        vec![broken_fixture(name, edit)],
        &["inspect", name],
        says,
    )
}

/// A `--hw` profile case: planning a valid graph with the profile `hw` (made by `make`).
fn hw_case(
    input: &'static str,
    make: Option<Make>,
    hw: &str,
    says: &'static [&'static str],
) -> Case {
    let graph = Make::File("g.pb", fs::read(golden_graph("dense")).unwrap());
    let make = [Some(graph), make].into_iter().flatten().collect();
    case(input, make, &["plan", "g.pb", "--hw", hw], says)
}

fn node_with_op(graph: &mut pb::Graph, op: &str) -> usize {
    graph
        .nodes
        .iter()
        .position(|n| n.op == op)
        .expect("the fixture has the op")
}

fn malformed_cases() -> Vec<Case> {
    let fixture_pb = fs::read(fixture("pb")).unwrap();
    let fixture_json = fs::read(fixture("json")).unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let random: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let f = |name, bytes: &[u8]| Make::File(name, bytes.to_vec());
    let mut cases = vec![
        case(
            "empty file",
            vec![f("empty.pb", b"")],
            &["inspect", "empty.pb"],
            &["file is empty"],
        ),
        case(
            "only whitespace",
            vec![f("blank.json", b" \n\t\n")],
            &["inspect", "blank.json"],
            &["file is empty"],
        ),
        case(
            "random bytes",
            vec![f("random.pb", &random)],
            &["inspect", "random.pb"],
            &["not a valid protobuf graph"],
        ),
        case(
            "truncated protobuf",
            vec![f("truncated.pb", &fixture_pb[..fixture_pb.len() / 2])],
            &["inspect", "truncated.pb"],
            &["not a valid protobuf graph"],
        ),
        case(
            "JSON in a `.pb` file",
            vec![f("mislabelled.pb", &fixture_json)],
            &["inspect", "mislabelled.pb"],
            &["looks like JSON"],
        ),
        case(
            "unknown extension",
            vec![f("graph.onnx", b"whatever")],
            &["inspect", "graph.onnx"],
            &["unknown graph format"],
        ),
        case(
            "missing file",
            vec![],
            &["inspect", "missing.pb"],
            &["cannot read graph missing.pb"],
        ),
        case(
            "a directory",
            vec![Make::Dir("dir.pb")],
            &["inspect", "dir.pb"],
            &["a directory"],
        ),
        case(
            "a character device (`/dev/zero`)",
            vec![Make::Link("zero.pb", "/dev/zero")],
            &["inspect", "zero.pb"],
            &["a character device"],
        ),
        case(
            "a FIFO with no writer",
            vec![Make::Fifo("fifo.pb")],
            &["inspect", "fifo.pb"],
            &["a FIFO"],
        ),
        case(
            "a file over the 4 GiB limit",
            vec![Make::Sparse("huge.json", (4 << 30) + 1)],
            &["inspect", "huge.json"],
            &["over the limit"],
        ),
        case(
            "JSON that is not an object",
            vec![f("list.json", b"[1, 2, 3]")],
            &["inspect", "list.json"],
            &["expected struct recompute.ir.v1.Graph"],
        ),
        case(
            "unknown JSON field",
            vec![f("field.json", br#"{"nodez": []}"#)],
            &["inspect", "field.json"],
            &["unknown field `nodez`"],
        ),
        case(
            "JSON value of the wrong type",
            vec![f("type.json", br#"{"nodes": 5}"#)],
            &["inspect", "type.json"],
            &["invalid type: integer `5`"],
        ),
        case(
            "a JSON integer out of its field's range",
            vec![f(
                "range.json",
                br#"{"nodes": [{"name": "n", "layer": 4294967296}]}"#,
            )],
            &["inspect", "range.json"],
            &["`layer` must be an integer from 0 to 4294967295, not 4294967296"],
        ),
        case(
            "a JSON enum name the enum does not have",
            vec![f(
                "enum.json",
                br#"{"values": [{"name": "v", "dtype": "DTYPE_FLOAT99"}]}"#,
            )],
            &["inspect", "enum.json"],
            &[
                "`dtype` must be one of DTYPE_UNSPECIFIED, DTYPE_FLOAT32,",
                "not `DTYPE_FLOAT99`",
            ],
        ),
        case(
            "a JSON enum of the wrong type",
            vec![f(
                "enumtype.json",
                br#"{"nodes": [{"name": "n", "phase": true}]}"#,
            )],
            &["inspect", "enumtype.json"],
            &["expected `phase` to be one of PHASE_UNSPECIFIED"],
        ),
        case(
            "unclosed JSON",
            vec![f("unclosed.json", b"{\"name\": \"g\", \"nodes\": [")],
            &["inspect", "unclosed.json"],
            &["EOF"],
        ),
        case(
            "a JSON key given twice",
            vec![f("twice.json", br#"{"name": "a", "name": "b"}"#)],
            &["inspect", "twice.json"],
            &["duplicate field `name`"],
        ),
        case(
            "a non-finite float that is not a proto3 spelling",
            vec![f(
                "float.json",
                br#"{"nodes": [{"attributes": [{"name": "eps", "float": "NaN(0x7ff8)"}]}]}"#,
            )],
            &["inspect", "float.json"],
            &["invalid value"],
        ),
        case(
            "no nodes",
            vec![f("nonodes.json", br#"{"name": "g"}"#)],
            &["inspect", "nonodes.json"],
            &["graph has no nodes"],
        ),
        case(
            "a million empty nodes (2 MB)",
            vec![f("million.pb", &[0x1a, 0x00].repeat(1_000_000))],
            &["inspect", "million.pb"],
            &["node #0 has no name"],
        ),
        graph_case(
            "node without a name",
            "unnamed.pb",
            |g| g.nodes[0].name.clear(),
            &["node #0 has no name"],
        ),
        graph_case(
            "two nodes of one name",
            "dup.pb",
            |g| g.nodes[1].name = g.nodes[0].name.clone(),
            &["duplicate node name `embed_tokens`"],
        ),
        graph_case(
            "a value read but not declared",
            "dangling.pb",
            |g| g.nodes[0].inputs[0] = "nowhere".to_owned(),
            &["reads `nowhere`, which is not a declared value"],
        ),
        graph_case(
            "a value written twice",
            "twice.pb",
            |g| g.nodes[1].outputs[0] = g.nodes[0].outputs[0].clone(),
            &["is produced twice"],
        ),
        graph_case(
            "a value never written",
            "orphan.pb",
            |g| {
                let mut orphan = g.values[0].clone();
                orphan.name = "orphan".to_owned();
                orphan.role = pb::Role::Activation as i32;
                g.values.push(orphan);
            },
            &["value `orphan` (activation) is never produced"],
        ),
        graph_case(
            "a forward node reading a backward result",
            "phase.pb",
            |g| {
                let backward = pb::Phase::Backward as i32;
                let gradient = g
                    .nodes
                    .iter()
                    .find(|n| n.phase == backward)
                    .unwrap()
                    .outputs[0]
                    .clone();
                let mut late = g.values[0].clone();
                late.name = "late".to_owned();
                late.role = pb::Role::Activation as i32;
                g.values.push(late);
                let mut reader = g.nodes[0].clone();
                reader.name = "late_forward".to_owned();
                reader.phase = pb::Phase::Forward as i32;
                reader.inputs = vec![gradient];
                reader.outputs = vec!["late".to_owned()];
                g.nodes.push(reader);
            },
            &["forward node `late_forward` reads", "which backward node"],
        ),
        graph_case(
            "a dependency cycle",
            "cycle.pb",
            |g| {
                let back = g.nodes[1].outputs[0].clone();
                g.nodes[0].inputs.push(back);
            },
            &["dependency cycle through node"],
        ),
        graph_case(
            "nodes out of execution order",
            "order.pb",
            |g| g.nodes.swap(0, 1),
            &["before its producer", "execution order"],
        ),
        graph_case(
            "an unknown dtype code",
            "dtype.pb",
            |g| g.values[0].dtype = 99,
            &["unknown dtype code 99"],
        ),
        graph_case(
            "a negative dimension",
            "negative.pb",
            |g| g.values[0].shape[0] = -1,
            &["negative size -1 in dimension 0"],
        ),
        graph_case(
            "a size that overflows 64 bits",
            "overflow.pb",
            |g| g.values[0].shape = vec![i64::MAX, i64::MAX],
            &["overflows 64 bits"],
        ),
        graph_case(
            "a marker without a name",
            "marker.pb",
            |g| {
                let marker = node_with_op(g, ir::MARKER_OP);
                g.nodes[marker].attributes.clear();
            },
            &["has no name (a string attribute `name`)"],
        ),
        graph_case(
            "a node of an undeclared model",
            "model.pb",
            |g| g.nodes[0].model = "nowhere".to_owned(),
            &["model `nowhere`, which the graph does not declare"],
        ),
        graph_case(
            "a model nested in itself",
            "nested.pb",
            |g| g.models[0].parent = g.models[0].name.clone(),
            &["is nested inside itself"],
        ),
        graph_case(
            "a unit declared twice",
            "unit.pb",
            |g| {
                let unit = g.models[0].units[0].clone();
                g.models[0].units.push(unit);
            },
            &["declares unit `SAVE_ATTN` twice"],
        ),
        graph_case(
            "an interval with an empty marker",
            "interval.pb",
            |g| g.models[0].units[0].intervals[0].begin.clear(),
            &["an empty begin marker"],
        ),
        graph_case(
            "a layer beyond the model's layers",
            "layer.pb",
            |g| g.nodes[1].layer = Some(99),
            &["has layer 99 but model `main` declares 2 layers"],
        ),
        graph_case(
            "a schema fact naming a missing input",
            "schema.pb",
            |g| {
                g.nodes[0].schema = Some(pb::SchemaFacts {
                    mutates: vec![9],
                    ..Default::default()
                })
            },
            &["names input position 9"],
        ),
        graph_case(
            "an attribute without a value",
            "attribute.pb",
            |g| g.nodes[0].attributes[0].value = None,
            &["attribute `padding_idx` has no value"],
        ),
        graph_case(
            "a name with a line break and terminal escapes",
            "escapes.pb",
            |g| {
                g.nodes[0].name = "evil\n\u{1b}[2J\u{202e}".to_owned();
                g.nodes[1].name = g.nodes[0].name.clone();
            },
            &["duplicate node name `evil\\n\\u{1b}[2J\\u{202e}`"],
        ),
        graph_case(
            "a name of a million bytes",
            "long.pb",
            |g| {
                g.nodes[0].name = "n".repeat(1 << 20);
                g.nodes[1].name = g.nodes[0].name.clone();
            },
            &["bytes cut"],
        ),
        case(
            "an enum code JSON cannot name, converted without validation",
            vec![broken_fixture("code.pb", |g| g.nodes[0].phase = 7)],
            &["convert", "code.pb", "out.json", "--no-validate"],
            &["cannot be written as JSON", "node #0: `phase` code 7"],
        ),
        hw_case(
            "hardware profile that is not JSON",
            Some(f("hw.json", b"fast")),
            "hw.json",
            &["not a valid hardware profile"],
        ),
        hw_case(
            "hardware profile with an unknown field",
            Some(f("hw.json", br#"{"hbm_bytes_per_sec": 1}"#)),
            "hw.json",
            &["unknown field `hbm_bytes_per_sec`"],
        ),
        hw_case(
            "hardware profile with a rate that is not positive",
            Some(f("hw.json", br#"{"hbm_bytes_per_s": -1}"#)),
            "hw.json",
            &["`hbm_bytes_per_s` must be a positive number"],
        ),
        hw_case(
            "hardware profile with a collective's latency out of range",
            Some(f(
                "hw.json",
                br#"{"collectives": [{"op": "_c10d_functional.all_gather_into_tensor.default", "latency_s": 5, "link_bytes_per_s": 1e9}]}"#,
            )),
            "hw.json",
            &["`latency_s` must be a number of seconds from 0 to 1"],
        ),
        hw_case(
            "hardware profile with two lines for one collective",
            Some(f(
                "hw.json",
                br#"{"collectives": [{"op": "a", "latency_s": 0, "link_bytes_per_s": 1}, {"op": "a", "latency_s": 0, "link_bytes_per_s": 2}]}"#,
            )),
            "hw.json",
            &["`collectives` names `a` twice"],
        ),
        hw_case(
            "hardware profile with a thin matmul's share above 1",
            Some(f(
                "hw.json",
                br#"{"thin_matmuls": [{"operands": "fp32", "dim": "k", "size": 4, "efficiency": 2}]}"#,
            )),
            "hw.json",
            &["`thin_matmuls[0]`: `efficiency` must be above 0 and at most 1, got 2"],
        ),
        hw_case(
            "hardware profile that is a character device",
            None,
            "/dev/urandom",
            &["cannot read hardware profile /dev/urandom: it is a character device"],
        ),
        hw_case(
            "hardware profile that is a FIFO",
            Some(Make::Fifo("hw.json")),
            "hw.json",
            &["a FIFO"],
        ),
        hw_case(
            "hardware profile over the 1 MiB limit",
            Some(Make::Sparse("hw.json", (1 << 20) + 1)),
            "hw.json",
            &["over the limit of 1048576 bytes"],
        ),
        case(
            "plan that is a FIFO (`diff`)",
            vec![Make::Fifo("old.pb"), Make::Fifo("new.pb")],
            &["diff", "old.pb", "new.pb"],
            &["cannot read plan old.pb: it is a FIFO"],
        ),
        case(
            "a budget's option beside --keep, with no budget",
            vec![Make::File("g.pb", fs::read(golden_graph("dense")).unwrap())],
            &["plan", "g.pb", "--keep", "all", "--budget-offload"],
            &["--budget-offload chooses within a budget: give --budget SIZE too"],
        ),
        case(
            "--budget-offload at --granularity op",
            vec![Make::File("g.pb", fs::read(golden_graph("dense")).unwrap())],
            &["plan", "g.pb", "--budget", "1GB", "--budget-offload", "--granularity", "op"],
            &["--budget-offload chooses whole units per layer"],
        ),
        case(
            "choices file that is a character device",
            vec![
                Make::File("g.pb", fs::read(golden_graph("dense")).unwrap()),
                Make::Link("point.json", "/dev/zero"),
            ],
            &["plan", "g.pb", "--choices", "point.json"],
            &["cannot read choices file point.json: it is a character device"],
        ),
        case(
            "an empty unit name (`--keep \"\"`)",
            vec![Make::File("g.pb", fs::read(golden_graph("dense")).unwrap())],
            &["plan", "g.pb", "--keep", ""],
            &["--keep takes `none`, `all` or unit names, not an empty name"],
        ),
    ];
    cases.push(Case {
        input: "no graph given (usage)",
        make: vec![],
        args: vec!["inspect".to_owned()],
        exit: 2,
        says: &["required arguments were not provided"],
    });
    cases
}

/// `args` as a shell command line shows them: an empty argument as `""`.
fn shell_words(args: &[String]) -> String {
    let shown: Vec<&str> = args
        .iter()
        .map(|a| if a.is_empty() { "\"\"" } else { a.as_str() })
        .collect();
    shown.join(" ")
}

fn make_in(dir: &Path, make: &Make) {
    match make {
        Make::File(name, bytes) => fs::write(dir.join(name), bytes).unwrap(),
        Make::Link(name, target) => std::os::unix::fs::symlink(target, dir.join(name)).unwrap(),
        Make::Fifo(name) => {
            let status = Command::new("mkfifo").arg(dir.join(name)).status().unwrap();
            assert!(status.success(), "mkfifo");
        }
        Make::Dir(name) => fs::create_dir(dir.join(name)).unwrap(),
        Make::Sparse(name, len) => fs::File::create(dir.join(name))
            .unwrap()
            .set_len(*len)
            .unwrap(),
    }
}

/// Runs the planner in `dir`; a run longer than a few seconds fails the test.
fn planner_in(dir: &Path, args: &[String]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the planner binary runs");
    let id = child.id();
    let (done, output) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match output.recv_timeout(std::time::Duration::from_secs(20)) {
        Ok(output) => output.expect("the planner's output"),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(id.to_string()).status();
            panic!("planner {args:?} ran for more than 20 s");
        }
    }
}

/// Runs every case, checks what the planner says, and returns the table rows.
fn run_malformed_cases() -> Vec<[String; 4]> {
    let root = std::env::temp_dir().join(format!("planner-malformed-{}", std::process::id()));
    let mut rows = Vec::new();
    for (i, case) in malformed_cases().into_iter().enumerate() {
        let dir = root.join(i.to_string());
        fs::create_dir_all(&dir).unwrap();
        for make in &case.make {
            make_in(&dir, make);
        }
        let out = planner_in(&dir, &case.args);
        let err = stderr(&out);
        let first = err.lines().next().unwrap_or_default().to_owned();
        let what = format!("{}: `planner {}`", case.input, case.args.join(" "));
        assert_eq!(out.status.code(), Some(case.exit), "{what}: {err}");
        assert!(first.starts_with("error: "), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert!(!first.chars().any(char::is_control), "{what}: {first:?}");
        assert!(
            first.len() < 1_000,
            "{what}: a line of {} bytes",
            first.len()
        );
        if case.exit == 1 {
            assert_eq!(err.lines().count(), 1, "{what}: {err}");
        }
        for word in case.says {
            assert!(
                first.contains(word),
                "{what}: `{first}` does not say `{word}`"
            );
        }
        rows.push([
            case.input.to_owned(),
            format!("`planner {}`", shell_words(&case.args)),
            case.exit.to_string(),
            first,
        ]);
    }
    fs::remove_dir_all(&root).unwrap();
    rows
}

/// The table as Markdown: messages in code spans, pipes escaped.
fn malformed_table(rows: &[[String; 4]]) -> String {
    let mut table =
        String::from("| Input | Command | Exit | What the planner prints |\n|---|---|---:|---|\n");
    for [input, command, exit, message] in rows {
        let cell = |s: &str| s.replace('|', "\\|");
        table.push_str(&format!(
            "| {} | {} | {} | <code>{}</code> |\n",
            cell(input),
            cell(command),
            exit,
            cell(&html_escape(message))
        ));
    }
    table
}

fn html_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const MALFORMED_DOC_HEAD: &str = "\
# Malformed inputs

Every kind of malformed input the planner handles, the command that meets it, and the one line
it prints (exit 1; 2 for a usage error). Nothing malformed panics the binary, blocks it, or costs
it more than a small multiple of the file in memory. Names from the input are escaped (line
breaks, terminal escapes, invisible characters) and a long name keeps its head and tail.

This table is written by the test that runs these cases,
`cli/tests/cli.rs::malformed_inputs_fail_cleanly_as_documented`; after a change of message,
re-bless it with `UPDATE_GOLDEN=1 cargo test -p planner-cli --test cli` and read the diff.

`planner run` (built with the `run` feature) meets more: safetensors files that are not regular
files or not valid, malformed `rng/seed` tensors, inputs larger than memory, split sizes that
overflow, world sizes and timeouts beyond what a process or its clock holds, ops that allocate
past their declared tensors or run too long, ranks that panic. Each is one `error:` line (one
per failing rank) within seconds, proved in `cli/tests/run_cli.rs`; the limits are in
[runtime.md](runtime.md). Launched one rank per process (torchrun), a launch
environment that does not fit (`WORLD_SIZE` other than the graph's, `MASTER_PORT` unset or not
a port) is refused before anything runs, and a rank that fails, panics or stalls is named on
every rank: `cli/tests/run_torchrun.rs`.

";

#[test]
fn malformed_inputs_fail_cleanly_as_documented() {
    let doc = format!(
        "{MALFORMED_DOC_HEAD}{}",
        malformed_table(&run_malformed_cases())
    );
    let path = repo_root().join("docs/malformed-inputs.md");
    if let Err(diff) = testkit::check_golden(&path, &doc) {
        panic!("{diff}");
    }
}

#[test]
fn floats_of_every_kind_survive_pb_to_json_to_pb() {
    let mut graph = fixture_wire();
    let eps = graph.nodes[1]
        .attributes
        .iter_mut()
        .find(|a| a.name == "eps")
        .expect("the fixture's eps");
    let specials = [
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        -f64::NAN,
        f64::from(f32::MIN),
        -0.0,
        f64::from_bits(1),
    ];
    eps.value = Some(pb::attribute::Value::Floats(pb::FloatList {
        values: specials.to_vec(),
    }));
    let source = Scratch::new("floats.pb", &graph.encode_to_vec());
    let json = Scratch::empty_path("floats.json");
    let back = Scratch::empty_path("floats-back.pb");
    let out = planner(&[&"convert", &source.0, &json.0]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = fs::read_to_string(&json.0).unwrap();
    for spelling in [
        "\"Infinity\"",
        "\"-Infinity\"",
        "\"NaN\"",
        "\"NaN(0xfff8000000000000)\"",
    ] {
        assert!(text.contains(spelling), "{spelling} not in the JSON");
    }
    let out = planner(&[&"convert", &json.0, &back.0]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(fs::read(&source.0).unwrap(), fs::read(&back.0).unwrap());
    // The two files are one graph: one fingerprint.
    let fingerprint = |path: &PathBuf| {
        let out = planner(&[&"plan", path, &"--format", &"json"]);
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        plan["graph"]["fingerprint"].as_str().unwrap().to_owned()
    };
    assert_eq!(fingerprint(&source.0), fingerprint(&json.0));
}

#[test]
fn plan_says_whether_the_device_total_fits_the_hardware_memory() {
    let graph = golden_graph("moe_ep2");
    let fits = planner(&[&"plan", &graph, &"--hw", &"h100"]);
    assert!(fits.status.success(), "{}", stderr(&fits));
    assert!(
        stdout(&fits).contains("\n  fits in 80 GiB with "),
        "{}",
        stdout(&fits)
    );
    let small = Scratch::new("small.json", br#"{"memory_bytes": 1024}"#);
    let over = planner(&[&"plan", &graph, &"--hw", &small.0, &"--fsdp", &"2"]);
    assert!(over.status.success(), "{}", stderr(&over));
    let text = stdout(&over);
    assert!(
        text.contains("device total (fsdp 2, adamw state in fp32): "),
        "{text}"
    );
    assert!(text.contains("\n  does not fit in 1 KiB: "), "{text}");
}

#[test]
fn a_training_state_budget_bounds_the_device_total_or_names_what_fills_it() {
    let graph = golden_graph("moe_ep2");
    let json = |args: &[&dyn AsRef<std::ffi::OsStr>]| -> serde_json::Value {
        let out = planner(
            &[
                &[&"plan" as &dyn AsRef<std::ffi::OsStr>, &graph],
                args,
                &[&"-q", &"--format", &"json"],
            ]
            .concat(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice(&out.stdout).expect("a JSON plan")
    };
    let whole = json(&[&"--keep", &"all", &"--master-weights"]);
    let budget = whole["memory"]["device_total_bytes"].as_u64().unwrap();
    let budget_arg = budget.to_string();
    let answer = json(&[
        &"--budget",
        &budget_arg,
        &"--budget-includes",
        &"training-state",
        &"--master-weights",
    ]);
    let total = answer["memory"]["device_total_bytes"].as_u64().unwrap();
    assert!(total <= budget, "{total} > {budget}");
    assert_clean_error(
        &planner(&[
            &"plan",
            &graph,
            &"-q",
            &"--budget",
            &"1KiB",
            &"--budget-includes",
            &"training-state",
        ]),
        &["budget 1.0 KiB (1024 B) is not above", "alone"],
    );
}

const GLM: &str = "../tests/golden/glm_dsa_ep2.pb";

#[test]
fn offloading_an_unknown_unit_is_an_error_naming_the_declared_ones() {
    assert_clean_error(
        &planner(&[
            &"plan",
            &GLM,
            &"--keep",
            &"all",
            &"--offload",
            &"save_nothing",
        ]),
        &["unknown-unit", "SAVE_NOTHING", "SAVE_DSA_INDEXER"],
    );
}

#[test]
fn offloading_a_unit_keep_does_not_keep_is_an_error() {
    assert_clean_error(
        &planner(&[
            &"plan",
            &GLM,
            &"--keep",
            &"save_attn",
            &"--offload",
            &"save_dsa_indexer",
        ]),
        &["--offload", "SAVE_DSA_INDEXER", "--keep does not keep"],
    );
}

#[test]
fn offload_with_a_budget_or_an_unknown_kind_is_a_usage_error() {
    assert_usage_error(
        &planner(&[
            &"plan",
            &GLM,
            &"--budget",
            &"70KiB",
            &"--offload-kinds",
            &"kept",
        ]),
        &["--budget", "--offload-kinds"],
    );
    assert_usage_error(
        &planner(&[&"plan", &GLM, &"--offload-kinds", &"everything"]),
        &["everything", "layer-input"],
    );
    assert_usage_error(
        &planner(&[&"pareto", &GLM, &"--offload-kinds", &"kept"]),
        &["--offload-kinds"],
    );
}

#[test]
fn offloading_the_dsa_indexer_lowers_the_device_peak_and_states_host_bytes_and_transfer_time() {
    let peak = |extra: &[&dyn AsRef<std::ffi::OsStr>]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"plan",
            &GLM,
            &"--keep",
            &"save_dsa_indexer",
            &"--format",
            &"json",
        ];
        args.extend_from_slice(extra);
        let out = planner(&args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        plan["memory"].clone()
    };
    let kept = peak(&[]);
    let offloaded = peak(&[&"--offload", &"SAVE_DSA_INDEXER"]);
    assert!(offloaded["peak_bytes"].as_u64() < kept["peak_bytes"].as_u64());
    assert!(offloaded["offloaded_bytes"].as_u64() > Some(0));
    assert_eq!(kept["offloaded_bytes"].as_u64(), Some(0));
}
