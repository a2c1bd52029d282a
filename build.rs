//! Records the git commit the binary is built from (the GPU machine receives no `.git`, so
//! results files take the commit from the binary) and keeps libtorch_cuda linked.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = std::env::var("WIDE_GIT_COMMIT").ok().or_else(|| {
        let head = git(&["rev-parse", "HEAD"])?;
        let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty()).unwrap_or(false);
        Some(if dirty { format!("{head}-dirty") } else { head })
    });
    println!("cargo:rustc-env=WIDE_GIT_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
    println!("cargo:rerun-if-env-changed=WIDE_GIT_COMMIT");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for f in ["HEAD", "index", "refs/heads"] {
            println!("cargo:rerun-if-changed={dir}/{f}");
        }
    }
    // Run paths to the libtorch and NVRTC that wide-kernels found (its build script's
    // metadata), so `target/release/wide` runs without LD_LIBRARY_PATH; where that variable
    // is set (the GPU machine's env.sh) it still comes first.
    for var in ["DEP_WIDE_TORCH_TORCH_LIB", "DEP_WIDE_TORCH_CUDA_LIB"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Some(dir) = std::env::var(var).ok().filter(|d| !d.is_empty()) {
            println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{dir}");
        }
    }
    // libtorch_cuda registers CUDA with libtorch when loaded; the default --as-needed link
    // would drop it since no symbol of it is called directly.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch_cuda");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
