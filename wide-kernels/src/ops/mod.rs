//! Ops on tch tensors. Each op has a tch reference (CPU and GPU) and, where it pays, a CUDA
//! kernel; callers use the op and the op picks the path.
//!
//! Routed ops ([`layout`], [`gemm`], [`dispatch`]) share one CUDA source, `routed.cu`,
//! specialised by dtype and tile shape.
pub mod attention;
pub mod dispatch;
pub mod fused;
pub mod gemm;
pub mod layout;
pub mod probe;
pub mod scale_shift;
pub mod skinny_wg;
pub mod wgmma;
#[cfg(test)]
mod pdl_audit;

use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::Result;
use dispatch::{TileConfig, TILES};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const ROUTED_SOURCE: &str = concat!(include_str!("mma_sync.cuh"), include_str!("pdl.cuh"), include_str!("partition.cuh"), include_str!("router_gate.cuh"), include_str!("rope.cuh"), include_str!("routed.cu"));

/// The routed module for a dtype: without a tile, the layout and GEMV entries; with a tile
/// (and gate+up fusion flag), the `mma.sync` tiled entries.
pub fn routed_source(f16: bool, tile: Option<(TileConfig, bool)>) -> KernelSource {
    let mut s = KernelSource::new("routed", ROUTED_SOURCE).define("WIDE_F16", f16 as u32);
    if let Some((t, fused)) = tile {
        s = s
            .define("BM", t.bm)
            .define("BN", t.bn)
            .define("BK", t.bk)
            .define("WM", t.wm)
            .define("WN", t.wn)
            .define("STAGES", t.stages)
            .define("FUSED", fused as u32);
    }
    s
}

/// A routed entry point, loaded once per (dtype, tile, entry, device): the hot path does a map
/// lookup instead of hashing the source again.
pub(crate) fn routed_kernel(f16: bool, tile: Option<(TileConfig, bool)>, entry: &str, device: usize) -> Result<CudaKernel> {
    type Key = (bool, Option<(TileConfig, bool)>, String, usize);
    static K: OnceLock<Mutex<HashMap<Key, CudaKernel>>> = OnceLock::new();
    let key = (f16, tile, entry.to_string(), device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&routed_source(f16, tile), entry, device)?;
    if let Some((t, fused)) = tile {
        k.set_max_dynamic_shared_mem(t.smem_bytes(fused))?;
    }
    K.get_or_init(Default::default).lock().unwrap().insert(key, k);
    Ok(k)
}

/// Keeps the device busy for `micros` microseconds on libtorch's current stream. Benchmarks
/// queue it before a timed region so the host enqueues the region's launches ahead of the
/// GPU and CUDA events time device work alone (as a CUDA-graph replay would run).
pub fn gpu_spin(device: usize, micros: u32) -> Result<()> {
    let k = routed_kernel(false, None, "gpu_spin", device)?;
    unsafe { k.launch(LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 }, &[KernelArg::I64(micros as i64 * 1000)]) }
}

/// A zeroed f32 buffer of at least twice the device's L2 size (and at least `at_least` bytes):
/// reading it (`sum`) before a timed run leaves the L2 full of its clean lines, writing it
/// (`fill_`) full of dirty ones, so the run's own data comes from DRAM. Used by the autotuner
/// and by `wide bench kernels`.
pub fn l2_flush_buffer(device: usize, at_least: usize) -> Result<Tensor> {
    let bytes = (2 * crate::cuda::l2_cache_bytes(device)?).max(at_least);
    Ok(Tensor::zeros([bytes.div_ceil(4) as i64], (Kind::Float, Device::Cuda(device))))
}

/// Every kernel source with every specialisation the project ships, so that a CPU-only CI
/// run can compile all of them with NVRTC (a kernel that does not compile fails CI).
pub fn all_kernel_variants() -> Vec<KernelSource> {
    let mut v = Vec::new();
    v.extend(scale_shift::kernel_variants());
    v.extend(fused::kernel_variants());
    v.extend(wgmma::kernel_variants());
    v.extend(skinny_wg::kernel_variants());
    v.extend(attention::kernel_variants());
    v.extend(probe::kernel_variants());
    for f16 in [false, true] {
        v.push(routed_source(f16, None));
        for t in TILES {
            for fused in [false, true] {
                v.push(routed_source(f16, Some((t, fused))));
            }
        }
    }
    v
}

/// One kernel image written by [`precompile`].
#[derive(Debug, Clone)]
pub struct Precompiled {
    pub name: &'static str,
    pub arch: String,
    pub file: std::path::PathBuf,
    pub bytes: u64,
    /// False when a valid image was already there.
    pub compiled: bool,
}

/// Compiles the variants of [`precompile_list`] into the cache directory `dir`, for
/// `WIDE_KERNEL_CACHE=dir` on a GPU machine of that architecture. `each` sees every image as it
/// is done.
pub fn precompile(variants: Vec<(crate::KernelSource, String)>, dir: &std::path::Path, mut each: impl FnMut(&Precompiled)) -> anyhow::Result<Vec<Precompiled>> {
    let mut done = Vec::with_capacity(variants.len());
    for (k, target) in variants {
        let (file, bytes, compiled) = crate::nvrtc::compile_into(&k, &target, dir)?;
        let p = Precompiled { name: k.name, arch: target, file, bytes, compiled };
        each(&p);
        done.push(p);
    }
    Ok(done)
}

/// Every shipped kernel variant ([`all_kernel_variants`]; with `only`, the families
/// (`KernelSource::name`) named there) with its target for `arch` (`sm_90`: cubins;
/// `compute_90`: PTX). Hopper-only variants (sm_90a) come with compute capability 9.0 and are
/// left out otherwise.
pub fn precompile_list(arch: &str, only: &[String]) -> anyhow::Result<Vec<(crate::KernelSource, String)>> {
    crate::nvrtc::check_arch(arch)?;
    let all = all_kernel_variants();
    for o in only {
        anyhow::ensure!(
            all.iter().any(|k| k.name == o),
            "unknown kernel family `{o}`: choose from {}",
            all.iter().map(|k| k.name).collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let digits = |a: &str| a.trim_start_matches("sm_").trim_start_matches("compute_").trim_end_matches('a').to_string();
    let prefix = if crate::nvrtc::is_real_arch(arch) { "sm_" } else { "compute_" };
    Ok(all
        .into_iter()
        .filter(|k| only.is_empty() || only.iter().any(|o| o == k.name))
        .filter_map(|k| match k.target {
            // Untargeted kernels are looked up under the plain architecture (sm_90 for sm_90a).
            None => Some((k, arch.trim_end_matches('a').to_string())),
            Some(t) if digits(t) == digits(arch) => {
                let target = format!("{prefix}{}", t.trim_start_matches("compute_"));
                Some((k, target))
            }
            Some(_) => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn precompiling_for_sm_90a_names_the_files_the_run_time_looks_up() {
        let a = super::precompile_list("sm_90a", &[]).unwrap();
        let plain = super::precompile_list("sm_90", &[]).unwrap();
        let targets = |l: &[(crate::KernelSource, String)]| l.iter().map(|(k, t)| format!("{} {:?} {t}", k.name, k.defines)).collect::<Vec<_>>();
        assert_eq!(targets(&a), targets(&plain));
        assert!(a.iter().all(|(k, t)| t == if k.target.is_some() { "sm_90a" } else { "sm_90" }));
    }

    /// Every shipped kernel variant must compile for the GPUs we target, here on a CPU-only
    /// machine too (NVRTC from the PyPI CUDA runtime). A missing NVRTC fails, never skips.
    /// The same variants through NVRTC's machine-code step for the H200 (sm_90, and sm_90a for the
    /// Hopper-only ones): what `wide kernels precompile` ships. Catches what PTX alone does not
    /// (register or shared-memory limits the assembler enforces). The same machine code then goes
    /// through the programmatic-launch audit (`pdl_audit`): no read-only load of a kernel that
    /// waits for the launch before it may be scheduled above that wait.
    #[test]
    fn every_kernel_variant_assembles_for_sm_90_with_no_load_above_a_launch_wait() {
        let dir = std::env::temp_dir().join(format!("wide-cubins-{}", std::process::id()));
        let all = super::precompile_list("sm_90", &[]).unwrap();
        let n = all.len();
        let mut bad = Vec::new();
        let (mut waiting, mut modules, mut hopper) = (0, 0, false);
        for (k, target) in all {
            hopper |= target == "sm_90a";
            let (file, _, _) = crate::nvrtc::compile_into(&k, &target, &dir).unwrap_or_else(|e| panic!("{e:#}"));
            let bytes = std::fs::read(&file).unwrap();
            assert!(bytes.starts_with(b"\x7fELF"), "{}: not machine code", file.display());
            // Only a source with the wait's instruction text (pdl.cuh) can wait: the others need no PTX.
            if !k.source.contains("griddepcontrol.wait") {
                continue;
            }
            let ptx = crate::nvrtc::compile(&k, &target.replace("sm_", "compute_")).unwrap_or_else(|e| panic!("{e:#}"));
            let (entries, b) = super::pdl_audit::audit(&ptx.image, &file);
            waiting += entries;
            modules += (entries > 0) as usize;
            bad.extend(b.into_iter().map(|b| format!("{} {:?} ({target}): {b}", k.name, k.defines)));
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(hopper, "the wgmma variants build for sm_90a");
        assert!(waiting > 0, "no entry with griddepcontrol.wait was found: the launch-wait audit checked nothing");
        assert!(bad.is_empty(), "{}:\n{}", super::pdl_audit::RULE, bad.join("\n"));
        eprintln!("{n} variants assembled; launch-wait audit: {waiting} entries that wait, in {modules} modules, none with a read-only load moved above its wait");
    }

    #[test]
    fn every_kernel_variant_compiles_with_nvrtc() {
        assert!(
            crate::nvrtc::nvrtc_available(),
            "libnvrtc was not found: put the CUDA runtime's lib directory on LD_LIBRARY_PATH (scripts/setup.sh --print-env)"
        );
        std::env::set_var("WIDE_KERNEL_CACHE", std::env::temp_dir().join(format!("wide-kcache-{}", std::process::id())));
        for arch in ["compute_80", "compute_90"] {
            for k in super::all_kernel_variants() {
                // Architecture-specific modules (sm_90a wgmma) compile for their own target only.
                let arch = k.target.unwrap_or(arch);
                let c = crate::nvrtc::compile(&k, arch).unwrap_or_else(|e| panic!("{e:#}"));
                let text = String::from_utf8_lossy(&c.image);
                assert!(text.contains(".entry"), "{}: no kernel entry in PTX", k.name);
                // The decode launches (launch_pdl) wait for their predecessor on sm_90.
                let untiled = !k.defines.iter().any(|(d, _)| d == "BM");
                if arch == "compute_90" && (k.name == "infer" || (k.name == "routed" && untiled)) {
                    assert!(text.contains("griddepcontrol.wait"), "{}: no griddepcontrol.wait in the sm_90 PTX", k.name);
                }
                if arch == "compute_90" && k.name == "infer" {
                    // The clustered norm + router: first-layer outputs into block 0's shared memory.
                    assert!(text.contains("mapa.shared::cluster") && text.contains("barrier.cluster.wait"), "infer: no cluster code in the sm_90 PTX");
                }
                if k.defines.iter().any(|(d, _)| d == "BM") {
                    assert!(text.contains("mma.sync.aligned.m16n8k16"), "tiled variant without tensor-core MMA: {:?}", k.defines);
                    assert!(!text.contains(".local"), "tiled variant spills to local memory: {:?}", k.defines);
                }
                if k.name == "attn_prefill" {
                    assert!(text.contains("mma.sync.aligned.m16n8k16"), "prefill attention without tensor-core MMA: {:?}", k.defines);
                    assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans"), "prefill attention without the V transpose load: {:?}", k.defines);
                    assert!(!text.contains(".local"), "prefill attention spills to local memory: {:?}", k.defines);
                }
                if k.name == "wgmma" {
                    assert!(text.contains(".target sm_90a"), "wgmma variant not built for sm_90a: {:?}", k.defines);
                    // Plain: m64n128 per weight tile; fused: one m64n256 over the gate and up tiles.
                    let fused = k.defines.iter().any(|(d, v)| d == "FUSED" && v == "1");
                    let inst = if fused { "wgmma.mma_async.sync.aligned.m64n256k16.f32" } else { "wgmma.mma_async.sync.aligned.m64n128k16.f32" };
                    assert!(text.contains(inst), "wgmma variant without {inst}: {:?}", k.defines);
                    // Tall last tiles: the extra rows' m64n64 and the registers moved to the consumers.
                    if k.defines.iter().any(|(d, v)| d == "TALL" && v == "1") {
                        let ok = text.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32") && text.contains("setmaxnreg.inc.sync.aligned.u32 200");
                        assert!(ok, "tall wgmma variant without the extra sub-tile or setmaxnreg: {:?}", k.defines);
                    }
                    let desc = super::wgmma::sw128_desc(0).to_string();
                    assert!(text.contains(&desc), "wgmma descriptor constant {desc} (wgmma::sw128_desc) not in the PTX: {:?}", k.defines);
                    assert!(!text.contains(".local"), "wgmma variant spills to local memory: {:?}", k.defines);
                }
            }
        }
    }
}
