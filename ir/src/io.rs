//! Graph files: binary protobuf (`.pb`) and the canonical proto3 JSON of the same message
//! (`.json`). Reading returns the wire message; [`load`] also validates it into a [`Graph`].

use std::{
    fs,
    path::{Path, PathBuf},
};

use prost::Message;

use crate::{error::LoadError, graph::Graph, validate::BuildError, wire::graph as pb};

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
    load_bytes(&bytes, format, path)
}

/// [`load`] for the bytes of a file; `path` only names it in errors. The values and nodes of
/// a `.pb` are decoded and converted element by element, so the decoded message never exists
/// whole (a third of the memory, and the time to fault it in, at a million nodes).
pub fn load_bytes(bytes: &[u8], format: Format, path: &Path) -> Result<Graph, LoadError> {
    let invalid = |error| LoadError::Invalid {
        path: path.to_owned(),
        error,
    };
    match format {
        Format::Protobuf => {
            check_not_empty(bytes, path)?;
            let parts =
                split_protobuf(bytes).map_err(|reason| protobuf_error(bytes, path, reason))?;
            Graph::from_encoded(
                parts.header,
                &parts.values,
                &parts.nodes,
                crate::fingerprint(bytes),
            )
            .map_err(|e| match e {
                BuildError::Protobuf(reason) => protobuf_error(bytes, path, reason),
                BuildError::Invalid(error) => invalid(error),
            })
        }
        Format::Json => Graph::from_wire(decode(bytes, format, path)?).map_err(invalid),
    }
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
    check_not_empty(bytes, path)?;
    match format {
        Format::Protobuf => {
            pb::Graph::decode(bytes).map_err(|e| protobuf_error(bytes, path, e.to_string()))
        }
        Format::Json => serde_json::from_slice(bytes).map_err(|e| LoadError::Json {
            path: path.to_owned(),
            reason: e.to_string(),
        }),
    }
}

fn check_not_empty(bytes: &[u8], path: &Path) -> Result<(), LoadError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(LoadError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(())
}

fn protobuf_error(bytes: &[u8], path: &Path, reason: String) -> LoadError {
    LoadError::Protobuf {
        path: path.to_owned(),
        reason,
        hint: if looks_like_json(bytes) {
            "; it looks like JSON: name it `.json`"
        } else {
            ""
        },
    }
}

/// Top-level field numbers of the `Graph` elements the loader decodes itself (see
/// `proto/graph.proto`).
const VALUES_FIELD: u32 = 2;
const NODES_FIELD: u32 = 3;

/// A protobuf `Graph` with its repeated `values` and `nodes` (nearly all of a graph's bytes)
/// still encoded, one slice per element, in order; `header` holds the other fields.
struct Split<'a> {
    header: pb::Graph,
    values: Vec<&'a [u8]>,
    nodes: Vec<&'a [u8]>,
}

/// Walks the top level once to slice out each value and node; the remaining fields are
/// decoded as usual.
fn split_protobuf(bytes: &[u8]) -> Result<Split<'_>, String> {
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
    let header = pb::Graph::decode(rest.as_slice()).map_err(|e| e.to_string())?;
    Ok(Split {
        header,
        values,
        nodes,
    })
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
