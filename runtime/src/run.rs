//! `planner run`: every rank runs the plan's training step (and, with `--check`, the same step
//! without checkpointing and with whole-layer recompute) and compares the results.
//!
//! Ranks are threads of this process, each with its own communicator end; under a launcher
//! (`torchrun`), this process runs its one rank and meets the others through the launcher's
//! store. The main thread
//! never waits on a rank without a deadline: once a rank fails, the others get the abort
//! through their communicator, and a rank that still has not stopped after the timeout is
//! reported as hung rather than waited for.

use std::{
    any::Any,
    cell::RefCell,
    panic::{self, AssertUnwindSafe},
    path::PathBuf,
    sync::{mpsc, Arc, Once},
    time::{Duration, Instant},
};

use ir::{
    plan::{Executor, Plan, Stage},
    EntityId, Graph, NodeId, Role, ValueId,
};
use tch::Device;
use thiserror::Error;

use crate::{
    check,
    comm::{
        gloo::Gloo,
        launch::{self, Launch},
        loopback::LoopbackGroup,
        nccl, CommError, Communicator, Identity,
    },
    exec::{self, Fault, HostFigures, OpCounts, StageSeconds, StepError, StepResult},
    fingerprint, host_memory,
    inputs::{self, InputError, RankInputs},
    program::{PrepareError, Program},
    rng::RankRng,
    schedule::{ReplaySpec, Schedule, ScheduleError},
    watch::RankActivity,
};

/// The most ranks one process runs as threads: each holds a copy of the model and its own
/// thread, and a larger job runs one rank per process under a launcher.
pub const MAX_RANKS: usize = 1024;

/// The longest `--timeout`: deadlines are the clock plus the timeout, and this keeps them
/// far inside what the clock and `Duration` hold (about 31 years).
pub const MAX_TIMEOUT_SECS: f64 = 1e9;

/// How many failing ranks a run's error lists before it only counts the rest.
const LISTED_FAILURES: usize = 8;

/// How often the watchdog looks at what each rank runs.
const WATCH_INTERVAL: Duration = Duration::from_millis(50);

/// `--timeout` as a duration: a number of seconds above 0 and at most [`MAX_TIMEOUT_SECS`].
pub fn timeout_from_secs(seconds: f64) -> Result<Duration, String> {
    if !(seconds > 0.0 && seconds <= MAX_TIMEOUT_SECS) {
        return Err(format!(
            "--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_SECS:e} \
             (about 31 years), got {seconds}"
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A variant of the training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The plan under test.
    Plan,
    /// No checkpointing: everything backward reads stays from forward.
    NoCheckpoint,
    /// Whole-layer recompute (`--keep none` at ratio 1).
    WholeLayer,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Plan => "plan",
            Variant::NoCheckpoint => "no-checkpoint",
            Variant::WholeLayer => "whole-layer",
        }
    }
}

/// What one rank runs.
#[derive(Clone)]
pub struct RankJob {
    pub graph: Arc<Graph>,
    pub plan: Arc<Plan>,
    /// The whole-layer-recompute plan of the same graph, run by `--check`.
    pub whole_layer: Option<Arc<Plan>>,
    /// The rank's safetensors (weights, inputs, tangents, reference).
    pub inputs: PathBuf,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The device of rank 0; with several ranks on CUDA, rank `r` uses `cuda:r`.
    pub device: Device,
    /// Fills missing inputs when given.
    pub seed: Option<u64>,
    /// Also run without checkpointing (and whole-layer) and compare.
    pub check: bool,
    /// How long a rank waits in a collective before it gives up, and how long one op may
    /// run before the watchdog ends the run.
    pub timeout: Duration,
    /// The most bytes of graph inputs all ranks of this process may start from, checked
    /// before anything is read or filled; also the largest safetensors file read.
    pub max_input_bytes: u64,
    pub fault: Option<Fault>,
    /// Steps each variant runs (at least 1): outputs and memory are the first step's, times
    /// the median of all of them.
    pub repeat: u32,
    /// What the CPU allocator does with the memory a step frees, for CPU ranks.
    pub cpu_memory: CpuMemory,
}

/// What the CPU allocator does with the memory a step frees (`planner run` keeps it unless
/// `--release-cpu-memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuMemory {
    /// Keep it for the rest of the process, as a GPU's caching allocator keeps its blocks
    /// ([`host_memory::retain_freed_memory`]): steps after the first pay few page faults for
    /// their fresh tensors, which the cost model does not count.
    #[default]
    Retain,
    /// Leave the allocator as the process has it (glibc's defaults: large freed blocks go back
    /// to the kernel and fault again when next touched).
    Release,
}

/// One variant's run on one rank.
#[derive(Debug, Clone)]
pub struct VariantRun {
    pub variant: Variant,
    /// The planner's prediction of this variant's peak, if any.
    pub predicted_peak_bytes: Option<u64>,
    pub measured_peak_bytes: u64,
    /// The activation bytes held when forward ended, as the plan's `saved_bytes` counts them.
    pub measured_saved_bytes: u64,
    /// The plan's `saved_bytes`, where this variant has a plan of a joint graph.
    pub predicted_saved_bytes: Option<u64>,
    /// CUDA only: the caching allocator's peak, parameters excluded.
    pub allocator_peak_bytes: Option<u64>,
    /// Median wall time of the step, and of each stage's steps, over `repeat` steps.
    pub seconds: f64,
    /// Median minor page faults of the process per step, where the OS counts them.
    pub page_faults: Option<u64>,
    pub stage_seconds: StageSeconds,
    /// Median wall time per node over `repeat` steps, summed over the stages that ran it.
    pub node_seconds: Vec<f64>,
    pub repeat: u32,
    /// The planner's prediction of the step's and replay's time, where this variant has a
    /// plan.
    pub predicted_step_time_s: Option<f64>,
    pub predicted_replay_time_s: Option<f64>,
    pub counts: OpCounts,
    /// The offloaded storages in host memory (the first step's) and the median time of the
    /// copies to the host and back.
    pub host: HostFigures,
    /// What the plan predicts of them, where it offloads.
    pub predicted_host: Option<PredictedHost>,
}

/// A plan's offload figures: bytes moved to host memory (each storage once), the most in host
/// memory at once, and the copies' time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PredictedHost {
    pub offloaded_bytes: u64,
    pub peak_bytes: u64,
    pub transfer_time_s: f64,
}

/// One checked output tensor (the loss or a gradient) of one rank.
#[derive(Debug, Clone)]
pub struct TensorCheck {
    pub name: String,
    /// The plan's result, as [`check::digest`] fingerprints it.
    pub digest: String,
    /// Per other variant run (no-checkpoint, whole-layer): whether the plan's result is
    /// bit-identical to it.
    pub identical: Vec<(Variant, bool)>,
    /// Against PyTorch's reference, when the rank has one.
    pub reference: Option<check::Error>,
}

#[derive(Debug, Clone)]
pub struct RankReport {
    pub rank: usize,
    pub device: Device,
    pub runs: Vec<VariantRun>,
    pub tensors: Vec<TensorCheck>,
    /// Why the reference was not compared, when it was not.
    pub reference_skipped: Option<String>,
    /// Graph inputs this rank filled from the seed.
    pub seeded: usize,
}

/// Everything `planner run` found.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// `loopback`, `gloo` or `nccl`.
    pub communicator: &'static str,
    /// Ranks of the whole run; this process ran those in `ranks`.
    pub world: usize,
    pub graph: String,
    pub structure: String,
    pub plan: String,
    pub check: bool,
    pub ranks: Vec<RankReport>,
}

impl RunReport {
    /// The first check that failed, as `rank R: what`; `None` when all passed.
    pub fn first_failure(&self) -> Option<String> {
        for rank in &self.ranks {
            for t in &rank.tensors {
                for (variant, same) in &t.identical {
                    if !same {
                        return Some(format!(
                            "rank {}: `{}` differs from the {} run",
                            rank.rank,
                            t.name,
                            variant.name()
                        ));
                    }
                }
                if let Some(e) = t.reference.filter(|e| !e.within) {
                    return Some(format!(
                        "rank {}: `{}` differs from PyTorch's reference (max abs {:.3e}, max rel {:.3e})",
                        rank.rank, t.name, e.max_abs, e.max_rel
                    ));
                }
            }
        }
        None
    }
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error("{0}")]
    Prepare(#[from] PrepareError),
    #[error("{0}")]
    Schedule(#[from] ScheduleError),
    #[error("{0}")]
    Plan(#[from] ir::plan::GraphMismatch),
    #[error("{0}")]
    Inputs(#[from] InputError),
    #[error(
        "the graph inputs of {ranks} rank(s) declare {bytes} bytes, over the limit of {limit} \
         bytes for a run (--max-input-bytes; by default this machine's memory)"
    )]
    InputsTooLarge {
        ranks: usize,
        bytes: u64,
        limit: u64,
    },
    #[error("{}", list_failures(.0))]
    Ranks(Vec<(usize, String)>),
}

/// One line per failing rank, the first [`LISTED_FAILURES`] of them, then how many more.
fn list_failures(failures: &[(usize, String)]) -> String {
    let mut lines: Vec<String> = failures
        .iter()
        .take(LISTED_FAILURES)
        .map(|(rank, message)| format!("rank {rank}: {message}"))
        .collect();
    if failures.len() > LISTED_FAILURES {
        lines.push(format!(
            "... and {} more rank(s) failed",
            failures.len() - LISTED_FAILURES
        ));
    }
    lines.join("\n")
}

/// The step of `plan` on `graph` as a schedule (refused if the plan is for another graph).
pub fn schedule_of(graph: &Graph, plan: &Plan) -> Result<Schedule, RunError> {
    plan.check_graph(graph)?;
    if plan.config.executor == Executor::Compiled {
        return Err(ScheduleError::CompiledPlan.into());
    }
    let mut saved = vec![false; graph.values().len()];
    for s in &plan.saved {
        saved[s.value.index()] = true;
    }
    let replays: Vec<ReplaySpec> = plan
        .replay
        .iter()
        .map(|r| ReplaySpec {
            nodes: r.nodes.clone(),
            before: r.before,
        })
        .collect();
    let mut offloaded: Vec<ValueId> = plan
        .saved
        .iter()
        .filter(|s| s.offloaded)
        .map(|s| graph.storage_root(s.value))
        .collect();
    offloaded.sort_unstable();
    offloaded.dedup();
    if !offloaded.is_empty() && plan.config.executor != Executor::Graph {
        return Err(ScheduleError::OffloadForAnotherExecutor {
            executor: plan.config.executor.name().to_owned(),
        }
        .into());
    }
    let prefetch = plan.config.offload.prefetch as usize;
    Ok(Schedule::new(graph, &saved, &replays)?.offloading(graph, &offloaded, prefetch)?)
}

/// Makes a rank's communicator once it knows what the rank runs (NCCL ranks meet and compare
/// at the rendezvous).
pub type Connect =
    Box<dyn FnOnce(&Identity) -> Result<Box<dyn Communicator>, CommError> + Send + 'static>;

/// One rank of a run: which, on which device, what it runs and how it communicates.
pub struct RankSpec {
    pub rank: usize,
    pub device: Device,
    pub job: RankJob,
    pub connect: Connect,
}

/// The device rank `rank` of this process runs on: CUDA ranks take consecutive GPUs.
pub fn rank_device(device: Device, rank: usize) -> Device {
    match device {
        Device::Cuda(base) => Device::Cuda(base + rank),
        other => other,
    }
}

/// What a rank announces to the others before the first collective.
pub fn identity(job: &RankJob) -> Identity {
    Identity {
        structure: fingerprint::structure(&job.graph),
        plan: fingerprint::plan(&job.plan, &job.graph),
    }
}

/// Checks everything that can be checked before a rank starts: the inputs fit the memory
/// limit, every op runs on the device, the plans fit their graphs and are closed.
fn preflight(specs: &[RankSpec], world: usize, max_input_bytes: u64) -> Result<(), RunError> {
    let bytes = specs.iter().fold(0u64, |total, spec| {
        total.saturating_add(inputs::declared_bytes(&spec.job.graph))
    });
    if bytes > max_input_bytes {
        return Err(RunError::InputsTooLarge {
            ranks: specs.len(),
            bytes,
            limit: max_input_bytes,
        });
    }
    for spec in specs {
        let job = &spec.job;
        Program::prepare(&job.graph, spec.device, world)?;
        schedule_of(&job.graph, &job.plan)?;
        if let Some(whole) = &job.whole_layer {
            schedule_of(&job.graph, whole)?;
        }
    }
    Ok(())
}

/// Runs every rank of `jobs` (one per rank) as threads through the loopback communicator.
pub fn run_loopback(jobs: Vec<RankJob>, config: &RunConfig) -> Result<RunReport, RunError> {
    let group = LoopbackGroup::new(jobs.len(), config.timeout);
    let aborter = group.clone();
    let abort: Abort = Box::new(move |rank, message| aborter.abort(rank, message));
    let specs = jobs
        .into_iter()
        .enumerate()
        .map(|(rank, job)| {
            let comm = group.rank(rank);
            RankSpec {
                rank,
                device: rank_device(config.device, rank),
                job,
                connect: Box::new(move |_: &Identity| Ok(Box::new(comm) as Box<dyn Communicator>)),
            }
        })
        .collect();
    run_ranks(specs, config, "loopback", Some(abort))
}

/// Runs every rank of `jobs` as threads of this process, one GPU each (from `config.device`
/// on), through NCCL; the rendezvous runs on this host's loopback interface.
pub fn run_nccl_threads(jobs: Vec<RankJob>, config: &RunConfig) -> Result<RunReport, RunError> {
    let world = jobs.len();
    let any_port = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let hub = nccl::host(any_port, world, config.timeout)
        .map_err(|e| RunError::Ranks(vec![(0, e.to_string())]))?;
    let specs = jobs
        .into_iter()
        .enumerate()
        .map(|(rank, job)| {
            let device = rank_device(config.device, rank);
            nccl_rank(hub.address, rank, world, device, job, config)
        })
        .collect();
    run_ranks(specs, config, "nccl", None)
}

/// This process's rank of a job launched like PyTorch's (`torchrun`): the ranks meet through
/// the launcher's store, where rank 0 publishes its hub; CPU ranks run their collectives
/// through gloo, CUDA ranks through NCCL on the GPU of their local rank (counted from
/// `config.device`). Rank 0 returns once every rank is done or gone (or after the timeout),
/// so its hub outlives the ranks that still report to it.
pub fn run_launched(
    job: RankJob,
    launch: &Launch,
    config: &RunConfig,
) -> Result<RunReport, RunError> {
    let rank = launch.rank;
    let failed = |e: CommError| RunError::Ranks(vec![(rank, e.to_string())]);
    let store = Arc::new(launch.store(config.timeout).map_err(failed)?);
    let device = match config.device {
        Device::Cuda(base) => Device::Cuda(base + launch.local_rank),
        other => other,
    };
    let cuda = matches!(device, Device::Cuda(_));
    let hub = if rank == 0 {
        let id = if cuda {
            nccl::unique_id().map_err(failed)?
        } else {
            Vec::new()
        };
        Some(launch::host_hub(launch, &store, id, config.timeout).map_err(failed)?)
    } else {
        None
    };
    let address = launch::find_hub(&store, config.timeout).map_err(failed)?;
    let (spec, communicator) = if cuda {
        let spec = nccl_rank(address, rank, launch.world, device, job, config);
        (spec, "nccl")
    } else {
        let (world, timeout) = (launch.world, config.timeout);
        let connect: Connect = Box::new(move |identity: &Identity| {
            let comm = Gloo::connect(&store, address, rank, world, identity.clone(), timeout)?;
            Ok(Box::new(comm) as Box<dyn Communicator>)
        });
        let spec = RankSpec {
            rank,
            device,
            job,
            connect,
        };
        (spec, "gloo")
    };
    let report = run_ranks(vec![spec], config, communicator, None);
    if let Some(hub) = hub {
        hub.wait_stopped(config.timeout);
    }
    report
}

fn nccl_rank(
    hub: std::net::SocketAddr,
    rank: usize,
    world: usize,
    device: Device,
    job: RankJob,
    config: &RunConfig,
) -> RankSpec {
    let timeout = config.timeout;
    RankSpec {
        rank,
        device,
        job,
        connect: Box::new(move |identity: &Identity| {
            let comm = nccl::Nccl::connect(hub, rank, world, device, identity.clone(), timeout)?;
            Ok(Box::new(comm) as Box<dyn Communicator>)
        }),
    }
}

/// Fails rank `rank` for every other rank of the group, from outside its thread (the
/// watchdog's way to stop the others when an op overruns).
type Abort = Box<dyn Fn(usize, &str) + Send>;

/// Runs each rank on its own thread; every rank's result or error. `world` is the number of
/// ranks of the whole run (this process may run fewer).
fn run_ranks(
    specs: Vec<RankSpec>,
    config: &RunConfig,
    communicator: &'static str,
    abort: Option<Abort>,
) -> Result<RunReport, RunError> {
    let world = specs.len();
    let header = specs.first().map(|spec| {
        let id = identity(&spec.job);
        (spec.job.graph.name().to_owned(), id.structure, id.plan)
    });
    let total = specs
        .first()
        .map_or(0, |s| s.job.graph.metadata().world_size.max(1) as usize)
        .max(world);
    preflight(&specs, total, config.max_input_bytes)?;
    if config.cpu_memory == CpuMemory::Retain && specs.iter().any(|s| s.device == Device::Cpu) {
        // Threads that allocated before (planning's) keep their arenas, which a rank's thread
        // may be handed; the settings still keep its blocks mapped and untrimmed.
        host_memory::retain_freed_memory();
    }
    quiet_rank_panics();
    let (sender, receiver) = mpsc::channel();
    let ranks: Vec<usize> = specs.iter().map(|s| s.rank).collect();
    let mut watched = Vec::with_capacity(world);
    for (slot, spec) in specs.into_iter().enumerate() {
        let sender = sender.clone();
        let config = config.clone();
        let rank = spec.rank;
        let activity = RankActivity::new();
        watched.push(Watched {
            rank,
            graph: Arc::clone(&spec.job.graph),
            activity: Arc::clone(&activity),
        });
        std::thread::Builder::new()
            .name(format!("{RANK_THREAD}{rank}"))
            .spawn(move || {
                let result = rank_thread(spec, &config, &activity);
                // The receiver may be gone when the run already gave up on this rank.
                let _ = sender.send((slot, result));
            })
            .map_err(|e| RunError::Ranks(vec![(rank, format!("cannot start a thread: {e}"))]))?;
    }
    drop(sender);
    let watchdog = Watchdog {
        ranks: watched,
        op_limit: config.timeout,
        abort,
    };
    let results = collect(&receiver, &watchdog, config.timeout);
    let mut reports = Vec::with_capacity(world);
    let mut failures = Vec::new();
    for (slot, result) in results.into_iter().enumerate() {
        match result {
            Some(Ok(report)) => reports.push(report),
            Some(Err(e)) => failures.push((ranks[slot], e)),
            None => failures.push((ranks[slot], RankFailure::Hung(config.timeout.as_secs_f64()))),
        }
    }
    if !failures.is_empty() {
        return Err(RunError::Ranks(order_failures(failures)));
    }
    skip_reference_if_seeded(&mut reports);
    let (graph, structure, plan) = header.unwrap_or_default();
    Ok(RunReport {
        communicator,
        world: total,
        graph,
        structure,
        plan,
        check: config.check,
        ranks: reports,
    })
}

/// The name of rank r's thread is this prefix and r.
const RANK_THREAD: &str = "rank-";

thread_local! {
    /// Where the last panic of this rank thread happened (`file:line`).
    static PANIC_LOCATION: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Panics on rank threads are reported as the rank's failure (with the op it ran), not
/// printed by the default hook as they happen; other threads keep the previous hook.
fn quiet_rank_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let on_rank = std::thread::current()
                .name()
                .is_some_and(|name| name.starts_with(RANK_THREAD));
            if on_rank {
                let location = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()));
                PANIC_LOCATION.with(|slot| *slot.borrow_mut() = location);
            } else {
                previous(info);
            }
        }));
    });
}

/// The message a panic carried, in one line.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| crate::tensor::one_line(s))
        .or_else(|| {
            payload
                .downcast_ref::<String>()
                .map(|s| crate::tensor::one_line(s))
        })
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// One rank's thread: connect, run, and tell the others when this rank failed. A panic (a
/// libtorch call that failed inside tch, a bug) is this rank's failure like any other.
fn rank_thread(
    spec: RankSpec,
    config: &RunConfig,
    activity: &Arc<RankActivity>,
) -> Result<RankReport, RankFailure> {
    let mut comm = (spec.connect)(&identity(&spec.job))?;
    let job = &spec.job;
    let run = panic::catch_unwind(AssertUnwindSafe(|| {
        rank_main(spec.rank, spec.device, job, comm.as_mut(), config, activity)
    }));
    let result = run.unwrap_or_else(|payload| {
        Err(RankFailure::Panicked {
            during: activity
                .now()
                .describe(&job.graph)
                .map_or_else(String::new, |op| format!(" in {op}")),
            message: panic_message(payload.as_ref()),
            location: PANIC_LOCATION
                .with(|slot| slot.borrow_mut().take())
                .map_or_else(String::new, |at| format!(" (at {at})")),
        })
    });
    match result {
        Ok(report) => {
            comm.finish()?;
            Ok(report)
        }
        Err(e) => {
            comm.abort(&e.to_string());
            Err(e)
        }
    }
}

/// A rank as the watchdog sees it.
struct Watched {
    rank: usize,
    graph: Arc<Graph>,
    activity: Arc<RankActivity>,
}

/// Ends a rank whose op runs longer than `op_limit`, and tells the others.
struct Watchdog {
    ranks: Vec<Watched>,
    op_limit: Duration,
    abort: Option<Abort>,
}

impl Watchdog {
    /// The failure of the rank in `slot` if its op has run past the limit.
    fn overrun(&self, slot: usize) -> Option<RankFailure> {
        let watched = &self.ranks[slot];
        let doing = watched.activity.now();
        let crate::watch::Doing::Op {
            since, timed: true, ..
        } = doing
        else {
            return None;
        };
        (since.elapsed() > self.op_limit).then(|| {
            let failure = RankFailure::OpTimeout {
                op: doing.describe(&watched.graph).unwrap_or_default(),
                seconds: self.op_limit.as_secs_f64(),
            };
            if let Some(abort) = &self.abort {
                abort(watched.rank, &failure.to_string());
            }
            failure
        })
    }
}

type RankResult = Result<RankReport, RankFailure>;

/// Every rank's result; after the first failure, the others get `grace` to stop. Meanwhile
/// the watchdog fails any rank whose op runs past its limit.
fn collect(
    receiver: &mpsc::Receiver<(usize, RankResult)>,
    watchdog: &Watchdog,
    grace: Duration,
) -> Vec<Option<RankResult>> {
    let world = watchdog.ranks.len();
    let mut results: Vec<Option<RankResult>> = (0..world).map(|_| None).collect();
    let mut deadline: Option<Instant> = None;
    while results.iter().any(Option::is_none) {
        let wait = deadline.map_or(WATCH_INTERVAL, |d| {
            d.saturating_duration_since(Instant::now())
                .min(WATCH_INTERVAL)
        });
        match receiver.recv_timeout(wait) {
            Ok((slot, result)) => {
                if results[slot].is_none() {
                    results[slot] = Some(result);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        for (slot, result) in results.iter_mut().enumerate() {
            if result.is_none() {
                *result = watchdog.overrun(slot).map(Err);
            }
        }
        let failed = results.iter().any(|r| matches!(r, Some(Err(_))));
        if failed && deadline.is_none() {
            deadline = Some(Instant::now() + grace);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    results
}

/// A rank's own failure first, then the ranks that only saw it; the rank order otherwise.
fn order_failures(failures: Vec<(usize, RankFailure)>) -> Vec<(usize, String)> {
    let (mut own, mut others): (Vec<_>, Vec<_>) = failures
        .into_iter()
        .partition(|(_, f)| !f.is_from_another_rank());
    own.append(&mut others);
    own.into_iter().map(|(r, f)| (r, f.to_string())).collect()
}

/// Why a rank did not finish.
#[derive(Debug, Error)]
pub enum RankFailure {
    #[error("{0}")]
    Inputs(#[from] InputError),
    #[error("{0}")]
    Prepare(#[from] PrepareError),
    #[error("{0}")]
    Schedule(#[from] RunError),
    #[error("{0}")]
    Comm(#[from] CommError),
    #[error("{0}")]
    Step(#[from] StepError),
    #[error("did not stop within {0} s after the run failed (hung); left behind")]
    Hung(f64),
    #[error("panicked{during}: {message}{location}")]
    Panicked {
        /// ` in forward node `x` (op)` when the rank was running an op.
        during: String,
        message: String,
        location: String,
    },
    #[error("{op} did not finish within {seconds} s (--timeout); left behind")]
    OpTimeout { op: String, seconds: f64 },
}

impl RankFailure {
    fn is_from_another_rank(&self) -> bool {
        match self {
            RankFailure::Comm(e) => !matches!(e, CommError::Mismatch { .. }),
            RankFailure::Step(e) => e.is_from_another_rank(),
            RankFailure::Hung(_) => true,
            _ => false,
        }
    }
}

/// The variants a rank runs, in order, with their schedules and predicted peaks.
fn variants(job: &RankJob, check: bool) -> Result<Vec<(Variant, Schedule, Predicted)>, RunError> {
    let graph = &job.graph;
    let memory = &job.plan.memory;
    let mut out = vec![(
        Variant::Plan,
        schedule_of(graph, &job.plan)?,
        Predicted::of(&job.plan),
    )];
    if check {
        let cost = &job.plan.cost;
        out.push((
            Variant::NoCheckpoint,
            Schedule::no_checkpoint(graph),
            Predicted {
                peak: memory.no_checkpoint_peak_bytes,
                saved: None,
                step_time_s: Some(cost.forward_time_s + cost.backward_time_s),
                replay_time_s: Some(0.0),
                host: None,
            },
        ));
        if let Some(whole) = &job.whole_layer {
            out.push((
                Variant::WholeLayer,
                schedule_of(graph, whole)?,
                Predicted {
                    peak: memory.full_recompute_peak_bytes,
                    ..Predicted::of(whole)
                },
            ));
        }
    }
    Ok(out)
}

/// What the planner predicts of one variant's step.
struct Predicted {
    peak: Option<u64>,
    /// The activation bytes forward leaves for backward (a joint graph's plans only).
    saved: Option<u64>,
    step_time_s: Option<f64>,
    replay_time_s: Option<f64>,
    host: Option<PredictedHost>,
}

impl Predicted {
    /// What `plan` predicts of the step that executes it.
    fn of(plan: &Plan) -> Predicted {
        Predicted {
            peak: plan.memory.peak_bytes,
            saved: plan.joint.then_some(plan.memory.saved_bytes),
            step_time_s: Some(plan.cost.step_time_s),
            replay_time_s: Some(plan.cost.replay_time_s),
            host: (plan.memory.offloaded_bytes > 0).then_some(PredictedHost {
                offloaded_bytes: plan.memory.offloaded_bytes,
                peak_bytes: plan.memory.host_peak_bytes,
                transfer_time_s: plan.cost.transfer_time_s,
            }),
        }
    }
}

/// Each node's median time over `steps` (the first step's one-time costs, such as a kernel's
/// first call, would weigh on a mean).
fn median_node_times(steps: &[StepResult]) -> Vec<f64> {
    let nodes = steps.first().map_or(0, |s| s.node_seconds.len());
    (0..nodes)
        .map(|node| median(steps.iter().map(|s| s.node_seconds[node])))
        .collect()
}

/// The median of `values` (the mean of the middle two for an even count); 0 when empty.
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The median of the steps' page faults, where every step counted them.
fn median_page_faults(steps: &[StepResult]) -> Option<u64> {
    let faults: Option<Vec<u64>> = steps.iter().map(|s| s.page_faults).collect();
    faults.map(|f| median(f.into_iter().map(|n| n as f64)).round() as u64)
}

/// The median step time of `steps`, and the median of each stage's time (each median on its
/// own, so the stages need not add up to the step).
fn median_times(steps: &[StepResult]) -> (f64, StageSeconds) {
    let stages = StageSeconds::new(
        [Stage::Forward, Stage::Replay, Stage::Backward]
            .map(|stage| median(steps.iter().map(|s| s.stage_seconds.of(stage)))),
    );
    (median(steps.iter().map(|s| s.seconds)), stages)
}

fn rank_main(
    rank: usize,
    device: Device,
    job: &RankJob,
    comm: &mut dyn Communicator,
    config: &RunConfig,
    activity: &Arc<RankActivity>,
) -> Result<RankReport, RankFailure> {
    let graph = &job.graph;
    crate::ffi::set_device(device).map_err(|m| {
        RankFailure::Step(StepError::Op {
            stage: Stage::Forward,
            node: "-".to_owned(),
            op: "device".to_owned(),
            message: m,
        })
    })?;
    let path = inputs::rank_path(&job.inputs, rank);
    let inputs = inputs::load(
        graph,
        &path,
        rank,
        config.seed,
        device,
        config.max_input_bytes,
    )?;
    let program = Program::prepare(graph, device, comm.world_size())?.watched(Arc::clone(activity));
    let variants = variants(job, config.check)?;
    comm.agree(&identity(job))?;
    let mut runs = Vec::new();
    let mut outputs = Vec::new();
    for (variant, schedule, predicted) in &variants {
        let mut steps = Vec::new();
        for _ in 0..config.repeat.max(1) {
            let mut rng = initial_rng(&inputs, device, config.seed, rank)?;
            let mut step =
                exec::run_step(&program, schedule, &inputs, comm, &mut rng, config.fault)?;
            if !steps.is_empty() {
                // Only the first step's outputs are compared: a later one's are freed at once.
                step.outputs = Vec::new();
            }
            steps.push(step);
        }
        let (seconds, stage_seconds) = median_times(&steps);
        let node_seconds = median_node_times(&steps);
        let host = HostFigures {
            seconds: median(steps.iter().map(|s| s.host.seconds)),
            ..steps[0].host
        };
        let step = steps.swap_remove(0);
        runs.push(VariantRun {
            variant: *variant,
            predicted_peak_bytes: predicted.peak,
            measured_peak_bytes: step.peak_bytes,
            predicted_saved_bytes: predicted.saved,
            measured_saved_bytes: step.saved_bytes,
            allocator_peak_bytes: step.allocator_peak_bytes,
            seconds,
            page_faults: median_page_faults(&steps),
            stage_seconds,
            node_seconds,
            repeat: config.repeat.max(1),
            predicted_step_time_s: predicted.step_time_s,
            predicted_replay_time_s: predicted.replay_time_s,
            counts: step.counts,
            host,
            predicted_host: predicted.host,
        });
        outputs.push((*variant, step.outputs));
    }
    let (tensors, reference_skipped) = compare(graph, device, &inputs, &outputs, config.check);
    Ok(RankReport {
        rank,
        device,
        runs,
        tensors,
        reference_skipped,
        seeded: inputs.seeded.len(),
    })
}

/// The reference is the step PyTorch ran on every rank's real tensors: once any rank ran on
/// tensors filled from the seed, no rank computes that step (they exchange data).
fn skip_reference_if_seeded(reports: &mut [RankReport]) {
    let seeded: Vec<String> = reports
        .iter()
        .filter(|r| r.seeded > 0)
        .map(|r| r.rank.to_string())
        .collect();
    if seeded.is_empty() {
        return;
    }
    for report in reports {
        if report.reference_skipped.is_none() {
            report.reference_skipped = Some(format!(
                "rank(s) {} ran on inputs filled from the seed, so no rank runs the reference's step",
                seeded.join(", ")
            ));
            for t in &mut report.tensors {
                t.reference = None;
            }
        }
    }
}

/// The rank's generator stream at the start of a step: seeded as the reference step's CPU
/// generator was when the inputs say (so random ops draw what PyTorch drew), else from
/// `--seed` and the rank.
fn initial_rng(
    inputs: &RankInputs,
    device: Device,
    seed: Option<u64>,
    rank: usize,
) -> Result<RankRng, RankFailure> {
    let seed = inputs
        .rng_seed
        .unwrap_or_else(|| seed.unwrap_or(0).wrapping_add(rank as u64));
    RankRng::seeded(device, seed).map_err(|m| {
        RankFailure::Step(StepError::Op {
            stage: Stage::Forward,
            node: "-".to_owned(),
            op: "generator".to_owned(),
            message: m,
        })
    })
}

type Outputs = Vec<(ir::ValueId, tch::Tensor)>;

/// Compares the plan's outputs with the other variants' (bit for bit) and with the reference.
fn compare(
    graph: &Graph,
    device: Device,
    inputs: &RankInputs,
    outputs: &[(Variant, Outputs)],
    check: bool,
) -> (Vec<TensorCheck>, Option<String>) {
    let Some((_, mine)) = outputs.first() else {
        return (Vec::new(), None);
    };
    let reference_skipped = if !check {
        Some("run with --check to compare".to_owned())
    } else if !inputs.seeded.is_empty() {
        Some(format!(
            "{} input tensors were filled from the seed",
            inputs.seeded.len()
        ))
    } else if device != Device::Cpu && graph.nodes().values().any(|n| n.effects.random) {
        Some(
            "random ops draw from the GPU's generator, not the CPU one the reference used"
                .to_owned(),
        )
    } else if inputs.reference.loss.is_none() && inputs.reference.grads.is_empty() {
        Some("the inputs hold no reference".to_owned())
    } else {
        None
    };
    let mut tensors = Vec::new();
    for (k, (value, tensor)) in mine.iter().enumerate() {
        let v = graph.value(*value);
        let identical = outputs[1..]
            .iter()
            .filter_map(|(variant, theirs)| {
                theirs
                    .get(k)
                    .map(|(_, t)| (*variant, check::identical(tensor, t)))
            })
            .collect();
        let expected = match v.role {
            Role::Loss => inputs.reference.loss.as_ref(),
            _ => inputs.reference.grads.get(v.name.as_str()),
        };
        let reference = expected
            .filter(|_| reference_skipped.is_none())
            .map(|e| check::error(tensor, e));
        tensors.push(TensorCheck {
            name: v.name.to_string(),
            digest: check::digest(tensor),
            identical,
            reference,
        });
    }
    (tensors, reference_skipped)
}

/// Replay counts of the nodes in `nodes`, all together.
pub fn replayed(counts: &OpCounts, nodes: impl IntoIterator<Item = NodeId>) -> u64 {
    nodes
        .into_iter()
        .map(|n| u64::from(counts.of(n, Stage::Replay)))
        .sum()
}
