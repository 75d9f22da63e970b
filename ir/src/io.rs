//! Graph files: binary protobuf (`.pb`) and the canonical proto3 JSON of the same message
//! (`.json`). Reading returns the wire message; [`load`] also validates it into a [`Graph`].

use std::{
    fs,
    path::{Path, PathBuf},
};

use prost::Message;
use rayon::prelude::*;

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
        Format::Protobuf => decode_protobuf(bytes).map_err(|reason| LoadError::Protobuf {
            path: path.to_owned(),
            reason,
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

/// Top-level field numbers of `Graph` decoded in parallel (see `proto/graph.proto`).
const VALUES_FIELD: u32 = 2;
const NODES_FIELD: u32 = 3;

/// `pb::Graph::decode`, with the repeated `values` and `nodes` (nearly all of a graph's bytes)
/// decoded in parallel: the top level is walked once to slice out each element, the remaining
/// fields are decoded as usual, and element order is kept, so the result is the same message.
fn decode_protobuf(bytes: &[u8]) -> Result<pb::Graph, String> {
    use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
    let mut buf = bytes;
    let mut values: Vec<&[u8]> = Vec::new();
    let mut nodes: Vec<&[u8]> = Vec::new();
    let mut rest: Vec<u8> = Vec::new();
    while !buf.is_empty() {
        let start = bytes.len() - buf.len();
        let (tag, wire_type) = decode_key(&mut buf).map_err(|e| e.to_string())?;
        if wire_type == WireType::LengthDelimited && (tag == VALUES_FIELD || tag == NODES_FIELD) {
            let len = decode_varint(&mut buf).map_err(|e| e.to_string())?;
            let len = match usize::try_from(len) {
                Ok(len) if len <= buf.len() => len,
                _ => return Err(format!("field {tag} of length {len} runs past the end")),
            };
            let (element, tail) = buf.split_at(len);
            match tag {
                VALUES_FIELD => values.push(element),
                _ => nodes.push(element),
            }
            buf = tail;
        } else {
            skip_field(wire_type, tag, &mut buf, DecodeContext::default())
                .map_err(|e| e.to_string())?;
            rest.extend_from_slice(&bytes[start..bytes.len() - buf.len()]);
        }
    }
    let mut graph = pb::Graph::decode(rest.as_slice()).map_err(|e| e.to_string())?;
    let (values, nodes) = rayon::join(|| decode_all(&values), || decode_all(&nodes));
    graph.values = values?;
    graph.nodes = nodes?;
    Ok(graph)
}

/// Decodes each slice as one `M`, in parallel, keeping order.
fn decode_all<M: Message + Default + Send>(slices: &[&[u8]]) -> Result<Vec<M>, String> {
    slices
        .par_iter()
        .map(|s| M::decode(*s).map_err(|e| e.to_string()))
        .collect()
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
