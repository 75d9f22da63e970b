//! Replays every committed fuzz input through the checks its fuzz target runs, on stable Rust:
//! the minimised corpora (`fuzz/corpus/<target>/`) and every input that once failed
//! (`fuzz/regressions/<target>/`). CI replays what the fuzzer found; it does not fuzz
//! (`docs/fuzzing.md` says how to).
//!
//! The targets' bodies and the graph generator are the fuzz crate's own files, compiled here.

#[path = "../../fuzz/src/graphs.rs"]
mod graphs;
#[path = "../../fuzz/src/targets.rs"]
mod targets;

use std::{
    fs,
    panic::{catch_unwind, resume_unwind, AssertUnwindSafe},
    path::{Path, PathBuf},
};

/// A fuzz target's body.
type Target = fn(&[u8]);

/// Every fuzz target, by the name of its corpus directory.
const TARGETS: [(&str, Target); 8] = [
    ("load_pb", targets::load_pb),
    ("load_json", targets::load_json),
    ("hw_profile", targets::hw_profile),
    ("inspect_text", targets::inspect_text),
    ("convert_roundtrip", targets::convert_roundtrip),
    ("plan_pb", targets::plan_pb),
    ("plan_json", targets::plan_json),
    ("plan_graph", targets::plan_graph),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files directly under `dir`, in name order; none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.expect("a directory entry").path())
                .collect()
        })
        .unwrap_or_default();
    files.retain(|p| p.is_file());
    files.sort();
    files
}

/// Runs `target` on every input under `fuzz/<kind>/<name>`; a failure names its file.
fn replay(kind: &str, name: &str, target: Target) -> usize {
    let inputs = files(&fuzz_dir().join(kind).join(name));
    for input in &inputs {
        let bytes = fs::read(input).expect("a committed input reads");
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| target(&bytes))) {
            eprintln!("{} fails its target", input.display());
            resume_unwind(panic);
        }
    }
    inputs.len()
}

#[test]
fn every_minimised_corpus_replays_cleanly() {
    for (name, target) in TARGETS {
        let replayed = replay("corpus", name, target);
        assert!(replayed > 0, "fuzz/corpus/{name} holds no inputs");
    }
}

#[test]
fn every_past_crasher_replays_cleanly() {
    for (name, target) in TARGETS {
        replay("regressions", name, target);
    }
}

/// Targets whose inputs another test replays: `run_inputs` runs plans on libtorch, which only
/// `planner run`'s build has (`cli/tests/run_fuzz_corpus.rs`).
const REPLAYED_ELSEWHERE: [&str; 1] = ["run_inputs"];

#[test]
fn every_corpus_and_regression_directory_belongs_to_a_target() {
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = fs::read_dir(fuzz_dir().join(kind)) else {
            continue;
        };
        for entry in entries {
            let name = entry.expect("a directory entry").file_name();
            let name = name.to_string_lossy();
            assert!(
                TARGETS.iter().any(|(target, _)| *target == name)
                    || REPLAYED_ELSEWHERE.contains(&name.as_ref()),
                "fuzz/{kind}/{name} is replayed by no target"
            );
        }
    }
}

proptest::proptest! {
    /// The fuzz generator on stable: random bytes make a valid graph, which loads, and then
    /// break it; the broken graph loads or fails with one clean line, and converts losslessly.
    #[test]
    fn generated_graphs_load_and_break_cleanly(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096)) {
        if let Some(spec) = graphs::GraphSpec::from_bytes(&data) {
            let valid = prost::Message::encode_to_vec(&spec.valid());
            let loaded = ir::io::load_bytes(&valid, ir::io::Format::Protobuf, Path::new("valid"));
            proptest::prop_assert!(loaded.is_ok(), "{:?}", loaded.err());
        }
        targets::inspect_text(&data);
        targets::convert_roundtrip(&data);
    }
}
