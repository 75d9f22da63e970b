//! `planner run`: executes a plan with the runtime (libtorch) and reports what it measured.
//! Built only with the `run` feature, the one part of the binary that links libtorch.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use ir::{
    plan::{Decision, Plan, Stage},
    EntityId, Graph, NodeId,
};
use planner::{
    config::{self, PlanConfig},
    cost::HwProfile,
    plan,
    units::{format_bytes, format_seconds},
};
use runtime::{
    check,
    comm::launch::Launch,
    exec::{Fault, FaultKind},
    program,
    run::{self, CpuMemory, RankJob, RankReport, RunConfig, RunReport, VariantRun},
};
use serde_json::{json, Value as Json};

use planner_commands::{
    args::{RunArgs, SummaryFormat},
    load_hw,
    output::Output,
    report_errors, Failure,
};

pub(crate) fn run_run(args: RunArgs) -> Result<(), Failure> {
    let ran = run_and_report(args);
    if let Err(Failure::Error(message)) = &ran {
        tell_the_launcher(message);
    }
    ran
}

fn run_and_report(args: RunArgs) -> Result<(), Failure> {
    let device = parse_device(&args.device)?;
    let fault = args.inject_fault.as_deref().map(parse_fault).transpose()?;
    let timeout = run::timeout_from_secs(args.timeout)?;
    let planning = planning_config(&args)?;
    // The profile the per-op predictions of the report use: the plan's own, unless `--plan`
    // was made with another.
    let hw = load_hw(args.planning.hw.as_deref())?;
    let config = RunConfig {
        device,
        seed: args.seed,
        check: args.check,
        timeout,
        max_input_bytes: args
            .max_input_bytes
            .or_else(runtime::inputs::machine_memory)
            .unwrap_or(DEFAULT_MAX_INPUT_BYTES),
        fault,
        repeat: args.repeat,
        cpu_memory: match args.release_cpu_memory {
            true => CpuMemory::Release,
            false => CpuMemory::Retain,
        },
    };
    let (report, graph, plan) = match Launch::from_env()? {
        Some(launch) => run_launched(&args, &planning, &launch, &config)?,
        None => {
            let jobs = rank_jobs(&args, &planning)?;
            let (graph, plan) = (Arc::clone(&jobs[0].graph), Arc::clone(&jobs[0].plan));
            (execute(jobs, &config)?, graph, plan)
        }
    };
    if plan.cost.hw != hw.name {
        eprintln!(
            "warning: the plan's times assume the profile `{}`; the per-op predictions use `{}` \
             (--hw), so they do not add up to the plan's",
            ir::display::name(&plan.cost.hw),
            ir::display::name(&hw.name)
        );
    }
    let text = match args.format {
        SummaryFormat::Text => text(&report, &graph, &plan, &hw),
        SummaryFormat::Json => {
            let mut s = serde_json::to_string_pretty(&json_report(&report, &graph, &plan, &hw))
                .map_err(|e| format!("cannot serialise the report: {e}"))?;
            s.push('\n');
            s
        }
    };
    Output::stdout().write(text.as_bytes())?;
    match report.first_failure() {
        Some(failure) => Err(Failure::Error(format!("check failed: {failure}"))),
        None => Ok(()),
    }
}

/// The inputs limit where this machine's memory cannot be read.
const DEFAULT_MAX_INPUT_BYTES: u64 = 16 << 30;

/// This process's rank of a launched job, the only one it loads and plans: its report, with
/// the graph and plan it ran.
fn run_launched(
    args: &RunArgs,
    planning: &PlanConfig,
    launch: &Launch,
    config: &RunConfig,
) -> Result<(RunReport, Arc<Graph>, Arc<Plan>), Failure> {
    if args.ranks.is_some() {
        return Err(Failure::Error(
            "--ranks runs ranks as threads of one process; under a launcher (RANK and \
             WORLD_SIZE set) each process runs its own rank"
                .to_owned(),
        ));
    }
    let own = rank_file(&args.graph, launch.rank);
    let graph = Arc::new(load_graph(own.as_deref().unwrap_or(&args.graph))?);
    world_size(&graph, Some(launch.world), "WORLD_SIZE")?;
    let job = rank_job(args, planning, launch.rank, graph, own.is_some())?;
    let (graph, plan) = (Arc::clone(&job.graph), Arc::clone(&job.plan));
    Ok((execute_launched(job, launch, config)?, graph, plan))
}

/// torchrun's failure summary shows what a rank wrote to the error file it names
/// (`TORCHELASTIC_ERROR_FILE`, PyTorch's `{"message", "timestamp"}`): the rank's error goes
/// there too, besides stderr. A file that cannot be written leaves stderr alone to say it.
fn tell_the_launcher(message: &str) {
    let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") else {
        return;
    };
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let error = json!({"message": message, "timestamp": timestamp});
    let _ = std::fs::write(path, error.to_string());
}

/// One job per rank, for ranks run as threads. Rank r runs its own graph `STEM.rank<r>.pb`
/// where one lies beside the graph (ranks whose graphs differ, e.g. by the sequence positions
/// each rank holds), with its own plan, else rank 0's graph and plan (planned once).
fn rank_jobs(args: &RunArgs, planning: &PlanConfig) -> Result<Vec<RankJob>, Failure> {
    let first = Arc::new(load_graph(&args.graph)?);
    let ranks = thread_ranks(&first, args.ranks)?;
    let mut jobs: Vec<RankJob> = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let own = rank_file(&args.graph, rank);
        let job = match (&own, jobs.first()) {
            (None, Some(rank0)) => rank0.clone(),
            (Some(path), _) => rank_job(args, planning, rank, Arc::new(load_graph(path)?), true)?,
            (None, None) => rank_job(args, planning, rank, Arc::clone(&first), false)?,
        };
        jobs.push(job);
    }
    Ok(jobs)
}

/// What rank `rank` runs on `graph` (its own file's when `own_graph`): its plan (`--plan`, or
/// its `STEM.rank<r>.EXT` for a graph of its own, or planned here) and its tensors
/// (`STEM.rank<r>.safetensors` beside rank 0's).
fn rank_job(
    args: &RunArgs,
    planning: &PlanConfig,
    rank: usize,
    graph: Arc<Graph>,
    own_graph: bool,
) -> Result<RankJob, Failure> {
    let plan = match &args.plan {
        Some(path) => read_rank_plan(path, rank, own_graph, &graph)?,
        None => make_plan(&graph, planning, args.planning.hw.as_deref())?,
    };
    let whole_layer = (args.check && plan.joint)
        .then(|| make_plan(&graph, &PlanConfig::default(), args.planning.hw.as_deref()))
        .transpose()?;
    Ok(RankJob {
        graph,
        plan: Arc::new(plan),
        whole_layer: whole_layer.map(Arc::new),
        inputs: args
            .inputs
            .clone()
            .unwrap_or_else(|| runtime::inputs::twin(&args.graph)),
    })
}

fn load_graph(path: &Path) -> Result<Graph, String> {
    ir::io::load(path).map_err(|e| e.to_string())
}

/// Rank `rank`'s own file beside `path` (`STEM.rank<r>.EXT`), if there is one.
fn rank_file(path: &Path, rank: usize) -> Option<PathBuf> {
    (rank > 0)
        .then(|| runtime::inputs::rank_path(path, rank))
        .filter(|p| p.exists())
}

/// The plan of a rank: `--plan` itself, or `STEM.rank<r>.EXT` for a rank with its own graph.
fn read_rank_plan(
    path: &Path,
    rank: usize,
    own_graph: bool,
    graph: &Graph,
) -> Result<Plan, String> {
    let path = if own_graph {
        runtime::inputs::rank_path(path, rank)
    } else {
        path.to_owned()
    };
    Plan::read_for(&path, graph).map_err(|e| {
        let whose = if own_graph {
            format!(
                " (rank {rank} runs its own graph `{}`)",
                ir::display::name(graph.name())
            )
        } else {
            String::new()
        };
        format!("{e}{whose}")
    })
}

/// Runs the ranks as threads of this process: over the loopback communicator on the CPU, as
/// NCCL ranks (one GPU each) on CUDA.
pub(crate) fn execute(jobs: Vec<RankJob>, config: &RunConfig) -> Result<RunReport, String> {
    if !matches!(config.device, runtime::Device::Cuda(_)) {
        return run::run_loopback(jobs, config).map_err(|e| e.to_string());
    }
    require_cuda()?;
    run::run_nccl_threads(jobs, config).map_err(|e| e.to_string())
}

/// Runs this process's rank of a job launched like PyTorch's (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set, as `torchrun` does): through gloo on the
/// CPU, NCCL on CUDA.
fn execute_launched(
    job: RankJob,
    launch: &Launch,
    config: &RunConfig,
) -> Result<RunReport, String> {
    if matches!(config.device, runtime::Device::Cuda(_)) {
        require_cuda()?;
    }
    run::run_launched(job, launch, config).map_err(|e| e.to_string())
}

fn require_cuda() -> Result<(), String> {
    if runtime::cuda_available() {
        Ok(())
    } else {
        Err("--device cuda: no CUDA device is available".to_owned())
    }
}

fn planning_config(args: &RunArgs) -> Result<PlanConfig, String> {
    Ok(PlanConfig {
        keep: config::parse_keep(&args.keep).map_err(|e| e.to_string())?,
        offload: args.offloading.config()?,
        ..args.planning.config()
    })
}

fn make_plan(graph: &Graph, config: &PlanConfig, hw: Option<&Path>) -> Result<Plan, Failure> {
    let hw = load_hw(hw)?;
    let plan = plan::plan(graph, config, &hw).map_err(|e| e.to_string())?;
    if plan.has_errors() {
        report_errors(&plan);
        return Err(Failure::Status(1));
    }
    Ok(plan)
}

/// `ranks` (given by `source`: `--ranks` or the launcher's `WORLD_SIZE`), or the world size
/// the graph was exported for; they must agree.
fn world_size(graph: &Graph, ranks: Option<usize>, source: &str) -> Result<usize, String> {
    let name = ir::display::name(graph.name());
    let exported = graph.metadata().world_size.max(1) as usize;
    match ranks {
        None => Ok(exported),
        Some(0) => Err(format!("{source} must be at least 1")),
        Some(n) if n == exported => Ok(n),
        Some(n) => Err(format!(
            "graph `{name}` was exported for {exported} rank(s); it cannot run on {source} {n}"
        )),
    }
}

/// The ranks this process runs as threads: `--ranks` or the graph's world size, at most
/// [`run::MAX_RANKS`].
fn thread_ranks(graph: &Graph, ranks: Option<usize>) -> Result<usize, String> {
    let ranks = world_size(graph, ranks, "--ranks")?;
    if ranks > run::MAX_RANKS {
        return Err(format!(
            "graph `{}` was exported for {ranks} ranks, but one `planner run` runs at most {} \
             ranks as threads",
            ir::display::name(graph.name()),
            run::MAX_RANKS
        ));
    }
    Ok(ranks)
}

pub(crate) fn parse_device(text: &str) -> Result<runtime::Device, String> {
    program::parse_device(text)
        .ok_or_else(|| format!("--device must be `cpu`, `cuda` or `cuda:N`, not `{text}`"))
}

fn parse_fault(text: &str) -> Result<Fault, String> {
    let bad = || {
        format!(
            "--inject-fault takes `fail:RANK:N`, `panic:RANK:N` or `stall:RANK:N:SECONDS`, \
             not `{text}`"
        )
    };
    let parts: Vec<&str> = text.split(':').collect();
    let number = |i: usize| -> Result<u64, String> {
        parts.get(i).and_then(|p| p.parse().ok()).ok_or_else(bad)
    };
    let kind = match (parts.first().copied(), parts.len()) {
        (Some("fail"), 3) => FaultKind::Fail,
        (Some("panic"), 3) => FaultKind::Panic,
        (Some("stall"), 4) => {
            let seconds: f64 = parts[3].parse().map_err(|_| bad())?;
            FaultKind::Stall(Duration::try_from_secs_f64(seconds).map_err(|_| bad())?)
        }
        _ => return Err(bad()),
    };
    Ok(Fault {
        rank: number(1)? as usize,
        before_collective: number(2)?,
        kind,
    })
}

/// Signed difference of `measured` from `predicted`, in percent.
fn diff_percent(measured: u64, predicted: u64) -> Option<f64> {
    (predicted > 0).then(|| (measured as f64 - predicted as f64) / predicted as f64 * 100.0)
}

/// Per op, how many times it ran in `stage`, most first.
fn ops_in(graph: &Graph, run: &VariantRun, stage: Stage) -> Vec<(String, u64)> {
    let mut counts: std::collections::BTreeMap<&str, u64> = Default::default();
    for (id, node) in graph.nodes().iter() {
        let n = u64::from(run.counts.of(id, stage));
        if n > 0 {
            *counts.entry(node.op.as_str()).or_default() += n;
        }
    }
    let mut out: Vec<(String, u64)> = counts.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// The forward nodes the plan keeps (decision save), per unit name (`-` for none).
fn kept_nodes(plan: &Plan, graph: &Graph) -> Vec<(String, Vec<NodeId>)> {
    let mut by_unit: std::collections::BTreeMap<String, Vec<NodeId>> = Default::default();
    for d in plan.nodes.iter().filter(|d| d.decision == Decision::Save) {
        let unit = d
            .unit
            .map(|u| graph.model(d.model).units[u].name.clone())
            .unwrap_or_else(|| "-".to_owned());
        by_unit.entry(unit).or_default().push(d.node);
    }
    by_unit.into_iter().collect()
}

fn text(report: &RunReport, graph: &Graph, plan: &Plan, hw: &HwProfile) -> String {
    let mut out = String::new();
    let device = report
        .ranks
        .first()
        .map_or_else(String::new, |r| program::device_name(r.device));
    out += &format!(
        "run: {} on {device}, {} rank(s) ({}{}), keep {}\n",
        report.graph,
        report.world,
        report.communicator,
        this_process(report),
        keep_text(plan)
    );
    out += &format!(
        "  graph structure {}, plan {}: agreed by every rank\n",
        report.structure, report.plan
    );
    for rank in &report.ranks {
        rank_text(&mut out, rank, (graph, plan, hw), report.check);
    }
    out
}

/// `; this process runs rank 1` when the process ran only some of the ranks.
fn this_process(report: &RunReport) -> String {
    if report.ranks.len() == report.world {
        return String::new();
    }
    let ranks: Vec<String> = report.ranks.iter().map(|r| r.rank.to_string()).collect();
    format!("; this process runs rank {}", ranks.join(", "))
}

/// What the plan keeps and offloads: its `--keep`, or per layer (a budget's answer, `--choices`).
fn keep_text(plan: &Plan) -> String {
    let config = &plan.config;
    let names = config.keep.names();
    let keep = match (config.layer_keep.is_empty(), names.is_empty()) {
        (false, _) => "per layer (the plan's layer_keep)".to_owned(),
        (true, true) => "none".to_owned(),
        (true, false) => names.join(","),
    };
    let offload = match config.layer_offload.is_empty() {
        true => "",
        false => ", offload per layer (the plan's layer_offload)",
    };
    format!(
        "{keep}{offload}, recompute ratio {}, collectives {}",
        config.recompute_ratio, config.collectives
    )
}

fn rank_text(
    out: &mut String,
    rank: &RankReport,
    (graph, plan, hw): (&Graph, &Plan, &HwProfile),
    check: bool,
) {
    *out += &format!("\nrank {}\n", rank.rank);
    *out += &format!(
        "  {:<14} {:>8} {:>7} {:>9}   {:>26}   {:>26}  {:>7}  {:>10}\n",
        "step", "forward", "replay", "backward", "measured peak", "predicted peak", "diff", "time"
    );
    for run in &rank.runs {
        let predicted = run
            .predicted_peak_bytes
            .map_or_else(|| "-".to_owned(), format_bytes);
        let diff = run
            .predicted_peak_bytes
            .and_then(|p| diff_percent(run.measured_peak_bytes, p))
            .map_or_else(|| "-".to_owned(), |d| format!("{d:+.1}%"));
        *out += &format!(
            "  {:<14} {:>8} {:>7} {:>9}   {:>26}   {:>26}  {:>7}  {:>10}\n",
            run.variant.name(),
            run.counts.total(Stage::Forward),
            run.counts.total(Stage::Replay),
            run.counts.total(Stage::Backward),
            format_bytes(run.measured_peak_bytes),
            predicted,
            diff,
            format_seconds(run.seconds)
        );
        *out += &time_line(run);
        *out += &host_line(run);
        if let Some(peak) = run.allocator_peak_bytes {
            *out += &format!(
                "  {:<14} CUDA caching allocator peak: {}\n",
                "",
                format_bytes(peak)
            );
        }
    }
    if let Some(run) = rank.runs.first() {
        *out += &format!(
            "  op time, largest misses: {}\n",
            largest_misses(graph, run, hw, 4)
        );
        let replayed = ops_in(graph, run, Stage::Replay);
        *out += &format!("  replayed ops: {}\n", top_ops(&replayed, 8));
        for (unit, nodes) in kept_nodes(plan, graph) {
            let replays = run::replayed(&run.counts, nodes.iter().copied());
            *out += &format!(
                "  kept by {unit}: {} ops ({}), run in replay {replays} times\n",
                nodes.len(),
                op_summary(graph, &nodes)
            );
        }
    }
    if !check {
        return;
    }
    let others: Vec<&str> = rank.runs[1..].iter().map(|r| r.variant.name()).collect();
    let differing: Vec<&str> = rank
        .tensors
        .iter()
        .filter(|t| t.identical.iter().any(|(_, same)| !same))
        .map(|t| t.name.as_str())
        .collect();
    *out += &if differing.is_empty() {
        format!(
            "  parity: all {} outputs (loss, gradients) bit-identical to {}\n",
            rank.tensors.len(),
            others.join(" and ")
        )
    } else {
        format!("  parity: FAILED, differing: {}\n", differing.join(", "))
    };
    match &rank.reference_skipped {
        Some(why) => *out += &format!("  reference: not compared ({why})\n"),
        None => {
            *out += &format!(
                "  reference (PyTorch): |a - e| <= {:e} + {:e}·|e| per element\n",
                check::ATOL,
                check::RTOL
            );
            for t in &rank.tensors {
                let Some(e) = t.reference else {
                    *out += &format!("    {:<40} no reference\n", t.name);
                    continue;
                };
                *out += &format!(
                    "    {:<40} max abs {:.2e}  max rel {:.2e}  {}\n",
                    t.name,
                    e.max_abs,
                    e.max_rel,
                    if e.within { "ok" } else { "FAILED" }
                );
            }
        }
    }
}

/// `time: forward 1.2 ms, replay 0.3 ms, backward 2.1 ms (median of 5, 12 page faults a
/// step); predicted step 3.5 ms (-2.9%), replay 0.3 ms (+1.0%)`: the measured stages, the
/// process's page faults, and the predictions against the measured step and replay.
fn time_line(run: &VariantRun) -> String {
    let stage = |s| format_seconds(run.stage_seconds.of(s));
    // A plan file from before step times were predicted holds 0: nothing to compare.
    let against = |predicted: Option<f64>, measured: f64| {
        predicted.filter(|&p| p > 0.0).map_or_else(
            || "-".to_owned(),
            |p| match diff_ratio(measured, p) {
                Some(d) => format!("{} ({d:+.1}%)", format_seconds(p)),
                None => format_seconds(p),
            },
        )
    };
    let faults = run
        .page_faults
        .map_or_else(String::new, |n| format!(", {n} page faults a step"));
    format!(
        "  {:<14} time: forward {}, replay {}, backward {} (median of {}{faults}); predicted step {}, replay {}\n",
        "",
        stage(Stage::Forward),
        stage(Stage::Replay),
        stage(Stage::Backward),
        run.repeat,
        against(run.predicted_step_time_s, run.seconds),
        against(
            run.predicted_replay_time_s,
            run.stage_seconds.of(Stage::Replay)
        ),
    )
}

/// The offloaded storages in host memory against the plan's figures (empty when neither
/// offloads).
fn host_line(run: &VariantRun) -> String {
    if run.predicted_host.is_none() && run.host.bytes.moved == 0 {
        return String::new();
    }
    let predicted = run.predicted_host.unwrap_or_default();
    let bytes = |measured: u64, predicted: u64| {
        let diff =
            diff_percent(measured, predicted).map_or_else(String::new, |d| format!(", {d:+.1}%"));
        format!(
            "{} (predicted {}{diff})",
            format_bytes(measured),
            format_bytes(predicted)
        )
    };
    format!(
        "  {:<14} host: offloaded {}, host peak {}; copies {} (predicted {}, synchronous here)\n",
        "",
        bytes(run.host.bytes.moved, predicted.offloaded_bytes),
        bytes(run.host.bytes.peak, predicted.peak_bytes),
        format_seconds(run.host.seconds),
        format_seconds(predicted.transfer_time_s),
    )
}

/// One op's time in a step: every run of its nodes, in every stage, measured (median over the
/// repeated steps) and predicted by the hardware profile.
struct OpTime<'g> {
    op: &'g str,
    runs: u64,
    measured_s: f64,
    predicted_s: f64,
}

/// The step's time per op, the op taking most time first.
fn op_times<'g>(graph: &'g Graph, run: &VariantRun, hw: &HwProfile) -> Vec<OpTime<'g>> {
    let mut by_op: std::collections::BTreeMap<&str, OpTime<'g>> = Default::default();
    for (id, node) in graph.nodes().iter() {
        let runs: u64 = [Stage::Forward, Stage::Replay, Stage::Backward]
            .iter()
            .map(|&s| u64::from(run.counts.of(id, s)))
            .sum();
        if runs == 0 {
            continue;
        }
        let entry = by_op.entry(node.op.as_str()).or_insert(OpTime {
            op: node.op.as_str(),
            runs: 0,
            measured_s: 0.0,
            predicted_s: 0.0,
        });
        entry.runs += runs;
        entry.measured_s += run.node_seconds.get(id.index()).copied().unwrap_or(0.0);
        entry.predicted_s += runs as f64 * hw.node_seconds(graph, id);
    }
    let mut times: Vec<OpTime<'g>> = by_op.into_values().collect();
    times.sort_by(|a, b| b.measured_s.total_cmp(&a.measured_s));
    times
}

/// `aten.mm.default ×24 1.2 ms (predicted 0.6 ms), ...`: the `limit` ops whose predicted time
/// is furthest from the measured one.
fn largest_misses(graph: &Graph, run: &VariantRun, hw: &HwProfile, limit: usize) -> String {
    let mut times = op_times(graph, run, hw);
    times.sort_by(|a, b| {
        (b.measured_s - b.predicted_s)
            .abs()
            .total_cmp(&(a.measured_s - a.predicted_s).abs())
    });
    let text: Vec<String> = times
        .iter()
        .take(limit)
        .map(|t| {
            format!(
                "{} ×{} {} (predicted {})",
                t.op,
                t.runs,
                format_seconds(t.measured_s),
                format_seconds(t.predicted_s)
            )
        })
        .collect();
    if text.is_empty() {
        "none".to_owned()
    } else {
        text.join(", ")
    }
}

/// How far `predicted` is from `measured`, in percent of the measurement.
fn diff_ratio(measured: f64, predicted: f64) -> Option<f64> {
    (measured > 0.0).then(|| (predicted - measured) / measured * 100.0)
}

/// The `limit` most frequent ops (`aten.mm.default ×12, ... (+3 more)`), or `none`.
fn top_ops(counts: &[(String, u64)], limit: usize) -> String {
    if counts.is_empty() {
        return "none".to_owned();
    }
    let mut text: Vec<String> = counts
        .iter()
        .take(limit)
        .map(|(op, n)| format!("{op} ×{n}"))
        .collect();
    if counts.len() > limit {
        text.push(format!("(+{} more ops)", counts.len() - limit));
    }
    text.join(", ")
}

/// `aten.topk.default ×2, aten.mm.default ×1`
fn op_summary(graph: &Graph, nodes: &[NodeId]) -> String {
    let mut counts: std::collections::BTreeMap<&str, u64> = Default::default();
    for &n in nodes {
        *counts.entry(graph.node(n).op.as_str()).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(op, n)| format!("{op} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn json_report(report: &RunReport, graph: &Graph, plan: &Plan, hw: &HwProfile) -> Json {
    json!({
        "graph": {"name": report.graph, "structure": report.structure},
        "plan": {"fingerprint": report.plan, "keep": plan.config.keep.names(),
                 "recompute_ratio": plan.config.recompute_ratio,
                 "collectives": plan.config.collectives.name()},
        "communicator": report.communicator,
        "world_size": report.world,
        "check": report.check,
        "tolerance": {"atol": check::ATOL, "rtol": check::RTOL},
        "passed": report.first_failure().is_none(),
        "first_failure": report.first_failure(),
        "ranks": report.ranks.iter().map(|r| rank_json(r, graph, plan, hw)).collect::<Vec<_>>(),
    })
}

fn rank_json(rank: &RankReport, graph: &Graph, plan: &Plan, hw: &HwProfile) -> Json {
    let runs: Vec<Json> = rank
        .runs
        .iter()
        .map(|run| {
            let stage_ops = |stage| {
                ops_in(graph, run, stage)
                    .into_iter()
                    .map(|(op, n)| json!({"op": op, "count": n}))
                    .collect::<Vec<_>>()
            };
            json!({
                "variant": run.variant.name(),
                "ops": {"forward": run.counts.total(Stage::Forward),
                        "replay": run.counts.total(Stage::Replay),
                        "backward": run.counts.total(Stage::Backward)},
                "replay_ops": stage_ops(Stage::Replay),
                "measured_peak_bytes": run.measured_peak_bytes,
                "predicted_peak_bytes": run.predicted_peak_bytes,
                "peak_diff_percent": run.predicted_peak_bytes.and_then(|p| diff_percent(run.measured_peak_bytes, p)),
                "measured_saved_bytes": run.measured_saved_bytes,
                "predicted_saved_bytes": run.predicted_saved_bytes,
                "allocator_peak_bytes": run.allocator_peak_bytes,
                "seconds": run.seconds,
                "measured": {"step_time_s": run.seconds,
                             "forward_time_s": run.stage_seconds.of(Stage::Forward),
                             "replay_time_s": run.stage_seconds.of(Stage::Replay),
                             "backward_time_s": run.stage_seconds.of(Stage::Backward),
                             "repeat": run.repeat,
                             "page_faults": run.page_faults,
                             "offloaded_bytes": run.host.bytes.moved,
                             "host_peak_bytes": run.host.bytes.peak,
                             "transfer_time_s": run.host.seconds},
                "predicted": {"step_time_s": run.predicted_step_time_s,
                              "replay_time_s": run.predicted_replay_time_s,
                              "offloaded_bytes": run.predicted_host.map(|h| h.offloaded_bytes),
                              "host_peak_bytes": run.predicted_host.map(|h| h.peak_bytes),
                              "transfer_time_s": run.predicted_host.map(|h| h.transfer_time_s)},
                "op_times": op_times(graph, run, hw).iter().map(|t| json!({
                    "op": t.op, "runs": t.runs, "measured_s": t.measured_s,
                    "predicted_s": t.predicted_s})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let kept: Vec<Json> = match rank.runs.first() {
        Some(run) => kept_nodes(plan, graph)
            .into_iter()
            .map(|(unit, nodes)| {
                json!({"unit": unit, "kept_ops": nodes.len(),
                       "replayed": run::replayed(&run.counts, nodes.iter().copied())})
            })
            .collect(),
        None => Vec::new(),
    };
    let tensors: Vec<Json> = rank
        .tensors
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "digest": t.digest,
                "identical": t.identical.iter().map(|(v, same)| json!({"variant": v.name(), "identical": same})).collect::<Vec<_>>(),
                "reference": t.reference.map(|e| json!({"max_abs": finite(e.max_abs), "max_rel": finite(e.max_rel), "within": e.within})),
            })
        })
        .collect();
    json!({
        "rank": rank.rank,
        "device": program::device_name(rank.device),
        "runs": runs,
        "kept": kept,
        "tensors": tensors,
        "reference_skipped": rank.reference_skipped,
    })
}

/// JSON has no infinity: a shape mismatch's error is written as null.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}
