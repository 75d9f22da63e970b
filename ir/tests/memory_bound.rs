//! Loading and converting a broken file costs memory bounded by a small multiple of the file,
//! whatever its shape: millions of empty elements, or one element holding millions of empty
//! parts. A decoded element is many times the size of its encoding (an empty node is 2 bytes in
//! a `.pb` and 3 in a `.json`, and hundreds in memory), so these hold only if conversion stops
//! at the first invalid element and nothing decodes a whole graph first.
//!
//! The heap is measured by a counting global allocator; the tests of this file take turns.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex,
    },
};

use ir::io::{self, Format};
use prost::encoding::{encode_key, encode_varint, WireType};

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The tests of this file run one at a time: another test's allocations would count.
static TURN: Mutex<()> = Mutex::new(());

/// The peak of heap bytes `work` allocates beyond what was live when it started.
fn peak_extra<T>(work: impl FnOnce() -> T) -> (usize, T) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = work();
    (PEAK.load(Ordering::Relaxed).saturating_sub(before), result)
}

/// The bound every case must meet: this many times the file's size, plus a fixed allowance
/// for thread pools, batch buffers and the like.
const TIMES_FILE: usize = 10;
const FIXED: usize = 4 << 20;

fn field(out: &mut Vec<u8>, tag: u32, payload: &[u8]) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(payload.len() as u64, out);
    out.extend_from_slice(payload);
}

/// `count` copies of field `tag` holding `payload`.
fn repeated(tag: u32, payload: &[u8], count: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..count {
        field(&mut out, tag, payload);
    }
    out
}

/// A valid value and model for a node to refer to, then `rest`.
fn with_declarations(rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut value = Vec::new();
    field(&mut value, 1, b"v");
    value.extend([0x10, 1, 0x20, 3]); // float32, input
    field(&mut out, 2, &value);
    let mut model = Vec::new();
    field(&mut model, 1, b"m");
    field(&mut out, 5, &model);
    out.extend_from_slice(rest);
    out
}

/// A node named `n` of model `m` with `parts` appended inside it.
fn node_with(parts: &[u8]) -> Vec<u8> {
    let mut node = Vec::new();
    field(&mut node, 1, b"n");
    field(&mut node, 2, b"aten.mm.default");
    node.extend([0x30, 1]); // forward
    field(&mut node, 7, b"m");
    node.extend_from_slice(parts);
    let mut out = Vec::new();
    field(&mut out, 3, &node);
    out
}

const MANY: usize = 250_000;

/// Every shape of broken `.pb`: loading fails, and costs little.
fn broken_protobuf_files() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("empty nodes", repeated(3, b"", MANY)),
        (
            "empty values",
            [repeated(2, b"", MANY), repeated(3, b"", 1)].concat(),
        ),
        (
            "empty models",
            [repeated(5, b"", MANY), repeated(3, b"", 1)].concat(),
        ),
        (
            "empty outputs",
            with_declarations(&[node_with(b""), repeated(4, b"", MANY)].concat()),
        ),
        (
            "empty attributes",
            with_declarations(&node_with(&repeated(5, b"", MANY))),
        ),
        (
            "empty inputs",
            with_declarations(&node_with(&repeated(3, b"", MANY))),
        ),
        (
            "empty stack frames",
            with_declarations(&node_with(
                &[repeated(13, b"", MANY), repeated(3, b"?", 1)].concat(),
            )),
        ),
        ("empty units", {
            let mut model = Vec::new();
            field(&mut model, 1, b"m");
            model.extend(repeated(4, b"", MANY));
            let mut out = Vec::new();
            field(&mut out, 5, &model);
            [out, repeated(3, b"", 1)].concat()
        }),
    ]
}

/// Every shape of broken `.json`: one element of millions of parts, or millions of elements.
fn broken_json_files() -> Vec<(&'static str, Vec<u8>)> {
    let cases = [
        (
            "empty nodes",
            format!(r#"{{"nodes":[{}]}}"#, json_list("{}", MANY)),
        ),
        (
            "empty values",
            format!(r#"{{"values":[{}],"nodes":[{{}}]}}"#, json_list("{}", MANY)),
        ),
        (
            "empty attributes",
            format!(
                r#"{{"nodes":[{{"name":"n","attributes":[{}]}}]}}"#,
                json_list("{}", MANY)
            ),
        ),
        (
            "empty inputs",
            format!(
                r#"{{"nodes":[{{"name":"n","inputs":[{}]}}]}}"#,
                json_list(r#""""#, MANY)
            ),
        ),
        (
            "empty units",
            format!(
                r#"{{"models":[{{"name":"m","units":[{}]}}],"nodes":[{{}}]}}"#,
                json_list("{}", MANY)
            ),
        ),
        (
            "empty intervals",
            format!(
                r#"{{"models":[{{"name":"m","units":[{{"unit":"u","intervals":[{}]}}]}}],"nodes":[{{}}]}}"#,
                json_list("{}", MANY)
            ),
        ),
    ];
    cases.map(|(case, text)| (case, text.into_bytes())).into()
}

/// `count` copies of `item`, comma-separated.
fn json_list(item: &str, count: usize) -> String {
    vec![item; count].join(",")
}

/// Checks that `work` on `bytes` stays within the bound, and fails with an error.
fn check_bounded<T>(case: &str, bytes: &[u8], work: impl FnOnce() -> Result<T, ir::LoadError>) {
    let (extra, result) = peak_extra(work);
    let error = match result {
        Ok(_) => panic!("{case}: the broken file was accepted"),
        Err(error) => error,
    };
    assert!(
        extra <= TIMES_FILE * bytes.len() + FIXED,
        "{case}: {extra} bytes for a {}-byte file ({error})",
        bytes.len()
    );
}

#[test]
fn loading_a_broken_file_costs_a_small_multiple_of_the_file() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    for (format, files) in [
        (Format::Protobuf, broken_protobuf_files()),
        (Format::Json, broken_json_files()),
    ] {
        for (case, bytes) in files {
            check_bounded(case, &bytes, || {
                io::load_bytes(&bytes, format, Path::new("case")).map(drop)
            });
        }
    }
}

#[test]
fn converting_a_broken_file_costs_a_small_multiple_of_the_file() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ir-memory-bound-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (from, to, files) in [
        ("case.pb", "out.json", broken_protobuf_files()),
        ("case.json", "out.pb", broken_json_files()),
    ] {
        let (input, output) = (dir.join(from), dir.join(to));
        for (case, bytes) in files {
            std::fs::write(&input, &bytes).unwrap();
            check_bounded(case, &bytes, || io::convert(&input, &output, true));
            // Without validation the broken graph converts, one element at a time. The file
            // itself is read into memory too, so it counts once more.
            let (extra, result) = peak_extra(|| io::convert(&input, &output, false));
            result.unwrap_or_else(|e| panic!("{case}: {e}"));
            assert!(
                extra <= (TIMES_FILE + 1) * bytes.len() + FIXED,
                "{case}: converting without validation took {extra} bytes for {}",
                bytes.len()
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
