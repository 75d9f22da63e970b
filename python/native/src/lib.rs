//! `recompute_planner._native`: the planner in-process for Python.
//!
//! A thin layer over the Rust crates. A graph (a file path, or bytes with their format) and
//! the options of `planner plan` go in; the plan comes out as a [`PlannedGraph`], which writes
//! its JSON text (the one dialect `recompute_planner.plans` parses into typed objects) or its
//! protobuf bytes only when Python asks for them. Plan files and `--hw` profiles are read
//! through the CLI's reader of input files, and plans converted through `ir::plan`. Planning
//! runs on a thread of its own while the caller waits with the GIL released, checking Python's
//! signals (Ctrl-C raises at once). Every error raises
//! `recompute_planner.errors.PlannerError(message, code)`, whose message is the text the CLI
//! prints after `error: `.

use std::{
    ops::Deref,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc::{self, RecvTimeoutError},
        Arc,
    },
    time::Duration,
};

use ir::{
    io::Format as GraphFormat,
    ops::CollectiveKind,
    plan::{
        Collectives, Executor, Format as PlanFormat, Offload, Optimizer, Plan, PlanReadError,
        RandomOps, SavedKind, Spelled, StateDtype, Training,
    },
    Graph, LoadError,
};
use planner::{
    budget::{BudgetError, Granularity, Search},
    config::{self, ConfigError, PlanConfig},
    cost::HwProfile,
    plan::PlanError,
    policy,
    progress::Progress,
    state::{BudgetBasis, BudgetTooSmall, State},
    units,
};
use pyo3::{prelude::*, pybacked::PyBackedBytes, types::PyBytes};

mod fx;

use fx::WireGraph;

/// A failure on the Rust side: the CLI's `error:` text and a stable code for Python.
#[derive(Debug)]
struct Failure {
    message: String,
    code: &'static str,
}

impl Failure {
    fn new(code: &'static str, message: impl ToString) -> Failure {
        Failure {
            message: message.to_string(),
            code,
        }
    }

    /// The Python exception: `recompute_planner.errors.PlannerError(message, code)`.
    fn into_py_err(self, py: Python<'_>) -> PyErr {
        let raised = py
            .import("recompute_planner.errors")
            .and_then(|m| m.getattr("PlannerError"))
            .and_then(|class| class.call1((self.message, self.code)));
        match raised {
            Ok(exception) => PyErr::from_value(exception),
            Err(import_failed) => import_failed,
        }
    }
}

impl From<LoadError> for Failure {
    fn from(e: LoadError) -> Self {
        Failure::new("invalid-graph", e)
    }
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        let code = match e {
            ConfigError::UnknownUnit { .. } => "unknown-unit",
            ConfigError::MixedKeep { .. } | ConfigError::EmptyUnit { .. } => "invalid-keep",
            ConfigError::EmptyOffloadUnit { .. } => "invalid-offload",
            ConfigError::OffloadNotKept { .. } => "offload-not-kept",
            ConfigError::Ratio { .. } => "invalid-ratio",
            ConfigError::ChoicesFormat { .. }
            | ConfigError::ChoicesUnknown { .. }
            | ConfigError::ChoicesOffloadNotKept { .. }
            | ConfigError::ChoicesOffloadNotCheckpointed { .. } => "invalid-choices",
        };
        Failure::new(code, e)
    }
}

impl From<PlanError> for Failure {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Config(e) => e.into(),
            PlanError::Partition(_) => Failure::new("internal-error", e),
        }
    }
}

impl From<BudgetError> for Failure {
    fn from(e: BudgetError) -> Self {
        let code = match e {
            BudgetError::Plan(e) => return e.into(),
            BudgetError::Infeasible { .. } => "budget-infeasible",
            BudgetError::NotJoint => "budget-needs-joint-graph",
            BudgetError::TooManyUnits { .. } => "too-many-units",
            BudgetError::Interrupted => "interrupted",
            BudgetError::Offload | BudgetError::OffloadOps => "invalid-option",
        };
        Failure::new(code, e)
    }
}

impl From<BudgetTooSmall> for Failure {
    fn from(e: BudgetTooSmall) -> Self {
        Failure::new("budget-infeasible", e)
    }
}

impl From<PlanReadError> for Failure {
    fn from(e: PlanReadError) -> Self {
        let code = match e {
            PlanReadError::Mismatch(_) => "graph-mismatch",
            _ => "invalid-plan",
        };
        Failure::new(code, e)
    }
}

/// Where the graph comes from: a file, bytes `D` in a known format, or a graph the FX builder
/// made (`origin` names them in errors, as a path would).
enum Source<D> {
    File(PathBuf),
    Bytes {
        data: D,
        format: GraphFormat,
        origin: PathBuf,
    },
    Built {
        graph: Py<WireGraph>,
        origin: PathBuf,
    },
}

impl<D: Deref<Target = [u8]>> Source<D> {
    fn load(&self) -> Result<Graph, Failure> {
        Ok(match self {
            Source::File(path) => ir::io::load(path)?,
            Source::Bytes {
                data,
                format,
                origin,
            } => ir::io::load_bytes(data, *format, origin)?,
            Source::Built { graph, origin } => {
                graph.get().load().map_err(|error| LoadError::Invalid {
                    path: origin.clone(),
                    error,
                })?
            }
        })
    }
}

/// `--budget`, `--budget-includes`, `--granularity` and `--budget-offload`.
struct Budget {
    bytes: u64,
    basis: BudgetBasis,
    granularity: Granularity,
    /// `--budget-offload`: the search also offloads kept units' saved values.
    offload: bool,
}

fn graph_format(name: &str) -> Result<GraphFormat, Failure> {
    match name {
        "pb" => Ok(GraphFormat::Protobuf),
        "json" => Ok(GraphFormat::Json),
        _ => Err(Failure::new(
            "invalid-option",
            format!("graph format must be `pb` or `json`, not `{name}`"),
        )),
    }
}

fn plan_format(name: &str) -> Result<PlanFormat, Failure> {
    match name {
        "pb" => Ok(PlanFormat::Protobuf),
        "json" => Ok(PlanFormat::Json),
        _ => Err(Failure::new(
            "invalid-option",
            format!("plan format must be `pb` or `json`, not `{name}`"),
        )),
    }
}

/// Each spelled keyword of `plan` that takes a list (`offload_kinds`): every spelling, for the
/// package's tests to hold the docstring to the planner's.
fn spelled_list_options() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![(
        "offload_kinds",
        SavedKind::ALL.iter().map(|k| k.name()).collect(),
    )]
}

/// The offload options (`offload`, `offload_kinds`, `offload_prefetch`), as the CLI reads
/// them (comma-separated names, or one per item).
fn offload(units: &[String], kinds: &[String], prefetch: u32) -> Result<Offload, Failure> {
    Ok(Offload {
        units: config::parse_offload_units(units)?,
        kinds: kinds
            .iter()
            .flat_map(|k| k.split(','))
            .map(|k| spelled::<SavedKind>("offload_kinds", k.trim()))
            .collect::<Result<_, _>>()?,
        prefetch,
    })
}

/// A spelled option (`collectives`, `random_ops`, `executor`): its value, or an error listing
/// the spellings the planner accepts, as the CLI does.
fn spelled<T: Spelled>(option: &str, name: &str) -> Result<T, Failure> {
    T::from_name(name).ok_or_else(|| {
        Failure::new(
            "invalid-option",
            format!("{option} must be one of {}, not `{name}`", T::spellings()),
        )
    })
}

/// Each spelled keyword of `plan` (`collectives`, ...): its default, then every spelling, for
/// the package's tests to hold the Python signature and docstring to the planner's.
fn spelled_options() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    fn option<T: Spelled + Default>(
        keyword: &'static str,
    ) -> (&'static str, &'static str, Vec<&'static str>) {
        (
            keyword,
            T::default().name(),
            T::ALL.iter().map(|v| v.name()).collect(),
        )
    }
    vec![
        option::<Collectives>("collectives"),
        option::<RandomOps>("random_ops"),
        option::<Executor>("executor"),
        option::<BudgetBasis>("budget_includes"),
        option::<Granularity>("granularity"),
        option::<Optimizer>("optimizer"),
        option::<StateDtype>("optimizer_state_dtype"),
    ]
}

fn budget(
    size: Option<&str>,
    includes: &str,
    granularity: &str,
    offload: bool,
) -> Result<Option<Budget>, Failure> {
    let granularity = spelled::<Granularity>("granularity", granularity)?;
    let basis = spelled::<BudgetBasis>("budget_includes", includes)?;
    if offload && size.is_none() {
        return Err(Failure::new(
            "invalid-option",
            "budget_offload chooses what to offload within a budget: give `budget` too",
        ));
    }
    if offload && granularity == Granularity::Op {
        return Err(BudgetError::OffloadOps.into());
    }
    size.map(|size| {
        let bytes = units::parse_bytes(size).map_err(|e| Failure::new("invalid-option", e))?;
        Ok(Budget {
            bytes,
            basis,
            granularity,
            offload,
        })
    })
    .transpose()
}

/// The training state the device total counts (`fsdp`, `optimizer`, ...), as the CLI reads it.
fn training(
    fsdp: u32,
    optimizer: &str,
    state_dtype: &str,
    master_weights: bool,
) -> Result<Training, Failure> {
    if !(1..=65536).contains(&fsdp) {
        return Err(Failure::new(
            "invalid-option",
            format!("fsdp must be from 1 to 65536, not {fsdp}"),
        ));
    }
    Ok(Training {
        fsdp,
        optimizer: spelled::<Optimizer>("optimizer", optimizer)?,
        state_dtype: spelled::<StateDtype>("optimizer_state_dtype", state_dtype)?,
        master_weights,
    })
}

/// One `planner plan`: the graph and every option, owned, so that it can run on a thread of
/// its own.
struct Planning {
    source: Source<PyBackedBytes>,
    config: PlanConfig,
    budget: Option<Budget>,
    /// Per-layer choices as JSON (a pareto point's or a plan's `layer_keep` and
    /// `layer_offload`), over `config`; never with `budget`.
    choices: Option<String>,
    hw: HwProfile,
}

impl Planning {
    /// Plans the graph as `planner plan` does: the unit choice of `--budget` when given, its
    /// search stopping when `progress` is interrupted.
    fn run(&self, progress: &dyn Progress) -> Result<PlannedGraph, Failure> {
        let graph = self.source.load()?;
        let plan = match (&self.budget, &self.choices) {
            (None, None) => planner::plan::plan(&graph, &self.config, &self.hw)?,
            (None, Some(json)) => {
                let choices = config::parse_choices(&graph, json.as_bytes())?;
                planner::plan::plan_with_choices(&graph, &self.config, choices, &self.hw)?
            }
            (Some(budget), _) => {
                let activations = State::of(&graph, &self.config.training)
                    .activation_budget(budget.bytes, budget.basis)?;
                Search::with_progress(&graph, &self.config, &self.hw, progress)?.answer(
                    activations,
                    budget.granularity,
                    budget.offload,
                )?
            }
        };
        Ok(PlannedGraph { plan, graph })
    }
}

/// A plan made in-process, with the graph whose names its ids stand for. Nothing is encoded
/// until asked: a caller that reads only a plan's memory figures, or none of it, never pays
/// for writing (and Python for parsing) every node's decision. It holds the graph until it is
/// dropped; `recompute_planner.plans.Plan` drops it once the JSON text is written.
#[pyclass(frozen, module = "recompute_planner._native")]
struct PlannedGraph {
    plan: Plan,
    graph: Graph,
}

impl PlannedGraph {
    /// The plan in `format`, written with the caller's GIL released.
    fn encode(&self, py: Python<'_>, format: PlanFormat) -> Vec<u8> {
        py.detach(|| self.plan.encode(&self.graph, format))
    }
}

/// `plan` without its lists of nodes, saved values, replays and units: the sections whose
/// size does not grow with the graph's.
fn summary(plan: &Plan) -> Plan {
    Plan {
        planner_version: plan.planner_version.clone(),
        graph: plan.graph.clone(),
        config: plan.config.clone(),
        joint: plan.joint,
        nodes: Vec::new(),
        saved: Vec::new(),
        replay: Vec::new(),
        units: Vec::new(),
        memory: plan.memory,
        cost: plan.cost.clone(),
        diagnostics: plan.diagnostics.clone(),
    }
}

#[pymethods]
impl PlannedGraph {
    /// The plan's JSON text, as `planner plan --format json` writes it.
    fn json(&self, py: Python<'_>) -> String {
        json_text(self.encode(py, PlanFormat::Json))
    }

    /// The plan's JSON text with its lists of nodes, saved values, replays and units empty:
    /// every other section as [`PlannedGraph::json`] writes it, for a fraction of the work
    /// (what checking a plan's diagnostics, or reading its memory figures, needs), written with
    /// the caller's GIL released.
    fn summary_json(&self, py: Python<'_>) -> String {
        json_text(py.detach(|| summary(&self.plan).encode(&self.graph, PlanFormat::Json)))
    }

    /// The binary `plan.proto` encoding, as `planner plan --format pb` writes it.
    fn pb<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.encode(py, PlanFormat::Protobuf))
    }
}

/// How often a thread waiting for the planner checks Python's signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// A [`Progress`] that only carries a request to stop.
#[derive(Default)]
struct Interrupt(AtomicBool);

impl Progress for Interrupt {
    fn stage(&self, _: &str, _: Option<u64>) {}
    fn advance(&self) {}
    fn interrupted(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs `work` on a thread of its own while the calling thread waits with the GIL released,
/// checking Python's signals every [`SIGNAL_CHECK`]: Ctrl-C (or any signal handler that
/// raises) raises in the caller at once, and asks `work` to stop (a search stops before its
/// next candidate plan). Whatever `work` then returns is dropped. Signals reach only Python's
/// main thread; elsewhere the call simply waits.
fn interruptible<T: Send + 'static>(
    py: Python<'_>,
    work: impl FnOnce(&dyn Progress) -> Result<T, Failure> + Send + 'static,
) -> PyResult<T> {
    let interrupt = Arc::new(Interrupt::default());
    let (done, result) = mpsc::channel::<Result<T, Failure>>();
    let flag = Arc::clone(&interrupt);
    std::thread::Builder::new()
        .name("planner".to_owned())
        .spawn(move || {
            // The caller may have gone (interrupted): nobody to tell.
            let _ = done.send(work(flag.as_ref()));
        })
        .map_err(|e| {
            Failure::new("internal-error", format!("cannot start the planner: {e}")).into_py_err(py)
        })?;
    let mut result = result;
    loop {
        // A receiver is not shared between threads: it goes to the waiting side and back.
        let (receiver, received) = py.detach(move || {
            let received = result.recv_timeout(SIGNAL_CHECK);
            (result, received)
        });
        result = receiver;
        match received {
            Ok(outcome) => return outcome.map_err(|f| f.into_py_err(py)),
            Err(RecvTimeoutError::Timeout) => {
                if let Err(raised) = py.check_signals() {
                    interrupt.0.store(true, Ordering::Relaxed);
                    return Err(raised);
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(
                    Failure::new("internal-error", "the planner stopped without an answer")
                        .into_py_err(py),
                )
            }
        }
    }
}

fn json_text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Plans a graph; returns the plan as a [`PlannedGraph`] (diagnostics included: Python raises
/// the error-level ones). `path` is the graph file, or with `data` only what names the bytes.
#[pyfunction]
#[pyo3(signature = (
    *, path, data=None, format=None, graph=None, keep, recompute_ratio, collectives_name, random_ops_name,
    executor_name, budget_size=None, budget_includes="activations", granularity,
    budget_offload=false, fsdp=1,
    optimizer_name="adamw", optimizer_state_dtype_name="fp32", master_weights=false,
    offload=Vec::new(), offload_kinds=Vec::new(), offload_prefetch=Offload::DEFAULT_PREFETCH,
    choices=None, hw_name=None, hw_json=None, hw_path=None
))]
#[allow(clippy::too_many_arguments)] // the options of `planner plan`, each by keyword
fn plan(
    py: Python<'_>,
    path: &str,
    data: Option<PyBackedBytes>,
    format: Option<&str>,
    graph: Option<Py<WireGraph>>,
    keep: Vec<String>,
    recompute_ratio: f64,
    collectives_name: &str,
    random_ops_name: &str,
    executor_name: &str,
    budget_size: Option<&str>,
    budget_includes: &str,
    granularity: &str,
    budget_offload: bool,
    fsdp: u32,
    optimizer_name: &str,
    optimizer_state_dtype_name: &str,
    master_weights: bool,
    offload: Vec<String>,
    offload_kinds: Vec<String>,
    offload_prefetch: u32,
    choices: Option<String>,
    hw_name: Option<&str>,
    hw_json: Option<&str>,
    hw_path: Option<&str>,
) -> PyResult<PlannedGraph> {
    let planning = (|| -> Result<Planning, Failure> {
        // Configuration errors come before any other work, as in the CLI.
        let keep = config::parse_keep(&keep)?;
        let recompute_ratio = config::check_ratio(recompute_ratio)?;
        let budget = budget(budget_size, budget_includes, granularity, budget_offload)?;
        if budget.is_some() && choices.is_some() {
            return Err(Failure::new(
                "invalid-option",
                "a budget chooses the units per layer: give `budget` or `choices`, not both",
            ));
        }
        let training = training(
            fsdp,
            optimizer_name,
            optimizer_state_dtype_name,
            master_weights,
        )?;
        let offload = self::offload(&offload, &offload_kinds, offload_prefetch)?;
        #[allow(clippy::needless_update)] // PlanConfig grows options; the rest keep defaults
        let config = PlanConfig {
            keep,
            recompute_ratio,
            collectives: spelled::<Collectives>("collectives", collectives_name)?,
            random_ops: spelled::<RandomOps>("random_ops", random_ops_name)?,
            executor: spelled::<Executor>("executor", executor_name)?,
            training,
            offload,
            ..PlanConfig::default()
        };
        let hw = resolve_hw(py, hw_name, hw_json, hw_path)?;
        let source = match (graph, data, format) {
            (Some(graph), None, None) => Source::Built {
                graph,
                origin: PathBuf::from(path),
            },
            (Some(_), _, _) => {
                return Err(Failure::new(
                    "invalid-option",
                    "a built graph comes alone: no bytes and no format with it",
                ))
            }
            (None, Some(data), Some(format)) => Source::Bytes {
                data,
                format: graph_format(format)?,
                origin: PathBuf::from(path),
            },
            (None, Some(_), None) => {
                return Err(Failure::new(
                    "invalid-option",
                    "graph bytes need their format (`pb` or `json`)",
                ))
            }
            (None, None, _) => Source::File(PathBuf::from(path)),
        };
        Ok(Planning {
            source,
            config,
            budget,
            choices,
            hw,
        })
    })()
    .map_err(|f| f.into_py_err(py))?;
    interruptible(py, move |progress| planning.run(progress))
}

/// The hardware profile given by one of: a shipped profile's `name` (`h100`, `h200`, `b200`,
/// `mi300x`), JSON fields over the H200's, or a file of them (read as the CLI reads `--hw`: a
/// regular file under the profile's size limit); none of them is the H200.
fn resolve_hw(
    py: Python<'_>,
    name: Option<&str>,
    json: Option<&str>,
    path: Option<&str>,
) -> Result<HwProfile, Failure> {
    let profile = match (name, json, path) {
        (None, None, None) => Ok(HwProfile::default()),
        (Some(name), None, None) => HwProfile::shipped(name).ok_or_else(|| {
            format!(
                "unknown hardware profile `{}` (shipped: {})",
                ir::display::name(name),
                HwProfile::shipped_names()
            )
        }),
        (None, Some(text), None) => HwProfile::from_json(text.as_bytes(), "hardware profile"),
        (None, None, Some(path)) => py.detach(|| HwProfile::from_file(Path::new(path))),
        _ => Err("a hardware profile is one of a name, JSON fields or a file".into()),
    };
    profile.map_err(|e| Failure::new("invalid-option", e))
}

/// Reads the plan file at `path` (`from_format`: `json` or `pb`) through the planner's
/// reader of input files (a regular file under the plan size limit: never a device or a FIFO)
/// and writes it in `to_format`.
#[pyfunction]
fn read_plan_file<'py>(
    py: Python<'py>,
    path: &str,
    from_format: &str,
    to_format: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let converted = (|| -> Result<Vec<u8>, Failure> {
        let (from, to) = (plan_format(from_format)?, plan_format(to_format)?);
        let (plan, names) = py.detach(|| Plan::read_as(Path::new(path), from))?;
        Ok(plan.encode(&names, to))
    })();
    match converted {
        Ok(bytes) => Ok(PyBytes::new(py, &bytes)),
        Err(f) => Err(f.into_py_err(py)),
    }
}

/// A hardware profile's every field as JSON, given as `plan` takes it (a shipped `name`, JSON
/// fields over the H200's, or a file). The exporter reads the device facts a trace reports from
/// it, the planner its rates.
#[pyfunction]
#[pyo3(signature = (*, name=None, json=None, path=None))]
fn hw_profile(
    py: Python<'_>,
    name: Option<&str>,
    json: Option<&str>,
    path: Option<&str>,
) -> PyResult<String> {
    resolve_hw(py, name, json, path)
        .map(|profile| profile.to_json())
        .map_err(|f| f.into_py_err(py))
}

/// The benchmarks `planner calibrate` times, as JSON, for an executor that runs them itself
/// (`recompute_planner.calibrate`, in eager PyTorch), collectives over `world` ranks.
#[pyfunction]
#[pyo3(signature = (cuda, world=2))]
fn calibration_benchmarks(cuda: bool, world: u32) -> String {
    let all: Vec<_> = planner::calibration::benchmarks(cuda, world)
        .iter()
        .map(|b| b.describe())
        .collect();
    serde_json::Value::from(all).to_string()
}

/// The profile fitted to the medians of `calibration_benchmarks(cuda, world)` (`None` for one not
/// run), with the device's memory where known, over the base profile `base_json`, as JSON;
/// `collectives` says which process group the collectives' medians went through.
#[pyfunction]
#[pyo3(signature = (*, cuda, medians, runs, device, description, threads, memory_bytes, base_json, name, world=2, collectives=None))]
#[allow(clippy::too_many_arguments)]
fn fit_calibration(
    py: Python<'_>,
    cuda: bool,
    medians: Vec<Option<f64>>,
    runs: u32,
    device: &str,
    description: &str,
    threads: u32,
    memory_bytes: Option<f64>,
    base_json: &str,
    name: &str,
    world: u32,
    collectives: Option<&str>,
) -> PyResult<String> {
    let fitted = (|| -> Result<String, String> {
        let base = HwProfile::from_json(base_json.as_bytes(), "base profile")?;
        let calibration = planner::cost::Calibration {
            device: device.to_owned(),
            description: description.to_owned(),
            threads,
            timings: planner::calibration::timings_of(cuda, world, &medians, runs)?,
            not_measured: Vec::new(),
            collectives: collectives.map(str::to_owned),
        };
        let profile = planner::calibration::fit(&base, name, memory_bytes, calibration)
            .map_err(|e| e.to_string())?;
        Ok(profile.to_json())
    })();
    fitted.map_err(|e| Failure::new("invalid-option", e).into_py_err(py))
}

/// Reads a plan (`from_format`: `json` or `pb`) through `ir::plan` and writes it in
/// `to_format`: the one reader of plan files, the CLI's.
#[pyfunction]
fn convert_plan<'py>(
    py: Python<'py>,
    data: &[u8],
    from_format: &str,
    to_format: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let converted = (|| -> Result<Vec<u8>, Failure> {
        let (from, to) = (plan_format(from_format)?, plan_format(to_format)?);
        let (plan, names) = Plan::decode(data, from)?;
        Ok(plan.encode(&names, to))
    })();
    match converted {
        Ok(bytes) => Ok(PyBytes::new(py, &bytes)),
        Err(f) => Err(f.into_py_err(py)),
    }
}

/// The collective `op` (`namespace.name.overload`) is by the planner's op knowledge:
/// `"functional"`, `"mutating"`, or `None` for an op that is no collective. The exporter
/// records this in each node's schema, so both sides read one rule.
#[pyfunction]
fn collective_kind(op: &str) -> Option<&'static str> {
    ir::ops::lookup(op).collective.map(|kind| match kind {
        CollectiveKind::Functional => "functional",
        CollectiveKind::Mutating => "mutating",
    })
}

/// What every declared marker interval of every layer run encloses, by the planner's own
/// marker walk: `(model, layer, micro_batch, begin, end, [node names])` per layer run and
/// interval, in walk order. An interval that opened and enclosed nothing has an empty list.
#[pyfunction]
#[pyo3(signature = (*, data, format, origin))]
fn interval_contents(
    py: Python<'_>,
    data: &[u8],
    format: &str,
    origin: &str,
) -> PyResult<Vec<IntervalRow>> {
    let listed = (|| -> Result<Vec<IntervalRow>, Failure> {
        let source = Source::Bytes {
            data,
            format: graph_format(format)?,
            origin: PathBuf::from(origin),
        };
        let graph = source.load()?;
        Ok(policy::interval_contents(&graph)
            .into_iter()
            .map(|contents| {
                let names = contents.nodes.iter();
                (
                    graph.model(contents.site.at.model).name.clone(),
                    contents.site.at.layer,
                    contents.site.micro_batch,
                    contents.begin.to_owned(),
                    contents.end.to_owned(),
                    names.map(|&id| graph.node(id).name.to_string()).collect(),
                )
            })
            .collect())
    })();
    listed.map_err(|f| f.into_py_err(py))
}

/// What the package's `planner` says to `planner run` and `planner calibrate`: running a plan
/// links libtorch, which the Python package does not.
const NO_RUNTIME: &str = "the Python package's `planner` has no runtime: `planner run` and \
    `planner calibrate` are in the Rust build with libtorch (`cargo build --release -p \
    planner-cli --features run`, then `target/release/planner run ...`; docs/runtime.md); from \
    Python, `recompute_planner.calibrate(device, out=PATH)` writes a profile `--hw` reads";

/// The `planner` command line (`argv`, the program name first, each argument's bytes as
/// `os.fsencode` gives them), as the `planner` console script runs it: its output goes to the
/// process's stdout and stderr, and it returns the exit status. The process is meant to end next: a command leaves its graph and plan to the OS
/// instead of freeing them.
#[pyfunction]
fn planner_main(py: Python<'_>, argv: Vec<Vec<u8>>) -> u8 {
    use std::{ffi::OsString, os::unix::ffi::OsStringExt};
    py.detach(|| {
        planner_commands::main(
            argv.into_iter().map(OsString::from_vec),
            planner_commands::Runtime::Absent(NO_RUNTIME),
        )
    })
}

/// One row of [`interval_contents`].
type IntervalRow = (String, u32, u32, String, String, Vec<String>);

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_class::<PlannedGraph>()?;
    m.add_class::<WireGraph>()?;
    m.add_function(wrap_pyfunction!(fx::build_fx_graph, m)?)?;
    m.add_function(wrap_pyfunction!(convert_plan, m)?)?;
    m.add_function(wrap_pyfunction!(read_plan_file, m)?)?;
    m.add_function(wrap_pyfunction!(collective_kind, m)?)?;
    m.add_function(wrap_pyfunction!(interval_contents, m)?)?;
    m.add_function(wrap_pyfunction!(hw_profile, m)?)?;
    m.add_function(wrap_pyfunction!(calibration_benchmarks, m)?)?;
    m.add_function(wrap_pyfunction!(fit_calibration, m)?)?;
    m.add_function(wrap_pyfunction!(planner_main, m)?)?;
    m.add("SPELLED_OPTIONS", spelled_options())?;
    m.add("SPELLED_LIST_OPTIONS", spelled_list_options())?;
    m.add("DEFAULT_OFFLOAD_PREFETCH", Offload::DEFAULT_PREFETCH)?;
    m.add("MARKER_OP", ir::MARKER_OP)?;
    m.add("MARKER_NAME_ATTR", ir::MARKER_NAME_ATTR)?;
    m.add("PLANNER_VERSION", ir::plan::PLANNER_VERSION)?;
    // Whether this extension is an optimised build (debug assertions off): in-process timings
    // depend on it (`scripts/compare_partitioner.py` reports it).
    m.add("OPTIMIZED", !cfg!(debug_assertions))?;
    // The descriptors of graph.proto and plan.proto as the Rust side compiled them: the
    // package builds its protobuf modules from these (recompute_planner.proto), so they match
    // the planner's schema exactly and need no protoc.
    m.add(
        "DESCRIPTORS",
        [
            (
                "graph_pb2",
                PyBytes::new(m.py(), ir::wire::GRAPH_DESCRIPTOR),
            ),
            ("plan_pb2", PyBytes::new(m.py(), ir::wire::PLAN_DESCRIPTOR)),
        ],
    )?;
    Ok(())
}
