//! Run-time compilation of CUDA C++ with NVRTC, cached in process and on disk.
//!
//! A kernel is a [`KernelSource`]: source text, entry points and compile-time defines (the
//! shape/tile specialisation). The cache key is a hash of source, defines, options and target
//! architecture, so an edited kernel never reuses a stale image. The disk cache lives in
//! `$WIDE_KERNEL_CACHE` or `~/.cache/wide/kernels`.
//!
//! Two images: PTX for a virtual target (`compute_XY`; the driver compiles it when it loads)
//! and a cubin for a real one (`sm_XY`, machine code the driver loads as it is). NVRTC needs no
//! GPU, so `wide kernels precompile` fills a cache directory with every shipped variant's cubin
//! on any machine, for a GPU machine that keeps no cache of its own; the GPU path loads a cached
//! cubin when there is one and otherwise compiles PTX (faster from cold than NVRTC's own
//! machine-code step: 29 s against 45 s for one `wide bench e2e` on the H200).
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

/// Compiled device code: PTX text (NUL-terminated) for a `compute_XY` target, a cubin (ELF
/// machine code) for an `sm_XY` one.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub arch: String,
    pub image: Arc<Vec<u8>>,
    pub key: u64,
}

/// Whether `arch` names a real architecture (`sm_90`, `sm_90a`: NVRTC emits a cubin) rather than
/// a virtual one (`compute_90`: PTX).
pub fn is_real_arch(arch: &str) -> bool {
    arch.starts_with("sm_")
}

/// Checks an architecture name for `--arch`-style user input: `sm_` or `compute_` and a
/// compute capability of two or three digits, optionally with the `a` suffix.
pub fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").or_else(|| arch.strip_prefix("compute_")).map(|d| d.trim_end_matches('a'));
    match digits {
        Some(d) if (2..=3).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => bail!("unknown GPU architecture `{arch}`: use sm_XY for machine code (sm_90 for an H100/H200, sm_80 for an A100) or compute_XY for PTX"),
    }
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
/// `$CUDA_HOME/include`, `/usr/local/cuda/include` or the build's own. NVRTC ships the builtin
/// ones itself.
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
        // Last, the headers this binary was built against, where they still are.
        if let Some(d) = option_env!("WIDE_BUILD_CUDA_INCLUDE") {
            cands.push(d.into());
        }
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

thread_local! {
    static SOURCE_HASHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many kernel sources this thread has hashed (each `CudaKernel::get` and cache lookup
/// hashes its whole source). A launch path that hashes on every call pays that in host time
/// (~0.1 ms for the routed module); tests use this to check that hot paths take loaded entries
/// from their maps instead.
pub fn source_hashes() -> u64 {
    SOURCE_HASHES.with(|c| c.get())
}

fn key_of(src: &KernelSource, opts: &[String]) -> u64 {
    SOURCE_HASHES.with(|c| c.set(c.get() + 1));
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
    // Where the CUDA headers sit differs between machines (a precompiled image must be found
    // on the GPU machine), so the include path is not part of the key; nor is NVRTC's version,
    // for the same reason: an image the driver refuses is compiled again (`CudaKernel::get`).
    let opts: Vec<&String> = opts.iter().filter(|o| !o.starts_with("--include-path=")).collect();
    opts.hash(&mut h);
    h.finish()
}

/// Is the NVRTC library loadable here?
pub fn nvrtc_available() -> bool {
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Where the disk cache keeps the image of `src` for `arch`, and its key.
pub fn cache_file(src: &KernelSource, arch: &str) -> (PathBuf, u64) {
    let key = key_of(src, &options(src, arch));
    let ext = if is_real_arch(arch) { "cubin" } else { "ptx" };
    (cache_dir().join(format!("{}-{arch}-{key:016x}.{ext}", src.name)), key)
}

/// Whether a cache file's bytes can be loaded for `arch`: for a real architecture a 64-bit ELF
/// image whose header tables and sections all lie inside the file (a truncated cubin fails
/// this), else PTX text with its `.version` line and the terminating NUL the driver reads up to.
/// A truncated or foreign file is recompiled (and replaced), never loaded.
fn valid_image(bytes: &[u8], arch: &str) -> bool {
    if is_real_arch(arch) {
        elf_end(bytes).is_some_and(|end| end <= bytes.len() as u64)
    } else {
        let head = &bytes[..bytes.len().min(4096)];
        bytes.last() == Some(&0) && head.windows(8).any(|w| w == b".version")
    }
}

/// Where a little-endian ELF64 image's last header table or section ends, if its headers can be
/// read (`None` for anything else).
fn elf_end(bytes: &[u8]) -> Option<u64> {
    let field = |at: u64, n: u64| -> Option<u64> {
        let at = usize::try_from(at).ok()?;
        Some(bytes.get(at..at.checked_add(n as usize)?)?.iter().rev().fold(0u64, |v, &x| (v << 8) | x as u64))
    };
    if !bytes.starts_with(b"\x7fELF") || bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return None;
    }
    let (phoff, shoff) = (field(0x20, 8)?, field(0x28, 8)?);
    let (phentsize, phnum, shentsize, shnum) = (field(0x36, 2)?, field(0x38, 2)?, field(0x3a, 2)?, field(0x3c, 2)?);
    if shnum == 0 || shentsize < 64 {
        return None;
    }
    let mut end = (shoff.checked_add(shentsize * shnum)?).max(phoff.checked_add(phentsize * phnum)?);
    for i in 0..shnum {
        let sh = shoff + i * shentsize;
        // sh_type at +4; sh_offset at +24, sh_size at +32; SHT_NOBITS (8) occupies no bytes.
        if field(sh + 4, 4)? != 8 {
            end = end.max(field(sh + 24, 8)?.checked_add(field(sh + 32, 8)?)?);
        }
    }
    Some(end)
}

/// Compiles `src` for `arch` with NVRTC, bypassing both caches, and replaces their entries: for
/// a cached image the driver refused (one written by another toolchain).
pub fn recompile(src: &KernelSource, arch: &str) -> Result<CompiledKernel> {
    let (file, key) = cache_file(src, arch);
    let image = compile_uncached(src, &options(src, arch), is_real_arch(arch))?;
    let _ = write_atomically(&file, &image);
    let k = CompiledKernel { arch: arch.to_string(), image: Arc::new(image), key };
    mem_cache().lock().unwrap().insert(key, k.clone());
    Ok(k)
}

/// Compiles `src` for `arch` (`compute_90`: PTX; `sm_90`: a cubin), from the in-process cache,
/// the disk cache, or NVRTC, in that order.
pub fn compile(src: &KernelSource, arch: &str) -> Result<CompiledKernel> {
    if let Some(k) = cached(src, arch) {
        return Ok(k);
    }
    // Best effort on the disk cache: a read-only cache directory only costs a recompile next time.
    recompile(src, arch)
}

/// Compiles `src` for `arch` into the cache directory `dir` (the file the run-time cache reads
/// when `WIDE_KERNEL_CACHE` names `dir`), unless a valid image is already there. Returns the
/// file, its size and whether NVRTC ran.
pub fn compile_into(src: &KernelSource, arch: &str, dir: &std::path::Path) -> Result<(PathBuf, u64, bool)> {
    let (file, _) = cache_file(src, arch);
    let file = dir.join(file.file_name().expect("cache files have names"));
    if let Ok(bytes) = std::fs::read(&file) {
        if valid_image(&bytes, arch) {
            return Ok((file, bytes.len() as u64, false));
        }
    }
    let image = compile_uncached(src, &options(src, arch), is_real_arch(arch))?;
    write_atomically(&file, &image)?;
    Ok((file, image.len() as u64, true))
}

/// The image of `src` for `arch` if the in-process or disk cache holds a valid one (no compile).
pub fn cached(src: &KernelSource, arch: &str) -> Option<CompiledKernel> {
    let (file, key) = cache_file(src, arch);
    if let Some(k) = mem_cache().lock().unwrap().get(&key) {
        return Some(k.clone());
    }
    let bytes = std::fs::read(&file).ok().filter(|b| valid_image(b, arch))?;
    let k = CompiledKernel { arch: arch.to_string(), image: Arc::new(bytes), key };
    mem_cache().lock().unwrap().insert(key, k.clone());
    Some(k)
}

fn mem_cache() -> &'static Mutex<HashMap<u64, CompiledKernel>> {
    static MEM: OnceLock<Mutex<HashMap<u64, CompiledKernel>>> = OnceLock::new();
    MEM.get_or_init(Default::default)
}

/// Writes `file` through a temporary name in its directory (created if missing), then renames
/// it: a reader never sees half an image.
fn write_atomically(file: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let dir = file.parent().context("a cache file has a directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating the kernel directory {}", dir.display()))?;
    // Unique per process and call: threads compiling the same kernel never share a temporary.
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = file.with_extension(format!("tmp{}-{serial}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, file).with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))
}

fn compile_uncached(src: &KernelSource, opts: &[String], cubin: bool) -> Result<Vec<u8>> {
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
        // NVRTC opens libnvrtc-builtins by name from the library path: a program run without
        // the set-up's environment finds libnvrtc (the binary's run path) but not it.
        let hint = if log.contains("libnvrtc-builtins") {
            "\nNVRTC's builtins library is not on LD_LIBRARY_PATH: run `eval \"$(bash scripts/setup.sh --print-env)\"` first (on a GPU machine, `. .device/env.sh`)"
        } else {
            ""
        };
        bail!("compiling kernel `{}` with NVRTC failed ({e:?}), options {opts:?}:\n{log}{hint}", src.name);
    }
    // `WIDE_NVRTC_LOG=1` prints the compiler's messages (ptxas warnings such as a serialised
    // wgmma) for each module compiled.
    if !log.trim().is_empty() && crate::knobs::switch("WIDE_NVRTC_LOG") == Some(true) {
        eprintln!("nvrtc log of `{}` {:?}:\n{log}", src.name, src.defines);
    }
    if cubin {
        let image = unsafe { get_cubin(prog) };
        let _ = unsafe { nvrtc::destroy_program(prog) };
        return image.map_err(|e| anyhow!("reading the cubin of `{}`: {e:?}", src.name));
    }
    let ptx = unsafe { nvrtc::get_ptx(prog) };
    let _ = unsafe { nvrtc::destroy_program(prog) };
    let ptx = ptx.map_err(|e| anyhow!("reading PTX of `{}`: {e:?}", src.name))?;
    // NVRTC returns the text with its terminating NUL, which cuModuleLoadData needs.
    Ok(ptx.into_iter().map(|c| c as u8).collect())
}

/// The machine code of a program compiled for a real architecture.
unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc_sys::nvrtcResult> {
    let mut size: usize = 0;
    let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    let mut buf = vec![0u8; size];
    let r = nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architecture_names() {
        for ok in ["sm_90", "sm_90a", "sm_80", "compute_90", "compute_90a", "sm_100"] {
            check_arch(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in ["", "sm_", "sm_9", "hopper", "sm_90x", "compute_1000", "90"] {
            let e = check_arch(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("unknown GPU architecture `{bad}`")), "{e}");
        }
        assert!(is_real_arch("sm_90a") && !is_real_arch("compute_90"));
    }

    #[test]
    fn truncated_or_foreign_images_are_not_loaded() {
        let dir = std::env::temp_dir().join(format!("wide-kcache-{}", std::process::id()));
        std::env::set_var("WIDE_KERNEL_CACHE", &dir);
        let src = KernelSource::new("image_check", "extern \"C\" __global__ void add_one(float* x) { x[threadIdx.x] += 1.f; }\n");
        for arch in ["compute_80", "sm_80"] {
            let image = compile(&src, arch).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(valid_image(&image.image, arch), "{arch}: a fresh image");
            let bytes = &image.image[..];
            for cut in [bytes.len() - 1, bytes.len() / 2, 64, 0] {
                assert!(!valid_image(&bytes[..cut], arch), "{arch}: truncated to {cut} of {} bytes", bytes.len());
            }
        }
        let ptx = compile(&src, "compute_80").unwrap().image;
        assert!(!valid_image(&ptx, "sm_80"), "PTX where machine code is expected");
        let cubin = compile(&src, "sm_80").unwrap().image;
        assert!(!valid_image(&cubin, "compute_80"), "machine code where PTX is expected");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
