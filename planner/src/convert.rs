//! `planner convert`: `.pb` <-> `.json`, losslessly.

use std::path::Path;

use ir::{io, Graph, LoadError};

/// Reads `input` and writes the same message to `output`, each in the format its extension
/// names. With `validate`, the graph must load as a valid [`Graph`] first, so a broken graph is
/// reported rather than copied; without it, any decodable message converts (useful to turn a
/// broken `.pb` into JSON and read it).
pub fn convert(input: &Path, output: &Path, validate: bool) -> Result<(), LoadError> {
    let wire = io::read_wire(input)?;
    // Resolve the output format before any work, so a bad name fails fast.
    io::Format::from_path(output)?;
    if validate {
        Graph::from_wire(wire.clone()).map_err(|error| LoadError::Invalid {
            path: input.to_owned(),
            error,
        })?;
    }
    io::write_wire(&wire, output)
}
