//! Compiles `proto/*.proto` with protox (no system `protoc`) into prost types plus the
//! canonical proto3-JSON serde impls (pbjson), the graph schema's tables for the hand decoders
//! (`build/schema.rs`), and each file's descriptor for the Python package's protobuf modules.

use std::{env, fs, path::PathBuf};

use prost::Message;

#[path = "build/schema.rs"]
mod schema;

const PROTOS: [&str; 2] = ["graph.proto", "plan.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `ir/proto` links to the repository's `proto/`: inside the crate, so a packaged crate
    // (the Python sdist) carries the files.
    let proto_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("proto");
    for file in PROTOS {
        println!("cargo:rerun-if-changed={}", proto_dir.join(file).display());
    }
    println!("cargo:rerun-if-changed=build/schema.rs");
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

    let graph = descriptors
        .file
        .iter()
        .find(|f| f.name() == "graph.proto")
        .ok_or("graph.proto has no descriptor")?;
    fs::write(
        out_dir.join("graph_fields.rs"),
        schema::field_numbers(graph),
    )?;
    fs::write(
        out_dir.join("graph_tables.rs"),
        schema::transcode_tables(graph)?,
    )?;
    // What a `_pb2` module holds: the serialized `FileDescriptorProto`, without source
    // locations.
    for mut file in descriptors.file {
        file.source_code_info = None;
        let stem = file.name().trim_end_matches(".proto").to_owned();
        fs::write(
            out_dir.join(format!("{stem}.descriptor.pb")),
            file.encode_to_vec(),
        )?;
    }
    Ok(())
}
