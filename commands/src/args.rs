//! The command line's arguments: every option documented, every number range-checked when it
//! is parsed (a value out of range is a usage error, exit 2, however it is spelled).

use std::path::{Path, PathBuf};

use clap::{
    builder::{PossibleValue, PossibleValuesParser, TypedValueParser},
    Args, Parser, Subcommand, ValueEnum,
};
use ir::plan::{
    Code, Collectives, Executor, Offload, Optimizer, RandomOps, SavedKind, Spelled, StateDtype,
    Training,
};
use planner::{
    budget::Granularity,
    config::{self, PlanConfig},
    state::BudgetBasis,
};

#[derive(Parser)]
#[command(
    name = "planner",
    version,
    about = "Static planner for selective activation checkpointing of PyTorch training graphs",
    long_about = "Static planner for selective activation checkpointing of PyTorch training \
graphs.\n\nIt reads a training step exported to the project's IR (`.pb` or `.json`), decides per \
forward op what is saved and what is recomputed in backward, predicts peak memory and replay \
cost, and reports every way a checkpointing configuration silently fails. See docs/ for the \
rules, the plan format and the diagnostics."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Plan selective checkpointing: per-op decisions, saved set, replay, memory, diagnostics
    Plan(PlanArgs),
    /// Per-node changes between two plans; exits 1 on decision changes
    Diff(DiffArgs),
    /// The peak-memory / replay-time trade-off: every configuration on the frontier
    Pareto(ParetoArgs),
    /// Summarise a graph: models, layers, markers, units, compiled regions, ops
    Inspect(InspectArgs),
    /// Convert a graph between `.pb` and `.json` (by extension), losslessly
    Convert(ConvertArgs),
    /// Execute one training step of a plan with libtorch and prove it (`--check`); needs a
    /// build with `--features run`
    Run(Box<RunArgs>),
    /// Measure this device's op rates and overheads with the runtime: a profile for `--hw`;
    /// needs a build with `--features run`
    ///
    /// Launched as a job's ranks are (`torchrun --no-python ... planner calibrate -o FILE`),
    /// it times collectives through the launched gloo group (CPU; a CUDA launch is refused
    /// for now) and every other op while all ranks share the machine, as they will in
    /// `planner run`; rank 0 writes the profile.
    Calibrate(Box<CalibrateArgs>),
}

/// The options that shape a plan besides `--keep`, shared by `plan` and `pareto`.
#[derive(Args)]
pub struct Planning {
    /// Checkpoint the layers with index < floor(RATIO × layers) of each model (0 to 1)
    #[arg(
        long,
        value_name = "RATIO",
        default_value_t = 1.0,
        value_parser = ratio,
        allow_negative_numbers = true
    )]
    pub recompute_ratio: f64,
    /// Whether functional collectives and device-to-host syncs re-run in replay or are saved
    #[arg(long, value_parser = spelled::<Collectives>(), default_value_t)]
    collectives: Collectives,
    /// Random ops (dropout) in checkpointed layers: saved, or replayed with the generator
    /// state forward saw (the executor must restore it)
    #[arg(long, value_parser = spelled::<RandomOps>(), default_value_t)]
    random_ops: RandomOps,
    /// What will run the plan: a graph executor (graph: the runtime) replays exactly what
    /// backward needs; compiled: the torch.compile stage, a graph executor without unit markers;
    /// eager torch.utils.checkpoint re-runs each layer's forward prefix
    #[arg(long, value_parser = spelled::<Executor>(), default_value_t)]
    executor: Executor,
    /// Hardware profile for cost estimates: a shipped one (h100, h200, b200, mi300x: vendor
    /// datasheet figures) or a JSON file whose fields left out keep the H200's [default: h200]
    #[arg(long, value_name = "NAME|FILE.json")]
    pub hw: Option<PathBuf>,
    /// FSDP shard degree: parameters, gradients and optimizer state split N ways in the device
    /// total, plus the unsharded parameters and gradients being gathered and reduced (1 to
    /// 65536; 1: unsharded)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..=65536),
        allow_negative_numbers = true
    )]
    fsdp: u32,
    /// The optimizer whose state the device total counts: AdamW (two moments), SGD with
    /// momentum (one buffer), or none
    #[arg(long, value_parser = spelled::<Optimizer>(), default_value_t)]
    optimizer: Optimizer,
    /// The element type of the optimizer state: fp32, or the parameter's dtype (as
    /// `torch.optim` on bf16 parameters)
    #[arg(long, value_parser = spelled::<StateDtype>(), default_value_t)]
    optimizer_state_dtype: StateDtype,
    /// Count an fp32 master copy of every parameter that is not fp32 (mixed precision)
    #[arg(long)]
    master_weights: bool,
}

impl Planning {
    /// The planning options as a configuration keeping nothing (`--keep` is the caller's).
    pub fn config(&self) -> PlanConfig {
        PlanConfig {
            recompute_ratio: self.recompute_ratio,
            collectives: self.collectives,
            random_ops: self.random_ops,
            executor: self.executor,
            training: Training {
                fsdp: self.fsdp,
                optimizer: self.optimizer,
                state_dtype: self.optimizer_state_dtype,
                master_weights: self.master_weights,
            },
            ..PlanConfig::default()
        }
    }
}

/// `--offload`, `--offload-kinds` and `--offload-prefetch`, shared by `plan` and `run`.
#[derive(Args)]
pub struct Offloading {
    /// Kept units whose saved values go to host memory after their last forward read and come
    /// back before backward reads them (case-insensitive; each must be kept by --keep)
    #[arg(long, value_name = "UNITS")]
    pub offload: Vec<String>,
    /// Saved kinds to offload wherever they are (comma-separated or repeated)
    #[arg(long, value_name = "KINDS", value_delimiter = ',', value_parser = spelled::<SavedKind>())]
    pub offload_kinds: Vec<SavedKind>,
    #[command(flatten)]
    pub prefetch: Prefetch,
}

/// `--offload-prefetch`, shared by `plan`, `run` and `pareto`.
#[derive(Args)]
pub struct Prefetch {
    /// How many backward steps (replayed or backward ops) before its first backward read an
    /// offloaded value's reload starts: more hides a larger copy, and holds the value longer
    #[arg(
        long,
        value_name = "N",
        default_value_t = Offload::DEFAULT_PREFETCH,
        value_parser = clap::value_parser!(u32).range(0..=1_000_000)
    )]
    pub offload_prefetch: u32,
}

impl Offloading {
    /// The offload configuration these options ask for.
    pub fn config(&self) -> Result<Offload, String> {
        Ok(Offload {
            units: config::parse_offload_units(&self.offload).map_err(|e| e.to_string())?,
            kinds: self.offload_kinds.clone(),
            prefetch: self.prefetch.offload_prefetch,
        })
    }
}

#[derive(Args)]
pub struct PlanArgs {
    /// The graph (`.pb` or `.json`)
    pub graph: PathBuf,
    /// Units to keep: `none` (default: whole-layer recompute), `all`, or names such as
    /// `save_attn,save_dsa_indexer` (case-insensitive; repeatable)
    #[arg(long, value_name = "UNITS")]
    pub keep: Vec<String>,
    #[command(flatten)]
    pub planning: Planning,
    #[command(flatten)]
    pub offloading: Offloading,
    /// Choose the units per layer that minimise replay time with the activation peak within
    /// SIZE (e.g. `40GiB`; the activation peak unless --budget-includes says more); replaces
    /// --keep; takes no --offload or --offload-kinds (--budget-offload lets it offload)
    #[arg(
        long,
        value_name = "SIZE",
        conflicts_with_all = ["keep", "choices", "offload", "offload_kinds"],
        value_parser = size,
        allow_hyphen_values = true
    )]
    pub budget: Option<u64>,
    /// What --budget bounds: the activation peak, with the parameters, or the whole training
    /// state on one device (parameters, gradients, optimizer state: the device total)
    #[arg(long, value_parser = spelled::<BudgetBasis>(), default_value_t, requires = "budget")]
    pub budget_includes: BudgetBasis,
    /// With --budget: choose whole units per layer, or also single ops
    #[arg(long, value_parser = spelled::<Granularity>(), default_value_t, requires = "budget")]
    pub granularity: Granularity,
    /// With --budget: also choose, per layer, which kept units' saved values and whether the
    /// layer's inputs go to host memory (--offload-prefetch applies), where that fits the
    /// budget with less replay plus exposed transfer time than recomputing, or below what
    /// recomputing alone reaches; whole units only (--granularity unit)
    #[arg(long, requires = "budget")]
    pub budget_offload: bool,
    /// Keep per layer the units a `pareto --format json` point (or a plan's JSON) lists in its
    /// `layer_keep`, and offload what its `layer_offload` lists (units, and layer inputs where
    /// `layer_input` is true); other layers follow --keep
    #[arg(long, value_name = "FILE.json")]
    pub choices: Option<PathBuf>,
    /// Output format [default: from the -o extension (.json, .pb, .dot), else text]
    #[arg(long, value_enum)]
    pub format: Option<PlanFormat>,
    /// Write the plan to FILE instead of stdout (never onto an input)
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Exit 3 when the plan has warnings
    #[arg(long)]
    pub deny_warnings: bool,
    /// With --deny-warnings: waive warnings of this code (repeatable)
    #[arg(long, value_name = "CODE", value_parser = code, requires = "deny_warnings")]
    pub allow: Vec<Code>,
    /// No progress bar on the terminal during --budget
    #[arg(long, short)]
    pub quiet: bool,
}

impl PlanArgs {
    /// An option that only means something under `--budget`, given without it. clap checks
    /// their `requires = "budget"` only when no option `--budget` conflicts with is given
    /// (`--keep`, `--choices`, `--offload`); an option at its default value cannot be told
    /// from one not given, and passes.
    pub fn budget_option_without_budget(&self) -> Option<&'static str> {
        if self.budget.is_some() {
            return None;
        }
        [
            (self.budget_offload, "--budget-offload"),
            (self.granularity != Granularity::default(), "--granularity"),
            (
                self.budget_includes != BudgetBasis::default(),
                "--budget-includes",
            ),
        ]
        .into_iter()
        .find_map(|(given, option)| given.then_some(option))
    }

    /// The files the command reads, which no output may overwrite.
    pub fn inputs(&self) -> Vec<&Path> {
        let mut inputs = vec![self.graph.as_path()];
        inputs.extend(self.planning.hw.as_deref());
        inputs.extend(self.choices.as_deref());
        inputs
    }
}

#[derive(Args)]
pub struct ParetoArgs {
    /// The graph (`.pb` or `.json`)
    pub graph: PathBuf,
    #[command(flatten)]
    pub planning: Planning,
    /// Budgets tried between keeping nothing and keeping everything on large searches
    /// (1 to 4096)
    #[arg(
        long,
        default_value_t = 32,
        value_parser = clap::value_parser!(u64).range(1..=4096),
        allow_negative_numbers = true
    )]
    pub steps: u64,
    /// Also offer each point with part or all of its kept units and layer inputs offloaded to
    /// host memory (per layer, earliest layers first; --offload-prefetch applies), time then
    /// being replay plus exposed transfer time
    #[arg(long)]
    pub with_offload: bool,
    #[command(flatten)]
    pub prefetch: Prefetch,
    /// Output format [default: from the -o extension (.json, .svg), else text]
    #[arg(long, value_enum)]
    pub format: Option<ParetoFormat>,
    /// Write to FILE instead of stdout (never onto an input)
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// No progress bar on the terminal
    #[arg(long, short)]
    pub quiet: bool,
}

impl ParetoArgs {
    pub fn inputs(&self) -> Vec<&Path> {
        let mut inputs = vec![self.graph.as_path()];
        inputs.extend(self.planning.hw.as_deref());
        inputs
    }
}

#[derive(Args)]
pub struct DiffArgs {
    /// The plan to compare against (`.json` or `.pb`)
    pub old: PathBuf,
    /// The new plan (`.json` or `.pb`)
    pub new: PathBuf,
    /// Exit 1 on reason-only changes too (same decision, another reason or unit)
    #[arg(long)]
    pub strict: bool,
}

#[derive(Args)]
pub struct InspectArgs {
    /// The graph (`.pb` or `.json`)
    pub graph: PathBuf,
    /// Output format
    #[arg(long, value_enum, default_value_t = SummaryFormat::Text)]
    pub format: SummaryFormat,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// The graph to read (`.pb` or `.json`)
    pub input: PathBuf,
    /// The file to write, in the format its extension names (`.json` or `.pb`)
    pub output: PathBuf,
    /// Convert even a graph that does not validate (to read a broken file as JSON)
    #[arg(long)]
    pub no_validate: bool,
}

/// `planner run`'s arguments. Every build parses them, so `planner run --help` is the same
/// with and without the runtime; only a build with the `run` feature runs the step (in the
/// runtime library, which parses them again).
#[derive(Args)]
pub struct RunArgs {
    /// Graph file (`.pb` or `.json`) of a joint (forward+backward) or forward graph
    pub graph: PathBuf,
    /// A plan made for this graph (`.json` or `.pb`); without it the step is planned here
    /// from the planning flags
    #[arg(
        long,
        value_name = "PLAN",
        conflicts_with_all = [
            "keep", "recompute_ratio", "collectives", "random_ops",
            "offload", "offload_kinds", "offload_prefetch",
        ]
    )]
    pub plan: Option<PathBuf>,
    /// Units to keep (as for `planner plan`): `none` (default), `all`, or unit names
    #[arg(long, value_name = "UNITS")]
    pub keep: Vec<String>,
    #[command(flatten)]
    pub planning: Planning,
    #[command(flatten)]
    pub offloading: Offloading,
    /// `cpu`, `cuda` or `cuda:N` (with several ranks on CUDA, rank r uses the r-th GPU after N)
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Ranks to run as threads of this process (default: the graph's world size)
    #[arg(long, value_name = "N")]
    pub ranks: Option<usize>,
    /// Also run without checkpointing and with whole-layer recompute: results must be
    /// bit-identical (CPU) and within tolerance of PyTorch's reference
    #[arg(long)]
    pub check: bool,
    /// Output format
    #[arg(long, value_enum, default_value_t = SummaryFormat::Text)]
    pub format: SummaryFormat,
    /// Rank 0's weights, inputs and tangents (default: the graph's `.safetensors` twin); rank r
    /// reads `STEM.rank<r>.safetensors` beside it
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<PathBuf>,
    /// Fill inputs the safetensors file does not hold from this seed
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seconds a rank waits in a collective before it declares the others failed, and the
    /// longest any one op may run (at most 1e9)
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    pub timeout: f64,
    /// Steps each variant runs: outputs and memory are the first step's, times the median of
    /// all of them (3 or more hide the first step's one-time costs)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// On the CPU, leave glibc's allocator as it is: large freed blocks go back to the kernel,
    /// and each step pays a page fault per 4 KiB of them when it touches them again. By
    /// default the run keeps the memory it obtained, as a GPU's caching allocator keeps its
    /// blocks, so that steps after the first measure the ops rather than the kernel
    #[arg(long)]
    pub release_cpu_memory: bool,
    /// The most bytes of weights, inputs and tangents all ranks start from together (as the
    /// graphs declare them, checked before anything is read or filled), and the largest
    /// safetensors file read (`16GiB`, `512MB`; default: this machine's memory)
    #[arg(long, value_name = "SIZE", value_parser = planner::units::parse_bytes)]
    pub max_input_bytes: Option<u64>,
    /// Inject a failure to test fault handling: `fail:RANK:COLLECTIVE`, `panic:RANK:COLLECTIVE`
    /// or `stall:RANK:COLLECTIVE:SECONDS` (before that rank's COLLECTIVE-th collective, from 0)
    #[arg(long, value_name = "FAULT", hide = true)]
    pub inject_fault: Option<String>,
}

/// `planner calibrate`'s arguments, parsed by every build as `run`'s are.
#[derive(Args)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON, as `--hw FILE` and `hw=` read it; default: stdout)
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N`
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Steps each benchmark runs; its time is their median
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(3..=1000))]
    pub repeat: u32,
    /// The profile's name (default: `calibrated <device>`)
    #[arg(long)]
    pub name: Option<String>,
    /// The profile whose figures stand for what is not measured (fp64 and fp8 matmuls, device
    /// memory on a GPU): a shipped name or a file
    #[arg(long, value_name = "PROFILE", default_value = "h200")]
    pub base: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SummaryFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanFormat {
    Text,
    Json,
    Pb,
    Dot,
}

impl PlanFormat {
    /// The format a file name's extension names, if any.
    pub fn of_path(path: &Path) -> Option<PlanFormat> {
        match path.extension()?.to_str()? {
            "json" => Some(PlanFormat::Json),
            "pb" => Some(PlanFormat::Pb),
            "dot" | "gv" => Some(PlanFormat::Dot),
            "txt" => Some(PlanFormat::Text),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ParetoFormat {
    Text,
    Json,
    Svg,
}

impl ParetoFormat {
    pub fn of_path(path: &Path) -> Option<ParetoFormat> {
        match path.extension()?.to_str()? {
            "json" => Some(ParetoFormat::Json),
            "svg" => Some(ParetoFormat::Svg),
            "txt" => Some(ParetoFormat::Text),
            _ => None,
        }
    }
}

/// The value parser of an option spelled by a [`Spelled`] enumeration, the one definition of
/// its spellings: they are the possible values, each variant's doc comment their help.
fn spelled<T: Spelled>() -> impl TypedValueParser<Value = T> {
    let values = T::ALL
        .iter()
        .map(|&variant| PossibleValue::new(variant.name()).help(one_line(variant.help())));
    PossibleValuesParser::new(values)
        .try_map(|name: String| T::from_name(&name).ok_or("not one of the spellings"))
}

/// A doc comment as one line of help, without its closing full stop (clap's style).
fn one_line(doc: &str) -> String {
    let words: Vec<&str> = doc.split_whitespace().collect();
    words.join(" ").trim_end_matches('.').to_owned()
}

/// `--recompute-ratio`: a number from 0 to 1.
fn ratio(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    planner::config::check_ratio(value).map_err(|e| e.to_string())
}

/// `--budget`: a size such as `40GiB`.
fn size(text: &str) -> Result<u64, String> {
    planner::units::parse_bytes(text)
}

/// `--allow`: a diagnostic code.
fn code(text: &str) -> Result<Code, String> {
    Code::from_name(text).ok_or_else(|| {
        format!(
            "unknown diagnostic code `{text}` (codes: {})",
            Code::spellings()
        )
    })
}
