//! Times the phases of loading a graph file (read, decode, validate):
//!
//!     cargo run --release -p ir --example profile_load -- GRAPH.pb

use std::{path::Path, time::Instant};

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: profile_load GRAPH.pb");
        std::process::exit(2);
    };
    let path = Path::new(&path);
    let t = Instant::now();
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let read = t.elapsed();
    let t = Instant::now();
    let wire =
        ir::io::decode(&bytes, ir::io::Format::Protobuf, path).unwrap_or_else(|e| panic!("{e}"));
    let decode = t.elapsed();
    let t = Instant::now();
    let graph = ir::Graph::from_wire_encoded(wire, ir::fingerprint(&bytes))
        .unwrap_or_else(|e| panic!("{e}"));
    let validate = t.elapsed();
    println!(
        "{} nodes, {} MB: read {:.0} ms, decode {:.0} ms, validate {:.0} ms",
        graph.nodes().len(),
        bytes.len() / 1_000_000,
        read.as_secs_f64() * 1e3,
        decode.as_secs_f64() * 1e3,
        validate.as_secs_f64() * 1e3
    );
}
