//! `planner run` end to end: the report a user reads, and the ways a run is refused or fails,
//! each one `error:` line and exit 1.

#![cfg(feature = "run")]

use std::{
    path::PathBuf,
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
    let out = planner(&[
        "run",
        golden("dense").to_str().unwrap(),
        "--check",
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
    let tensors = report["ranks"][0]["tensors"].as_array().unwrap();
    assert!(tensors.iter().all(|t| t["reference"]["within"] == true));
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

#[test]
fn a_plan_made_for_another_graph_is_refused() {
    let plan = scratch("dense.plan.pb");
    let made = planner(&[
        "plan",
        golden("dense").to_str().unwrap(),
        "--format",
        "pb",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(made.status.success(), "{}", text(&made.stderr));
    let out = planner(&[
        "run",
        golden("moe_ep2").to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
    ]);
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
