//! Every committed `.pb` is in canonical encoding: decoding and re-encoding gives the same
//! bytes. `load` fingerprints a `.pb` as read, so this is what makes a graph's fingerprint the
//! same from `.pb` and `.json`, and pb -> json -> pb byte-identical.

use std::{fs, path::Path};

use ir::io::{self, Format};

#[test]
fn committed_protobuf_graphs_are_canonical() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests");
    let mut checked = 0;
    for dir in ["fixtures", "golden"] {
        let Ok(entries) = fs::read_dir(root.join(dir)) else {
            continue;
        };
        for path in entries.map(|e| e.unwrap().path()) {
            if path.extension().is_none_or(|e| e != "pb") {
                continue;
            }
            let bytes = fs::read(&path).unwrap();
            let wire = io::decode(&bytes, Format::Protobuf, &path).unwrap();
            assert!(
                io::encode(&wire, Format::Protobuf).unwrap() == bytes,
                "{} is not in canonical encoding",
                path.display()
            );
            let json = io::encode(&wire, Format::Json).unwrap();
            let back = io::decode(&json, Format::Json, &path).unwrap();
            assert!(
                io::encode(&back, Format::Protobuf).unwrap() == bytes,
                "{}: pb -> json -> pb",
                path.display()
            );
            assert_eq!(
                io::load(&path).unwrap().fingerprint(),
                ir::Graph::from_wire(back).unwrap().fingerprint()
            );
            // The streamed conversion writes the same bytes, both ways.
            let streamed = io::convert_bytes(&bytes, Format::Protobuf, Format::Json, true, &path);
            assert!(
                streamed.unwrap() == json,
                "{}: streamed JSON",
                path.display()
            );
            let streamed = io::convert_bytes(&json, Format::Json, Format::Protobuf, true, &path);
            assert!(
                streamed.unwrap() == bytes,
                "{}: streamed protobuf",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no .pb files found");
}
