//! With the `run` feature the runtime library (the package's cdylib, which the binary loads for
//! `planner run`) links libtorch through the runtime: make it load `libtorch_cuda` (nothing calls
//! it by name, so the linker's --as-needed would drop it and CUDA would be missing on a GPU
//! machine) and find libtorch without `LD_LIBRARY_PATH`. The binary itself never links libtorch.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_RUNTIME_SHIM_TORCH_LIB");
    if std::env::var_os("CARGO_FEATURE_RUN").is_none() {
        return;
    }
    let Some(lib) = std::env::var_os("DEP_RUNTIME_SHIM_TORCH_LIB") else {
        return;
    };
    let lib = std::path::PathBuf::from(lib);
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-cdylib-link-arg=-ltorch_cuda");
        println!("cargo:rustc-cdylib-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,{}", lib.display());
}
