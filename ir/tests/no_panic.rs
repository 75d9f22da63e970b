//! No input may panic the loader: arbitrary bytes in either format, and arbitrary (mostly
//! invalid) wire graphs, either load or return an error.

use std::path::Path;

use ir::{
    io::{self, Format},
    Graph,
};
use proptest::prelude::*;

mod support;
use support::wire_graph;

/// Both ways in: decode then validate, and the loader's own streaming path.
fn load_bytes(bytes: &[u8], format: Format) {
    if let Ok(wire) = io::decode(bytes, format, Path::new("fuzz")) {
        let _ = Graph::from_wire(wire);
    }
    let _ = io::load_bytes(bytes, format, Path::new("fuzz"));
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        load_bytes(&bytes, Format::Protobuf);
        load_bytes(&bytes, Format::Json);
    }

    #[test]
    fn arbitrary_wire_graphs_never_panic(graph in wire_graph()) {
        let encoded = io::encode(&graph, Format::Protobuf).unwrap();
        let _ = Graph::from_wire(graph);
        // Every prefix of a valid encoding is a truncated file.
        for cut in [encoded.len() / 3, encoded.len() / 2, encoded.len().saturating_sub(1)] {
            load_bytes(&encoded[..cut], Format::Protobuf);
        }
    }

}
