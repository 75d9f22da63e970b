//! Golden files: where they are, the one switch that re-blesses them, and the unified diff a
//! mismatch prints.

use std::{
    fs,
    path::{Path, PathBuf},
};

use similar::TextDiff;

/// The repository root (this crate sits one level below it).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `tests/golden/NAME.pb`, a graph the exporter's model zoo wrote.
pub fn golden_graph(name: &str) -> PathBuf {
    repo_root().join(format!("tests/golden/{name}.pb"))
}

/// Whether golden files are being re-blessed (`UPDATE_GOLDEN=1`): every golden check reads
/// this one switch.
pub fn updating() -> bool {
    std::env::var_os("UPDATE_GOLDEN").is_some()
}

/// Holds `actual` to the golden file at `path`: when re-blessing, writes it there; otherwise
/// a difference is an error holding the unified diff from the file to `actual`.
pub fn check_golden(path: &Path, actual: &str) -> Result<(), String> {
    if updating() {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        return fs::write(path, actual).map_err(|e| format!("{}: {e}", path.display()));
    }
    let expected = fs::read_to_string(path).unwrap_or_default();
    if expected == actual {
        return Ok(());
    }
    let root = repo_root();
    let name = path
        .strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string();
    Err(format!(
        "{name} differs (re-bless with UPDATE_GOLDEN=1 after reading the diff):\n{}",
        unified_diff(&name, &expected, actual)
    ))
}

/// The unified diff (three lines of context) from `expected`, the golden file `name`, to
/// `actual`: an inserted line shows as one line, not as every line after it.
pub fn unified_diff(name: &str, expected: &str, actual: &str) -> String {
    TextDiff::from_lines(expected, actual)
        .unified_diff()
        .context_radius(3)
        .header(name, "actual")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inserted_line_diffs_as_one_added_line() {
        let expected = "a\nb\nc\nd\n";
        let actual = "a\nnew\nb\nc\nd\n";
        let diff = unified_diff("golden", expected, actual);
        let changed: Vec<&str> = diff
            .lines()
            .filter(|l| {
                (l.starts_with('+') || l.starts_with('-'))
                    && !l.starts_with("+++")
                    && !l.starts_with("---")
            })
            .collect();
        assert_eq!(changed, ["+new"], "{diff}");
        assert!(diff.starts_with("--- golden\n+++ actual\n"), "{diff}");
    }
}
