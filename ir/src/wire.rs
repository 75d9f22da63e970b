//! Generated wire types. They stop at the loading boundary: the rest of the project works on
//! the typed model in [`crate::graph`].

mod attribute_json;

pub(crate) use attribute_json::FieldKey;
pub use attribute_json::JsonF64;

#[allow(clippy::all, clippy::pedantic)]
pub mod graph {
    include!(concat!(env!("OUT_DIR"), "/recompute.ir.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/recompute.ir.v1.serde.rs"));
}

#[allow(clippy::all, clippy::pedantic)]
pub mod plan {
    include!(concat!(env!("OUT_DIR"), "/recompute.plan.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/recompute.plan.v1.serde.rs"));
}

/// The field numbers of `graph.proto`'s messages (`fields::node::ATTRIBUTES`), written by
/// `build.rs` from its descriptor: the hand decoders match on these, never on bare numbers.
pub mod fields {
    include!(concat!(env!("OUT_DIR"), "/graph_fields.rs"));
}

/// The serialized `FileDescriptorProto` of `graph.proto` (source locations left out): what a
/// protoc-generated `graph_pb2` module holds, for building the Python messages without protoc.
pub const GRAPH_DESCRIPTOR: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/graph.descriptor.pb"));

/// The serialized `FileDescriptorProto` of `plan.proto`, as [`GRAPH_DESCRIPTOR`].
pub const PLAN_DESCRIPTOR: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/plan.descriptor.pb"));
