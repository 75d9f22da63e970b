//! The `planner` command line (SPEC §8). Exit codes: 0 success (warnings allowed), 1 bad input
//! or configuration (`error: ...` on stderr) or, for `diff`, plans that differ, 2 usage, 3
//! `--deny-warnings` with warnings present.

use std::{fs, io::Write, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};

mod allocator;
#[cfg(feature = "run")]
mod run;

/// Loading and planning allocate millions of small strings and vectors: mimalloc does that
/// faster than the system allocator, above all across threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ir::plan::{Collectives, Format as PlanFile, Keep, Level, Plan};
use planner::{
    budget,
    config::{self, PlanConfig},
    convert,
    cost::HwProfile,
    diff, inspect, pareto, plan, render, units,
};

#[derive(Parser)]
#[command(
    name = "planner",
    version,
    about = "Static planner for selective activation checkpointing"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan selective checkpointing: per-op decisions, saved set, replay, diagnostics
    Plan(PlanArgs),
    /// Per-node changes between two plans (`.json` or `.pb`); exits 1 on decision changes
    Diff {
        /// The plan to compare against (`.json` or `.pb`)
        old: PathBuf,
        /// The new plan (`.json` or `.pb`)
        new: PathBuf,
        /// Exit 1 on reason-only changes too (same decision, another reason or unit)
        #[arg(long)]
        strict: bool,
    },
    /// The peak-memory / replay-time trade-off of every configuration on the frontier
    Pareto(ParetoArgs),
    /// Summarise a graph: models, layers, markers, units, compiled regions, ops
    Inspect {
        /// Graph file (`.pb` or `.json`)
        graph: PathBuf,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Convert a graph between `.pb` and `.json` (by extension), losslessly
    Convert {
        input: PathBuf,
        output: PathBuf,
        /// Convert even a graph that does not validate (to read a broken file as JSON)
        #[arg(long)]
        no_validate: bool,
    },
    /// Execute one training step of a plan with libtorch and prove it (`--check`)
    #[cfg(feature = "run")]
    Run(run::RunArgs),
    /// Not in this build: `run` needs the runtime (the `run` feature)
    #[cfg(not(feature = "run"))]
    #[command(hide = true)]
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        _args: Vec<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(clap::Args)]
struct PlanArgs {
    /// Graph file (`.pb` or `.json`)
    graph: PathBuf,
    /// Units to keep: `none` (default: whole-layer recompute), `all`, or names such as
    /// `save_attn,save_dsa_indexer` (case-insensitive; repeatable)
    #[arg(long, value_name = "UNITS")]
    keep: Vec<String>,
    /// Checkpoint layers with index < floor(RATIO × layers) of each model
    #[arg(long, value_name = "RATIO", default_value_t = 1.0)]
    recompute_ratio: f64,
    /// Whether functional collectives and device-to-host syncs re-run in replay or are saved
    #[arg(long, value_enum, default_value_t = CollectivesArg::Recompute)]
    collectives: CollectivesArg,
    #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
    format: PlanFormat,
    /// Write the plan to FILE instead of stdout
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    /// Exit 3 when the plan has warnings
    #[arg(long)]
    deny_warnings: bool,
    /// Hardware profile (JSON) for cost estimates; fields left out keep the H200 defaults
    #[arg(long, value_name = "FILE.json")]
    hw: Option<PathBuf>,
    /// Choose the units per layer that minimise replay time with the peak within SIZE
    /// (e.g. `40GiB`); replaces --keep
    #[arg(long, value_name = "SIZE", conflicts_with = "keep")]
    budget: Option<String>,
    /// With --budget: choose whole units per layer, or also single ops
    #[arg(long, value_enum, default_value_t = Granularity::Unit, requires = "budget")]
    granularity: Granularity,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Granularity {
    Unit,
    Op,
}

#[derive(clap::Args)]
struct ParetoArgs {
    /// Graph file (`.pb` or `.json`)
    graph: PathBuf,
    #[arg(long, value_name = "RATIO", default_value_t = 1.0)]
    recompute_ratio: f64,
    #[arg(long, value_enum, default_value_t = CollectivesArg::Recompute)]
    collectives: CollectivesArg,
    #[arg(long, value_name = "FILE.json")]
    hw: Option<PathBuf>,
    /// Budgets tried between keeping nothing and keeping everything
    #[arg(long, default_value_t = 32)]
    steps: u64,
    #[arg(long, value_enum, default_value_t = ParetoFormat::Text)]
    format: ParetoFormat,
    /// Write to FILE instead of stdout
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ParetoFormat {
    Text,
    Json,
    Svg,
}

#[derive(Clone, Copy, ValueEnum)]
enum CollectivesArg {
    Recompute,
    Save,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PlanFormat {
    Text,
    Json,
    Pb,
    Dot,
}

/// How a command ended, when not in plain success.
enum Failure {
    /// Exit 1 with `error: ...` on stderr.
    Error(String),
    /// Exit with this status; what needed saying was said.
    Status(u8),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Error(message)
    }
}

fn main() -> ExitCode {
    allocator::keep_freed_memory();
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Error(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Status(code)) => ExitCode::from(code),
    }
}

fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Plan(args) => run_plan(args),
        Command::Diff { old, new, strict } => run_diff(&old, &new, strict),
        Command::Pareto(args) => run_pareto(args),
        Command::Inspect { graph, format } => {
            let graph = ir::io::load(&graph).map_err(|e| e.to_string())?;
            let summary = inspect::summarize(&graph);
            skip_teardown(graph);
            let text = match format {
                Format::Text => inspect::render_text(&summary),
                Format::Json => {
                    let mut json = serde_json::to_string_pretty(&summary)
                        .map_err(|e| format!("cannot serialise the summary: {e}"))?;
                    json.push('\n');
                    json
                }
            };
            Ok(write_stdout(text.as_bytes())?)
        }
        Command::Convert {
            input,
            output,
            no_validate,
        } => Ok(convert::convert(&input, &output, !no_validate).map_err(|e| e.to_string())?),
        #[cfg(feature = "run")]
        Command::Run(args) => run::run_run(args),
        #[cfg(not(feature = "run"))]
        Command::Run { .. } => Err(Failure::Error(
            "this `planner` was built without the runtime: after `source scripts/env.sh`, \
             build it with `cargo build --release -p planner-cli --features run`"
                .to_owned(),
        )),
    }
}

fn run_plan(args: PlanArgs) -> Result<(), Failure> {
    // Configuration errors come before any other work (R2).
    let keep = config::parse_keep(&args.keep).map_err(|e| e.to_string())?;
    let recompute_ratio = config::check_ratio(args.recompute_ratio).map_err(|e| e.to_string())?;
    let budget = args.budget.as_deref().map(units::parse_bytes).transpose()?;
    let config = PlanConfig {
        keep,
        recompute_ratio,
        collectives: args.collectives.into(),
    };
    let hw = load_hw(args.hw.as_deref())?;
    let graph = ir::io::load(&args.graph).map_err(|e| e.to_string())?;
    let plan = match budget {
        Some(bytes) => {
            let search = budget::Search::new(&graph, &config, &hw).map_err(|e| e.to_string())?;
            let mut plan = match args.granularity {
                Granularity::Unit => search.within(bytes),
                Granularity::Op => search.within_ops(bytes),
            }
            .map_err(|e| e.to_string())?;
            plan.config.budget_bytes = Some(bytes);
            plan
        }
        None => plan::plan(&graph, &config, &hw).map_err(|e| e.to_string())?,
    };
    if plan.has_errors() {
        report_errors(&plan);
        return Err(Failure::Status(1));
    }
    let bytes = match args.format {
        PlanFormat::Text => render::text(&plan, &graph).into_bytes(),
        PlanFormat::Json => plan.encode(&graph, PlanFile::Json),
        PlanFormat::Pb => plan.encode(&graph, PlanFile::Protobuf),
        PlanFormat::Dot => render::dot(&graph, &plan).into_bytes(),
    };
    match &args.output {
        Some(path) => {
            fs::write(path, &bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?
        }
        None => write_stdout(&bytes)?,
    }
    if args.format != PlanFormat::Text || args.output.is_some() {
        report_warnings(&plan);
    }
    let denied = args.deny_warnings && plan.has_warnings();
    skip_teardown((graph, plan));
    if denied {
        eprintln!("error: the plan has warnings and --deny-warnings is set");
        return Err(Failure::Status(3));
    }
    Ok(())
}

/// The process exits next, and the OS takes its memory back at once: freeing a million-node
/// graph and its plan one allocation at a time would add a tenth of the run.
fn skip_teardown<T>(done: T) {
    std::mem::forget(done);
}

/// An error diagnostic rejects the configuration: say so on stderr, one block per error.
fn report_errors(plan: &Plan) {
    for d in plan.diagnostics.iter().filter(|d| d.level == Level::Error) {
        eprintln!("error: {}: {}", d.code, d.message);
        eprintln!("  hint: {}", d.hint);
    }
}

/// When the plan goes to a file or a machine format, warnings still reach the human.
fn report_warnings(plan: &Plan) {
    for d in plan.diagnostics.iter().filter(|d| d.level != Level::Error) {
        eprintln!("{}[{}]: {}", d.level, d.code, d.message);
    }
}

fn run_pareto(args: ParetoArgs) -> Result<(), Failure> {
    let config = PlanConfig {
        keep: Keep::Nothing,
        recompute_ratio: config::check_ratio(args.recompute_ratio).map_err(|e| e.to_string())?,
        collectives: args.collectives.into(),
    };
    let hw = load_hw(args.hw.as_deref())?;
    let graph = ir::io::load(&args.graph).map_err(|e| e.to_string())?;
    let search = budget::Search::new(&graph, &config, &hw).map_err(|e| e.to_string())?;
    let points = pareto::frontier(&search, args.steps).map_err(|e| e.to_string())?;
    let text = match args.format {
        ParetoFormat::Text => pareto::table(&graph, &hw.name, &points),
        ParetoFormat::Json => pareto::json(&graph, &points),
        ParetoFormat::Svg => pareto::svg(&graph, &points),
    };
    emit(args.output.as_deref(), text.as_bytes())
}

/// Writes to `path`, or to stdout without one.
fn emit(path: Option<&std::path::Path>, bytes: &[u8]) -> Result<(), Failure> {
    match path {
        Some(path) => {
            Ok(fs::write(path, bytes)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?)
        }
        None => Ok(write_stdout(bytes)?),
    }
}

fn load_hw(path: Option<&std::path::Path>) -> Result<HwProfile, String> {
    path.map_or_else(|| Ok(HwProfile::default()), HwProfile::from_file)
}

impl From<CollectivesArg> for Collectives {
    fn from(arg: CollectivesArg) -> Self {
        match arg {
            CollectivesArg::Recompute => Collectives::Recompute,
            CollectivesArg::Save => Collectives::Save,
        }
    }
}

fn run_diff(old: &std::path::Path, new: &std::path::Path, strict: bool) -> Result<(), Failure> {
    let read = |path: &std::path::Path| -> Result<diff::PlanFile, String> {
        let (plan, names) = Plan::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(diff::PlanFile { plan, names })
    };
    let (old, new) = (read(old)?, read(new)?);
    let changes = diff::diff(&old, &new);
    write_stdout(diff::report(&old.plan, &new.plan, &changes).as_bytes())?;
    let failed = !changes.decisions.is_empty() || (strict && !changes.reasons.is_empty());
    if failed {
        Err(Failure::Status(1))
    } else {
        Ok(())
    }
}

/// Writes to stdout; a closed pipe (`planner inspect g.pb | head`) is not an error.
fn write_stdout(bytes: &[u8]) -> Result<(), String> {
    match std::io::stdout().lock().write_all(bytes) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("cannot write to stdout: {e}")),
    }
}
