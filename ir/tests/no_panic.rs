//! No input may panic the loader: arbitrary bytes in either format, and arbitrary (mostly
//! invalid) wire graphs, either load or return an error.

use std::path::Path;

use ir::{
    io::{self, Format},
    wire::graph as pb,
    Graph,
};
use proptest::prelude::*;

fn load_bytes(bytes: &[u8], format: Format) {
    if let Ok(wire) = io::decode(bytes, format, Path::new("fuzz")) {
        let _ = Graph::from_wire(wire);
    }
}

/// Small name pools so that names collide, dangle and resolve often.
fn name(prefix: &'static str) -> impl Strategy<Value = String> {
    (0u8..6).prop_map(move |i| format!("{prefix}{i}"))
}

fn wire_value() -> impl Strategy<Value = pb::Value> {
    (
        name("v"),
        -1i32..16,
        prop::collection::vec(prop_oneof![-2i64..64, Just(i64::MAX), Just(1 << 40)], 0..4),
        -1i32..9,
    )
        .prop_map(|(name, dtype, shape, role)| pb::Value {
            name,
            dtype,
            shape,
            role,
        })
}

fn wire_node() -> impl Strategy<Value = pb::Node> {
    (
        name("n"),
        prop_oneof![
            Just("aten.mm.default".to_owned()),
            Just(ir::MARKER_OP.to_owned()),
            Just("aten.add_.Tensor".to_owned()),
            Just("c10d.allreduce_.default".to_owned()),
            Just("mystery.op.default".to_owned()),
            Just(String::new()),
        ],
        prop::collection::vec(name("v"), 0..3),
        prop::collection::vec(name("v"), 0..2),
        -1i32..4,
        prop_oneof![Just("m0".to_owned()), Just("m9".to_owned())],
        prop::option::of(0u32..4),
        prop::collection::vec(0u32..4, 0..2),
        prop::option::of(0u32..4),
        -1i32..4,
    )
        .prop_map(
            |(name, op, inputs, outputs, phase, model, layer, mutates, view_of, collective)| {
                pb::Node {
                    name,
                    op,
                    inputs,
                    outputs,
                    phase,
                    model,
                    layer,
                    schema: Some(pb::SchemaFacts {
                        mutates,
                        view_of,
                        random: false,
                        collective,
                    }),
                    ..Default::default()
                }
            },
        )
}

fn wire_graph() -> impl Strategy<Value = pb::Graph> {
    (
        prop::collection::vec(wire_value(), 0..10),
        prop::collection::vec(wire_node(), 0..10),
        prop::collection::vec(name("v"), 0..3),
        prop::collection::vec(
            (
                name("m"),
                prop_oneof![Just(String::new()), name("m")],
                0u32..3,
            ),
            0..3,
        ),
    )
        .prop_map(|(values, nodes, outputs, models)| pb::Graph {
            name: "fuzz".to_owned(),
            values,
            nodes,
            outputs,
            models: models
                .into_iter()
                .map(|(name, parent, num_layers)| pb::Model {
                    name,
                    parent,
                    num_layers,
                    units: Vec::new(),
                })
                .collect(),
            metadata: None,
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        load_bytes(&bytes, Format::Protobuf);
        load_bytes(&bytes, Format::Json);
    }

    #[test]
    fn arbitrary_wire_graphs_never_panic(graph in wire_graph()) {
        let encoded = io::encode(&graph, Format::Protobuf);
        let _ = Graph::from_wire(graph);
        // Every prefix of a valid encoding is a truncated file.
        for cut in [encoded.len() / 3, encoded.len() / 2, encoded.len().saturating_sub(1)] {
            load_bytes(&encoded[..cut], Format::Protobuf);
        }
    }

}
