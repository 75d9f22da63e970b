//! The graph IR of the recompute planner (docs/ir.md): wire format, validated loading into a
//! typed core model, the data-dependency DAG and the op knowledge base.
//!
//! **Architecture invariant:** this crate never links libtorch; it knows graphs, not tensors.

mod dag;
pub mod display;
pub mod error;
pub mod graph;
pub mod id;
pub mod io;
mod layout;
mod name_index;
pub mod ops;
pub mod plan;
mod validate;
mod view;
pub mod wire;

pub use error::{LoadError, ValidationError};
pub use graph::{
    AttrValue, Attribute, DType, Effects, Graph, MarkerInterval, Metadata, Model, Name, Node,
    Phase, Role, Shape, Unit, Value, ValueIds, MARKER_NAME_ATTR, MARKER_OP,
};
pub use id::{EntityId, IdVec, ModelId, NodeId, UnitId, ValueId};
pub use validate::fingerprint;
