//! The `planner` command line (SPEC §8). Exit codes: 0 success, 1 bad input or configuration
//! (`error: ...` on stderr), 2 usage.

use std::{io::Write, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};
use planner::{convert, inspect};

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
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Inspect { graph, format } => {
            let graph = ir::io::load(&graph).map_err(|e| e.to_string())?;
            let summary = inspect::summarize(&graph);
            let text = match format {
                Format::Text => inspect::render_text(&summary),
                Format::Json => {
                    let mut json = serde_json::to_string_pretty(&summary)
                        .map_err(|e| format!("cannot serialise the summary: {e}"))?;
                    json.push('\n');
                    json
                }
            };
            write_stdout(&text)
        }
        Command::Convert {
            input,
            output,
            no_validate,
        } => convert::convert(&input, &output, !no_validate).map_err(|e| e.to_string()),
    }
}

/// Writes to stdout; a closed pipe (`planner inspect g.pb | head`) is not an error.
fn write_stdout(text: &str) -> Result<(), String> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("cannot write to stdout: {e}")),
    }
}
