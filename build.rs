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
    // libtorch_cuda registers CUDA with libtorch when loaded; the default --as-needed link
    // would drop it since no symbol of it is called directly.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch_cuda");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
