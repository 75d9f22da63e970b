//! Where a command's output goes: stdout, or a file that is never one of the command's inputs.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use ir::io::{read_input_file, InputKind};

/// The destination of a command's output, checked before any work.
pub struct Output {
    path: Option<PathBuf>,
}

impl Output {
    pub fn stdout() -> Output {
        Output { path: None }
    }

    /// Writes to `path` (stdout without one); refused when `path` is one of `inputs` (the
    /// same file, whatever the spelling), so `plan G.pb -o G.pb` cannot destroy the graph.
    pub fn new(path: Option<&Path>, inputs: &[&Path]) -> Result<Output, String> {
        if let Some(path) = path {
            if let Some(input) = inputs.iter().find(|input| same_file(path, input)) {
                return Err(format!(
                    "refusing to write the output onto the input {}: choose another -o file",
                    input.display()
                ));
            }
        }
        Ok(Output {
            path: path.map(Path::to_owned),
        })
    }

    pub fn write(&self, bytes: &[u8]) -> Result<(), String> {
        match &self.path {
            Some(path) => {
                fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
            }
            None => write_stdout(bytes),
        }
    }
}

/// Whether two paths name one existing file (a missing output cannot be an input): the same
/// device and inode, so a hard link or a symbolic link to the input is the input too.
#[cfg(unix)]
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Whether two paths name one existing file (a missing output cannot be an input).
#[cfg(not(unix))]
fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Writes to stdout; a closed pipe (`planner inspect g.pb | head`) is not an error.
fn write_stdout(bytes: &[u8]) -> Result<(), String> {
    match std::io::stdout().lock().write_all(bytes) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("cannot write to stdout: {e}")),
    }
}

/// Reads an input file the command names that is not a graph (a choices file): a regular file
/// under the size limit of its kind, like every other input.
pub fn read_file(path: &Path, kind: InputKind) -> Result<Vec<u8>, String> {
    read_input_file(path, kind).map_err(|e| e.to_string())
}
