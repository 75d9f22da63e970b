//! Typed errors of loading and validating a graph. Each names its culprit (node, value, model
//! or file) so the CLI can print one useful line.

use std::path::PathBuf;

use thiserror::Error;

/// A graph file could not be read, decoded or validated.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: unknown graph format: expected a `.pb` (binary protobuf) or `.json` file")]
    UnknownFormat { path: PathBuf },
    #[error("{path}: file is empty")]
    Empty { path: PathBuf },
    #[error("{path}: not a valid protobuf graph ({reason}){hint}")]
    Protobuf {
        path: PathBuf,
        reason: String,
        hint: &'static str,
    },
    #[error("{path}: not a valid JSON graph: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("{path}: {error}")]
    Invalid {
        path: PathBuf,
        #[source]
        error: ValidationError,
    },
}

/// A decoded graph breaks a rule of the IR (docs/ir.md).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ValidationError {
    #[error("graph has no nodes")]
    NoNodes,
    #[error("graph has too many {what} ({count}; the limit is {limit})")]
    TooMany {
        what: &'static str,
        count: usize,
        limit: usize,
    },
    #[error("node #{index} has no name")]
    UnnamedNode { index: usize },
    #[error("value #{index} has no name")]
    UnnamedValue { index: usize },
    #[error("model #{index} has no name")]
    UnnamedModel { index: usize },
    #[error("duplicate node name `{name}`")]
    DuplicateNode { name: String },
    #[error("duplicate value name `{name}`")]
    DuplicateValue { name: String },
    #[error("duplicate model name `{name}`")]
    DuplicateModel { name: String },
    #[error("value `{value}` has no dtype")]
    UnspecifiedDtype { value: String },
    #[error("value `{value}` has unknown dtype code {code}")]
    UnknownDtype { value: String, code: i32 },
    #[error("value `{value}` has no role")]
    UnspecifiedRole { value: String },
    #[error("value `{value}` has unknown role code {code}")]
    UnknownRole { value: String, code: i32 },
    #[error("value `{value}` has negative size {size} in dimension {dim}")]
    NegativeDim {
        value: String,
        dim: usize,
        size: i64,
    },
    #[error(
        "value `{value}` of shape {shape:?} is too large: its size in bytes overflows 64 bits"
    )]
    ShapeOverflow { value: String, shape: Vec<i64> },
    #[error("node `{node}` has no phase")]
    UnspecifiedPhase { node: String },
    #[error("node `{node}` has unknown phase code {code}")]
    UnknownPhase { node: String, code: i32 },
    #[error("node `{node}` has unknown collective kind code {code}")]
    UnknownCollective { node: String, code: i32 },
    #[error("node `{node}` has no op")]
    MissingOp { node: String },
    #[error("node `{node}` reads `{value}`, which is not a declared value")]
    UnknownInput { node: String, value: String },
    #[error("node `{node}` writes `{value}`, which is not a declared value")]
    UnknownOutput { node: String, value: String },
    #[error("value `{value}` is produced twice: by `{first}` and by `{second}`")]
    ProducedTwice {
        value: String,
        first: String,
        second: String,
    },
    #[error("node `{node}` produces `{value}`, a graph input ({role})")]
    ProducesGraphInput {
        node: String,
        value: String,
        role: &'static str,
    },
    #[error(
        "value `{value}` ({role}) is never produced: no node writes it and it is not a graph input"
    )]
    NeverProduced { value: String, role: &'static str },
    #[error("dependency cycle through node `{node}`")]
    Cycle { node: String },
    #[error("node `{node}` reads `{value}` before its producer `{producer}` runs: nodes must be in execution order")]
    UsedBeforeProduced {
        node: String,
        value: String,
        producer: String,
    },
    #[error("graph output `{value}` is not a declared value")]
    UnknownGraphOutput { value: String },
    #[error("node `{node}` belongs to model `{model}`, which the graph does not declare")]
    UndeclaredModel { node: String, model: String },
    #[error("model `{model}` names parent `{parent}`, which the graph does not declare")]
    UndeclaredParent { model: String, parent: String },
    #[error("model `{model}` is nested inside itself")]
    ParentCycle { model: String },
    #[error("node `{node}` has layer {layer} but model `{model}` declares {num_layers} layers")]
    LayerOutOfRange {
        node: String,
        layer: u32,
        model: String,
        num_layers: u32,
    },
    #[error("node `{node}`: schema fact `{fact}` names input position {position}, but the node has {inputs} inputs")]
    SchemaPosition {
        node: String,
        fact: &'static str,
        position: u32,
        inputs: usize,
    },
    #[error("node `{node}`: attribute `{attribute}` has no value")]
    EmptyAttribute { node: String, attribute: String },
    #[error("node `{node}`: attribute #{index} has no name")]
    UnnamedAttribute { node: String, index: usize },
    #[error("marker node `{node}` has no name (a string attribute `name`)")]
    UnnamedMarker { node: String },
    #[error("model `{model}`: unit #{index} has no name")]
    UnnamedUnit { model: String, index: usize },
    #[error("model `{model}` declares unit `{unit}` twice")]
    DuplicateUnit { model: String, unit: String },
    #[error("model `{model}`: unit `{unit}` has an interval with an empty {side} marker")]
    EmptyIntervalMarker {
        model: String,
        unit: String,
        side: &'static str,
    },
}
