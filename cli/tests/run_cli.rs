//! `planner run` end to end: the report a user reads, and the ways a run is refused or fails,
//! each one `error:` line and exit 1.

#![cfg(feature = "run")]

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

fn golden(name: &str) -> PathBuf {
    testkit::golden_graph(name)
}

fn planner(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .output()
        .expect("the planner binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A scratch directory for this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("planner-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir.join(name)
}

#[test]
fn the_dsa_golden_on_two_ranks_proves_the_plan() {
    let graph = golden("glm_dsa_ep2");
    let out = planner(&[
        "run",
        graph.to_str().unwrap(),
        "--keep",
        "save_dsa_indexer",
        "--ranks",
        "2",
        "--check",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for needle in [
        "rank 0\n",
        "rank 1\n",
        "measured peak",
        "predicted peak",
        "bit-identical to no-checkpoint and whole-layer",
        "aten.topk.default ×3), run in replay 0 times",
        "reference (PyTorch)",
    ] {
        assert!(stdout.contains(needle), "missing `{needle}` in:\n{stdout}");
    }
    assert!(!stdout.contains("FAILED"), "{stdout}");
}

#[test]
fn the_json_report_carries_peaks_op_counts_and_parity() {
    // Timed as this CPU runs ops: each before the next (an asynchronous GPU profile overlaps
    // them, so the times of ops run alone add up to more than its step).
    let cpu = scratch("in_order.json");
    std::fs::write(&cpu, r#"{"name": "in order", "asynchronous": false}"#).unwrap();
    let out = planner(&[
        "run",
        golden("dense").to_str().unwrap(),
        "--check",
        "--hw",
        cpu.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["passed"], true);
    let runs = &report["ranks"][0]["runs"];
    let variants: Vec<&str> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["variant"].as_str().unwrap())
        .collect();
    assert_eq!(variants, ["plan", "no-checkpoint", "whole-layer"]);
    assert!(runs[0]["ops"]["replay"].as_u64().unwrap() > 0);
    assert_eq!(runs[1]["ops"]["replay"], 0);
    assert!(runs[0]["measured_peak_bytes"].as_u64().unwrap() > 0);
    // Times: measured per stage, predicted from the plan's cost; no replay without checkpoints.
    let time = |run: &serde_json::Value, key: &str| run[key].as_f64().unwrap();
    let measured = &runs[0]["measured"];
    assert!(time(measured, "replay_time_s") > 0.0);
    assert!(time(measured, "step_time_s") >= time(measured, "forward_time_s"));
    assert!(time(&runs[0]["predicted"], "replay_time_s") > 0.0);
    assert!(
        time(&runs[0]["predicted"], "step_time_s") > time(&runs[1]["predicted"], "step_time_s")
    );
    assert_eq!(runs[1]["measured"]["replay_time_s"], 0.0);
    assert_eq!(runs[1]["predicted"]["replay_time_s"], 0.0);
    // Per op: every run of its nodes; the predictions add up to the plan's step time, the
    // measurements to no more than the step's.
    for run in runs.as_array().unwrap() {
        let ops = run["op_times"].as_array().unwrap();
        let total = |key: &str| ops.iter().map(|t| t[key].as_f64().unwrap()).sum::<f64>();
        let runs_of = ops.iter().map(|t| t["runs"].as_u64().unwrap()).sum::<u64>();
        let counted = ["forward", "replay", "backward"].map(|s| run["ops"][s].as_u64().unwrap());
        assert_eq!(runs_of, counted.iter().sum::<u64>());
        let predicted = time(&run["predicted"], "step_time_s");
        assert!((total("predicted_s") - predicted).abs() <= 1e-9 * predicted);
        assert!(total("measured_s") <= time(&run["measured"], "step_time_s") * 1.05);
    }
    let tensors = report["ranks"][0]["tensors"].as_array().unwrap();
    assert!(tensors.iter().all(|t| t["reference"]["within"] == true));
}

/// The measured peak and host bytes of rank 0's plan run, with its predictions.
fn offload_figures(report: &serde_json::Value) -> [u64; 4] {
    let run = &report["ranks"][0]["runs"][0];
    let bytes = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    [
        bytes(&run["measured_peak_bytes"]),
        bytes(&run["predicted_peak_bytes"]),
        bytes(&run["measured"]["offloaded_bytes"]),
        bytes(&run["predicted"]["offloaded_bytes"]),
    ]
}

#[test]
fn an_offloading_plan_runs_with_its_storages_on_the_host_as_predicted() {
    let graph = golden("glm_dsa_ep2");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", graph.to_str().unwrap(), "--keep", "save_dsa_indexer"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--format", "json"]);
        let out = planner(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON")
    };
    let [kept_peak, _, kept_moved, _] = offload_figures(&run(&[]));
    let offloaded = run(&["--offload", "save_dsa_indexer", "--offload-prefetch", "0"]);
    let [peak, predicted_peak, moved, predicted_moved] = offload_figures(&offloaded);
    assert_eq!(kept_moved, 0);
    assert_eq!((peak, moved), (predicted_peak, predicted_moved));
    assert!(
        moved > 0 && peak < kept_peak,
        "{peak} B vs {kept_peak} B kept"
    );
    let out = planner(&[
        "run",
        graph.to_str().unwrap(),
        "--keep",
        "save_dsa_indexer",
        "--offload",
        "save_dsa_indexer",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("host: offloaded 10.5 KiB (10752 B) (predicted 10.5 KiB (10752 B), +0.0%)"),
        "{stdout}"
    );
}

/// `planner run` on the dense golden keeping everything, with `options`, exits 1 before
/// running, its error saying `why` and to plan for the graph executor.
fn assert_refused_for_another_executor(options: &[&str], why: &str) {
    let dense = golden("dense");
    let mut args = vec!["run", dense.to_str().unwrap(), "--keep", "all"];
    args.extend_from_slice(options);
    let out = planner(&args);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(why) && stderr.contains("--executor graph"),
        "{stderr}"
    );
}

#[test]
fn an_eager_plans_offload_is_refused_before_running() {
    assert_refused_for_another_executor(
        &["--offload-kinds", "kept", "--executor", "eager"],
        "offloads for the eager executor",
    );
}

#[test]
fn a_plan_for_the_compiled_executor_is_refused_before_running() {
    assert_refused_for_another_executor(
        &["--executor", "compiled"],
        "the plan is for the compiled executor",
    );
}

#[test]
fn offload_options_with_a_plan_file_are_refused() {
    let out = planner(&[
        "run",
        golden("dense").to_str().unwrap(),
        "--plan",
        "plan.json",
        "--offload-kinds",
        "kept",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot be used with"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn an_unsupported_op_is_one_error_line_naming_it_and_its_first_node() {
    let mut b = testkit::Builder::new(1, &[]);
    let x = b.input("x");
    let (first, y) = b.node("aten.no_such_op.default", &[&x]);
    b.node("aten.no_such_op.default", &[&y]);
    let path = scratch("unsupported.json");
    ir::io::write_wire(&b.wire(), &path).expect("written");
    let out = planner(&["run", path.to_str().unwrap(), "--seed", "1"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: unsupported op `aten.no_such_op.default` (first used by node `{first}`)"
        )),
        "{stderr}"
    );
}

/// `planner plan` of `graph` with `options`, written to the scratch file `name`.
fn plan_file(graph: &str, options: &[&str], name: &str) -> PathBuf {
    let plan = scratch(name);
    let made = planner(
        &[
            &[
                "plan",
                golden(graph).to_str().unwrap(),
                "-o",
                plan.to_str().unwrap(),
            ],
            options,
        ]
        .concat(),
    );
    assert!(made.status.success(), "{}", text(&made.stderr));
    plan
}

/// `planner run` of `graph` with the plan file `plan`.
fn run_plan_file(graph: &str, plan: &Path) -> Output {
    planner(&[
        "run",
        golden(graph).to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
    ])
}

#[test]
fn a_plan_made_for_another_graph_is_refused() {
    let plan = plan_file("dense", &["--format", "pb"], "dense.plan.pb");
    let out = run_plan_file("moe_ep2", &plan);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the plan was made for graph `dense`") && stderr.contains("re-plan"),
        "{stderr}"
    );
}

#[test]
fn a_failing_rank_ends_the_run_with_every_rank_naming_it() {
    let out = planner(&[
        "run",
        golden("moe_ep2").to_str().unwrap(),
        "--inject-fault",
        "fail:1:2",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines[0].starts_with("error: rank 1: ")
            && lines[0].contains("fault injected before collective #2"),
        "{stderr}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("rank 0: ") && l.contains("rank 1 failed")),
        "{stderr}"
    );
}

#[test]
fn a_stalled_rank_ends_every_rank_within_the_timeout() {
    let started = Instant::now();
    let out = planner(&[
        "run",
        golden("moe_ep2").to_str().unwrap(),
        "--timeout",
        "1",
        "--inject-fault",
        "stall:1:0:600",
    ]);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "ended by the timeout, not the stall"
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 0: ")
            && stderr.contains("rank 1 did not reach collective #0 (all_to_all_single"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 1: did not stop"), "{stderr}");
}

#[test]
fn ranks_other_than_the_exported_world_size_are_refused() {
    let out = planner(&["run", golden("moe_ep2").to_str().unwrap(), "--ranks", "3"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("exported for 2 rank(s)"), "{stderr}");
}

#[test]
fn ranks_with_their_own_graph_run_their_own_plan() {
    // glm_dsa_ep2's ranks hold other sequence positions: rank 1 has its own graph, so a plan
    // file is needed for each.
    let plan = scratch("glm.plan.pb");
    let write_plan = |graph: &str, out: &PathBuf| {
        let made = planner(&["plan", graph, "--keep", "all", "-o", out.to_str().unwrap()]);
        assert!(made.status.success(), "{}", text(&made.stderr));
    };
    write_plan(golden("glm_dsa_ep2").to_str().unwrap(), &plan);
    let run = || {
        planner(&[
            "run",
            golden("glm_dsa_ep2").to_str().unwrap(),
            "--plan",
            plan.to_str().unwrap(),
        ])
    };
    let out = run();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("glm.plan.rank1.pb") && stderr.contains("rank 1 runs its own graph"),
        "{stderr}"
    );
    let rank1 = testkit::repo_root().join("tests/golden/glm_dsa_ep2.rank1.pb");
    write_plan(rank1.to_str().unwrap(), &scratch("glm.plan.rank1.pb"));
    let out = run();
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Runs the planner, killing it after `limit`: `None` when it did not end in time.
fn planner_within(args: &[&str], limit: Duration) -> Option<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the planner binary starts");
    let started = Instant::now();
    while started.elapsed() < limit {
        if child
            .try_wait()
            .expect("the child can be waited for")
            .is_some()
        {
            return Some(child.wait_with_output().expect("its output"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// The one `error:` block of a run that must fail promptly (well within the default 60 s
/// `--timeout`), exit 1.
fn fails_promptly(args: &[&str]) -> String {
    let out = planner_within(args, Duration::from_secs(30)).expect("the run ends promptly");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// A graph of one input `x` and one op on it (for `ranks` ranks), edited by `edit`, written
/// as `name`.
fn one_op_graph(
    name: &str,
    ranks: u32,
    op: &str,
    edit: impl FnOnce(&mut ir::wire::graph::Graph),
) -> PathBuf {
    let mut b = testkit::Builder::new(1, &[]);
    let x = b.input("x");
    let (_, y) = b.node(op, &[&x]);
    b.output(&y);
    let mut graph = b.wire();
    graph
        .metadata
        .get_or_insert_with(Default::default)
        .world_size = ranks;
    edit(&mut graph);
    let path = scratch(name);
    ir::io::write_wire(&graph, &path).expect("written");
    path
}

fn attribute(name: &str, value: ir::wire::graph::attribute::Value) -> ir::wire::graph::Attribute {
    ir::wire::graph::Attribute {
        name: name.to_owned(),
        value: Some(value),
    }
}

fn ints(values: &[i64]) -> ir::wire::graph::attribute::Value {
    ir::wire::graph::attribute::Value::Ints(ir::wire::graph::IntList {
        values: values.to_vec(),
    })
}

/// Writes a safetensors file of `(key, dtype, shape, data)` tensors.
fn write_safetensors(path: &PathBuf, tensors: &[(&str, &str, &[u64], Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (key, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            (*key).to_owned(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(data);
    std::fs::write(path, file).expect("written");
}

#[test]
fn a_panicking_rank_is_reported_at_once_naming_it_and_its_op() {
    let started = Instant::now();
    let stderr = fails_promptly(&[
        "run",
        golden("moe_ep2").to_str().unwrap(),
        "--inject-fault",
        "panic:1:0",
    ]);
    assert!(started.elapsed() < Duration::from_secs(20), "{stderr}");
    let first = stderr.lines().next().unwrap();
    assert!(
        first.starts_with("error: rank 1: panicked in forward node `")
            && first.contains("(_c10d_functional.all_to_all_single.default)")
            && first.contains("fault injected before collective #0"),
        "{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("rank 0: ") && l.contains("rank 1 failed")),
        "{stderr}"
    );
    assert!(!stderr.contains("hung"), "{stderr}");
}

#[test]
fn a_malformed_rng_seed_on_one_rank_fails_both_ranks_at_once() {
    let graph = one_op_graph("seed.pb", 2, "aten.relu.default", |_| {});
    let tensors = scratch("seed.safetensors");
    let rank1 = scratch("seed.rank1.safetensors");
    write_safetensors(&tensors, &[]);
    for (shape, bytes) in [(&[2u64][..], vec![0u8; 16]), (&[0u64][..], Vec::new())] {
        write_safetensors(&rank1, &[("rng/seed", "I64", shape, bytes)]);
        let stderr = fails_promptly(&[
            "run",
            graph.to_str().unwrap(),
            "--inputs",
            tensors.to_str().unwrap(),
            "--seed",
            "1",
        ]);
        assert!(
            stderr.starts_with("error: rank 1: ")
                && stderr.contains("`rng/seed` must hold one integer >= 0")
                && stderr.contains(&format!("but it is Int64[{}]", shape[0])),
            "{stderr}"
        );
    }
    let nan = f32::NAN.to_le_bytes().to_vec();
    write_safetensors(&rank1, &[("rng/seed", "F32", &[], nan)]);
    let stderr = fails_promptly(&[
        "run",
        graph.to_str().unwrap(),
        "--inputs",
        tensors.to_str().unwrap(),
        "--seed",
        "1",
    ]);
    assert!(stderr.contains("but it is Float[]"), "{stderr}");
}

#[test]
fn all_to_all_split_sizes_that_wrap_are_refused_before_running() {
    let graph = one_op_graph(
        "splits.pb",
        3,
        "_c10d_functional.all_to_all_single.default",
        |g| {
            let node = &mut g.nodes[0];
            node.attributes
                .push(attribute("output_split_sizes", ints(&[1, 1, 2])));
            node.attributes.push(attribute(
                "input_split_sizes",
                ints(&[i64::MAX, i64::MAX, 6]),
            ));
        },
    );
    let stderr = fails_promptly(&["run", graph.to_str().unwrap(), "--seed", "1"]);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("input split sizes [9223372036854775807, 9223372036854775807, 6] add up to more than 64 bits hold rows, but input `x` has shape [4, 4]"),
        "{stderr}"
    );
}

#[test]
fn inputs_larger_than_memory_are_refused_before_allocating() {
    for dtype in [
        ir::wire::graph::Dtype::Int64,
        ir::wire::graph::Dtype::Float32,
    ] {
        let graph = one_op_graph("huge.pb", 1, "aten.relu.default", |g| {
            g.values[0].dtype = dtype as i32;
            g.values[0].shape = vec![1 << 40];
            g.values[1].dtype = dtype as i32;
            g.values[1].shape = vec![1 << 40];
        });
        let stderr = fails_promptly(&["run", graph.to_str().unwrap(), "--seed", "1"]);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("the graph inputs of 1 rank(s) declare")
                && stderr.contains("bytes for a run (--max-input-bytes"),
            "{stderr}"
        );
    }
    let stderr = fails_promptly(&[
        "run",
        golden("dense").to_str().unwrap(),
        "--max-input-bytes",
        "1KiB",
    ]);
    assert!(
        stderr.contains("over the limit of 1024 bytes for a run"),
        "{stderr}"
    );
}

#[test]
fn a_timeout_beyond_what_the_clock_holds_is_refused_in_plain_words() {
    for timeout in ["1e19", "1e20", "0", "-1", "NaN", "inf"] {
        let stderr = fails_promptly(&[
            "run",
            golden("dense").to_str().unwrap(),
            &format!("--timeout={timeout}"),
        ]);
        assert_eq!(
            stderr,
            format!(
                "error: --timeout must be a number of seconds above 0 and at most 1e9 (about \
                 31 years), got {}\n",
                timeout.parse::<f64>().unwrap()
            )
        );
    }
}

#[test]
fn a_world_size_beyond_what_threads_can_run_is_refused() {
    let graph = one_op_graph("world.pb", u32::MAX, "aten.relu.default", |_| {});
    let stderr = fails_promptly(&["run", graph.to_str().unwrap(), "--seed", "1"]);
    assert_eq!(
        stderr,
        "error: graph `built` was exported for 4294967295 ranks, but one `planner run` runs at \
         most 1024 ranks as threads\n"
    );
}

#[test]
fn many_failing_ranks_are_summarised() {
    let graph = one_op_graph("thousand.pb", 1000, "aten.relu.default", |_| {});
    let stderr = fails_promptly(&["run", graph.to_str().unwrap()]);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 9, "{stderr}");
    assert!(
        lines[0].starts_with("error: rank 0: no tensor for input `x`"),
        "{stderr}"
    );
    assert_eq!(lines[8], "... and 992 more rank(s) failed");
}

#[cfg(unix)]
#[test]
fn inputs_that_are_not_regular_files_are_refused_without_reading() {
    let fifo = scratch("inputs.fifo");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    for (path, kind) in [
        (fifo.to_str().unwrap(), "a FIFO (named pipe)"),
        ("/dev/zero", "a character device"),
    ] {
        let stderr = fails_promptly(&["run", golden("dense").to_str().unwrap(), "--inputs", path]);
        assert_eq!(
            stderr,
            format!(
                "error: rank 0: cannot read safetensors file {path}: it is {kind}, not a regular file\n"
            )
        );
    }
}

#[test]
fn a_malformed_safetensors_file_is_named_once_in_plain_words() {
    let tensors = scratch("short.safetensors");
    std::fs::write(&tensors, b"abcd").unwrap();
    let path = tensors.to_str().unwrap();
    let stderr = fails_promptly(&["run", golden("dense").to_str().unwrap(), "--inputs", path]);
    assert_eq!(
        stderr,
        format!(
            "error: rank 0: {path}: not a valid safetensors file: it is shorter than the 8 bytes \
             that give its header's length\n"
        )
    );
}

#[test]
fn an_op_allocating_past_its_declared_outputs_is_stopped_before_it_allocates() {
    let graph = one_op_graph("arange.pb", 1, "aten.arange.default", |g| {
        let node = &mut g.nodes[0];
        node.inputs.clear();
        node.attributes.push(attribute(
            "end",
            ir::wire::graph::attribute::Value::Int(400_000_000),
        ));
        g.values[1].dtype = ir::wire::graph::Dtype::Int64 as i32;
        g.values[1].shape = vec![4];
    });
    let stderr = fails_promptly(&["run", graph.to_str().unwrap(), "--seed", "1"]);
    assert!(
        stderr.starts_with("error: rank 0: forward node `n1` (aten.arange.default): the op asked for 3200000000 bytes at once, past the"),
        "{stderr}"
    );
}

#[test]
fn an_op_running_past_the_timeout_is_stopped_by_the_watchdog() {
    let graph = one_op_graph("expand.pb", 1, "aten.expand.default", |g| {
        g.values[0].shape = vec![1];
        g.values[1].shape = vec![1 << 40];
        g.nodes[0]
            .attributes
            .push(attribute("size", ints(&[1 << 40])));
    });
    // The expanded view allocates nothing; summing its 2^40 elements takes minutes.
    let mut wire = ir::io::read_wire(&graph).expect("read back");
    let sum = ir::wire::graph::Node {
        name: "total".to_owned(),
        op: "aten.sum.default".to_owned(),
        inputs: vec![wire.values[1].name.clone()],
        outputs: vec!["total.out".to_owned()],
        attributes: Vec::new(),
        ..wire.nodes[0].clone()
    };
    wire.values.push(ir::wire::graph::Value {
        name: "total.out".to_owned(),
        shape: vec![],
        ..wire.values[1].clone()
    });
    wire.nodes.push(sum);
    wire.outputs = vec!["total.out".to_owned()];
    ir::io::write_wire(&wire, &graph).expect("written");
    let started = Instant::now();
    let stderr = fails_promptly(&[
        "run",
        graph.to_str().unwrap(),
        "--seed",
        "1",
        "--timeout",
        "1",
    ]);
    assert!(started.elapsed() < Duration::from_secs(15), "{stderr}");
    assert_eq!(
        stderr,
        "error: rank 0: forward node `total` (aten.sum.default) did not finish within 1 s (--timeout); left behind\n"
    );
}

/// The shared libraries the dynamic loader maps for `planner ARGS`, from its `LD_DEBUG` trace.
fn libraries_loaded(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .env("LD_DEBUG", "libs")
        .output()
        .expect("the planner binary runs");
    text(&out.stderr)
        .lines()
        .filter(|l| l.contains("calling init:"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn only_planner_run_loads_libtorch() {
    let dense = golden("dense");
    for args in [&["--version"][..], &["inspect", dense.to_str().unwrap()]] {
        let loaded = libraries_loaded(args);
        assert!(!loaded.is_empty(), "LD_DEBUG traces the loader");
        assert!(!loaded.contains("libtorch"), "planner {args:?}:\n{loaded}");
    }
    let loaded = libraries_loaded(&["run", dense.to_str().unwrap(), "--timeout=0"]);
    assert!(
        loaded.contains("libtorch_cpu") && loaded.contains("libplanner_run"),
        "{loaded}"
    );
}

#[test]
fn planner_run_without_its_runtime_library_says_how_to_build_it() {
    let alone = scratch("alone");
    std::fs::create_dir_all(&alone).unwrap();
    let binary = alone.join("planner");
    std::fs::copy(env!("CARGO_BIN_EXE_planner"), &binary).expect("copied");
    let out = Command::new(&binary)
        .args(["run", golden("dense").to_str().unwrap()])
        .output()
        .expect("the copy runs");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: `planner run` needs the runtime library libplanner_run.so")
            && stderr.contains("cargo build --release -p planner-cli --features run"),
        "{stderr}"
    );
    let version = Command::new(&binary).arg("--version").output().unwrap();
    assert!(version.status.success(), "{}", text(&version.stderr));
}

/// A budget's answer run from its file: the summary says its units are chosen per layer, kept
/// and offloaded (its `--keep` is none). (`run_matrix.rs` holds such an answer's peaks.)
#[test]
fn a_budget_offload_plan_file_runs_and_says_it_chooses_per_layer() {
    let options = ["--budget", "48000", "--budget-offload", "-q"];
    let plan = plan_file("moe_ep2", &options, "moe.budget.json");
    let out = run_plan_file("moe_ep2", &plan);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{stdout}", text(&out.stderr));
    assert!(
        stdout.contains("keep per layer (the plan's layer_keep), offload per layer"),
        "{stdout}"
    );
}

/// [`testkit::activation_dominated`] with `[1024, 1024]` float32 values (4 MiB each): a step
/// that allocates and frees tens of MiB.
fn large_step_graph() -> PathBuf {
    let mut graph = testkit::activation_dominated().wire();
    for value in &mut graph.values {
        value.shape = vec![1024, 1024];
    }
    let path = scratch("large_step.pb");
    ir::io::write_wire(&graph, &path).expect("written");
    path
}

/// The median page faults a step of `planner run` on [`large_step_graph`] reports.
fn page_faults_a_step(extra: &[&str]) -> u64 {
    let graph = large_step_graph();
    let graph = graph.to_str().unwrap();
    let args = [
        &[
            "run", graph, "--seed", "0", "--repeat", "7", "--format", "json",
        ],
        extra,
    ]
    .concat();
    let out = planner(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    report["ranks"][0]["runs"][0]["measured"]["page_faults"]
        .as_u64()
        .expect("Linux counts page faults")
}

/// On the CPU the run keeps the memory glibc obtains, as a GPU's caching allocator keeps its
/// blocks: steps after the first reuse it, and the median step takes a fraction of the page
/// faults it takes with glibc's defaults (`--release-cpu-memory`), which fault again on the
/// large blocks glibc gave back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn steps_after_the_first_reuse_the_memory_the_first_obtained() {
    let retained = page_faults_a_step(&[]);
    let released = page_faults_a_step(&["--release-cpu-memory"]);
    // One 4 MiB value is 1,024 pages; the step makes about 20 of them. Measured a step: kept,
    // 0 to 1,024; with glibc's defaults, 7,152 (4,064 with the binary `cargo test
    // --workspace` builds, whose first steps leave glibc a higher mmap threshold).
    let two_values = 2 * 1024;
    assert!(
        retained <= two_values && released > 2 * two_values,
        "{retained} page faults a step with memory kept (at most {two_values}), {released} \
         with glibc's defaults"
    );
}
