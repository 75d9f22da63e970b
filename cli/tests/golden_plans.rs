//! Golden plan tests: one file per case under `tests/golden/plans/`, cranelift-filetest style.
//!
//! ```text
//! # what the case shows (free comment lines)
//! graph: tests/golden/moe_ep2.pb
//! args: --keep all
//! ---
//! exit 0
//! <the text plan on stdout>
//! --- stderr          (only when stderr is not empty)
//! <stderr>
//! ```
//!
//! A mismatch prints a unified diff; `UPDATE_GOLDEN=1 cargo test --test golden_plans` rewrites the
//! expected part after reading the diff.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Case {
    path: PathBuf,
    header: String,
    graph: String,
    args: Vec<String>,
    expected: String,
}

fn parse(path: &Path) -> Case {
    let text = fs::read_to_string(path).unwrap();
    let (header, expected) = text
        .split_once("\n---\n")
        .unwrap_or_else(|| panic!("{}: no `---` line after the header", path.display()));
    let field = |name: &str| {
        header
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    };
    Case {
        path: path.to_owned(),
        header: header.to_owned(),
        graph: field("graph:").unwrap_or_else(|| panic!("{}: no `graph:` line", path.display())),
        args: field("args:")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        expected: expected.to_owned(),
    }
}

fn actual(case: &Case) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_planner"))
        .current_dir(repo_root())
        .arg("plan")
        .arg(&case.graph)
        .args(&case.args)
        .output()
        .expect("the planner runs");
    let mut text = format!("exit {}\n", out.status.code().unwrap_or(-1));
    text += &String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stderr.is_empty() {
        text += "--- stderr\n";
        text += &stderr;
    }
    text
}

#[test]
fn golden_plans() {
    let dir = repo_root().join("tests/golden/plans");
    let mut paths: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "plan"))
        .collect();
    paths.sort();
    assert!(
        !paths.is_empty(),
        "no golden plan cases in {}",
        dir.display()
    );
    let bless = testkit::updating();
    let mut failures = Vec::new();
    for path in &paths {
        let case = parse(path);
        let actual = actual(&case);
        if actual == case.expected {
            continue;
        }
        if bless {
            fs::write(&case.path, format!("{}\n---\n{actual}", case.header)).unwrap();
        } else {
            let name = case.path.display().to_string();
            failures.push(testkit::unified_diff(&name, &case.expected, &actual));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} golden plans differ (re-bless with UPDATE_GOLDEN=1 after reading the diff):\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n")
    );
}
