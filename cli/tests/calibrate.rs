//! `planner calibrate` end to end: the profile it measures is one `--hw` reads, and it predicts
//! the step `planner run` measures on the same machine within a factor of 3.

#![cfg(feature = "run")]

use std::{path::PathBuf, process::Command};

use serde_json::Value;

fn planner(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .output()
        .expect("the planner binary runs");
    assert!(
        out.status.success(),
        "planner {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("planner-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir.join(name)
}

/// `log(predicted / measured)`: how many e-folds a prediction is off.
fn off(predicted: f64, measured: f64) -> f64 {
    (predicted / measured).ln().abs()
}

#[test]
fn a_calibrated_profile_is_read_by_hw_and_predicts_the_measured_step() {
    // Without `-o` the profile goes to stdout; `--hw` reads it from a file.
    let profile = planner(&["calibrate", "--repeat", "3"]);
    let path = scratch("cpu.json");
    std::fs::write(&path, profile.to_string()).unwrap();
    let timings = profile["calibration"]["timings"].as_array().unwrap();
    for class in [
        "overhead",
        "matmul_f32",
        "attention",
        "memory",
        "host_sync",
        "collective",
    ] {
        assert!(
            timings.iter().any(|t| t["class"] == class),
            "no `{class}` timing in {profile}"
        );
    }
    assert!(profile["op_overhead_s"].as_f64().unwrap() > 0.0);
    assert_eq!(profile["name"], "calibrated cpu");

    let graph = testkit::golden_graph("dense");
    let graph = graph.to_str().unwrap();
    let run = planner(&[
        "run",
        graph,
        "--keep",
        "SAVE_MLP",
        "--repeat",
        "5",
        "--hw",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let step = &run["ranks"][0]["runs"][0];
    let measured = step["measured"]["step_time_s"].as_f64().unwrap();
    let calibrated = step["predicted"]["step_time_s"].as_f64().unwrap();
    // Within a factor of 3 (tiny shapes: the executor's fixed cost per op decides). No
    // comparison with a datasheet here: the H200's launch overhead per op, not its rates,
    // decides its time of this step, and lands as near as this machine's noise.
    assert!(
        off(calibrated, measured) < 3f64.ln(),
        "measured {measured} s, calibrated {calibrated} s"
    );
    let cost = &planner(&[
        "plan",
        graph,
        "--keep",
        "SAVE_MLP",
        "--hw",
        path.to_str().unwrap(),
        "--format",
        "json",
    ])["cost"];
    assert_eq!(cost["hw"], "calibrated cpu");
    assert_eq!(cost["step_time_s"].as_f64(), Some(calibrated));
}
