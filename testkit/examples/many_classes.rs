//! Writes a graph of LAYERS decoder layers that are all different (a distinct op per layer),
//! each with a kept unit: a stress input for the budget search and the Pareto frontier.
//!
//!     cargo run --release -p testkit --example many_classes -- OUT.pb LAYERS

use std::{path::Path, process::ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [output, layers] = args.as_slice() else {
        eprintln!("usage: many_classes OUT.pb LAYERS");
        return ExitCode::from(2);
    };
    let Ok(layers) = layers.parse::<u32>() else {
        eprintln!("error: `{layers}` is not a layer count");
        return ExitCode::from(2);
    };
    let mut b = testkit::Builder::new(layers, &[("SAVE_ATTN", &[("attn.begin", "attn.end")])]);
    let mut h = b.input("x");
    let mut reads = Vec::new();
    for l in 0..layers {
        b.layer(Some(l));
        let m = b.marker("attn.begin", &h);
        let a = b.node(&format!("mystery.op{l}.default"), &[&m]).1;
        let e = b.marker("attn.end", &a);
        h = b.op(&e);
        reads.push(a);
    }
    b.layer(None);
    reads.reverse();
    b.backward_through("t", &reads);
    match ir::io::write_wire(&b.wire(), Path::new(output)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
