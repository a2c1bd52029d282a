//! Compiles the libtorch CUDA shim (`csrc/torch_cuda_shim.cpp`) against the headers of the
//! libtorch that tch links, found the way torch-sys finds it (`LIBTORCH`, or the active
//! Python's `torch` with `LIBTORCH_USE_PYTORCH=1`). When that libtorch has no CUDA library,
//! a fallback whose every call reports "built without CUDA" is compiled instead.
use std::env;
use std::path::PathBuf;
use std::process::Command;

struct Torch {
    includes: Vec<PathBuf>,
    lib_dir: PathBuf,
    cxx11_abi: bool,
    cuda_include: Option<PathBuf>,
    /// The folder with NVRTC (`libnvrtc.so*`), where one is known.
    cuda_lib: Option<PathBuf>,
}

fn python() -> String {
    env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_string())
}

fn from_python() -> Torch {
    let script = r#"
import os, torch, torch.utils.cpp_extension as ce
print("LIB", os.path.join(os.path.dirname(torch.__file__), "lib"))
for p in ce.include_paths(): print("INC", p)
print("ABI", int(torch._C._GLIBCXX_USE_CXX11_ABI))
try:
    import nvidia
    for root in nvidia.__path__:
        for sub in ("cu13", "cuda_runtime"):
            inc = os.path.join(root, sub, "include")
            if os.path.exists(os.path.join(inc, "cuda_runtime_api.h")): print("CUDAINC", inc)
            lib = os.path.join(root, sub, "lib")
            if os.path.isdir(lib) and any(f.startswith("libnvrtc.so") for f in os.listdir(lib)): print("CUDALIB", lib)
except ImportError:
    pass
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .output()
        .expect("running python to locate torch (set LIBTORCH or run scripts/setup.sh)");
    assert!(
        out.status.success(),
        "python could not import torch: {}\nRun scripts/setup.sh and use its environment.",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut t = Torch { includes: vec![], lib_dir: PathBuf::new(), cxx11_abi: true, cuda_include: None, cuda_lib: None };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("LIB ") {
            t.lib_dir = v.into();
        } else if let Some(v) = line.strip_prefix("INC ") {
            t.includes.push(v.into());
        } else if let Some(v) = line.strip_prefix("ABI ") {
            t.cxx11_abi = v.trim() == "1";
        } else if let Some(v) = line.strip_prefix("CUDAINC ") {
            t.cuda_include.get_or_insert(v.into());
        } else if let Some(v) = line.strip_prefix("CUDALIB ") {
            t.cuda_lib.get_or_insert(v.into());
        }
    }
    t
}

fn from_libtorch(root: PathBuf) -> Torch {
    Torch {
        includes: vec![root.join("include"), root.join("include/torch/csrc/api/include")],
        lib_dir: root.join("lib"),
        cxx11_abi: env::var("LIBTORCH_CXX11_ABI").map(|v| v != "0").unwrap_or(true),
        cuda_include: None,
        cuda_lib: None,
    }
}

fn main() {
    println!("cargo:rerun-if-changed=csrc/torch_cuda_shim.cpp");
    println!("cargo:rerun-if-changed=csrc/no_cuda_shim.c");
    for v in ["LIBTORCH", "LIBTORCH_USE_PYTORCH", "LIBTORCH_CXX11_ABI", "PYTHON_SYS_EXECUTABLE", "CUDA_HOME", "WIDE_CUDA_INCLUDE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let mut torch = match env::var("LIBTORCH") {
        Ok(root) if env::var("LIBTORCH_USE_PYTORCH").is_err() => from_libtorch(root.into()),
        _ => from_python(),
    };
    if let Ok(inc) = env::var("WIDE_CUDA_INCLUDE") {
        torch.cuda_include = Some(inc.into());
    } else if torch.cuda_include.is_none() {
        if let Ok(home) = env::var("CUDA_HOME") {
            torch.cuda_include = Some(PathBuf::from(home).join("include"));
        } else if PathBuf::from("/usr/local/cuda/include/cuda_runtime_api.h").exists() {
            torch.cuda_include = Some("/usr/local/cuda/include".into());
        }
    }
    if let Some(inc) = &torch.cuda_include {
        // The run-time header search's last resort (`nvrtc::cuda_include_dir`).
        println!("cargo:rustc-env=WIDE_BUILD_CUDA_INCLUDE={}", inc.display());
    }
    let has_cuda_lib = torch.lib_dir.join("libtorch_cuda.so").exists();
    // A torch installed, upgraded or swapped for its CUDA build rebuilds the shim (cargo checks
    // the modification times of the folder's files).
    println!("cargo:rerun-if-changed={}", torch.lib_dir.display());
    println!("cargo:rustc-link-search=native={}", torch.lib_dir.display());
    match (&torch.cuda_include, has_cuda_lib) {
        (Some(cuda_inc), true) => {
            let mut build = cc::Build::new();
            build.cpp(true).file("csrc/torch_cuda_shim.cpp").std("c++17").warnings(false);
            for inc in &torch.includes {
                build.include(inc);
            }
            build.include(cuda_inc);
            build.define("_GLIBCXX_USE_CXX11_ABI", if torch.cxx11_abi { "1" } else { "0" });
            build.flag_if_supported("-Wno-unused-parameter");
            build.compile("wide_torch_cuda_shim");
            println!("cargo:rustc-link-lib=dylib=torch_cuda");
            println!("cargo:rustc-link-lib=dylib=c10_cuda");
            println!("cargo:rustc-link-lib=dylib=c10");
            println!("cargo:rustc-link-lib=dylib=torch_cpu");
            println!("cargo:rustc-cfg=wide_cuda_shim");
        }
        _ => {
            println!(
                "cargo:warning=libtorch at {} has no CUDA library or no CUDA headers were found: the CUDA shim reports 'built without CUDA' at run time",
                torch.lib_dir.display()
            );
            cc::Build::new().file("csrc/no_cuda_shim.c").compile("wide_torch_cuda_shim");
        }
    }
    println!("cargo::rustc-check-cfg=cfg(wide_cuda_shim)");
    // The folders for the programs that link this crate (`DEP_WIDE_TORCH_TORCH_LIB` and
    // `DEP_WIDE_TORCH_CUDA_LIB` in their build scripts), which record them as run paths so that a
    // built binary finds libtorch and NVRTC without LD_LIBRARY_PATH (which still comes first: a
    // GPU machine's env.sh names its own libraries); this crate's test binaries get them too.
    let mut run_paths = vec![torch.lib_dir.clone()];
    println!("cargo:torch_lib={}", torch.lib_dir.display());
    if let Some(lib) = &torch.cuda_lib {
        println!("cargo:cuda_lib={}", lib.display());
        run_paths.push(lib.clone());
    }
    for dir in run_paths {
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{}", dir.display());
    }
    // Test binaries of this crate must keep libtorch_cuda loaded even when they reference none
    // of its symbols (the linker's --as-needed would drop it and CUDA would look absent).
    if has_cuda_lib {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
