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
    pbjson_build::Builder::new()
        .out_dir(&out_dir)
        .register_descriptors(&descriptors.encode_to_vec())?
        .build(&[".recompute"])?;
    Ok(())
}
