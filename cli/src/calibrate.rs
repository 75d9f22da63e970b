//! `planner calibrate`: times the op classes the cost model uses on this device, each as a
//! small graph of one op repeated, executed by the same runtime as `planner run` (so an op's
//! overhead is what this executor pays per op), and writes the hardware profile fitted to
//! the timings (`planner::calibration`), with the timings inside it. Under a launcher
//! (`torchrun`: `RANK` and `WORLD_SIZE` set) every rank times the collectives through the
//! launched gloo group, as `planner run` exchanges under it (a CUDA launch is refused: NCCL's
//! queued collectives need timing on the device), then every rank times the rest at once, sharing the machine as a launched job's ranks
//! do, and rank 0 writes the profile.

use std::{path::PathBuf, sync::Arc, time::Duration};

use ir::{wire::graph as pb, Graph};
use planner::{
    calibration::{self, benchmarks, Benchmark},
    config::PlanConfig,
    cost::{Calibration, HwProfile, Timing},
    plan,
};
use runtime::{
    comm::launch::Launch,
    program,
    run::{self as runtime_run, CpuMemory, RankJob, RunConfig, RunReport},
};

use planner_commands::{args::CalibrateArgs, load_hw, output::Output, Failure};

use crate::run;

pub(crate) fn run_calibrate(args: CalibrateArgs) -> Result<(), Failure> {
    let device = run::parse_device(&args.device)?;
    let cuda = matches!(device, runtime::Device::Cuda(_));
    let base = load_hw(Some(&args.base))?;
    let output = Output::new(args.output.as_deref(), &[&args.base])?;
    let config = RunConfig {
        device,
        seed: Some(0),
        check: false,
        timeout: Duration::from_secs(600),
        max_input_bytes: 4 << 30,
        fault: None,
        repeat: args.repeat,
        cpu_memory: CpuMemory::Retain,
    };
    let launch = Launch::from_env()?;
    if launch.is_some() && cuda {
        // NCCL queues a collective on the device's stream and returns: timing it per node
        // would time its launch, not the exchange.
        return Err(Failure::Error(
            "calibrating collectives through a launched NCCL group is not supported yet: \
             launch `planner calibrate --device cpu` (gloo), or calibrate one GPU without a \
             launcher"
                .to_owned(),
        ));
    }
    let (mut timings, collectives) = match &launch {
        Some(launch) => {
            let world = u32::try_from(launch.world).map_err(|e| e.to_string())?;
            let timed = time_launched(cuda, world, launch, &config, &base)?;
            let ranks = if world == 1 { "rank" } else { "ranks" };
            let group = format!("gloo, {world} {ranks} launched as processes");
            (timed, Some(group))
        }
        None => (Vec::new(), None),
    };
    // The interleaved benchmarks come first and hold no collective (tested), so node
    // `round * mixed.len() + i` of their graph is benchmark `i`'s. A launched job's
    // collectives are timed above, through its process group.
    let (mixed, alone): (Vec<Benchmark>, Vec<Benchmark>) = benchmarks(cuda, 2)
        .into_iter()
        .filter(|b| !(b.checkpointed || launch.is_some() && b.world > 1))
        .partition(|b| b.mixed);
    timings.extend(time_mixed(&mixed, &config, &base)?);
    for bench in &alone {
        timings.push(time(bench, &config, &base)?);
    }
    let collectives = collectives.or_else(|| {
        alone
            .iter()
            .find(|b| b.world > 1)
            .map(|b| format!("loopback, {} ranks as threads of one process", b.world))
    });
    for timing in &timings {
        let shape: Vec<String> = timing.shape.iter().map(u64::to_string).collect();
        eprintln!(
            "calibrate: {:<18} {:<56} {:>12} {:>12.3} us",
            timing.class,
            timing.op,
            shape.join("x"),
            timing.median_s * 1e6
        );
    }
    if let Some(launch) = launch.as_ref().filter(|l| l.rank != 0) {
        eprintln!(
            "calibrate: rank {} ran every benchmark beside the others; rank 0 writes the profile",
            launch.rank
        );
        return Ok(());
    }
    let device_name = program::device_name(device);
    let threads = u32::try_from(runtime::cpu_threads()).unwrap_or(0);
    let calibration = Calibration {
        device: device_name.clone(),
        description: describe(cuda),
        threads,
        timings,
        not_measured: Vec::new(),
        collectives,
    };
    let name = args
        .name
        .unwrap_or_else(|| format!("calibrated {device_name}"));
    // The machine's memory on the CPU; a GPU's keeps the base profile's.
    let memory = (!cuda)
        .then(runtime::inputs::machine_memory)
        .flatten()
        .map(|bytes| bytes as f64);
    let profile = calibration::fit(&base, &name, memory, calibration).map_err(|e| e.to_string())?;
    let mut json = serde_json::to_string_pretty(&profile).map_err(|e| e.to_string())?;
    json.push('\n');
    output.write(json.as_bytes())?;
    Ok(())
}

/// Each of `mixed`'s ops timed in one graph that interleaves them: the median per node over
/// the repeated steps, added over the op's nodes and divided by its repeats.
fn time_mixed(
    mixed: &[Benchmark],
    config: &RunConfig,
    hw: &HwProfile,
) -> Result<Vec<Timing>, Failure> {
    if mixed.is_empty() {
        return Ok(Vec::new());
    }
    let report = execute(calibration::graph_of(mixed), 1, config, hw)?;
    let run = report
        .ranks
        .first()
        .and_then(|rank| rank.runs.first())
        .ok_or_else(|| "the calibration run reported nothing".to_owned())?;
    mixed
        .iter()
        .enumerate()
        .map(|(i, bench)| {
            let total: f64 = run.node_seconds.iter().skip(i).step_by(mixed.len()).sum();
            let median = (total / mixed[0].repeats as f64).max(f64::MIN_POSITIVE);
            Ok(bench.timing(median, config.repeat)?)
        })
        .collect()
}

/// The collectives of each size timed through the launched job's process group, in one graph
/// (one rendezvous): each op's median with the `wait_tensor` after it, per op.
fn time_launched(
    cuda: bool,
    world: u32,
    launch: &Launch,
    config: &RunConfig,
    hw: &HwProfile,
) -> Result<Vec<Timing>, Failure> {
    let benches = calibration::launched_collectives(cuda, world);
    let graph = Arc::new(
        Graph::from_wire(calibration::graph_of(&benches))
            .map_err(|e| format!("a calibration graph is not valid: {e}"))?,
    );
    let plan = Arc::new(plan::plan(&graph, &PlanConfig::default(), hw).map_err(|e| e.to_string())?);
    let job = RankJob {
        graph,
        plan,
        whole_layer: None,
        inputs: PathBuf::from("/nonexistent/calibrate.safetensors"),
    };
    let report = runtime_run::run_launched(job, launch, config).map_err(|e| e.to_string())?;
    if let Some(failure) = report.first_failure() {
        return Err(Failure::Error(format!(
            "the collectives' calibration failed: {failure}"
        )));
    }
    let run = report
        .ranks
        .first()
        .and_then(|rank| rank.runs.first())
        .ok_or_else(|| "the calibration run reported nothing".to_owned())?;
    // Each round holds every benchmark's collective and its wait, in order.
    let per_round = 2 * benches.len();
    benches
        .iter()
        .enumerate()
        .map(|(i, bench)| {
            let total: f64 = run
                .node_seconds
                .chunks_exact(per_round)
                .map(|round| round[2 * i..2 * i + 2].iter().sum::<f64>())
                .sum();
            let median = (total / bench.repeats as f64).max(f64::MIN_POSITIVE);
            Ok(bench.timing(median, config.repeat)?)
        })
        .collect()
}

/// Plans `graph` and runs it on `ranks` ranks.
fn execute(
    graph: pb::Graph,
    ranks: u32,
    config: &RunConfig,
    hw: &HwProfile,
) -> Result<RunReport, Failure> {
    let graph =
        Graph::from_wire(graph).map_err(|e| format!("a calibration graph is not valid: {e}"))?;
    let graph = Arc::new(graph);
    let plan = Arc::new(plan::plan(&graph, &PlanConfig::default(), hw).map_err(|e| e.to_string())?);
    let jobs = (0..ranks)
        .map(|_| RankJob {
            graph: Arc::clone(&graph),
            plan: Arc::clone(&plan),
            whole_layer: None,
            inputs: PathBuf::from("/nonexistent/calibrate.safetensors"),
        })
        .collect();
    Ok(run::execute(jobs, config)?)
}

/// Median seconds of one op of `bench` (a collective's with the `wait_tensor` after it): its
/// graph's step time over its repeats.
fn time(bench: &Benchmark, config: &RunConfig, hw: &HwProfile) -> Result<Timing, Failure> {
    let report = execute(bench.graph(), bench.world, config, hw)?;
    // The step's time, not its forward stage's: on a GPU only the step waits for the device.
    let step = report
        .ranks
        .iter()
        .flat_map(|rank| rank.runs.first())
        .map(|run| run.seconds)
        .fold(0.0, f64::max);
    let median = (step / bench.repeats as f64).max(f64::MIN_POSITIVE);
    Ok(bench.timing(median, config.repeat)?)
}

fn describe(cuda: bool) -> String {
    if cuda {
        return "CUDA device".to_owned();
    }
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_else(|| "CPU".to_owned())
}
