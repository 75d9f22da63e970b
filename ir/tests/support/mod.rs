//! Generators of wire graphs shared by the property tests: small name pools, so that names
//! collide, dangle and resolve often.

#![allow(dead_code)]

use ir::wire::graph as pb;
use proptest::prelude::*;

pub fn name(prefix: &'static str) -> impl Strategy<Value = String> {
    (0u8..6).prop_map(move |i| format!("{prefix}{i}"))
}

pub fn wire_value() -> impl Strategy<Value = pb::Value> {
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

pub fn wire_node() -> impl Strategy<Value = pb::Node> {
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
        prop::collection::vec(wire_attribute(), 0..3),
        (any::<bool>(), name("r"), 0u32..3),
    )
        .prop_map(
            |(
                name,
                op,
                inputs,
                outputs,
                phase,
                model,
                layer,
                mutates,
                view_of,
                collective,
                attributes,
                (random, region, micro_batch),
            )| {
                // Some nodes list values Python releases after them (any declared names).
                let python_releases = if micro_batch % 2 == 1 {
                    inputs.clone()
                } else {
                    Vec::new()
                };
                pb::Node {
                    name,
                    op,
                    inputs,
                    outputs,
                    phase,
                    model,
                    layer,
                    attributes,
                    module_path: "layers.0.mlp".to_owned(),
                    compiled_region: if random { region } else { String::new() },
                    micro_batch,
                    schema: Some(pb::SchemaFacts {
                        mutates,
                        view_of,
                        random,
                        collective,
                    }),
                    stack_trace: vec!["model.py:1".to_owned(); usize::from(random)],
                    python_releases,
                }
            },
        )
}

pub fn wire_graph() -> impl Strategy<Value = pb::Graph> {
    (
        prop::collection::vec(wire_value(), 0..10),
        prop::collection::vec(wire_node(), 0..10),
        prop::collection::vec(name("v"), 0..3),
        prop::collection::vec(
            (
                name("m"),
                prop_oneof![Just(String::new()), name("m")],
                0u32..3,
                prop::collection::vec(wire_unit(), 0..3),
            ),
            0..3,
        ),
        prop::option::of((name("x"), 0u32..3, 0u32..3)),
    )
        .prop_map(|(values, nodes, outputs, models, metadata)| pb::Graph {
            name: "fuzz".to_owned(),
            values,
            nodes,
            outputs,
            models: models
                .into_iter()
                .map(|(name, parent, num_layers, units)| pb::Model {
                    name,
                    parent,
                    num_layers,
                    units,
                })
                .collect(),
            metadata: metadata.map(|(version, world_size, rank)| pb::Metadata {
                exporter_version: version,
                torch_version: String::new(),
                world_size,
                rank,
            }),
        })
}

/// A unit and its intervals, names drawn from small pools (some empty).
pub fn wire_unit() -> impl Strategy<Value = pb::UnitIntervals> {
    let marker = || prop_oneof![Just(String::new()), name("k")];
    (
        prop_oneof![Just(String::new()), name("u")],
        prop::collection::vec((marker(), marker()), 0..3),
    )
        .prop_map(|(unit, intervals)| pb::UnitIntervals {
            unit,
            intervals: intervals
                .into_iter()
                .map(|(begin, end)| pb::MarkerInterval { begin, end })
                .collect(),
        })
}

/// Any double: random bit patterns (NaNs with any payload and sign among them), and the
/// edges: zeros, subnormals, extremes, infinities, float32's extremes as f64.
pub fn any_double() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        prop::sample::select(vec![
            0.0,
            -0.0,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            f64::from_bits(1),
            -f64::from_bits(1),
            f64::from_bits(0x000f_ffff_ffff_ffff),
            f64::MAX,
            f64::MIN,
            f64::EPSILON,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -f64::NAN,
            f64::from_bits(0x7ff0_0000_0000_0001),
            f64::from(f32::MIN),
            f64::from(f32::MAX),
            f64::from(f32::MIN_POSITIVE),
            0.1,
            1.0 / 3.0,
        ]),
    ]
}

/// Every kind of attribute value, and none.
pub fn wire_attribute() -> impl Strategy<Value = pb::Attribute> {
    use pb::attribute::Value as W;
    let value = prop_oneof![
        Just(None),
        any::<i64>().prop_map(|v| Some(W::Int(v))),
        any_double().prop_map(|v| Some(W::Float(v))),
        name("s").prop_map(|v| Some(W::Str(v))),
        any::<bool>().prop_map(|v| Some(W::Bool(v))),
        prop::collection::vec(any::<i64>(), 0..4)
            .prop_map(|values| Some(W::Ints(pb::IntList { values }))),
        prop::collection::vec(any_double(), 0..4)
            .prop_map(|values| Some(W::Floats(pb::FloatList { values }))),
        prop::collection::vec(name("s"), 0..3)
            .prop_map(|values| Some(W::Strs(pb::StringList { values }))),
    ];
    (prop_oneof![Just(String::new()), name("a")], value)
        .prop_map(|(name, value)| pb::Attribute { name, value })
}
