//! The loader decodes a `.pb` file's values and nodes itself, borrowing strings from the file
//! buffer (`ir::view`). These tests hold it to prost's decoding followed by
//! `Graph::from_wire`: same graph, or the same error, on every golden graph, on arbitrary wire
//! graphs, and on encodings prost never writes but must read (unknown fields, unpacked
//! numbers, repeated and merged fields).

use std::path::{Path, PathBuf};

use ir::{
    fingerprint,
    io::{self, Format},
    wire::graph as pb,
    EntityId, Graph, LoadError,
};
use proptest::prelude::*;
use prost::{
    encoding::{encode_key, encode_varint, WireType},
    Message,
};

mod support;

/// Loads `bytes` both ways and checks that they agree; returns the loader's result.
fn agree(bytes: &[u8]) -> Result<Graph, LoadError> {
    let path = Path::new("case.pb");
    let streamed = io::load_bytes(bytes, Format::Protobuf, path);
    let reference = pb::Graph::decode(bytes)
        .map_err(|e| e.to_string())
        .map(|wire| Graph::from_wire_encoded(&wire, fingerprint(bytes)));
    match (&streamed, reference) {
        (Ok(graph), Ok(Ok(expected))) => {
            assert_eq!(format!("{graph:?}"), format!("{expected:?}"));
        }
        (Err(LoadError::Invalid { error, .. }), Ok(Err(expected))) => {
            assert_eq!(error, &expected);
        }
        (Err(LoadError::Protobuf { .. }), Err(_)) => {}
        (streamed, reference) => {
            panic!("the loader says {streamed:?}, prost + from_wire says {reference:?}")
        }
    }
    streamed
}

fn golden_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("tests/golden"))
        .expect("tests/golden")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "pb"))
        .collect();
    files.push(root.join("tests/fixtures/two_layer_moe.pb"));
    files.sort();
    files
}

fn fixture() -> pb::Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/two_layer_moe.pb");
    io::read_wire(&path).expect("the fixture reads")
}

#[test]
fn every_golden_graph_loads_as_prost_decodes_it() {
    let files = golden_files();
    assert!(files.len() >= 10, "{files:?}");
    for path in files {
        let bytes = std::fs::read(&path).expect("reads");
        let graph = agree(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!graph.nodes().is_empty());
    }
}

/// `graph` encoded with each value and node rewritten by `value` / `node` (given and
/// returning one message's bytes), then the other fields.
fn encode_with(
    graph: &pb::Graph,
    value: impl Fn(&pb::Value) -> Vec<u8>,
    node: impl Fn(&pb::Node) -> Vec<u8>,
) -> Vec<u8> {
    let mut out = Vec::new();
    let field = |out: &mut Vec<u8>, tag: u32, bytes: &[u8]| {
        encode_key(tag, WireType::LengthDelimited, out);
        encode_varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    };
    for v in &graph.values {
        field(&mut out, 2, &value(v));
    }
    for n in &graph.nodes {
        field(&mut out, 3, &node(n));
    }
    let header = pb::Graph {
        values: Vec::new(),
        nodes: Vec::new(),
        ..graph.clone()
    };
    out.extend_from_slice(&header.encode_to_vec());
    out
}

fn with_field(mut bytes: Vec<u8>, tag: u32, wire: WireType, payload: &[u8]) -> Vec<u8> {
    encode_key(tag, wire, &mut bytes);
    if wire == WireType::LengthDelimited {
        encode_varint(payload.len() as u64, &mut bytes);
    }
    bytes.extend_from_slice(payload);
    bytes
}

fn varint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    encode_varint(v, &mut out);
    out
}

#[test]
fn unknown_fields_of_every_wire_type_are_skipped() {
    let graph = fixture();
    let unknown = |bytes: Vec<u8>| {
        let bytes = with_field(bytes, 90, WireType::Varint, &varint(7));
        let bytes = with_field(bytes, 91, WireType::SixtyFourBit, &[1; 8]);
        let bytes = with_field(bytes, 92, WireType::LengthDelimited, b"skip me");
        with_field(bytes, 93, WireType::ThirtyTwoBit, &[2; 4])
    };
    let bytes = encode_with(
        &graph,
        |v| unknown(v.encode_to_vec()),
        |n| unknown(n.encode_to_vec()),
    );
    let plain = encode_with(&graph, Message::encode_to_vec, Message::encode_to_vec);
    let graph = agree(&bytes).expect("loads");
    // The same graph as without the unknown fields, fingerprint apart.
    let plain = agree(&plain).expect("loads");
    assert_eq!(graph.nodes().len(), plain.nodes().len());
    assert_eq!(
        format!("{:?}", graph.nodes()),
        format!("{:?}", plain.nodes())
    );
}

#[test]
fn unpacked_shapes_and_the_last_scalar_win_as_in_prost() {
    let graph = fixture();
    let unpacked_shape = |v: &pb::Value| {
        let mut bytes = pb::Value {
            shape: Vec::new(),
            ..v.clone()
        }
        .encode_to_vec();
        for &d in &v.shape {
            bytes = with_field(bytes, 3, WireType::Varint, &varint(d as u64));
        }
        bytes
    };
    // A node's name given twice: the last one counts.
    let renamed = |n: &pb::Node| {
        let bytes = pb::Node {
            name: "placeholder".to_owned(),
            ..n.clone()
        }
        .encode_to_vec();
        with_field(bytes, 1, WireType::LengthDelimited, n.name.as_bytes())
    };
    let loaded = agree(&encode_with(&graph, unpacked_shape, renamed)).expect("loads");
    let shapes: Vec<Vec<u64>> = graph
        .values
        .iter()
        .map(|v| v.shape.iter().map(|&d| d as u64).collect())
        .collect();
    let loaded_shapes: Vec<Vec<u64>> = loaded.values().values().map(|v| v.shape.to_vec()).collect();
    assert_eq!(loaded_shapes, shapes);
    assert_eq!(
        loaded.node(ir::NodeId::from_index(0)).name,
        graph.nodes[0].name
    );
}

#[test]
fn repeated_schema_facts_and_attribute_lists_merge_as_in_prost() {
    let graph = fixture();
    // Every node with an input gets a second `schema` field saying it writes input 0
    // (unpacked), and an attribute whose int list comes in two parts.
    let node = |n: &pb::Node| {
        let mut bytes = n.encode_to_vec();
        if !n.inputs.is_empty() {
            let schema = with_field(Vec::new(), 1, WireType::Varint, &varint(0));
            bytes = with_field(bytes, 12, WireType::LengthDelimited, &schema);
        }
        let list = |v: u64| with_field(Vec::new(), 1, WireType::Varint, &varint(v));
        let attribute = with_field(Vec::new(), 1, WireType::LengthDelimited, b"split");
        let attribute = with_field(attribute, 6, WireType::LengthDelimited, &list(1));
        let attribute = with_field(attribute, 6, WireType::LengthDelimited, &list(2));
        with_field(bytes, 5, WireType::LengthDelimited, &attribute)
    };
    // In-place writes to graph inputs and views may break rules: agreeing is what counts.
    let _ = agree(&encode_with(&graph, Message::encode_to_vec, node));
    let attribute_only = |n: &pb::Node| {
        let list = |v: u64| with_field(Vec::new(), 1, WireType::Varint, &varint(v));
        let attribute = with_field(Vec::new(), 1, WireType::LengthDelimited, b"split");
        let attribute = with_field(attribute, 6, WireType::LengthDelimited, &list(1));
        let attribute = with_field(attribute, 6, WireType::LengthDelimited, &list(2));
        with_field(n.encode_to_vec(), 5, WireType::LengthDelimited, &attribute)
    };
    let loaded =
        agree(&encode_with(&graph, Message::encode_to_vec, attribute_only)).expect("loads");
    let first = loaded.node(ir::NodeId::from_index(0));
    assert_eq!(
        first.attribute("split"),
        Some(&ir::AttrValue::Ints(vec![1, 2]))
    );
}

#[test]
fn a_wrong_wire_type_or_bad_utf8_is_a_protobuf_error() {
    let graph = fixture();
    let name_as_varint = |n: &pb::Node| with_field(n.encode_to_vec(), 1, WireType::Varint, &[5]);
    let bad_utf8 = |n: &pb::Node| {
        with_field(
            n.encode_to_vec(),
            2,
            WireType::LengthDelimited,
            &[0xff, 0xfe],
        )
    };
    let truncated = |n: &pb::Node| {
        with_field(n.encode_to_vec(), 3, WireType::LengthDelimited, &[])
            .into_iter()
            .chain([0x80])
            .collect()
    };
    for bytes in [
        encode_with(&graph, Message::encode_to_vec, name_as_varint),
        encode_with(&graph, Message::encode_to_vec, bad_utf8),
        encode_with(&graph, Message::encode_to_vec, truncated),
    ] {
        let error = agree(&bytes).expect_err("bad protobuf");
        assert!(matches!(error, LoadError::Protobuf { .. }), "{error}");
    }
}

/// The loader checks the UTF-8 of a node's or value's leading bytes in one pass, and of each
/// string after the first byte over 127 (a number over 127, a character outside ASCII) on its
/// own: names of any script decode as prost decodes them wherever they lie, and a broken
/// string is an error before or after such a byte.
#[test]
fn names_before_and_after_long_numbers_and_other_scripts_decode_as_in_prost() {
    let graph = fixture();
    let long_number = |bytes: Vec<u8>| with_field(bytes, 90, WireType::Varint, &varint(300));
    let renamed = |n: &pb::Node| pb::Node {
        name: format!("{}_ñ名", n.name),
        module_path: format!("{}·", n.module_path),
        ..n.clone()
    };
    let number_first =
        |n: &pb::Node| [long_number(Vec::new()), renamed(n).encode_to_vec()].concat();
    let number_last = |n: &pb::Node| long_number(renamed(n).encode_to_vec());
    for bytes in [
        encode_with(&graph, Message::encode_to_vec, number_first),
        encode_with(&graph, Message::encode_to_vec, number_last),
    ] {
        let loaded = agree(&bytes).expect("loads");
        let first = loaded.node(ir::NodeId::from_index(0));
        assert_eq!(first.name, format!("{}_ñ名", graph.nodes[0].name));
    }
    let bad = |bytes: Vec<u8>| with_field(bytes, 9, WireType::LengthDelimited, &[b'a', 0xff]);
    let bad_before = |n: &pb::Node| long_number(bad(n.encode_to_vec()));
    let bad_after = |n: &pb::Node| bad(long_number(n.encode_to_vec()));
    for bytes in [
        encode_with(&graph, Message::encode_to_vec, bad_before),
        encode_with(&graph, Message::encode_to_vec, bad_after),
    ] {
        let error = agree(&bytes).expect_err("bad UTF-8");
        assert!(matches!(error, LoadError::Protobuf { .. }), "{error}");
    }
}

/// An unknown group field nested `depth` deep.
fn nested_group(depth: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    for _ in 0..depth {
        encode_key(90, WireType::StartGroup, &mut bytes);
    }
    for _ in 0..depth {
        encode_key(90, WireType::EndGroup, &mut bytes);
    }
    bytes
}

#[test]
fn unknown_groups_count_against_the_recursion_limit_as_in_prost() {
    let graph = fixture();
    let mut outcomes = Vec::new();
    for depth in [1, 97, 98, 99, 100, 101] {
        let in_node = |n: &pb::Node| {
            let mut bytes = n.encode_to_vec();
            bytes.extend(nested_group(depth));
            bytes
        };
        let in_attribute = |n: &pb::Node| {
            let mut attribute = with_field(Vec::new(), 1, WireType::LengthDelimited, b"deep");
            attribute = with_field(attribute, 2, WireType::Varint, &varint(1));
            attribute.extend(nested_group(depth));
            with_field(n.encode_to_vec(), 5, WireType::LengthDelimited, &attribute)
        };
        for bytes in [
            encode_with(&graph, Message::encode_to_vec, in_node),
            encode_with(&graph, Message::encode_to_vec, in_attribute),
        ] {
            outcomes.push((depth, agree(&bytes).is_ok()));
        }
    }
    // Both limits are reached somewhere in between: the boundary was compared, not skipped.
    assert!(
        outcomes.contains(&(1, true)) && outcomes.contains(&(101, false)),
        "{outcomes:?}"
    );
}

#[test]
fn bad_protobuf_anywhere_is_reported_before_a_broken_rule() {
    let mut graph = fixture();
    // The first value breaks a rule (no dtype); the last node is not valid protobuf.
    graph.values[0].dtype = 0;
    let last = graph.nodes.len() - 1;
    let node = |n: &pb::Node| {
        let bytes = n.encode_to_vec();
        if n.name == graph.nodes[last].name {
            with_field(bytes, 2, WireType::LengthDelimited, &[0xff])
        } else {
            bytes
        }
    };
    let error = agree(&encode_with(&graph, Message::encode_to_vec, node)).expect_err("bad");
    assert!(matches!(error, LoadError::Protobuf { .. }), "{error}");
}

proptest! {
    #[test]
    fn arbitrary_wire_graphs_load_as_prost_decodes_them(graph in support::wire_graph()) {
        let _ = agree(&graph.encode_to_vec());
    }
}
