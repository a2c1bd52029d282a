//! Run-time compilation of CUDA C++ with NVRTC, cached in process and on disk.
//!
//! A kernel is a [`KernelSource`]: source text, entry points and compile-time defines (the
//! shape/tile specialisation). The cache key is a hash of source, defines, options and target
//! architecture, so an edited kernel never reuses a stale image. The disk cache lives in
//! `$WIDE_KERNEL_CACHE` or `~/.cache/wide/kernels`.
use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// One CUDA translation unit and how to specialise it.
#[derive(Debug, Clone)]
pub struct KernelSource {
    /// Name used in error messages and cache file names.
    pub name: &'static str,
    pub source: &'static str,
    /// `-D NAME=VALUE` specialisations.
    pub defines: Vec<(String, String)>,
    /// A fixed NVRTC target (e.g. `compute_90a` for Hopper-only instructions) instead of the
    /// device's own `compute_XY`; such a module loads only on devices of that compute capability.
    pub target: Option<&'static str>,
}

impl KernelSource {
    pub fn new(name: &'static str, source: &'static str) -> Self {
        Self { name, source, defines: Vec::new(), target: None }
    }
    /// Compiles for `arch` only (an architecture-specific target such as `compute_90a`).
    pub fn target(mut self, arch: &'static str) -> Self {
        self.target = Some(arch);
        self
    }
    pub fn define(mut self, key: &str, value: impl ToString) -> Self {
        self.defines.push((key.to_string(), value.to_string()));
        self
    }
}

/// Compiled device code: PTX text (for `compute_XY` targets).
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub arch: String,
    pub ptx: Arc<Vec<u8>>,
    pub key: u64,
}

fn options(src: &KernelSource, arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        "--fmad=true".to_string(),
    ];
    if let Some(inc) = cuda_include_dir() {
        o.push(format!("--include-path={}", inc.display()));
    }
    for (k, v) in &src.defines {
        o.push(format!("-D{k}={v}"));
    }
    o
}

/// CUDA headers for kernels that include `<cuda_bf16.h>` and friends: `$WIDE_CUDA_INCLUDE`,
/// `$CUDA_HOME/include` or `/usr/local/cuda/include`. NVRTC ships the builtin ones itself.
fn cuda_include_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut cands = vec![];
        if let Ok(d) = std::env::var("WIDE_CUDA_INCLUDE") {
            cands.push(PathBuf::from(d));
        }
        if let Ok(d) = std::env::var("CUDA_HOME") {
            cands.push(PathBuf::from(d).join("include"));
        }
        cands.push("/usr/local/cuda/include".into());
        cands.into_iter().find(|d| d.join("cuda_bf16.h").exists())
    })
    .clone()
}

fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("WIDE_KERNEL_CACHE") {
        return d.into();
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache/wide/kernels")
}

fn key_of(src: &KernelSource, opts: &[String]) -> u64 {
    // FNV-1a: stable across runs and toolchains (std's hasher is not).
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 ^= *b as u64;
                self.0 = self.0.wrapping_mul(0x100000001b3);
            }
        }
    }
    let mut h = Fnv(0xcbf29ce484222325);
    src.source.hash(&mut h);
    opts.hash(&mut h);
    h.finish()
}

/// Is the NVRTC library loadable here?
pub fn nvrtc_available() -> bool {
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Compiles `src` for `arch` (e.g. `compute_90`), from the in-process cache, the disk cache,
/// or NVRTC, in that order.
pub fn compile(src: &KernelSource, arch: &str) -> Result<CompiledKernel> {
    static MEM: OnceLock<Mutex<HashMap<u64, CompiledKernel>>> = OnceLock::new();
    let opts = options(src, arch);
    let key = key_of(src, &opts);
    let mem = MEM.get_or_init(Default::default);
    if let Some(k) = mem.lock().unwrap().get(&key) {
        return Ok(k.clone());
    }
    let file = cache_dir().join(format!("{}-{arch}-{key:016x}.ptx", src.name));
    let ptx = match std::fs::read(&file) {
        Ok(bytes) if !bytes.is_empty() => bytes,
        _ => {
            let ptx = compile_uncached(src, &opts)?;
            store(&file, &ptx);
            ptx
        }
    };
    let k = CompiledKernel { arch: arch.to_string(), ptx: Arc::new(ptx), key };
    mem.lock().unwrap().insert(key, k.clone());
    Ok(k)
}

fn store(file: &PathBuf, ptx: &[u8]) {
    // Best effort: a read-only cache directory only costs a recompile next time.
    if let Some(dir) = file.parent() {
        if std::fs::create_dir_all(dir).is_ok() {
            let tmp = file.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, ptx).is_ok() {
                let _ = std::fs::rename(&tmp, file);
            }
        }
    }
}

fn compile_uncached(src: &KernelSource, opts: &[String]) -> Result<Vec<u8>> {
    if !nvrtc_available() {
        bail!(
            "NVRTC (libnvrtc.so) was not found, so kernel `{}` cannot be compiled: put the CUDA runtime's lib directory on LD_LIBRARY_PATH (scripts/setup.sh --print-env does)",
            src.name
        );
    }
    let csrc = CString::new(src.source).context("kernel source contains a NUL byte")?;
    let name = CString::new(format!("{}.cu", src.name)).unwrap();
    let prog = nvrtc::create_program(&csrc, Some(&name))
        .map_err(|e| anyhow!("nvrtc could not create program {}: {e:?}", src.name))?;
    let res = unsafe { nvrtc::compile_program(prog, opts) };
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Err(e) = res {
        let _ = unsafe { nvrtc::destroy_program(prog) };
        bail!("compiling kernel `{}` with NVRTC failed ({e:?}), options {opts:?}:\n{log}", src.name);
    }
    let ptx = unsafe { nvrtc::get_ptx(prog) };
    let _ = unsafe { nvrtc::destroy_program(prog) };
    let ptx = ptx.map_err(|e| anyhow!("reading PTX of `{}`: {e:?}", src.name))?;
    // NVRTC returns the text with its terminating NUL, which cuModuleLoadData needs.
    Ok(ptx.into_iter().map(|c| c as u8).collect())
}
