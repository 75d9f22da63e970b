//! Compiles `proto/*.proto` with protox (no system `protoc`) into prost types plus the
//! canonical proto3-JSON serde impls (pbjson).

use std::{env, path::PathBuf};

use prost::Message;

const PROTOS: [&str; 2] = ["graph.proto", "plan.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    for file in PROTOS {
        println!("cargo:rerun-if-changed={}", proto_dir.join(file).display());
    }
    let descriptors = protox::compile(PROTOS, [&proto_dir])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);

    prost_build::Config::new()
        .out_dir(&out_dir)
        .compile_fds(descriptors.clone())?;
    // The messages that hold floats get hand-written JSON (`src/wire/attribute_json.rs`):
    // pbjson writes a non-finite double as `null`, which does not read back.
    pbjson_build::Builder::new()
        .out_dir(&out_dir)
        .register_descriptors(&descriptors.encode_to_vec())?
        .exclude([
            ".recompute.ir.v1.Attribute",
            ".recompute.ir.v1.IntList",
            ".recompute.ir.v1.FloatList",
        ])
        .build(&[".recompute"])?;
    Ok(())
}
