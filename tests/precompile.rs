//! `wide kernels precompile`: every image of the chosen families lands in the directory as
//! machine code, named as the run-time cache looks it up, and a second run reuses them.
mod common;

use common::run_wide;

#[test]
fn precompile_writes_cubins_the_cache_reuses() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("kernels");
    let d = dir.to_str().unwrap();
    let out = run_wide(&["kernels", "precompile", "--arch", "sm_90", "--only", "infer", "--out", d]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("2 images") && stdout.contains("(2 compiled"), "{stdout}");
    let list = wide_kernels::ops::precompile_list("sm_90", &["infer".to_string()]).unwrap();
    assert_eq!(list.len(), 2, "bf16 and f16");
    for (k, arch) in &list {
        let (file, _) = wide_kernels::nvrtc::cache_file(k, arch);
        let p = dir.join(file.file_name().unwrap());
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(bytes.starts_with(b"\x7fELF"), "{} is not machine code", p.display());
    }
    // A corrupt image is rebuilt, the good one kept.
    let victim = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
    std::fs::write(&victim, b"not a cubin").unwrap();
    let out = run_wide(&["kernels", "precompile", "--arch", "sm_90", "--only", "infer", "--out", d]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("(1 compiled"), "{stdout}");
    assert!(std::fs::read(&victim).unwrap().starts_with(b"\x7fELF"));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2, "no temporary files left behind");
}
