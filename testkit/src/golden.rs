//! Golden files: where they are, and the line diff a mismatch prints.

use std::path::{Path, PathBuf};

/// The repository root (this crate sits one level below it).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `tests/golden/NAME.pb`, a graph the exporter's model zoo wrote.
pub fn golden_graph(name: &str) -> PathBuf {
    repo_root().join(format!("tests/golden/{name}.pb"))
}

/// Whether golden files are being re-blessed (`UPDATE_GOLDEN=1`).
pub fn updating() -> bool {
    std::env::var_os("UPDATE_GOLDEN").is_some()
}

/// The lines that differ between `expected` and `actual`, for a golden mismatch.
pub fn line_diff(expected: &str, actual: &str) -> String {
    let (e, a): (Vec<_>, Vec<_>) = (expected.lines().collect(), actual.lines().collect());
    let mut diff = String::new();
    for i in 0..e.len().max(a.len()) {
        match (e.get(i), a.get(i)) {
            (Some(x), Some(y)) if x == y => {}
            (x, y) => {
                diff += &format!(
                    "  line {}:\n  - {}\n  + {}\n",
                    i + 1,
                    x.unwrap_or(&""),
                    y.unwrap_or(&"")
                );
            }
        }
    }
    diff
}
