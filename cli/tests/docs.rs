//! The documents that describe the code are checked against it: the plan format's example is
//! the planner's output for a golden graph, the command-line reference (`docs/cli.md`) is the
//! binary's help, ARCHITECTURE.md's code map names every source file, and every relative link
//! of the README, ARCHITECTURE.md and `docs/` leads to a file (and heading) that exists.
//! Re-bless the example and the reference with
//! `UPDATE_GOLDEN=1 cargo test -p planner-cli --test docs`.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use testkit::repo_root;

/// The command whose output `docs/plan-format.md` shows, and how many items of each list the
/// excerpt keeps.
const EXAMPLE_ARGS: [&str; 6] = [
    "plan",
    "tests/golden/glm_dsa_ep2.pb",
    "--keep",
    "save_dsa_indexer",
    "--format",
    "json",
];
const EXAMPLE_ITEMS: usize = 2;

#[test]
fn the_plan_format_example_is_the_planners_output() {
    let done = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(EXAMPLE_ARGS)
        .current_dir(repo_root())
        .output()
        .expect("the planner binary runs");
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let json = String::from_utf8(done.stdout).expect("the plan's JSON is UTF-8");
    let path = repo_root().join("docs/plan-format.md");
    let doc = fs::read_to_string(&path).expect("docs/plan-format.md reads");
    let updated = with_example(&doc, &excerpt(&json, EXAMPLE_ITEMS))
        .expect("docs/plan-format.md has a ```json block under ## Example");
    if let Err(diff) = testkit::check_golden(&path, &updated) {
        panic!("{diff}");
    }
}

/// `doc` with the first ```json block after `## Example` replaced by `json`.
fn with_example(doc: &str, json: &str) -> Option<String> {
    let section = doc.find("\n## Example\n")?;
    let start = section + doc[section..].find("```json\n")? + "```json\n".len();
    let end = start + doc[start..].find("```\n")?;
    Some(format!("{}{json}{}", &doc[..start], &doc[end..]))
}

/// The pretty-printed JSON `json` with every list cut to its first `items` items, as text: the
/// planner's own key order and spelling are kept, which parsing into a map would not keep.
fn excerpt(json: &str, items: usize) -> String {
    let mut out: Vec<String> = Vec::new();
    // For each open list: the indentation of its items and how many have begun.
    let mut lists: Vec<(usize, usize)> = Vec::new();
    // While a list's further items are skipped: the indentation of its closing bracket.
    let mut skipping: Option<usize> = None;
    for line in json.lines() {
        let indent = line.len() - line.trim_start().len();
        let body = line.trim_start();
        if let Some(close) = skipping {
            if indent == close && body.starts_with(']') {
                skipping = None;
                if let Some(last) = out.last_mut() {
                    *last = last.trim_end_matches(',').to_owned();
                }
            } else {
                continue;
            }
        }
        if let Some((item_indent, begun)) = lists.last_mut() {
            if indent + 2 == *item_indent && body.starts_with(']') {
                lists.pop();
            } else if indent == *item_indent && !body.starts_with(['}', ']']) {
                *begun += 1;
                if *begun > items {
                    skipping = Some(indent - 2);
                    continue;
                }
            }
        }
        if body.ends_with('[') {
            lists.push((indent + 2, 0));
        }
        out.push(line.to_owned());
    }
    out.join("\n") + "\n"
}

#[test]
fn the_excerpt_keeps_the_first_items_of_every_list() {
    let json = "{\n  \"a\": [\n    1,\n    2,\n    3\n  ],\n  \"b\": [\n    {\n      \"c\": [\n        \"x\",\n        \"y\"\n      ]\n    },\n    {}\n  ]\n}";
    let expected = "{\n  \"a\": [\n    1\n  ],\n  \"b\": [\n    {\n      \"c\": [\n        \"x\"\n      ]\n    }\n  ]\n}\n";
    assert_eq!(excerpt(json, 1), expected);
}

/// The folders whose source files the code map names; tests, fuzzing data, build output and
/// the stale `_generated/` an older package wrote at import are left out.
const SOURCE_DIRS: [&str; 9] = [
    "ir", "planner", "commands", "cli", "runtime", "testkit", "python", "scripts", "fuzz",
];
const SOURCE_EXTENSIONS: [&str; 5] = ["rs", "py", "cpp", "h", "sh"];
const SKIPPED_DIRS: [&str; 8] = [
    "tests",
    "target",
    "corpus",
    "regressions",
    "open-findings",
    "artifacts",
    "__pycache__",
    "_generated",
];

#[test]
fn the_code_map_names_every_source_file() {
    let root = repo_root();
    let architecture =
        fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md reads");
    let named = named_paths(&architecture);
    let mut files = Vec::new();
    for dir in SOURCE_DIRS {
        source_files(&root, &root.join(dir), &mut files);
    }
    let missing: Vec<&String> = files.iter().filter(|f| !is_named(f, &named)).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map does not name these source files:\n  {}\n\
         Name each in the section of its top folder (### `ir/`), by its path below that folder \
         with `src/` left out (`io/file.rs`, `tests/cli.rs`), or by its file name in a bullet \
         that begins with its folder (- `io/`: ... `file.rs` ...); python/ files also without \
         `recompute_planner/`.",
        missing
            .iter()
            .map(|f| f.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// Every source file below `dir`, as a path from the repository root with `/` separators.
fn source_files(root: &Path, dir: &Path, files: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !SKIPPED_DIRS.contains(&name) && !name.starts_with('.') {
                source_files(root, &path, files);
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| SOURCE_EXTENSIONS.contains(&e))
        {
            let relative = path.strip_prefix(root).expect("below the root");
            files.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// Whether the code map names `file` (`ir/src/io/file.rs`): its section (`ir`) holds its
/// path below the folder, `src/` and the Python package's folder left out.
fn is_named(file: &str, named: &BTreeSet<(String, String)>) -> bool {
    let (section, rest) = file.split_once('/').unwrap_or(("", file));
    let within = rest.strip_prefix("src/").unwrap_or(rest);
    let within = within.strip_prefix("recompute_planner/").unwrap_or(within);
    named.contains(&(section.to_owned(), within.to_owned()))
        || named.contains(&(section.to_owned(), rest.to_owned()))
}

/// (section, path) for every path the code map names: each backticked name in a section
/// (`### \`ir/\``), and, in a bullet that begins with a folder (- `io/`: ...), each name also
/// below that folder.
fn named_paths(architecture: &str) -> BTreeSet<(String, String)> {
    let Some(map) = architecture.split("\n## Code map\n").nth(1) else {
        return BTreeSet::new();
    };
    let map = map.split("\n## ").next().unwrap_or(map);
    let mut named = BTreeSet::new();
    for section in map.split("\n### ").skip(1) {
        let (heading, body) = section.split_once('\n').unwrap_or((section, ""));
        let folders: Vec<String> = backticked(heading)
            .map(|f| f.trim_end_matches('/').to_owned())
            .collect();
        for bullet in bullets(body) {
            let mut names = backticked(&bullet).peekable();
            let base = names
                .peek()
                .filter(|n| n.ends_with('/'))
                .map(|n| n.to_owned());
            for name in names {
                for folder in &folders {
                    named.insert((folder.clone(), name.to_owned()));
                    if let Some(base) = &base {
                        named.insert((folder.clone(), format!("{base}{name}")));
                    }
                }
            }
        }
    }
    named
}

/// A section's paragraphs and bullets, each as one text.
fn bullets(body: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in body.lines() {
        if line.starts_with("- ") || out.is_empty() || line.trim().is_empty() {
            out.push(String::new());
        }
        if let Some(last) = out.last_mut() {
            last.push_str(line);
            last.push('\n');
        }
    }
    out
}

/// The backticked spans of `text`.
fn backticked(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2)
}

/// The lines around `docs/cli.md`'s generated half: the help of `planner` and of each command.
const CLI_BEGIN: &str =
    "<!-- generated by cli/tests/docs.rs: UPDATE_GOLDEN=1 cargo test -p planner-cli --test docs -->";
const CLI_END: &str = "<!-- end generated -->";

#[test]
fn the_cli_reference_is_the_binarys_help() {
    let top = help(&[]);
    let commands = subcommands(&top);
    for expected in testkit::PLANNER_COMMANDS {
        assert!(
            commands.iter().any(|c| c == *expected),
            "`planner --help` lists no `{expected}`: {commands:?}"
        );
    }
    let mut generated = format!("{CLI_BEGIN}\n\n{}", help_section("planner", &top));
    for command in &commands {
        generated += &help_section(&format!("planner {command}"), &help(&[command]));
    }
    generated += CLI_END;
    let path = repo_root().join("docs/cli.md");
    let doc = fs::read_to_string(&path).expect("docs/cli.md reads");
    let updated = with_generated(&doc, &generated).unwrap_or_else(|| {
        panic!("docs/cli.md has no `{CLI_BEGIN}` line followed by a `{CLI_END}` line")
    });
    if let Err(diff) = testkit::check_golden(&path, &updated) {
        panic!("{diff}");
    }
}

/// `planner ARGS --help` (the long help), as every build of the binary prints it: `run` and
/// `calibrate` are parsed, and so documented, with or without the runtime. Clap wraps at the
/// terminal width only with its `wrap_help` feature, off here; `COLUMNS` pins the width should
/// it come on. Trailing spaces are cut, which a Markdown file would not keep.
fn help(args: &[&str]) -> String {
    let done = Command::new(env!("CARGO_BIN_EXE_planner"))
        .args(args)
        .arg("--help")
        .env("COLUMNS", "100")
        .env("NO_COLOR", "1")
        .env_remove("CLICOLOR_FORCE")
        .output()
        .expect("the planner binary runs");
    assert!(
        done.status.success(),
        "planner {args:?} --help: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let text = String::from_utf8(done.stdout).expect("the help is UTF-8");
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    lines.join("\n").trim_end().to_owned() + "\n"
}

/// The commands `planner --help` lists, in its order, without clap's own `help`.
fn subcommands(top: &str) -> Vec<String> {
    let list = top
        .split("\nCommands:\n")
        .nth(1)
        .expect("`planner --help` lists its commands");
    list.lines()
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|command| *command != "help")
        .map(str::to_owned)
        .collect()
}

fn help_section(title: &str, help: &str) -> String {
    format!("## {title}\n\n```text\n{help}```\n\n")
}

/// `doc` with everything from the line `CLI_BEGIN` to the line `CLI_END` (both included)
/// replaced by `generated`.
fn with_generated(doc: &str, generated: &str) -> Option<String> {
    let start = doc.find(CLI_BEGIN)?;
    let end = start + doc[start..].find(CLI_END)? + CLI_END.len();
    Some(format!("{}{generated}{}", &doc[..start], &doc[end..]))
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = repo_root();
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    markdown_files(&root.join("docs"), &mut files);
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = fs::read_to_string(file).expect("a Markdown file reads");
        let name = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = target.split_once('#').unwrap_or((target.as_str(), ""));
            let linked = if path.is_empty() {
                file.clone()
            } else {
                file.parent().expect("a file has a folder").join(path)
            };
            if !linked.exists() {
                broken.push(format!("{name}: ({target}): no such file"));
            } else if !anchor.is_empty() && linked.extension().is_some_and(|e| e == "md") {
                let headings = fs::read_to_string(&linked).expect("a Markdown file reads");
                if !anchors(&headings).contains(anchor) {
                    broken.push(format!("{name}: ({target}): no such heading"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: is the scan broken?"
    );
    assert!(
        broken.is_empty(),
        "broken relative links:\n  {}",
        broken.join("\n  ")
    );
}

/// Every `.md` file below `dir`.
fn markdown_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            markdown_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
}

/// `text` without its fenced code blocks.
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The targets of the inline links (`[text](target)`) outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    // Code spans may hold `](`: drop them (a backticked span never holds a link).
    let outside_code: String = prose.split('`').step_by(2).collect::<Vec<_>>().join(" ");
    outside_code
        .split("](")
        .skip(1)
        .filter_map(|rest| {
            rest.split_once(')')
                .map(|(target, _)| target.trim().to_owned())
        })
        .collect()
}

/// The anchors GitHub gives a Markdown file's headings: lower case, spaces as hyphens, and
/// every other character but letters, digits, `-` and `_` left out.
fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| {
            line.trim_start_matches('#')
                .trim()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => {
                        Some(c.to_lowercase().next().unwrap_or(c))
                    }
                    _ => None,
                })
                .collect()
        })
        .collect()
}
