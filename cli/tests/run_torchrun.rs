//! `planner run` launched as PyTorch launches a job: `torchrun --no-python` starts one process
//! per rank, the ranks meet through torchrun's store and run their collectives through
//! libtorch's gloo. Every golden exported for two ranks gives, on each rank, the report of the
//! single-process (loopback) run of that rank: outputs bit for bit, peaks and op counts. A rank
//! that fails, panics or stalls ends the job with an error naming it, within the timeout (and
//! in torchrun's failure summary); a launch whose environment does not fit the graph is refused
//! before anything runs.

#![cfg(feature = "run")]

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use serde_json::Value;

/// The ranks a launch starts unless it says otherwise.
const RANKS: usize = 2;

/// The longest a launch may take before the test kills it (a hang fails the test).
const LIMIT: Duration = Duration::from_secs(180);

fn planner_bin() -> &'static str {
    env!("CARGO_BIN_EXE_planner")
}

fn golden(name: &str) -> String {
    testkit::golden_graph(name).to_string_lossy().into_owned()
}

/// torchrun of the project's venv (`PLANNER_VENV`), else the one on `PATH`
/// (`scripts/env.sh` puts the venv first).
fn torchrun() -> PathBuf {
    std::env::var_os("PLANNER_VENV")
        .map(|venv| PathBuf::from(venv).join("bin/torchrun"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("torchrun"))
}

/// The variables of a launch, removed from a command so that only what a test sets counts.
const LAUNCH_VARS: [&str; 7] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
];

fn without_launch(command: &mut Command) -> &mut Command {
    for var in LAUNCH_VARS {
        command.env_remove(var);
    }
    command
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh directory for one launch's logs.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("planner-torchrun-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// What one torchrun launch left: its status and output, each rank's stdout and stderr.
struct Launched {
    output: Output,
    seconds: f64,
    stdout: Vec<String>,
    stderr: Vec<String>,
}

impl Launched {
    /// Everything the launch printed, for failure messages.
    fn describe(&self) -> String {
        let mut all = format!(
            "torchrun exited {:?} after {:.1} s\n{}",
            self.output.status.code(),
            self.seconds,
            text(&self.output.stderr)
        );
        for rank in 0..self.stderr.len() {
            all += &format!(
                "\n--- rank {rank} stderr:\n{}",
                self.stderr.get(rank).map_or("", String::as_str)
            );
        }
        all
    }

    fn report(&self, rank: usize) -> Value {
        serde_json::from_str(&self.stdout[rank]).unwrap_or_else(|e| {
            panic!(
                "rank {rank}'s report is not JSON ({e}):\n{}",
                self.describe()
            )
        })
    }
}

/// `torchrun --standalone --no-python --nproc-per-node 2 planner run ARGS`, each rank's output
/// in its own file (a standalone launch picks a free port, so launches run side by side).
fn launch(name: &str, args: &[&str]) -> Launched {
    launch_ranks(name, RANKS, args)
}

/// [`launch`] with `ranks` processes.
fn launch_ranks(name: &str, ranks: usize, args: &[&str]) -> Launched {
    launch_command(name, ranks, "run", args)
}

/// `planner COMMAND ARGS` on `ranks` processes launched by torchrun.
fn launch_command(name: &str, ranks: usize, command: &str, args: &[&str]) -> Launched {
    let logs = scratch(name);
    let started = Instant::now();
    let output = without_launch(&mut Command::new("timeout"))
        .args(["--kill-after=5", &LIMIT.as_secs().to_string()])
        .arg(torchrun())
        .args(["--standalone", "--no-python", "--nproc-per-node"])
        .arg(ranks.to_string())
        .arg("--log-dir")
        .arg(&logs)
        .args(["--redirects", "3", planner_bin(), command])
        .args(args)
        .output()
        .expect("torchrun starts (scripts/env.sh puts the venv's torchrun on PATH)");
    let seconds = started.elapsed().as_secs_f64();
    assert_ne!(
        output.status.code(),
        Some(124),
        "torchrun did not end within {} s",
        LIMIT.as_secs()
    );
    let rank_file = |rank: usize, file: &str| {
        find_rank_file(&logs, rank, file)
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    };
    Launched {
        seconds,
        stdout: (0..ranks).map(|r| rank_file(r, "stdout.log")).collect(),
        stderr: (0..ranks).map(|r| rank_file(r, "stderr.log")).collect(),
        output,
    }
}

/// torchrun writes rank r's `FILE` to `LOGS/<run id>/attempt_0/<r>/FILE`.
fn find_rank_file(logs: &Path, rank: usize, file: &str) -> Option<PathBuf> {
    std::fs::read_dir(logs)
        .ok()?
        .filter_map(|entry| entry.ok())
        .map(|entry| {
            entry
                .path()
                .join("attempt_0")
                .join(rank.to_string())
                .join(file)
        })
        .find(|path| path.exists())
}

/// The single-process run of the same graph: every rank a thread, loopback collectives.
fn loopback_report(args: &[&str]) -> Value {
    let out = without_launch(&mut Command::new(planner_bin()))
        .arg("run")
        .args(args)
        .output()
        .expect("the planner runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("a JSON report")
}

/// A rank's report without what differs between any two runs (wall times).
fn comparable(rank: &Value) -> Value {
    let mut rank = rank.clone();
    for run in rank["runs"].as_array_mut().expect("runs") {
        let run = run.as_object_mut().expect("a run");
        run.remove("seconds");
        run.remove("measured");
        run.remove("op_times");
    }
    rank
}

/// Each rank of the torchrun launch reports what the loopback run reports for that rank: the
/// same outputs bit for bit (digests), the same comparisons with the other variants and the
/// reference, the same peaks and op counts.
fn check_parity(golden_name: &str, ranks: usize) {
    let graph = golden(golden_name);
    let args = [
        graph.as_str(),
        "--check",
        "--format",
        "json",
        "--timeout",
        "60",
    ];
    let loopback = loopback_report(&args);
    assert_eq!(loopback["ranks"].as_array().map(Vec::len), Some(ranks));
    let launched = launch_ranks(golden_name, ranks, &args);
    assert!(launched.output.status.success(), "{}", launched.describe());
    for rank in 0..ranks {
        let report = launched.report(rank);
        assert_eq!(report["communicator"], "gloo");
        assert_eq!(report["world_size"], ranks);
        assert_eq!(report["passed"], true, "rank {rank}: {report:#}");
        assert_eq!(report["plan"], loopback["plan"]);
        assert_eq!(report["graph"]["structure"], loopback["graph"]["structure"]);
        let ranks = report["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 1, "each process runs its own rank only");
        let (mine, theirs) = (comparable(&ranks[0]), comparable(&loopback["ranks"][rank]));
        assert!(
            mine["tensors"].as_array().is_some_and(|t| !t.is_empty()),
            "rank {rank} reports no outputs"
        );
        assert_eq!(
            mine, theirs,
            "rank {rank} under torchrun differs from loopback"
        );
    }
}

macro_rules! parity {
    ($($name:ident),* $(,)?) => {
        /// The goldens exported for two ranks, one launch each.
        const TWO_RANK_GOLDENS: &[&str] = &[$(stringify!($name)),*];
        $(
            #[test]
            fn $name() {
                check_parity(stringify!($name), RANKS);
            }
        )*
    };
}

parity!(
    glm_dsa_ep2,
    glm_dsa_ep2_compiled,
    moe_domino,
    moe_ep2,
    moe_ep2_compiled,
    moe_ep2_cuda,
    moe_ep2_inplace,
    moe_ep2_unbalanced,
);

/// Four processes: `moe_ep4`'s collectives only move data (all-to-all), so its ranks equal the
/// loopback's bit for bit too. (A sum over more than two ranks may add in another order than
/// the loopback's rank order.)
#[test]
fn moe_ep4_on_four_processes() {
    check_parity("moe_ep4", 4);
}

/// Every golden exported for two ranks has its parity test.
#[test]
fn every_two_rank_golden_runs_under_torchrun() {
    let dir = testkit::repo_root().join("tests/golden");
    let mut two_ranks: Vec<String> = std::fs::read_dir(&dir)
        .expect("the goldens")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "pb"))
        .filter(|path| !path.to_string_lossy().contains(".rank"))
        .filter(|path| {
            let graph = ir::io::load(path).expect("a golden loads");
            graph.metadata().world_size == RANKS as u32
        })
        .filter_map(|path| path.file_stem()?.to_str().map(str::to_owned))
        .collect();
    two_ranks.sort();
    let mut tested = TWO_RANK_GOLDENS.to_vec();
    tested.sort_unstable();
    assert_eq!(two_ranks, tested);
}

/// Launches `moe_ep2` with `fault` injected and a timeout of `timeout` seconds.
fn launch_with_fault(name: &str, fault: &str, timeout: &str) -> Launched {
    let graph = golden("moe_ep2");
    let launched = launch(
        name,
        &[&graph, "--timeout", timeout, "--inject-fault", fault],
    );
    assert!(!launched.output.status.success(), "{}", launched.describe());
    launched
}

#[test]
fn a_failing_rank_ends_every_process_with_an_error_naming_it() {
    let launched = launch_with_fault("fail", "fail:1:0", "30");
    let site = "collective #0 (all_to_all_single at node `all_to_all_single`)";
    assert_eq!(
        launched.stderr[1],
        format!("error: rank 1: fault injected before {site}\n"),
        "{}",
        launched.describe()
    );
    assert_eq!(
        launched.stderr[0],
        format!(
            "error: rank 0: forward node `all_to_all_single`: rank 1 failed: fault injected \
             before {site}\n"
        ),
        "{}",
        launched.describe()
    );
    // torchrun's own failure summary shows each rank's error (its error file).
    let summary = text(&launched.output.stderr) + &text(&launched.output.stdout);
    assert!(
        summary.contains(&format!("traceback : rank 1: fault injected before {site}")),
        "{}",
        launched.describe()
    );
}

/// Rank 0 hosts the hub: when it panics, it still tells rank 1 before its process ends.
#[test]
fn a_panicking_rank_0_ends_every_process_with_an_error_naming_it() {
    let launched = launch_with_fault("panic", "panic:0:1", "30");
    let (rank0, rank1) = (&launched.stderr[0], &launched.stderr[1]);
    assert!(
        rank0.starts_with("error: rank 0: panicked in forward node `all_to_all_single_1`"),
        "{}",
        launched.describe()
    );
    assert!(
        rank1.starts_with(
            "error: rank 1: forward node `all_to_all_single_1`: rank 0 failed: panicked"
        ),
        "{}",
        launched.describe()
    );
}

/// A rank that stalls for a minute: rank 0 names it after the 2 s timeout and ends, and
/// torchrun ends the stalled process, long before the stall would.
#[test]
fn a_stalled_rank_is_named_within_the_timeout_not_waited_for() {
    let launched = launch_with_fault("stall", "stall:1:0:60", "2");
    assert_eq!(
        launched.stderr[0],
        "error: rank 0: forward node `all_to_all_single`: rank 1 did not reach collective #0 \
         (all_to_all_single at node `all_to_all_single`) within 2 s (stalled or hung)\n",
        "{}",
        launched.describe()
    );
    assert!(launched.seconds < 45.0, "{}", launched.describe());
}

/// `planner run` of `graph` with a launch environment of its own (no torchrun).
fn planner_with_env(graph: &str, vars: &[(&str, &str)]) -> Output {
    without_launch(&mut Command::new(planner_bin()))
        .args(["run", graph, "--timeout", "30"])
        .envs(vars.iter().copied())
        .output()
        .expect("the planner runs")
}

fn refused(vars: &[(&str, &str)]) -> String {
    let out = planner_with_env(&golden("moe_ep2"), vars);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    text(&out.stderr)
}

#[test]
fn a_world_size_other_than_the_graphs_is_refused() {
    let stderr = refused(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]);
    assert_eq!(
        stderr,
        "error: graph `moe_ep2` was exported for 2 rank(s); it cannot run on WORLD_SIZE 3\n"
    );
}

#[test]
fn a_missing_or_malformed_master_port_is_refused_naming_it() {
    let launch = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
    ];
    assert_eq!(refused(&launch), "error: MASTER_PORT is not set\n");
    for (port, message) in [
        ("http", "error: MASTER_PORT=`http` is not a number\n"),
        (
            "65536",
            "error: MASTER_PORT=`65536` is not a TCP port (1 to 65535)\n",
        ),
    ] {
        let mut vars = launch.to_vec();
        vars.push(("MASTER_PORT", port));
        assert_eq!(refused(&vars), message);
    }
}

/// A free TCP port of this host (free when asked; the store binds it right after).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// Launched by hand, without torchrun's store: rank 0 serves the store on `MASTER_PORT`, as
/// PyTorch's rank 0 does, and the ranks give the loopback run's outputs.
#[test]
fn ranks_launched_by_hand_meet_at_rank_0s_store() {
    let graph = golden("moe_ep2");
    let port = free_port().to_string();
    let world = RANKS.to_string();
    let processes: Vec<std::process::Child> = (0..RANKS)
        .map(|rank| {
            let rank = rank.to_string();
            without_launch(&mut Command::new(planner_bin()))
                .args(["run", &graph, "--format", "json", "--timeout", "30"])
                .envs([
                    ("RANK", rank.as_str()),
                    ("WORLD_SIZE", &world),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", &port),
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("the planner starts")
        })
        .collect();
    let loopback = loopback_report(&[&graph, "--format", "json"]);
    for (rank, process) in processes.into_iter().enumerate() {
        let out = process.wait_with_output().expect("the rank ends");
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
        let report: Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
        let digests = |r: &Value| r["tensors"].clone();
        assert_eq!(
            digests(&report["ranks"][0]),
            digests(&loopback["ranks"][rank]),
            "rank {rank}"
        );
    }
}

/// `planner ARGS` as rank 0 of a launch of 2 whose rank 1 never starts, its store on a free
/// port: the port and what the planner did.
fn alone_as_rank_0_of_2(args: &[&str]) -> (String, Output) {
    let port = free_port().to_string();
    let out = without_launch(&mut Command::new(planner_bin()))
        .args(args)
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ])
        .output()
        .expect("the planner runs");
    (port, out)
}

/// A launched rank loads and plans its own graph only: rank 0 of a launch never reads rank 1's
/// graph (here not a graph at all, which a run of every rank as threads refuses); it serves
/// the store and says so when rank 1 never joins.
#[test]
fn a_launched_rank_loads_no_other_ranks_graph() {
    let dir = scratch("own-graph");
    let golden_dir = testkit::repo_root().join("tests/golden");
    for file in ["glm_dsa_ep2.pb", "glm_dsa_ep2.safetensors"] {
        std::fs::copy(golden_dir.join(file), dir.join(file)).expect("a golden copies");
    }
    std::fs::write(dir.join("glm_dsa_ep2.rank1.pb"), b"not a graph").expect("written");
    let graph = dir.join("glm_dsa_ep2.pb");
    let graph = graph.to_str().unwrap();

    let threads = without_launch(&mut Command::new(planner_bin()))
        .args(["run", graph])
        .output()
        .expect("the planner runs");
    assert_eq!(threads.status.code(), Some(1));
    assert!(
        text(&threads.stderr).contains("glm_dsa_ep2.rank1.pb"),
        "{}",
        text(&threads.stderr)
    );

    let (port, out) = alone_as_rank_0_of_2(&["run", graph, "--timeout", "1"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let waited = format!(
        "error: rank 0: the store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) did not form \
         within 1 s: "
    );
    assert!(stderr.starts_with(&waited), "{stderr}");
    assert!(stderr.contains("1/2 clients joined"), "{stderr}");
}

/// `planner calibrate` under torchrun times the collectives through the launched gloo group, not
/// through threads of one process: the profile names the group, its collectives are slower
/// than the loopback ones a plain calibration times (processes exchange through sockets), and
/// only rank 0 writes the profile.
#[test]
fn a_launched_calibration_times_the_collectives_through_its_process_group() {
    let dir = scratch("calibrate");
    let profile = dir.join("profile.json");
    let launched = launch_command(
        "calibrate",
        RANKS,
        "calibrate",
        &["-o", profile.to_str().unwrap(), "--repeat", "3"],
    );
    assert!(launched.output.status.success(), "{}", launched.describe());
    assert!(
        launched.stderr[1].contains("rank 0 writes the profile"),
        "{}",
        launched.describe()
    );
    let read = |bytes: &[u8]| -> Value { serde_json::from_slice(bytes).expect("a JSON profile") };
    let gloo = read(&std::fs::read(&profile).expect("rank 0 wrote the profile"));
    let calibration = &gloo["calibration"];
    assert_eq!(
        calibration["collectives"],
        "gloo, 2 ranks launched as processes"
    );
    let not_measured = calibration["not_measured"].to_string();
    assert!(
        !not_measured.contains("collective_latency_s"),
        "{not_measured}"
    );

    let plain = without_launch(&mut Command::new(planner_bin()))
        .args(["calibrate", "--repeat", "3"])
        .output()
        .expect("the planner runs");
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let loopback = read(&plain.stdout);
    assert_eq!(
        loopback["calibration"]["collectives"],
        "loopback, 2 ranks as threads of one process"
    );
    let latency = |p: &Value| p["collective_latency_s"].as_f64().expect("a latency");
    assert!(
        latency(&gloo) > latency(&loopback),
        "gloo {} s, loopback {} s",
        latency(&gloo),
        latency(&loopback)
    );
}

/// A launched CUDA calibration is refused before anything runs: NCCL queues a collective and
/// returns, so its time per node would be its launch's.
#[test]
fn a_launched_cuda_calibration_is_refused() {
    let (_, out) = alone_as_rank_0_of_2(&["calibrate", "--device", "cuda"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: calibrating collectives through a launched NCCL group"),
        "{stderr}"
    );
}
