//! Writes a deep graph made by repeating a layer of a shallow one:
//!
//!     cargo run --release -p testkit --example deepen_file -- IN.pb OUT.pb LAYERS [MODEL]
//!
//! Layer 0 of MODEL (default `main`) is the template; layers 0 and 1 must be identical.

use std::{path::Path, process::ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, layers, rest @ ..] = args.as_slice() else {
        eprintln!("usage: deepen_file IN.pb OUT.pb LAYERS [MODEL]");
        return ExitCode::from(2);
    };
    let model = rest.first().map_or("main", String::as_str);
    let run = || -> Result<(), String> {
        let layers: u32 = layers
            .parse()
            .map_err(|_| format!("`{layers}` is not a layer count"))?;
        let wire = ir::io::read_wire(Path::new(input)).map_err(|e| e.to_string())?;
        let deep = testkit::deepen(&wire, model, 0, layers).map_err(|e| e.to_string())?;
        ir::io::write_wire(&deep, Path::new(output)).map_err(|e| e.to_string())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
