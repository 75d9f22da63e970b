//! `ir::io` reads JSON and converts graphs without decoding a message whole (it transcodes
//! field by field). These tests hold it to decoding whole messages with prost and pbjson and
//! encoding them again: the same bytes, or an error for the same input, on arbitrary graphs,
//! on protobuf encodings prost never writes but reads (merged elements, fields out of order,
//! unpacked numbers, unknown fields), on JSON broken in every way pbjson can be asked to read,
//! and for every double.

use std::path::Path;

use ir::{
    io::{self, Format},
    wire::graph as pb,
    LoadError,
};
use proptest::prelude::*;
use prost::{
    encoding::{encode_key, encode_varint, WireType},
    Message,
};
use serde_json::Value as Json;

mod support;
use support::{any_double, wire_graph};

fn path() -> &'static Path {
    Path::new("case")
}

/// Converts `bytes` without validating, as `planner convert --no-validate` does.
/// Where a JSON error stopped reading: serde_json's `line L column C`.
fn json_error_place(message: &str) -> Option<&str> {
    message.rsplit_once(" at line ").map(|(_, place)| place)
}

fn convert(bytes: &[u8], from: Format, to: Format) -> Result<Vec<u8>, LoadError> {
    io::convert_bytes(bytes, from, to, false, path())
}

/// What decoding whole and encoding again makes of `bytes`, or `None` when decoding fails.
fn reference(bytes: &[u8], from: Format, to: Format) -> Option<Result<Vec<u8>, String>> {
    let graph = io::decode(bytes, from, path()).ok()?;
    Some(io::encode(&graph, to).map_err(|e| e.to_string()))
}

/// The streamed conversion agrees with the whole-message one.
fn agree(bytes: &[u8], from: Format, to: Format) {
    let streamed = convert(bytes, from, to);
    match (streamed, reference(bytes, from, to)) {
        (Ok(streamed), Some(Ok(expected))) => assert!(
            streamed == expected,
            "streamed:\n{}\nexpected:\n{}",
            String::from_utf8_lossy(&streamed),
            String::from_utf8_lossy(&expected)
        ),
        // An enum code without a name cannot be written as JSON either way.
        (Err(LoadError::NoJsonName { .. }), Some(Err(_))) => {}
        (Err(LoadError::Protobuf { .. } | LoadError::Json { .. }), None) => {}
        (streamed, expected) => panic!("streamed {streamed:?}, whole {expected:?}"),
    }
}

fn field(out: &mut Vec<u8>, tag: u32, payload: &[u8]) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(payload.len() as u64, out);
    out.extend_from_slice(payload);
}

/// A stream of choices for the non-canonical encoder.
struct Choices<'a>(std::iter::Cycle<std::slice::Iter<'a, u8>>);

impl Choices<'_> {
    fn next(&mut self, n: u8) -> u8 {
        self.0.next().copied().unwrap_or(0) % n.max(1)
    }
}

/// `m` encoded, then (by choice) another message of its kind merged into it, then an unknown
/// field.
fn merged<M: Message>(m: &M, others: &[M], choices: &mut Choices<'_>) -> Vec<u8> {
    let mut bytes = m.encode_to_vec();
    if !others.is_empty() && choices.next(2) == 1 {
        let other = &others[usize::from(choices.next(others.len().min(255) as u8))];
        bytes.extend(other.encode_to_vec());
    }
    if choices.next(3) == 2 {
        field(&mut bytes, 99, b"unknown");
    }
    bytes
}

/// A node with its attributes as separate fields, each merged with another, and its inputs
/// and outputs as they are.
fn node_bytes(n: &pb::Node, choices: &mut Choices<'_>) -> Vec<u8> {
    let bare = pb::Node {
        attributes: Vec::new(),
        ..n.clone()
    };
    let mut bytes = merged(&bare, &[], choices);
    for a in &n.attributes {
        field(&mut bytes, 5, &merged(a, &n.attributes, choices));
    }
    bytes
}

/// A value with its shape unpacked (one varint field per dimension) by choice.
fn value_bytes(v: &pb::Value, choices: &mut Choices<'_>) -> Vec<u8> {
    if choices.next(2) == 0 {
        return merged(v, &[], choices);
    }
    let mut bytes = pb::Value {
        shape: Vec::new(),
        ..v.clone()
    }
    .encode_to_vec();
    for &d in &v.shape {
        encode_key(3, WireType::Varint, &mut bytes);
        encode_varint(d as u64, &mut bytes);
    }
    bytes
}

/// `graph` in an encoding prost reads but never writes: top-level fields interleaved and out
/// of order, a stale name and metadata given first, elements merged with others, unknown
/// fields, unpacked shapes.
fn noncanonical(graph: &pb::Graph, seed: &[u8]) -> Vec<u8> {
    let fallback = [0u8];
    let mut choices = Choices(
        if seed.is_empty() { &fallback[..] } else { seed }
            .iter()
            .cycle(),
    );
    let mut out = Vec::new();
    field(&mut out, 1, b"stale name");
    field(
        &mut out,
        6,
        &pb::Metadata {
            torch_version: "stale".to_owned(),
            world_size: 9,
            ..Default::default()
        }
        .encode_to_vec(),
    );
    let mut values = graph.values.iter().peekable();
    let mut nodes = graph.nodes.iter().peekable();
    // Values and nodes interleaved: each kind keeps its order.
    while values.peek().is_some() || nodes.peek().is_some() {
        let value_next =
            nodes.peek().is_none() || (values.peek().is_some() && choices.next(2) == 0);
        match (value_next, values.peek(), nodes.peek()) {
            (true, Some(_), _) => {
                let v = values.next().expect("peeked");
                field(&mut out, 2, &value_bytes(v, &mut choices));
            }
            _ => {
                let n = nodes.next().expect("peeked");
                field(&mut out, 3, &node_bytes(n, &mut choices));
            }
        }
    }
    for m in &graph.models {
        field(&mut out, 5, &merged(m, &graph.models, &mut choices));
    }
    let header = pb::Graph {
        values: Vec::new(),
        nodes: Vec::new(),
        models: Vec::new(),
        ..graph.clone()
    };
    out.extend(header.encode_to_vec());
    // The real name, even when empty: the last one wins.
    field(&mut out, 1, graph.name.as_bytes());
    out
}

/// One way to break a JSON document pbjson would read.
#[derive(Debug, Clone)]
enum Break {
    /// Replace the value of a member with this JSON.
    Replace(&'static str),
    /// Rename a member (`name` -> `nam`).
    Rename,
    /// Rename a member to its other spelling (`modulePath` <-> `module_path`).
    Respell,
    /// Give a member twice.
    Twice,
}

fn any_break() -> impl Strategy<Value = Break> {
    prop_oneof![
        prop::sample::select(vec![
            "null",
            "0",
            "-1",
            "1.5",
            "1e400",
            "\"\"",
            "\"x\"",
            "\"1\"",
            "\"NaN\"",
            "true",
            "[]",
            "{}",
            "[null]",
            "[1]",
            "[\"x\"]",
            "[{}]",
            "{\"values\": [1]}",
            "\"PHASE_FORWARD\"",
            "4294967296",
            "-9223372036854775809"
        ])
        .prop_map(Break::Replace),
        Just(Break::Rename),
        Just(Break::Respell),
        Just(Break::Twice),
    ]
}

/// Every object member of a JSON document, as a path of keys and indexes.
fn members(value: &Json, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        Json::Object(map) => {
            for (key, v) in map {
                at.push(key.clone());
                out.push(at.clone());
                members(v, at, out);
                at.pop();
            }
        }
        Json::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                at.push(i.to_string());
                members(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// The JSON text of `document` with `how` applied to the member at `path`.
fn broken(document: &Json, path: &[String], how: &Break) -> String {
    let (key, parents) = path.split_last().expect("a member has a key");
    let mut document = document.clone();
    let mut parent = &mut document;
    for step in parents {
        parent = match parent {
            Json::Object(map) => map.get_mut(step).expect("path"),
            Json::Array(items) => &mut items[step.parse::<usize>().expect("index")],
            _ => unreachable!("paths lead through objects and arrays"),
        };
    }
    let Json::Object(map) = parent else {
        unreachable!("a member's parent is an object")
    };
    let replacement = match how {
        Break::Replace(json) => (*json).to_owned(),
        Break::Twice => {
            let value = serde_json::to_string(&map[key]).expect("serialises");
            format!("{value},\"{key}\":{value}")
        }
        Break::Rename | Break::Respell => {
            let value = map.remove(key).expect("member");
            let renamed = match how {
                Break::Rename => key[..key.len().saturating_sub(1)].to_owned(),
                _ => respell(key),
            };
            map.insert(renamed, value);
            return serde_json::to_string(&document).expect("serialises");
        }
    };
    map.insert(key.clone(), Json::String("__BROKEN__".to_owned()));
    let text = serde_json::to_string(&document).expect("serialises");
    text.replacen("\"__BROKEN__\"", &replacement, 1)
}

/// `modulePath` <-> `module_path`.
fn respell(key: &str) -> String {
    if key.contains('_') {
        let mut out = String::new();
        let mut upper = false;
        for c in key.chars() {
            match (c, upper) {
                ('_', _) => upper = true,
                (c, true) => {
                    out.extend(c.to_uppercase());
                    upper = false;
                }
                (c, false) => out.push(c),
            }
        }
        out
    } else {
        key.chars()
            .flat_map(|c| match c.is_uppercase() {
                true => vec!['_', c.to_ascii_lowercase()],
                false => vec![c],
            })
            .collect()
    }
}

#[test]
fn a_refused_integer_is_placed_where_pbjson_places_it_last_member_or_not() {
    for text in [
        r#"{"metadata":{"rank":-1,"exporterVersion":"x0"},"name":"g"}"#,
        r#"{"metadata":{"exporterVersion":"x0","rank":-1},"name":"g"}"#,
        r#"{"nodes":[{"name":"a","layer":-1}]}"#,
        r#"{"nodes":[{"name":"a","layer":4294967296},{"name":"b"}]}"#,
    ] {
        let streamed = convert(text.as_bytes(), Format::Json, Format::Protobuf)
            .expect_err("a negative or too large u32 is refused")
            .to_string();
        let whole = io::decode(text.as_bytes(), Format::Json, path())
            .expect_err("pbjson refuses it too")
            .to_string();
        assert!(
            streamed.contains("must be an integer from 0 to 4294967295"),
            "{streamed}"
        );
        assert_eq!(
            json_error_place(&streamed),
            json_error_place(&whole),
            "{text}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn streamed_protobuf_and_json_are_what_prost_and_pbjson_write(graph in wire_graph()) {
        let bytes = graph.encode_to_vec();
        agree(&bytes, Format::Protobuf, Format::Protobuf);
        agree(&bytes, Format::Protobuf, Format::Json);
    }

    #[test]
    fn streamed_json_reads_as_pbjson_reads_it(graph in wire_graph()) {
        if let Ok(json) = io::encode(&graph, Format::Json) {
            agree(&json, Format::Json, Format::Protobuf);
            agree(&json, Format::Json, Format::Json);
        }
    }

    #[test]
    fn noncanonical_protobuf_converts_as_prost_decodes_it(
        graph in wire_graph(),
        seed in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let bytes = noncanonical(&graph, &seed);
        agree(&bytes, Format::Protobuf, Format::Protobuf);
        agree(&bytes, Format::Protobuf, Format::Json);
    }

    #[test]
    fn broken_json_is_rejected_or_read_as_pbjson_reads_it(
        graph in wire_graph(),
        pick in any::<prop::sample::Index>(),
        how in any_break(),
    ) {
        let Ok(json) = io::encode(&graph, Format::Json) else { return Ok(()) };
        let document: Json = serde_json::from_slice(&json).expect("valid JSON");
        let mut paths = Vec::new();
        members(&document, &mut Vec::new(), &mut paths);
        let text = broken(&document, &paths[pick.index(paths.len())], &how);
        let streamed = convert(text.as_bytes(), Format::Json, Format::Protobuf);
        let whole = io::decode(text.as_bytes(), Format::Json, path());
        match (streamed, whole) {
            (Ok(streamed), Ok(whole)) => prop_assert_eq!(streamed, whole.encode_to_vec()),
            (Err(streamed), Err(whole)) => {
                // The streamed reader words a bad number or enum in plain words naming the
                // field, where pbjson's words are terse: the same error, at the same place.
                let (streamed, whole) = (streamed.to_string(), whole.to_string());
                let same_place = json_error_place(&streamed).is_some()
                    && json_error_place(&streamed) == json_error_place(&whole);
                prop_assert!(streamed == whole || same_place, "{text}\n{streamed}\n{whole}");
            }
            (streamed, whole) => panic!("{text}\nstreamed {streamed:?}\nwhole {whole:?}"),
        }
    }

    #[test]
    fn every_double_survives_pb_to_json_to_pb(values in prop::collection::vec(any_double(), 1..6)) {
        let attribute = |value| pb::Attribute { name: "a".to_owned(), value: Some(value) };
        use pb::attribute::Value as W;
        let mut attributes: Vec<_> = values.iter().map(|&v| attribute(W::Float(v))).collect();
        attributes.push(attribute(W::Floats(pb::FloatList { values: values.clone() })));
        let graph = pb::Graph {
            nodes: vec![pb::Node { name: "n".to_owned(), attributes, ..Default::default() }],
            ..Default::default()
        };
        let bytes = graph.encode_to_vec();
        let json = convert(&bytes, Format::Protobuf, Format::Json).expect("converts");
        let back = convert(&json, Format::Json, Format::Protobuf).expect("reads back");
        prop_assert!(back == bytes, "{}", String::from_utf8_lossy(&json));
        // And the whole-message JSON of pbjson with the project's float mapping agrees.
        let whole = io::decode(&json, Format::Json, path()).expect("pbjson reads it");
        prop_assert!(whole.encode_to_vec() == bytes);
    }
}
