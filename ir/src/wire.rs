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
