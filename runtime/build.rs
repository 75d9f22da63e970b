//! Builds the C++ shim (`shim/shim.cpp`) against the libtorch that tch links: the same
//! headers, C++ standard and ABI flag torch-sys compiles its own wrapper with. libtorch comes
//! from the Python environment's torch (`LIBTORCH_USE_PYTORCH=1`), as for torch-sys.

use std::{env, path::PathBuf, process::Command};

/// What the Python environment's torch says about itself.
const PRINT_TORCH: &str = r"
import torch
from torch.utils import cpp_extension
print('CXX11:', torch._C._GLIBCXX_USE_CXX11_ABI)
for path in cpp_extension.include_paths():
    print('INCLUDE:', path)
for path in cpp_extension.library_paths():
    print('LIB:', path)
";

struct Torch {
    cxx11_abi: bool,
    includes: Vec<PathBuf>,
    lib: PathBuf,
}

fn python() -> &'static str {
    // The interpreter torch-sys asks (the environment's first `python` / `python3`).
    if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    }
}

fn query_torch() -> Torch {
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    println!("cargo:rerun-if-env-changed=PATH");
    let output = Command::new(python())
        .args(["-c", PRINT_TORCH])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (source scripts/env.sh)", python()));
    assert!(
        output.status.success(),
        "the Python environment has no torch (source scripts/env.sh): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let mut torch = Torch {
        cxx11_abi: true,
        includes: Vec::new(),
        lib: PathBuf::new(),
    };
    for line in text.lines() {
        if let Some(abi) = line.strip_prefix("CXX11: ") {
            torch.cxx11_abi = abi == "True";
        } else if let Some(path) = line.strip_prefix("INCLUDE: ") {
            torch.includes.push(PathBuf::from(path));
        } else if let Some(path) = line.strip_prefix("LIB: ") {
            torch.lib = PathBuf::from(path);
        }
    }
    torch
}

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.cpp");
    let torch = query_torch();
    cc::Build::new()
        .cpp(true)
        .file("shim/shim.cpp")
        .includes(&torch.includes)
        .flag("-std=c++17")
        .flag(format!(
            "-D_GLIBCXX_USE_CXX11_ABI={}",
            u8::from(torch.cxx11_abi)
        ))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("runtime_shim");
    // The lib directory for crates that link a binary with the runtime (`DEP_RUNTIME_SHIM_TORCH_LIB`).
    println!("cargo:torch_lib={}", torch.lib.display());
    // Tests and binaries of this crate load libtorch_cuda even though nothing calls it by name,
    // so CUDA is there when a GPU is (the linker's --as-needed would drop it).
    if torch.lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", torch.lib.display());
}
