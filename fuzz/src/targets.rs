//! The fuzz targets: each feeds its input to one entry point of the planner and checks the
//! contract: no panic (libFuzzer reports one as a crash), bounded time and memory (libFuzzer's
//! `-timeout` and `-rss_limit_mb`), and an error that is one clean line, short, with every
//! name from the input escaped.

use std::path::Path;

use ir::{
    io::{self, Format},
    Graph,
};
use planner::{cost::HwProfile, inspect};
use prost::Message;

use crate::graphs::GraphSpec;

/// The longest error message accepted: names are shortened, so a message is a few of them.
const MAX_MESSAGE: usize = 4096;

/// One line, no control characters, not too long.
pub fn check_message(message: &str) {
    assert!(!message.is_empty(), "an empty message");
    assert!(
        message.len() <= MAX_MESSAGE,
        "a message of {} bytes: {}...",
        message.len(),
        message.get(..200).unwrap_or_default()
    );
    assert!(
        !message.chars().any(char::is_control),
        "a control character in {message:?}"
    );
}

/// Inspect's text of a loaded graph: no control character but line ends, and its JSON form.
fn check_inspect(graph: &Graph) {
    let summary = inspect::summarize(graph);
    let text = inspect::render_text(&summary);
    assert!(
        !text.chars().any(|c| c != '\n' && c.is_control()),
        "a control character in the text"
    );
    assert!(text.ends_with('\n'));
    serde_json_check(&summary);
}

fn serde_json_check(summary: &inspect::Summary) {
    let json = serde_json::to_string(summary).expect("a summary serialises");
    assert!(json.starts_with('{'));
}

fn load(data: &[u8], format: Format) {
    match io::load_bytes(data, format, Path::new("fuzz")) {
        Ok(graph) => check_inspect(&graph),
        Err(error) => check_message(&error.to_string()),
    }
}

/// The `.pb` loader on arbitrary bytes.
pub fn load_pb(data: &[u8]) {
    load(data, Format::Protobuf);
}

/// The `.json` loader on arbitrary bytes.
pub fn load_json(data: &[u8]) {
    load(data, Format::Json);
}

/// `--hw` profile parsing on arbitrary bytes: a profile has finite positive rates, and
/// written back as JSON it reads back the same, to the bit.
pub fn hw_profile(data: &[u8]) {
    let origin = "hw.json";
    match HwProfile::from_json(data, origin) {
        Ok(hw) => {
            for rate in [
                hw.matmul_flops_per_s,
                hw.vector_flops_per_s,
                hw.hbm_bytes_per_s,
                hw.link_bytes_per_s,
            ] {
                assert!(rate.is_finite() && rate > 0.0, "rate {rate}");
            }
            let json = serde_json::to_vec(&hw).expect("a profile serialises");
            let back = HwProfile::from_json(&json, origin).expect("a written profile reads");
            assert!(
                back.hbm_bytes_per_s.to_bits() == hw.hbm_bytes_per_s.to_bits()
                    && back.matmul_flops_per_s.to_bits() == hw.matmul_flops_per_s.to_bits()
                    && back.vector_flops_per_s.to_bits() == hw.vector_flops_per_s.to_bits()
                    && back.link_bytes_per_s.to_bits() == hw.link_bytes_per_s.to_bits()
                    && back.name == hw.name,
                "the profile does not read back to the same bits"
            );
        }
        Err(message) => check_message(&message),
    }
}

/// Graphs made valid, then broken, loaded and rendered by `inspect`.
pub fn inspect_text(data: &[u8]) {
    let Some(spec) = GraphSpec::from_bytes(data) else {
        return;
    };
    load(&spec.wire().encode_to_vec(), Format::Protobuf);
}

/// pb -> json -> pb gives back the same bytes, with or without validation, and a valid graph
/// loads from either with one fingerprint.
pub fn convert_roundtrip(data: &[u8]) {
    let Some(spec) = GraphSpec::from_bytes(data) else {
        return;
    };
    let pb = spec.wire().encode_to_vec();
    let path = Path::new("fuzz");
    let json = match io::convert_bytes(&pb, Format::Protobuf, Format::Json, false, path) {
        Ok(json) => json,
        Err(error) => return check_message(&error.to_string()),
    };
    let back = io::convert_bytes(&json, Format::Json, Format::Protobuf, false, path)
        .unwrap_or_else(|e| panic!("the JSON written does not read back: {e}"));
    assert!(back == pb, "pb -> json -> pb changed the bytes");
    let from_pb = io::load_bytes(&pb, Format::Protobuf, path);
    let from_json = io::load_bytes(&json, Format::Json, path);
    match (from_pb, from_json) {
        (Ok(a), Ok(b)) => assert_eq!(a.fingerprint(), b.fingerprint()),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("pb and json load differently: {a:?} / {b:?}"),
    }
}
