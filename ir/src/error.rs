//! Typed errors of loading and validating a graph. Each names its culprit (node, value, model
//! or file) so the CLI can print one useful line; every name, path and quoted message from the
//! input is shown through [`crate::display`], so that line stays one short line.

use std::path::PathBuf;

use thiserror::Error;

use crate::display;

/// A graph file could not be read, decoded or validated.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot read {what} {}: {source}", display::path(.path))]
    Io {
        path: PathBuf,
        /// What the file was to hold (`graph`, `hardware profile`, ...).
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {what} {}: it is a {file_type}, not a regular file", display::path(.path))]
    NotAFile {
        path: PathBuf,
        what: &'static str,
        file_type: &'static str,
    },
    #[error(
        "cannot read {what} {}: it holds {size} bytes, over the limit of {limit} bytes for a {what}",
        display::path(.path)
    )]
    TooLarge {
        path: PathBuf,
        what: &'static str,
        size: u64,
        limit: u64,
    },
    #[error("cannot write {}: {source}", display::path(.path))]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: unknown graph format: expected a `.pb` (binary protobuf) or `.json` file",
        display::path(.path)
    )]
    UnknownFormat { path: PathBuf },
    #[error("{}: file is empty", display::path(.path))]
    Empty { path: PathBuf },
    #[error("{}: not a valid protobuf graph ({}){hint}", display::path(.path), display::message(.reason))]
    Protobuf {
        path: PathBuf,
        reason: String,
        hint: &'static str,
    },
    #[error("{}: not a valid JSON graph: {}", display::path(.path), display::message(.reason))]
    Json { path: PathBuf, reason: String },
    #[error(
        "{}: cannot be written as JSON: {}, and proto3 JSON spells enums by name",
        display::path(.path),
        display::message(.reason)
    )]
    NoJsonName { path: PathBuf, reason: String },
    #[error("{}: {error}", display::path(.path))]
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
    #[error("duplicate node name `{}`", display::name(.name))]
    DuplicateNode { name: String },
    #[error("duplicate value name `{}`", display::name(.name))]
    DuplicateValue { name: String },
    #[error("duplicate model name `{}`", display::name(.name))]
    DuplicateModel { name: String },
    #[error("value `{}` has no dtype", display::name(.value))]
    UnspecifiedDtype { value: String },
    #[error("value `{}` has unknown dtype code {code}", display::name(.value))]
    UnknownDtype { value: String, code: i32 },
    #[error("value `{}` has no role", display::name(.value))]
    UnspecifiedRole { value: String },
    #[error("value `{}` has unknown role code {code}", display::name(.value))]
    UnknownRole { value: String, code: i32 },
    #[error("value `{}` has negative size {size} in dimension {dim}", display::name(.value))]
    NegativeDim {
        value: String,
        dim: usize,
        size: i64,
    },
    #[error("value `{}` of shape {} is too large: its size in bytes overflows 64 bits", display::name(.value), display::numbers(.shape))]
    ShapeOverflow { value: String, shape: Vec<i64> },
    #[error("node `{}` has no phase", display::name(.node))]
    UnspecifiedPhase { node: String },
    #[error("node `{}` has unknown phase code {code}", display::name(.node))]
    UnknownPhase { node: String, code: i32 },
    #[error("node `{}` has unknown collective kind code {code}", display::name(.node))]
    UnknownCollective { node: String, code: i32 },
    #[error("node `{}` has no op", display::name(.node))]
    MissingOp { node: String },
    #[error("node `{}` reads `{}`, which is not a declared value", display::name(.node), display::name(.value))]
    UnknownInput { node: String, value: String },
    #[error("node `{}` writes `{}`, which is not a declared value", display::name(.node), display::name(.value))]
    UnknownOutput { node: String, value: String },
    #[error("node `{}` lists `{}` among the values Python releases after it, which is not a declared value", display::name(.node), display::name(.value))]
    UnknownPythonRelease { node: String, value: String },
    #[error("node `{}` lists `{}` among the values Python releases after it, but Python releases after a forward node only what forward made by then", display::name(.node), display::name(.value))]
    PythonReleaseOutsideForward { node: String, value: String },
    #[error("value `{}` is produced twice: by `{}` and by `{}`", display::name(.value), display::name(.first), display::name(.second))]
    ProducedTwice {
        value: String,
        first: String,
        second: String,
    },
    #[error("node `{}` produces `{}`, a graph input ({role})", display::name(.node), display::name(.value))]
    ProducesGraphInput {
        node: String,
        value: String,
        role: &'static str,
    },
    #[error("value `{}` ({role}) is never produced: no node writes it and it is not a graph input", display::name(.value))]
    NeverProduced { value: String, role: &'static str },
    #[error("dependency cycle through node `{}`", display::name(.node))]
    Cycle { node: String },
    #[error("node `{}` reads `{}` before its producer `{}` runs: nodes must be in execution order", display::name(.node), display::name(.value), display::name(.producer))]
    UsedBeforeProduced {
        node: String,
        value: String,
        producer: String,
    },
    #[error("forward node `{}` reads `{}`, which backward node `{}` produces: forward never reads a result of backward (is the node's phase right?)", display::name(.node), display::name(.value), display::name(.producer))]
    ForwardReadsBackward {
        node: String,
        value: String,
        producer: String,
    },
    #[error("graph output `{}` is not a declared value", display::name(.value))]
    UnknownGraphOutput { value: String },
    #[error("node `{}` belongs to model `{}`, which the graph does not declare", display::name(.node), display::name(.model))]
    UndeclaredModel { node: String, model: String },
    #[error("model `{}` names parent `{}`, which the graph does not declare", display::name(.model), display::name(.parent))]
    UndeclaredParent { model: String, parent: String },
    #[error("model `{}` is nested inside itself", display::name(.model))]
    ParentCycle { model: String },
    #[error("node `{}` has layer {layer} but model `{}` declares {num_layers} layers", display::name(.node), display::name(.model))]
    LayerOutOfRange {
        node: String,
        layer: u32,
        model: String,
        num_layers: u32,
    },
    #[error("node `{}`: schema fact `{fact}` names input position {position}, but the node has {inputs} inputs", display::name(.node))]
    SchemaPosition {
        node: String,
        fact: &'static str,
        position: u32,
        inputs: usize,
    },
    #[error("node `{}`: attribute `{}` has no value", display::name(.node), display::name(.attribute))]
    EmptyAttribute { node: String, attribute: String },
    #[error("node `{}`: attribute #{index} has no name", display::name(.node))]
    UnnamedAttribute { node: String, index: usize },
    #[error("marker node `{}` has no name (a string attribute `name`)", display::name(.node))]
    UnnamedMarker { node: String },
    #[error("model `{}`: unit #{index} has no name", display::name(.model))]
    UnnamedUnit { model: String, index: usize },
    #[error("model `{}` declares unit `{}` twice", display::name(.model), display::name(.unit))]
    DuplicateUnit { model: String, unit: String },
    #[error("model `{}`: unit `{}` has an interval with an empty {side} marker", display::name(.model), display::name(.unit))]
    EmptyIntervalMarker {
        model: String,
        unit: String,
        side: &'static str,
    },
}
