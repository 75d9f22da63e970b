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
                io::encode(&wire, Format::Protobuf) == bytes,
                "{} is not in canonical encoding",
                path.display()
            );
            let json = io::encode(&wire, Format::Json);
            let back = io::decode(&json, Format::Json, &path).unwrap();
            assert!(
                io::encode(&back, Format::Protobuf) == bytes,
                "{}: pb -> json -> pb",
                path.display()
            );
            assert_eq!(
                io::load(&path).unwrap().fingerprint(),
                ir::Graph::from_wire(back).unwrap().fingerprint()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no .pb files found");
}
