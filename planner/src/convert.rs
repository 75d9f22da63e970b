//! `planner convert`: `.pb` <-> `.json`, losslessly.

use std::path::Path;

use ir::{io, LoadError};

/// Reads `input` and writes the same message to `output`, each in the format its extension
/// names (see [`ir::io::convert`]). With `validate`, the graph must load as a valid graph
/// first, so a broken graph is reported rather than copied; without it, any decodable message
/// converts (useful to turn a broken `.pb` into JSON and read it).
pub fn convert(input: &Path, output: &Path, validate: bool) -> Result<(), LoadError> {
    io::convert(input, output, validate)
}
