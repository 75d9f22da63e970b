//! The recompute plan as data: what the planner decided for one graph, in the one typed form
//! every consumer shares (the CLI's renderers, `diff`, the budget search, the runtime and the
//! Python package).
//!
//! A [`Plan`] refers to the graph it was made for by typed ids; names appear only at the
//! output edge. Its writers ([`json`], [`wire`]) take the ids' names from a [`PlanNames`] (the
//! [`Graph`] itself); its readers return the plan with a [`NameTable`] of the names the file
//! holds, and [`Plan::resolve`] re-binds those to the ids of a graph, after checking that the
//! plan was made for that graph.

mod enums;
pub mod json;
mod names;
pub mod wire;

use std::path::Path;

pub use enums::{
    Code, Collectives, Decision, DevicePhase, Executor, Level, Optimizer, RandomOps, Reason,
    SavedKind, Spelled, Stage, StateDtype,
};
pub use names::{NameTable, PlanNames};
use thiserror::Error;

use crate::{Graph, ModelId, NodeId, UnitId, ValueId};

/// The version of the planner that writes plans (the workspace version).
pub const PLANNER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// A recompute plan for one graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub planner_version: String,
    pub graph: GraphRef,
    pub config: Config,
    /// False for a forward-only graph, which gets decisions and diagnostics but no partition.
    pub joint: bool,
    /// One per forward node, in execution order.
    pub nodes: Vec<NodeDecision>,
    /// The values that stay resident for backward, in value order.
    pub saved: Vec<SavedValue>,
    /// Per checkpointed layer, the forward nodes backward re-executes, in schedule order.
    pub replay: Vec<Replay>,
    /// Per kept unit: what it keeps, by layer.
    pub units: Vec<UnitSummary>,
    pub memory: Memory,
    pub cost: Cost,
    pub diagnostics: Vec<Diagnostic>,
}

/// The graph a plan was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphRef {
    pub name: String,
    /// A plan is refused on a graph with another fingerprint.
    pub fingerprint: String,
}

/// `--keep`: tri-state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// No `--keep`, or `--keep none`: keep nothing anywhere, nested models included; this is
    /// whole-layer recompute.
    Nothing,
    /// `--keep all`: every unit each model declares.
    All,
    /// Exactly these units (upper-case, deduplicated, in the order given).
    Units(Vec<String>),
}

impl Keep {
    /// The names as a plan records them: `[]` for nothing, `["ALL"]` for all.
    pub fn names(&self) -> Vec<String> {
        match self {
            Keep::Nothing => Vec::new(),
            Keep::All => vec![Keep::ALL.to_owned()],
            Keep::Units(units) => units.clone(),
        }
    }

    /// The inverse of [`Keep::names`].
    pub fn from_names(names: Vec<String>) -> Keep {
        match names.as_slice() {
            [] => Keep::Nothing,
            [one] if one == Keep::ALL => Keep::All,
            _ => Keep::Units(names),
        }
    }

    const ALL: &'static str = "ALL";
}

/// What shaped the plan besides the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub keep: Keep,
    /// Layers with index `< floor(ratio × num_layers)` of each model are checkpointed.
    pub recompute_ratio: f64,
    pub collectives: Collectives,
    pub random_ops: RandomOps,
    pub executor: Executor,
    /// `--budget` in bytes, when the units were chosen per layer to fit it.
    pub budget_bytes: Option<u64>,
    /// Per-layer unit choices that replace `keep` in their layers (the budget solver's, or
    /// `plan --choices`); empty when `keep` applies everywhere.
    pub layer_keep: Vec<LayerKeep>,
    pub training: Training,
    pub offload: Offload,
    /// Per-layer offload choices that replace `offload.units` in their layers: the kept units
    /// whose saved values go to host memory there, and whether the layer's output does (the
    /// budget solver's under `--budget-offload`, or `plan --choices`); empty when
    /// `offload.units` applies everywhere.
    pub layer_offload: Vec<LayerOffload>,
}

/// `--offload`, `--offload-kinds`, `--offload-prefetch`: which saved values the executor moves
/// to host memory after their last forward read, and how early backward brings them back
/// (docs/cost-and-memory.md, M5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offload {
    /// Kept units whose saved values go to the host (upper-case, deduplicated, in the order
    /// given).
    pub units: Vec<String>,
    /// Saved kinds that go to the host wherever they are.
    pub kinds: Vec<SavedKind>,
    /// Backward steps (replayed or backward ops) before its first backward read that a value's
    /// reload starts.
    pub prefetch: u32,
}

impl Offload {
    /// Four backward steps: enough compute to hide a layer input's reload on the shipped GPU
    /// profiles at modest widths, while holding the reloaded value only briefly.
    pub const DEFAULT_PREFETCH: u32 = 4;

    /// Whether anything is to be offloaded.
    pub fn is_asked(&self) -> bool {
        !self.units.is_empty() || !self.kinds.is_empty()
    }
}

impl Default for Offload {
    fn default() -> Self {
        Offload {
            units: Vec::new(),
            kinds: Vec::new(),
            prefetch: Offload::DEFAULT_PREFETCH,
        }
    }
}

/// The training state the device holds beside the step's activations (docs/cost-and-memory.md,
/// M4): `--fsdp`, `--optimizer`, `--optimizer-state-dtype`, `--master-weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Training {
    /// FSDP shard degree: parameters, gradients and optimizer state split this many ways
    /// (1: unsharded). Never 0.
    pub fsdp: u32,
    pub optimizer: Optimizer,
    pub state_dtype: StateDtype,
    /// An fp32 copy of every parameter that is not fp32 or fp64.
    pub master_weights: bool,
}

impl Default for Training {
    fn default() -> Self {
        Training {
            fsdp: 1,
            optimizer: Optimizer::default(),
            state_dtype: StateDtype::default(),
            master_weights: false,
        }
    }
}

/// One decoder layer of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerRef {
    pub model: ModelId,
    pub layer: u32,
}

/// Units of one layer: those it keeps (`layer_keep`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerKeep {
    pub at: LayerRef,
    /// In the model's declaration order.
    pub units: Vec<UnitId>,
}

/// What one layer moves to host memory (`layer_offload`): the saved values of kept units, and
/// its layer inputs (saved kind `layer-input` made in this layer: its output, which the next
/// checkpointed layer saves as its input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerOffload {
    pub at: LayerRef,
    /// In the model's declaration order.
    pub units: Vec<UnitId>,
    pub layer_input: bool,
}

/// The policy's verdict on one forward node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeDecision {
    pub node: NodeId,
    pub model: ModelId,
    pub layer: Option<u32>,
    pub decision: Decision,
    pub reason: Reason,
    /// The unit that kept the op (only for decision [`Decision::Save`] by a unit).
    pub unit: Option<UnitId>,
    /// Whether an output of the op is offloaded (a [`SavedValue::offloaded`]).
    pub offloaded: bool,
}

/// A value resident for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedValue {
    pub value: ValueId,
    /// The value whose storage this one shares (it is a view of it, or the result of an
    /// in-place write to it); its bytes are that storage's, counted once.
    pub alias_of: Option<ValueId>,
    pub bytes: u64,
    /// The producer's model and layer; `None` for graph inputs.
    pub model: Option<ModelId>,
    pub layer: Option<u32>,
    pub kind: SavedKind,
    /// In host memory between its last forward read and its reload, not on the device.
    pub offloaded: bool,
}

/// The forward nodes one checkpointed layer re-executes in backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub at: LayerRef,
    /// In execution order.
    pub nodes: Vec<NodeId>,
    /// The backward node this replay runs just before: the first that needs (directly, or
    /// through a later replayed op) a value it produces. A layer's replay may come in several
    /// such steps.
    pub before: NodeId,
    /// Estimated seconds of this replay.
    pub seconds: f64,
}

/// What one kept unit of one model keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSummary {
    pub model: ModelId,
    pub unit: UnitId,
    pub kept_ops: u64,
    /// Bytes of kept outputs that backward needs.
    pub saved_bytes: u64,
    /// Estimated replay time whole-layer recompute would spend on the ops this unit keeps.
    pub replay_time_avoided_s: f64,
    pub layers: Vec<UnitLayer>,
}

/// Serialized as it is in the plan's JSON (`json.rs`): its fields are the proto's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct UnitLayer {
    pub layer: u32,
    pub kept_ops: u64,
    pub saved_bytes: u64,
}

/// Peak memory of the step; peaks need a joint graph and are `None` for a forward-only one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// Peak live bytes of the step under this plan (parameters excluded).
    pub peak_bytes: Option<u64>,
    /// Activation bytes saved for backward (parameters, graph inputs and views of them
    /// excluded).
    pub saved_bytes: u64,
    pub no_checkpoint_peak_bytes: Option<u64>,
    pub full_recompute_peak_bytes: Option<u64>,
    /// Where the plan's peak is.
    pub peak: Option<Peak>,
    /// Resident for the whole step, not part of the peaks.
    pub parameter_bytes: u64,
    /// Gradients the step outputs (part of the peaks when the peak is at the end).
    pub gradient_bytes: u64,
    /// The whole training state on one device; `None` for a forward-only graph.
    pub device: Option<DeviceTotal>,
    /// Bytes of the offloaded storages (each once), and the most of them in host memory at
    /// once.
    pub offloaded_bytes: u64,
    pub host_peak_bytes: u64,
    /// The hardware profile's host memory, which the host peak is compared with.
    pub host_memory_bytes: u64,
    /// The saved activation bytes on the device when forward ends: `saved_bytes` less the
    /// offloaded storages that have left it by then (one a checkpoint's frame holds to its
    /// recompute leaves in backward).
    pub saved_on_device_bytes: u64,
}

/// The peak bytes of one device over a training step (docs/cost-and-memory.md, M4): the
/// larger of the forward/backward total (parameters, optimizer state, master weights and the
/// peak of activations and gradients) and the optimizer step's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTotal {
    pub total_bytes: u64,
    pub phase: DevicePhase,
    /// Parameters held through forward and backward.
    pub parameter_bytes: u64,
    /// The peak of activations and gradients: the plan's, or under FSDP the peak with the
    /// gradients sharded as they are reduce-scattered.
    pub activation_bytes: u64,
    pub optimizer_state_bytes: u64,
    pub master_weight_bytes: u64,
    /// The device total during the optimizer step.
    pub optimizer_step_bytes: u64,
    /// The hardware profile's memory.
    pub memory_bytes: u64,
}

impl DeviceTotal {
    /// Bytes left on the device (positive) or missing (negative).
    pub fn headroom(&self) -> i128 {
        i128::from(self.memory_bytes) - i128::from(self.total_bytes)
    }
}

/// The pass and the node running when memory peaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peak {
    pub stage: Stage,
    pub node: NodeId,
}

/// What replay costs, on a hardware profile. Serialized as it is in the plan's JSON
/// (`json.rs`): its fields are the proto's.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct Cost {
    pub replay_flops: u64,
    pub replay_bytes: u64,
    pub replay_comm_bytes: u64,
    pub replay_time_s: f64,
    /// Replay time of whole-layer recompute, for comparison.
    pub full_recompute_replay_time_s: f64,
    /// The forward and backward passes of the step, replay aside.
    pub forward_time_s: f64,
    pub backward_time_s: f64,
    /// The whole step: forward, replay and backward.
    pub step_time_s: f64,
    /// Host synchronisations replay re-runs (copies to the host, scalar reads).
    pub replay_host_syncs: u64,
    /// Copies of offloaded values to the host and back, in total, and the part of them that
    /// compute does not hide (included in `step_time_s`).
    pub transfer_time_s: f64,
    pub exposed_transfer_time_s: f64,
    /// The hardware profile the times assume.
    pub hw: String,
}

/// One way the configuration fails to do what the user asked.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Diagnostic {
    pub level: Level,
    pub code: Code,
    pub model: ModelId,
    pub unit: Option<UnitId>,
    /// Why, without a trailing period.
    pub message: String,
    /// What to do.
    pub hint: String,
}

/// A plan used with a graph it was not made for.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "the plan was made for graph `{}` ({}), not for `{}` ({}): re-plan this graph",
    crate::display::name(.plan_graph),
    crate::display::name(.plan_fingerprint),
    crate::display::name(.graph),
    crate::display::name(.fingerprint)
)]
pub struct GraphMismatch {
    pub plan_graph: String,
    pub plan_fingerprint: String,
    pub graph: String,
    pub fingerprint: String,
}

/// A plan file that cannot be read, or not for this graph.
#[derive(Debug, Error)]
pub enum PlanReadError {
    #[error("{}: unknown plan format: expected a `.json` or `.pb` plan", crate::display::name(.path))]
    UnknownFormat { path: String },
    #[error("{0}")]
    Load(#[from] crate::LoadError),
    #[error("not a valid protobuf plan ({})", crate::display::message(.0))]
    Protobuf(String),
    #[error("not a valid JSON plan: {}", crate::display::message(.0))]
    Json(String),
    #[error("the plan file is empty")]
    Empty,
    #[error("{field} `{}` is not one of: {expected}", crate::display::name(.value))]
    UnknownName {
        field: &'static str,
        value: String,
        expected: String,
    },
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    #[error("{what} has no {field}")]
    Missing {
        what: &'static str,
        field: &'static str,
    },
    #[error(transparent)]
    Mismatch(#[from] GraphMismatch),
    #[error(
        "the plan names {what} `{}`, which graph `{}` does not have",
        crate::display::name(.name),
        crate::display::name(.graph)
    )]
    Unresolved {
        what: &'static str,
        name: String,
        graph: String,
    },
    /// An error about the contents of the plan file at `path`.
    #[error("{}: {error}", crate::display::path(.path))]
    InFile {
        path: std::path::PathBuf,
        error: Box<PlanReadError>,
    },
}

impl PlanReadError {
    /// This error, naming the file it is about.
    fn in_file(self, path: &Path) -> PlanReadError {
        PlanReadError::InFile {
            path: path.to_owned(),
            error: Box::new(self),
        }
    }
}

/// The two encodings of a plan file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Protobuf,
}

impl Format {
    /// The format a path's extension names: `.json` or `.pb`.
    pub fn from_path(path: &Path) -> Option<Format> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => Some(Format::Json),
            Some("pb") => Some(Format::Protobuf),
            _ => None,
        }
    }
}

impl Plan {
    /// A plan applies only to the graph whose fingerprint it carries; consumers (the runtime,
    /// the torch integrations) call this before using it.
    pub fn check_graph(&self, graph: &Graph) -> Result<(), GraphMismatch> {
        if self.graph.fingerprint == graph.fingerprint() {
            return Ok(());
        }
        Err(GraphMismatch {
            plan_graph: self.graph.name.clone(),
            plan_fingerprint: self.graph.fingerprint.clone(),
            graph: graph.name().to_owned(),
            fingerprint: graph.fingerprint().to_owned(),
        })
    }

    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.level == Level::Error)
    }

    /// Reads a plan in `format` with the names it holds.
    pub fn decode(bytes: &[u8], format: Format) -> Result<(Plan, NameTable), PlanReadError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(PlanReadError::Empty);
        }
        let message = match format {
            Format::Json => json::decode(bytes)?,
            Format::Protobuf => wire::decode(bytes)?,
        };
        wire::from_wire(message)
    }

    /// Reads the plan file at `path` (`.json` or `.pb`) with the names it holds.
    pub fn read(path: &Path) -> Result<(Plan, NameTable), PlanReadError> {
        let format = Format::from_path(path).ok_or_else(|| PlanReadError::UnknownFormat {
            path: path.display().to_string(),
        })?;
        Plan::read_as(path, format)
    }

    /// Reads the plan file at `path` as `format`, whatever its extension: a regular file
    /// under the plan size limit ([`crate::io::read_input_file`]).
    pub fn read_as(path: &Path, format: Format) -> Result<(Plan, NameTable), PlanReadError> {
        let bytes = crate::io::read_input_file(path, crate::io::InputKind::Plan)?;
        Plan::decode(&bytes, format).map_err(|e| e.in_file(path))
    }

    /// Reads the plan file at `path` for `graph`: refused unless it was made for that graph.
    pub fn read_for(path: &Path, graph: &Graph) -> Result<Plan, PlanReadError> {
        let (plan, names) = Plan::read(path)?;
        plan.resolve(&names, graph).map_err(|e| e.in_file(path))
    }

    /// The bytes of this plan in `format`, its ids named by `names`.
    pub fn encode(&self, names: &dyn PlanNames, format: Format) -> Vec<u8> {
        match format {
            Format::Json => json::write(self, names),
            Format::Protobuf => wire::encode(self, names),
        }
    }
}
