//! Graph files: binary protobuf (`.pb`) and the canonical proto3 JSON of the same message
//! (`.json`). Reading returns the wire message; [`load`] also validates it into a [`Graph`].

use std::{
    fs,
    path::{Path, PathBuf},
};

use prost::Message;

use crate::{error::LoadError, graph::Graph, wire::graph as pb};

/// The two encodings of a graph file, chosen by extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Protobuf,
    Json,
}

impl Format {
    pub fn from_path(path: &Path) -> Result<Format, LoadError> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("pb") => Ok(Format::Protobuf),
            Some("json") => Ok(Format::Json),
            _ => Err(LoadError::UnknownFormat {
                path: path.to_owned(),
            }),
        }
    }
}

/// Reads, decodes and validates a graph file. A `.pb` is fingerprinted as read (it is the
/// canonical encoding when prost or Python's deterministic serialiser wrote it); a `.json` is
/// re-encoded first.
pub fn load(path: &Path) -> Result<Graph, LoadError> {
    let (bytes, format) = read_bytes(path)?;
    let wire = decode(&bytes, format, path)?;
    let graph = match format {
        Format::Protobuf => Graph::from_wire_encoded(wire, crate::fingerprint(&bytes)),
        Format::Json => Graph::from_wire(wire),
    };
    graph.map_err(|error| LoadError::Invalid {
        path: path.to_owned(),
        error,
    })
}

/// Reads and decodes a graph file without validating it.
pub fn read_wire(path: &Path) -> Result<pb::Graph, LoadError> {
    let (bytes, format) = read_bytes(path)?;
    decode(&bytes, format, path)
}

fn read_bytes(path: &Path) -> Result<(Vec<u8>, Format), LoadError> {
    let format = Format::from_path(path)?;
    let bytes = fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok((bytes, format))
}

/// Decodes the bytes of a graph file; `path` only names it in errors.
pub fn decode(bytes: &[u8], format: Format, path: &Path) -> Result<pb::Graph, LoadError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(LoadError::Empty {
            path: path.to_owned(),
        });
    }
    match format {
        Format::Protobuf => pb::Graph::decode(bytes).map_err(|e| LoadError::Protobuf {
            path: path.to_owned(),
            reason: e.to_string(),
            hint: if looks_like_json(bytes) {
                "; it looks like JSON: name it `.json`"
            } else {
                ""
            },
        }),
        Format::Json => serde_json::from_slice(bytes).map_err(|e| LoadError::Json {
            path: path.to_owned(),
            reason: e.to_string(),
        }),
    }
}

fn looks_like_json(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{')
}

/// The bytes of `graph` in `format`. Protobuf is prost's deterministic encoding; JSON is the
/// canonical proto3 mapping, pretty-printed with two-space indents and a final newline, so
/// pb -> json -> pb and json -> pb -> json are byte-identical.
pub fn encode(graph: &pb::Graph, format: Format) -> Vec<u8> {
    match format {
        Format::Protobuf => graph.encode_to_vec(),
        Format::Json => {
            let mut bytes = serde_json::to_vec_pretty(graph)
                .expect("serialising a prost message to JSON cannot fail");
            bytes.push(b'\n');
            bytes
        }
    }
}

/// Writes `graph` to `path`, in the format its extension names.
pub fn write_wire(graph: &pb::Graph, path: &Path) -> Result<(), LoadError> {
    let format = Format::from_path(path)?;
    fs::write(path, encode(graph, format)).map_err(|source| LoadError::Write {
        path: PathBuf::from(path),
        source,
    })
}
