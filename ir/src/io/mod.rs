//! Graph files: binary protobuf (`.pb`) and the canonical proto3 JSON of the same message
//! (`.json`). [`load`] reads and validates a file into a [`Graph`]; [`convert`] turns one
//! format into the other. Both work one element at a time, in memory bounded by a small
//! multiple of the file, and a file is read only if it is a regular file under the size limit
//! ([`read_input_file`]). [`read_wire`], [`decode`] and [`encode`] handle the whole decoded
//! message, for tools and tests that build or edit graphs.

mod file;
mod json_value;
mod transcode;

use std::{
    borrow::Cow,
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use prost::Message;

pub use file::{read_input_file, read_input_file_within, InputKind};

use crate::{
    error::LoadError,
    graph::Graph,
    layout::{first_protobuf_error, Layout},
    validate::BuildError,
    wire::graph as pb,
};

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
/// fingerprinted by the canonical encoding it is read into.
pub fn load(path: &Path) -> Result<Graph, LoadError> {
    let format = Format::from_path(path)?;
    let bytes = read_input_file(path, InputKind::Graph)?;
    load_bytes(&bytes, format, path)
}

/// [`load`] for the bytes of a file; `path` only names it in errors. Values and nodes are
/// decoded and converted in batches, stopping at the first invalid one, so neither the decoded
/// message nor a conversion of a broken file's every element ever exists.
pub fn load_bytes(bytes: &[u8], format: Format, path: &Path) -> Result<Graph, LoadError> {
    let encoded = canonical_input(bytes, format, path)?;
    let layout = walk(&encoded, bytes, path)?;
    build(&encoded, &layout, bytes, path)
}

/// Validates the graph in `encoded` (read from the file `bytes`) into a [`Graph`].
fn build(encoded: &[u8], layout: &Layout, bytes: &[u8], path: &Path) -> Result<Graph, LoadError> {
    let fingerprint = crate::fingerprint(encoded);
    Graph::from_encoded(encoded, layout, fingerprint).map_err(|e| match e {
        BuildError::Protobuf(reason) => protobuf_error(bytes, path, reason),
        BuildError::Invalid(error) => LoadError::Invalid {
            path: path.to_owned(),
            error,
        },
    })
}

/// Converts the graph file `input` into `output`, each in the format its extension names,
/// losslessly: the output is the canonical encoding of the message the input holds, so
/// pb -> json -> pb and json -> pb -> json give back the same bytes. With `validate`, the graph
/// must load as a valid [`Graph`] first, so a broken graph is reported rather than copied;
/// without it, any decodable message converts (useful to turn a broken `.pb` into JSON and
/// read it). Nothing is written unless the conversion can be made; elements are then written
/// one at a time, as they are transcoded.
pub fn convert(input: &Path, output: &Path, validate: bool) -> Result<(), LoadError> {
    let from = Format::from_path(input)?;
    // Resolve the output format before any work, so a bad name fails fast.
    let to = Format::from_path(output)?;
    let bytes = read_input_file(input, InputKind::Graph)?;
    let encoded = convertible(&bytes, from, to, validate, input)?;
    let write_error = |source| LoadError::Write {
        path: output.to_owned(),
        source,
    };
    let mut out = std::io::BufWriter::new(fs::File::create(output).map_err(write_error)?);
    write_as(&encoded, to, &mut out)
        .and_then(|()| out.flush())
        .map_err(write_error)
}

/// [`convert`] for the bytes of a file, returning the converted bytes; `path` only names the
/// input in errors.
pub fn convert_bytes(
    bytes: &[u8],
    from: Format,
    to: Format,
    validate: bool,
    path: &Path,
) -> Result<Vec<u8>, LoadError> {
    let encoded = convertible(bytes, from, to, validate, path)?;
    let mut out = Vec::new();
    write_as(&encoded, to, &mut out).map_err(|source| LoadError::Write {
        path: path.to_owned(),
        source,
    })?;
    Ok(out)
}

/// The protobuf encoding of a file's bytes, checked to convert to `to`: valid with
/// `validate`, decodable without, and with every enum named for JSON.
fn convertible<'b>(
    bytes: &'b [u8],
    from: Format,
    to: Format,
    validate: bool,
    path: &Path,
) -> Result<Cow<'b, [u8]>, LoadError> {
    let encoded = canonical_input(bytes, from, path)?;
    let layout = walk(&encoded, bytes, path)?;
    if validate {
        drop(build(&encoded, &layout, bytes, path)?);
    } else if let Some(reason) = first_protobuf_error(&encoded) {
        return Err(protobuf_error(bytes, path, reason));
    }
    if to == Format::Json {
        if let Some(reason) = transcode::first_unnamed_enum(&encoded) {
            return Err(LoadError::NoJsonName {
                path: path.to_owned(),
                reason,
            });
        }
    }
    Ok(encoded)
}

/// Writes a checked encoding in `format`: its canonical protobuf, or its JSON.
fn write_as(encoded: &[u8], format: Format, out: &mut impl Write) -> std::io::Result<()> {
    match format {
        Format::Protobuf => transcode::write_protobuf(encoded, out),
        Format::Json => transcode::write_json(encoded, out),
    }
}

/// The protobuf encoding of a file's bytes: a `.pb` as it is, a `.json` read into its
/// canonical encoding one element at a time.
fn canonical_input<'b>(
    bytes: &'b [u8],
    format: Format,
    path: &Path,
) -> Result<Cow<'b, [u8]>, LoadError> {
    check_not_empty(bytes, path)?;
    match format {
        Format::Protobuf => Ok(Cow::Borrowed(bytes)),
        Format::Json => transcode::to_protobuf(bytes)
            .map(Cow::Owned)
            .map_err(|e| json_error(path, &e)),
    }
}

/// Walks the top level of `encoded` (read from the file `bytes`).
fn walk(encoded: &[u8], bytes: &[u8], path: &Path) -> Result<Layout, LoadError> {
    Layout::of(encoded).map_err(|reason| protobuf_error(bytes, path, reason))
}

/// Reads and decodes a graph file whole, without validating it. The decoded message is many
/// times the size of the file: for trusted inputs (tools, tests); the CLI uses [`load`] and
/// [`convert`].
pub fn read_wire(path: &Path) -> Result<pb::Graph, LoadError> {
    let format = Format::from_path(path)?;
    let bytes = read_input_file(path, InputKind::Graph)?;
    decode(&bytes, format, path)
}

/// Decodes the bytes of a graph file whole, with prost or pbjson; `path` only names it in
/// errors.
pub fn decode(bytes: &[u8], format: Format, path: &Path) -> Result<pb::Graph, LoadError> {
    check_not_empty(bytes, path)?;
    match format {
        Format::Protobuf => {
            pb::Graph::decode(bytes).map_err(|e| protobuf_error(bytes, path, e.to_string()))
        }
        Format::Json => serde_json::from_slice(bytes).map_err(|e| json_error(path, &e)),
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

fn json_error(path: &Path, error: &serde_json::Error) -> LoadError {
    LoadError::Json {
        path: path.to_owned(),
        reason: error.to_string(),
    }
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

fn looks_like_json(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{')
}

/// The bytes of `graph` in `format`. Protobuf is prost's deterministic encoding; JSON is the
/// canonical proto3 mapping, pretty-printed with two-space indents and a final newline, so
/// pb -> json -> pb and json -> pb -> json are byte-identical. JSON fails for an enum code
/// without a name (proto3 JSON spells enums by name).
pub fn encode(graph: &pb::Graph, format: Format) -> Result<Vec<u8>, serde_json::Error> {
    match format {
        Format::Protobuf => Ok(graph.encode_to_vec()),
        Format::Json => {
            let mut bytes = serde_json::to_vec_pretty(graph)?;
            bytes.push(b'\n');
            Ok(bytes)
        }
    }
}

/// Writes `graph` to `path`, in the format its extension names.
pub fn write_wire(graph: &pb::Graph, path: &Path) -> Result<(), LoadError> {
    let format = Format::from_path(path)?;
    let write_error = |source| LoadError::Write {
        path: PathBuf::from(path),
        source,
    };
    let bytes = encode(graph, format).map_err(|e| write_error(e.into()))?;
    fs::write(path, bytes).map_err(write_error)
}
