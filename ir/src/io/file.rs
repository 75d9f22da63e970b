//! Reading an input file whole, safely: only a regular file is read, never more than a limit
//! set per kind of file, and never by blocking. A path naming `/dev/zero`, `/dev/urandom` or
//! a FIFO would otherwise read until memory runs out, or wait forever for a writer.

use std::{
    fs::{self, File, Metadata},
    io::Read,
    path::Path,
};

use crate::error::LoadError;

/// What an input file holds: it names the file in messages and bounds its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// A graph, `.pb` or `.json`.
    Graph,
    /// A `--hw` hardware profile (a small JSON object).
    HardwareProfile,
    /// A plan written by `planner plan`, `.pb` or `.json`.
    Plan,
    /// A `--choices` file: a `pareto` point's units per layer, as JSON.
    Choices,
    /// `planner run`'s weights, inputs and reference (safetensors); its reader passes the
    /// run's memory limit to [`read_input_file_within`].
    Tensors,
}

const GIB: u64 = 1 << 30;

impl InputKind {
    /// How messages call the file.
    pub fn noun(self) -> &'static str {
        match self {
            InputKind::Graph => "graph",
            InputKind::HardwareProfile => "hardware profile",
            InputKind::Plan => "plan",
            InputKind::Choices => "choices file",
            InputKind::Tensors => "safetensors file",
        }
    }

    /// The largest file accepted, in bytes. A million-node graph is about 160 MB as `.pb` and
    /// four times that as `.json`; a hardware profile is a few hundred bytes.
    pub fn max_bytes(self) -> u64 {
        match self {
            InputKind::Graph | InputKind::Plan => 4 * GIB,
            // A few dozen bytes per layer: a million layers fit.
            InputKind::Choices => 256 << 20,
            InputKind::HardwareProfile => 1 << 20,
            // Real models' weights; the run's own memory limit is usually lower.
            InputKind::Tensors => 1 << 40,
        }
    }
}

/// The bytes of the regular file at `path`. Anything else (a directory, a character or block
/// device, a FIFO, a socket) and any file over [`InputKind::max_bytes`] is an error that
/// names the file; nothing is read from them. The file type is checked before opening (opening
/// some devices does something), the file is opened without blocking (a FIFO swapped in after
/// the check cannot make the open wait for a writer), and checked again once open.
pub fn read_input_file(path: &Path, kind: InputKind) -> Result<Vec<u8>, LoadError> {
    read_input_file_within(path, kind, kind.max_bytes())
}

/// [`read_input_file`] under a lower limit of the caller's (never above the kind's own).
pub fn read_input_file_within(
    path: &Path,
    kind: InputKind,
    limit: u64,
) -> Result<Vec<u8>, LoadError> {
    let io_error = |source| LoadError::Io {
        path: path.to_owned(),
        what: kind.noun(),
        source,
    };
    check_regular_file(path, kind, &fs::metadata(path).map_err(io_error)?)?;
    let file = open_without_blocking(path).map_err(io_error)?;
    let metadata = file.metadata().map_err(io_error)?;
    check_regular_file(path, kind, &metadata)?;
    let limit = limit.min(kind.max_bytes());
    let too_large = |size| LoadError::TooLarge {
        path: path.to_owned(),
        what: kind.noun(),
        size,
        limit,
    };
    if metadata.len() > limit {
        return Err(too_large(metadata.len()));
    }
    let mut bytes = Vec::new();
    // The size is known: one allocation, or a clean error when memory cannot hold it.
    bytes
        .try_reserve_exact(usize::try_from(metadata.len()).unwrap_or(usize::MAX))
        .map_err(|_| io_error(std::io::ErrorKind::OutOfMemory.into()))?;
    // The file may grow while it is read: never take more than one byte over the limit.
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io_error)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

fn check_regular_file(path: &Path, kind: InputKind, metadata: &Metadata) -> Result<(), LoadError> {
    if metadata.is_file() {
        return Ok(());
    }
    Err(LoadError::NotAFile {
        path: path.to_owned(),
        what: kind.noun(),
        file_type: file_type_name(metadata),
    })
}

#[cfg(unix)]
fn file_type_name(metadata: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let file_type = metadata.file_type();
    if file_type.is_dir() {
        "directory"
    } else if file_type.is_char_device() {
        "character device"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_fifo() {
        "FIFO (named pipe)"
    } else if file_type.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

#[cfg(not(unix))]
fn file_type_name(metadata: &Metadata) -> &'static str {
    if metadata.is_dir() {
        "directory"
    } else {
        "special file"
    }
}

/// Opens `path` for reading with `O_NONBLOCK`: opening a FIFO then returns at once instead of
/// waiting for a writer. Reading a regular file is not affected by the flag.
#[cfg(unix)]
fn open_without_blocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_without_blocking(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

#[cfg(all(test, unix))]
mod tests {
    use std::{path::PathBuf, sync::mpsc, time::Duration};

    use super::*;

    /// A scratch directory removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("ir-file-{name}-{}", std::process::id()));
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Reads `path` on another thread: a read that blocks fails the test instead of hanging it.
    fn read_within_seconds(path: PathBuf, kind: InputKind) -> Result<Vec<u8>, LoadError> {
        let (done, result) = mpsc::channel();
        std::thread::spawn(move || done.send(read_input_file(&path, kind)));
        result
            .recv_timeout(Duration::from_secs(10))
            .expect("reading returns at once")
    }

    fn not_a_file(path: &str) -> String {
        match read_within_seconds(PathBuf::from(path), InputKind::Graph) {
            Err(e @ LoadError::NotAFile { .. }) => e.to_string(),
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn a_regular_file_is_read_whole() {
        let dir = Scratch::new("regular");
        let path = dir.0.join("g.pb");
        fs::write(&path, b"bytes").unwrap();
        assert_eq!(read_input_file(&path, InputKind::Graph).unwrap(), b"bytes");
    }

    #[test]
    fn character_devices_are_not_read() {
        for device in ["/dev/zero", "/dev/urandom", "/dev/null"] {
            let message = not_a_file(device);
            assert!(message.contains("character device"), "{message}");
            assert!(message.contains(device), "{message}");
        }
    }

    #[test]
    fn a_directory_is_not_read() {
        let dir = Scratch::new("directory");
        let message = not_a_file(dir.0.to_str().unwrap());
        assert!(
            message.contains("a directory, not a regular file"),
            "{message}"
        );
    }

    #[test]
    fn a_fifo_without_a_writer_fails_at_once() {
        let dir = Scratch::new("fifo");
        let fifo = dir.0.join("graph.pb");
        let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo reads it and keeps nothing.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let message = not_a_file(fifo.to_str().unwrap());
        assert!(message.contains("FIFO"), "{message}");
    }

    #[test]
    fn a_link_to_a_device_is_not_read() {
        let dir = Scratch::new("link");
        let link = dir.0.join("graph.pb");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert!(not_a_file(link.to_str().unwrap()).contains("character device"));
    }

    #[test]
    fn a_file_over_the_limit_is_not_read() {
        let dir = Scratch::new("large");
        let path = dir.0.join("hw.json");
        let limit = InputKind::HardwareProfile.max_bytes();
        fs::write(&path, vec![b' '; limit as usize + 1]).unwrap();
        let error = read_input_file(&path, InputKind::HardwareProfile).unwrap_err();
        assert!(matches!(error, LoadError::TooLarge { size, .. } if size == limit + 1));
        let message = error.to_string();
        assert!(message.contains("hardware profile"), "{message}");
        fs::write(&path, vec![b' '; limit as usize]).unwrap();
        assert!(read_input_file(&path, InputKind::HardwareProfile).is_ok());
    }

    #[test]
    fn a_graph_over_the_limit_is_refused_before_reading() {
        let dir = Scratch::new("sparse");
        let path = dir.0.join("huge.pb");
        // A sparse file: its size is over the limit, its blocks are not on disk.
        let file = File::create(&path).unwrap();
        file.set_len(InputKind::Graph.max_bytes() + 1).unwrap();
        let error = read_input_file(&path, InputKind::Graph).unwrap_err();
        assert!(matches!(error, LoadError::TooLarge { .. }), "{error}");
    }

    #[test]
    fn a_missing_file_names_itself() {
        let message = read_input_file(Path::new("/nonexistent/g.pb"), InputKind::Graph)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("cannot read graph /nonexistent/g.pb: "),
            "{message}"
        );
    }
}
