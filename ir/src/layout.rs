//! The top level of an encoded `Graph`: its fields in file order, the repeated ones (values,
//! nodes, models, outputs) still encoded, one slice each. Walking it touches only the field
//! keys and lengths, so the loader can walk a file several times (count, then convert values,
//! then nodes) instead of holding a list of every element.

use std::ops::Range;

use prost::{
    encoding::{skip_field, DecodeContext, WireType},
    Message,
};

use crate::{
    view::{read_key, read_varint, RawModel, RawNode, RawValue},
    wire::{
        fields::graph::{LAST, MODELS, NODES, OUTPUTS, VALUES},
        graph as pb,
    },
};

/// One top-level field of an encoded `Graph`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field<'a> {
    /// The bytes of one `Value` message.
    Value(&'a [u8]),
    /// The bytes of one `Node` message.
    Node(&'a [u8]),
    /// The bytes of one `Model` message.
    Model(&'a [u8]),
    /// The bytes of one output name (not yet checked to be UTF-8).
    Output(&'a [u8]),
    /// Any other declared field (the name, the metadata, a repeated field of the wrong wire
    /// type), key included.
    Other(&'a [u8]),
    /// A field `Graph` does not declare, skipped.
    Unknown,
}

/// The fields of an encoded `Graph`, in file order; after an error, nothing more.
#[derive(Clone)]
pub(crate) struct Fields<'a> {
    bytes: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Fields { bytes, rest: bytes }
    }

    #[inline]
    fn read(&mut self) -> Result<Field<'a>, String> {
        let start = self.bytes.len() - self.rest.len();
        let (tag, wire) = read_key(&mut self.rest)?;
        let repeated = matches!(tag, VALUES | NODES | OUTPUTS | MODELS);
        if wire == WireType::LengthDelimited && repeated {
            let len = read_varint(&mut self.rest)?;
            let len = match usize::try_from(len) {
                Ok(len) if len <= self.rest.len() => len,
                _ => return Err(format!("field {tag} of length {len} runs past the end")),
            };
            let (element, rest) = self.rest.split_at(len);
            self.rest = rest;
            return Ok(match tag {
                VALUES => Field::Value(element),
                NODES => Field::Node(element),
                OUTPUTS => Field::Output(element),
                _ => Field::Model(element),
            });
        }
        skip_field(wire, tag, &mut self.rest, DecodeContext::default())
            .map_err(|e| e.to_string())?;
        if tag > LAST {
            return Ok(Field::Unknown);
        }
        let end = self.bytes.len() - self.rest.len();
        Ok(Field::Other(&self.bytes[start..end]))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let field = self.read();
        if field.is_err() {
            self.rest = &[];
        }
        Some(field)
    }
}

/// What one walk over an encoded `Graph` learns: how many values, nodes and models it holds,
/// where each kind of element lies, and its other fields decoded (`values`, `nodes`, `models`
/// and `outputs` left empty).
pub(crate) struct Layout {
    pub header: pb::Graph,
    pub values: usize,
    pub nodes: usize,
    pub models: usize,
    /// The byte ranges from the first to the last field of each kind: walking a kind's
    /// elements walks only its range (in a canonical file, only those elements).
    pub value_span: Range<usize>,
    pub node_span: Range<usize>,
    pub model_span: Range<usize>,
    pub output_span: Range<usize>,
}

impl Layout {
    /// Walks `bytes` once; a field that runs past the end, a bad key or a bad header field is
    /// an error (the elements themselves are decoded later). Nothing is listed: walking a
    /// kind's span again costs less than a list of millions of slices would in fresh memory.
    pub fn of(bytes: &[u8]) -> Result<Layout, String> {
        let mut header = Vec::new();
        let (mut values, mut nodes, mut models) = (0, 0, 0);
        let mut spans: [Option<Range<usize>>; 4] = Default::default();
        let mut fields = Fields::new(bytes);
        loop {
            let start = bytes.len() - fields.rest.len();
            let Some(field) = fields.next() else { break };
            let kind = match field? {
                Field::Value(_) => {
                    values += 1;
                    0
                }
                Field::Node(_) => {
                    nodes += 1;
                    1
                }
                Field::Model(_) => {
                    models += 1;
                    2
                }
                Field::Output(_) => 3,
                Field::Other(raw) => {
                    header.extend_from_slice(raw);
                    continue;
                }
                Field::Unknown => continue,
            };
            let end = bytes.len() - fields.rest.len();
            let span = spans[kind].get_or_insert(start..end);
            span.end = end;
        }
        let header = pb::Graph::decode(header.as_slice()).map_err(|e| e.to_string())?;
        let [value_span, node_span, model_span, output_span] = spans.map(Option::unwrap_or_default);
        Ok(Layout {
            header,
            values,
            nodes,
            models,
            value_span,
            node_span,
            model_span,
            output_span,
        })
    }
}

/// The first element, in file order, that is not valid protobuf.
pub(crate) fn first_protobuf_error(bytes: &[u8]) -> Option<String> {
    let (mut values, mut nodes, mut models, mut outputs) = (0, 0, 0, 0);
    let next = |counter: &mut usize| {
        *counter += 1;
        *counter - 1
    };
    Fields::new(bytes).find_map(|field| match field {
        Ok(Field::Value(v)) => decode_value(next(&mut values), v).err(),
        Ok(Field::Node(n)) => decode_node(next(&mut nodes), n).err(),
        Ok(Field::Model(m)) => decode_model(next(&mut models), m).err(),
        Ok(Field::Output(o)) => decode_output(next(&mut outputs), o).err(),
        Ok(Field::Other(_) | Field::Unknown) => None,
        Err(reason) => Some(reason),
    })
}

/// Decodes value `index`; an error names it.
pub(crate) fn decode_value(index: usize, bytes: &[u8]) -> Result<RawValue<'_>, String> {
    RawValue::decode(bytes).map_err(|e| format!("value #{index}: {e}"))
}

/// Decodes node `index`; an error names it.
pub(crate) fn decode_node(index: usize, bytes: &[u8]) -> Result<RawNode<'_>, String> {
    RawNode::decode(bytes).map_err(|e| format!("node #{index}: {e}"))
}

/// Decodes model `index`; an error names it.
pub(crate) fn decode_model(index: usize, bytes: &[u8]) -> Result<RawModel<'_>, String> {
    RawModel::decode(bytes).map_err(|e| format!("model #{index}: {e}"))
}

/// Output name `index`, which must be UTF-8.
pub(crate) fn decode_output(index: usize, bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes)
        .map_err(|_| format!("output #{index}: invalid string value: data is not UTF-8 encoded"))
}

/// The elements one `pick` selects from the top-level fields of `bytes`, in order, each made
/// by `decode` (given its index among them) one at a time.
pub(crate) fn elements<'a, T: 'a>(
    bytes: &'a [u8],
    pick: impl Fn(Field<'a>) -> Option<&'a [u8]> + 'a,
    decode: impl Fn(usize, &'a [u8]) -> Result<T, String> + 'a,
) -> impl Iterator<Item = Result<T, String>> + 'a {
    let picked = Fields::new(bytes).filter_map(move |field| match field {
        Ok(field) => pick(field).map(Ok),
        Err(reason) => Some(Err(reason)),
    });
    picked
        .enumerate()
        .map(move |(index, element)| decode(index, element?))
}

pub(crate) fn pick_value(field: Field<'_>) -> Option<&[u8]> {
    match field {
        Field::Value(value) => Some(value),
        _ => None,
    }
}

pub(crate) fn pick_node(field: Field<'_>) -> Option<&[u8]> {
    match field {
        Field::Node(node) => Some(node),
        _ => None,
    }
}

pub(crate) fn pick_model(field: Field<'_>) -> Option<&[u8]> {
    match field {
        Field::Model(model) => Some(model),
        _ => None,
    }
}

pub(crate) fn pick_output(field: Field<'_>) -> Option<&[u8]> {
    match field {
        Field::Output(output) => Some(output),
        _ => None,
    }
}
