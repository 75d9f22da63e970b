//! The commands of the `planner` command line. `plan`, `diff`, `pareto`, `inspect` and
//! `convert` run here; `run` and `calibrate` need libtorch, so the program supplies them (a
//! [`Runtime`]): the runtime library runs them in process, the binary loads that library for
//! them, and a program without one says how to get it.

use std::path::Path;

use clap::Parser;
use ir::{
    io::InputKind,
    plan::{Code, Format as PlanFile, Level, Plan},
};
use planner::{
    budget::{BudgetError, Granularity, Search},
    config::{self, PlanConfig},
    convert,
    cost::HwProfile,
    diff, inspect, pareto, plan, render,
    state::State,
};

use crate::{
    args::{
        CalibrateArgs, Cli, Command, ConvertArgs, DiffArgs, InspectArgs, ParetoArgs, ParetoFormat,
        PlanArgs, PlanFormat, RunArgs, SummaryFormat,
    },
    output::{self, Output},
    progress,
};

/// How a command ended, when not in plain success.
pub enum Failure {
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

/// The two commands that need libtorch, as a program runs them.
pub trait RuntimeCommands {
    /// `planner run`.
    fn run(&self, args: RunArgs) -> Result<(), Failure>;
    /// `planner calibrate`.
    fn calibrate(&self, args: CalibrateArgs) -> Result<(), Failure>;
}

/// Whether the program running the command line has the runtime.
pub enum Runtime<'a> {
    /// It runs `run` and `calibrate` this way.
    Linked(&'a dyn RuntimeCommands),
    /// It has none: both commands exit 1 with this message, which names a program that has.
    Absent(&'a str),
}

impl<'a> Runtime<'a> {
    /// The runtime's commands, or the error that names a program that has them.
    fn linked(self) -> Result<&'a dyn RuntimeCommands, Failure> {
        match self {
            Runtime::Linked(commands) => Ok(commands),
            Runtime::Absent(message) => Err(Failure::Error(message.to_owned())),
        }
    }
}

/// Parses `args` (the program name first) and runs the command: the exit status. Usage errors
/// and `--help` print what clap prints and return its status (2 and 0), so the caller decides
/// how the process ends.
pub fn main(args: impl IntoIterator<Item = std::ffi::OsString>, runtime: Runtime<'_>) -> u8 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(usage) => {
            // Printing fails only when stdout or stderr is closed: nothing left to tell.
            let _ = usage.print();
            return u8::try_from(usage.exit_code()).unwrap_or(2);
        }
    };
    match run(cli.command, runtime) {
        Ok(()) => 0,
        Err(Failure::Error(message)) => {
            eprintln!("error: {message}");
            1
        }
        Err(Failure::Status(code)) => code,
    }
}

fn run(command: Command, runtime: Runtime<'_>) -> Result<(), Failure> {
    match command {
        Command::Plan(args) => run_plan(args),
        Command::Diff(args) => run_diff(args),
        Command::Pareto(args) => run_pareto(args),
        Command::Inspect(args) => run_inspect(args),
        Command::Convert(args) => run_convert(args),
        Command::Run(args) => runtime.linked()?.run(*args),
        Command::Calibrate(args) => runtime.linked()?.calibrate(*args),
    }
}

fn run_plan(args: PlanArgs) -> Result<(), Failure> {
    // Configuration errors come before any other work.
    if let Some(option) = args.budget_option_without_budget() {
        return Err(format!("{option} chooses within a budget: give --budget SIZE too").into());
    }
    if args.budget_offload && args.granularity == Granularity::Op {
        return Err(BudgetError::OffloadOps.to_string().into());
    }
    let keep = config::parse_keep(&args.keep).map_err(|e| e.to_string())?;
    let offload = args.offloading.config()?;
    let config = PlanConfig {
        keep,
        offload,
        ..args.planning.config()
    };
    let format = args
        .format
        .or_else(|| args.output.as_deref().and_then(PlanFormat::of_path));
    let out = Output::new(args.output.as_deref(), &args.inputs())?;
    let hw = load_hw(args.planning.hw.as_deref())?;
    let graph = ir::io::load(&args.graph).map_err(|e| e.to_string())?;
    let plan = make_plan(&args, &config, &graph, &hw)?;
    if plan.has_errors() {
        report_errors(&plan);
        return Err(Failure::Status(1));
    }
    let bytes = match format.unwrap_or(PlanFormat::Text) {
        PlanFormat::Text => render::text(&plan, &graph).into_bytes(),
        PlanFormat::Json => plan.encode(&graph, PlanFile::Json),
        PlanFormat::Pb => plan.encode(&graph, PlanFile::Protobuf),
        PlanFormat::Dot => render::dot(&graph, &plan).into_bytes(),
    };
    out.write(&bytes)?;
    if format.is_some_and(|f| f != PlanFormat::Text) || args.output.is_some() {
        report_warnings(&plan);
    }
    let denied = args.deny_warnings && has_denied_warnings(&plan, &args.allow);
    skip_teardown((graph, plan));
    if denied {
        eprintln!("error: the plan has warnings and --deny-warnings is set (waive a code with --allow CODE)");
        return Err(Failure::Status(3));
    }
    Ok(())
}

/// The plan the arguments ask for: under `--budget`, `--choices`, or the configuration.
fn make_plan(
    args: &PlanArgs,
    config: &PlanConfig,
    graph: &ir::Graph,
    hw: &HwProfile,
) -> Result<Plan, Failure> {
    if let Some(size) = args.budget {
        let activations = State::of(graph, &config.training)
            .activation_budget(size, args.budget_includes)
            .map_err(|e| e.to_string())?;
        let bar = progress::Bar::new(args.quiet);
        let search = Search::with_progress(graph, config, hw, &bar).map_err(|e| e.to_string())?;
        return Ok(search
            .answer(activations, args.granularity, args.budget_offload)
            .map_err(|e| e.to_string())?);
    }
    let mut resolved = config::resolve(graph, config).map_err(|e| e.to_string())?;
    if let Some(path) = &args.choices {
        let bytes = output::read_file(path, InputKind::Choices)?;
        let choices = config::parse_choices(graph, &bytes)
            .map_err(|e| format!("{}: {e}", ir::display::path(path)))?;
        resolved = resolved
            .with_choices(graph, choices)
            .map_err(|e| format!("{}: {e}", ir::display::path(path)))?;
    }
    Ok(plan::plan_resolved(graph, config, resolved, hw).map_err(|e| e.to_string())?)
}

/// Whether the plan has a warning whose code `--allow` does not waive.
fn has_denied_warnings(plan: &Plan, allowed: &[Code]) -> bool {
    plan.diagnostics
        .iter()
        .any(|d| d.level == Level::Warning && !allowed.contains(&d.code))
}

/// The process exits next, and the OS takes its memory back at once: freeing a million-node
/// graph and its plan one allocation at a time would add a tenth of the run.
fn skip_teardown<T>(done: T) {
    std::mem::forget(done);
}

/// An error diagnostic rejects the configuration: say so on stderr, one block per error.
pub fn report_errors(plan: &Plan) {
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
    let mut config = args.planning.config();
    config.offload.prefetch = args.prefetch.offload_prefetch;
    let format = args
        .format
        .or_else(|| args.output.as_deref().and_then(ParetoFormat::of_path));
    let out = Output::new(args.output.as_deref(), &args.inputs())?;
    let hw = load_hw(args.planning.hw.as_deref())?;
    let graph = ir::io::load(&args.graph).map_err(|e| e.to_string())?;
    let bar = progress::Bar::new(args.quiet);
    let search = Search::with_progress(&graph, &config, &hw, &bar).map_err(|e| e.to_string())?;
    let points = match args.with_offload {
        true => pareto::frontier_with_offload(&search, args.steps),
        false => pareto::frontier(&search, args.steps),
    }
    .map_err(|e| e.to_string())?;
    drop(bar);
    let text = match format.unwrap_or(ParetoFormat::Text) {
        ParetoFormat::Text => pareto::table(&graph, &hw.name, &points),
        ParetoFormat::Json => pareto::json(&graph, &points),
        ParetoFormat::Svg => pareto::svg(&graph, &points),
    };
    Ok(out.write(text.as_bytes())?)
}

fn run_inspect(args: InspectArgs) -> Result<(), Failure> {
    let graph = ir::io::load(&args.graph).map_err(|e| e.to_string())?;
    let summary = inspect::summarize(&graph);
    skip_teardown(graph);
    let text = match args.format {
        SummaryFormat::Text => inspect::render_text(&summary),
        SummaryFormat::Json => {
            let mut json = serde_json::to_string_pretty(&summary)
                .map_err(|e| format!("cannot serialise the summary: {e}"))?;
            json.push('\n');
            json
        }
    };
    Ok(Output::stdout().write(text.as_bytes())?)
}

fn run_convert(args: ConvertArgs) -> Result<(), Failure> {
    Output::new(Some(&args.output), &[&args.input])?;
    Ok(
        convert::convert(&args.input, &args.output, !args.no_validate)
            .map_err(|e| e.to_string())?,
    )
}

fn run_diff(args: DiffArgs) -> Result<(), Failure> {
    let read = |path: &Path| -> Result<diff::PlanFile, String> {
        let (plan, names) = Plan::read(path).map_err(|e| e.to_string())?;
        Ok(diff::PlanFile { plan, names })
    };
    let (old, new) = (read(&args.old)?, read(&args.new)?);
    let changes = diff::diff(&old, &new);
    Output::stdout().write(diff::report(&old.plan, &new.plan, &changes).as_bytes())?;
    let failed = !changes.decisions.is_empty() || (args.strict && !changes.reasons.is_empty());
    if failed {
        Err(Failure::Status(1))
    } else {
        Ok(())
    }
}

pub fn load_hw(path: Option<&Path>) -> Result<HwProfile, String> {
    path.map_or_else(|| Ok(HwProfile::default()), HwProfile::resolve)
}
