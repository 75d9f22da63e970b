//! The graph IR of the recompute planner (SPEC §3): wire format, validated loading into a
//! typed core model, the data-dependency DAG and the op knowledge base.
//!
//! **Architecture invariant:** this crate never links libtorch; it knows graphs, not tensors.

mod dag;
pub mod deepen;
pub mod display;
pub mod error;
pub mod graph;
pub mod id;
pub mod io;
mod layout;
mod name_index;
pub mod ops;
mod validate;
mod view;
pub mod wire;

pub use error::{LoadError, ValidationError};
pub use graph::{
    AttrValue, Attribute, DType, Effects, Graph, MarkerInterval, Metadata, Model, Name, Node,
    Phase, Role, Shape, Unit, Value, ValueIds, MARKER_NAME_ATTR, MARKER_OP,
};
pub use id::{EntityId, IdVec, ModelId, NodeId, ValueId};
pub use validate::fingerprint;
