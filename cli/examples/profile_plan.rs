//! Times the phases of `planner plan` on one graph, each once, single process: wall time, the
//! process's CPU time (user + system, all threads: what a shared machine does not inflate as
//! much), and the resident memory after the phase:
//!
//!     cargo run --release -p planner-cli --example profile_plan -- GRAPH.pb
//!
//! For finding where time goes; the benchmark of record is `cargo bench -p planner-cli --bench scale`.

use std::{path::Path, time::Instant};

use ir::plan::{Format, Keep};
use planner::{
    config::{self, PlanConfig},
    cost::HwProfile,
    diagnostics, memory, partition, plan, policy, render,
};

/// The `planner` binary's allocator settings (the same file).
#[path = "../src/allocator.rs"]
mod allocator;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: profile_plan GRAPH.pb");
        std::process::exit(2);
    };
    allocator::keep_freed_memory();
    let mut clock = Clock::start();
    let graph = ir::io::load(Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
    clock.lap(&format!("load ({} nodes)", graph.nodes().len()));
    let config = PlanConfig {
        keep: Keep::All,
        ..PlanConfig::default()
    };
    let hw = HwProfile::default();
    let resolved = config::resolve(&graph, &config).unwrap_or_else(|e| panic!("{e}"));
    clock.lap("resolve");
    let policy = policy::apply(&graph, &config, &resolved);
    clock.lap("policy");
    let part = partition::partition(&graph, &policy, config.executor);
    clock.lap("partition");
    partition::verify(&graph, &policy, &part).unwrap_or_else(|e| panic!("{e}"));
    clock.lap("verify");
    let sim = memory::simulate_executed(&graph, &part.order, &part.replays, part.executed());
    clock.lap("simulate");
    let diags = diagnostics::diagnose(&graph, &config, &resolved, &policy, Some(&part));
    clock.lap(&format!("diagnose ({})", diags.len()));
    let p = plan::plan(&graph, &config, &hw).unwrap_or_else(|e| panic!("{e}"));
    clock.lap(&format!("plan::plan (peak {})", sim.peak_bytes));
    let text = render::text(&p, &graph);
    clock.lap(&format!("render text ({} B)", text.len()));
    let json = p.encode(&graph, Format::Json);
    clock.lap(&format!("render json ({} B)", json.len()));
    drop((p, part, policy));
    clock.lap("drop plan");
    drop(graph);
    clock.lap("drop graph");
}

struct Clock {
    wall: Instant,
    cpu: Option<u64>,
}

impl Clock {
    fn start() -> Self {
        Clock {
            wall: Instant::now(),
            cpu: cpu_ms(),
        }
    }

    fn lap(&mut self, what: &str) {
        let cpu = cpu_ms();
        let spent = cpu.zip(self.cpu).map_or_else(
            || "?".to_owned(),
            |(now, before)| (now - before).to_string(),
        );
        println!(
            "{:>8.1} ms  {spent:>6} ms cpu  {:>6} MB resident  {what}",
            self.wall.elapsed().as_secs_f64() * 1e3,
            resident_mb()
        );
        *self = Clock::start();
    }
}

/// User + system CPU time of the process so far, all threads, from `/proc/self/stat` (Linux;
/// in clock ticks, taken as the usual 100 per second).
fn cpu_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces; the fields after its closing parenthesis do not.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    // utime and stime are fields 14 and 15 of the line; the state, field 3, is the first here.
    Some((ticks(11)? + ticks(12)?) * 10)
}

/// Resident set size from `/proc/self/statm` (Linux), `?` elsewhere.
fn resident_mb() -> String {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok());
    pages.map_or_else(|| "?".to_owned(), |p| (p * 4096 / 1_000_000).to_string())
}
