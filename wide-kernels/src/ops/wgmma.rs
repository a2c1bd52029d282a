//! Hopper routed GEMM for large M: `gemm_mn` (plain, and gate+up with the SwiGLU epilogue) on
//! `wgmma.mma_async` (sm_90a), source `wgmma.cu`.
//!
//! Per group of G output channels the work is a dense product of the group's active token rows
//! of x (gathered through the layout's `perm`) with the group's G contiguous weight rows. One
//! block computes a 128-token x 128-channel tile: a producer warpgroup gathers x rows and copies
//! the weight tile(s) with 16-byte `cp.async` into the 128-byte-swizzled K-major shared layout
//! (k steps of 64, a multi-stage mbarrier pipeline), two consumer warpgroups run m64n128k16
//! `wgmma` on them and scatter the results to the token rows; the inactive tokens listed after
//! the active ones get exact zeros. Compiled with NVRTC for `compute_90a`, so it runs on compute
//! capability 9.0 devices only ([`supported`]).
use super::dispatch::{wgmma_feasible, GemmShape, RoutedOp, WGMMA_BK, WGMMA_BM, WGMMA_BN};
use super::gemm::cuda_inputs;
use super::layout::RouteLayout;
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{ensure, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::Tensor;

const SOURCE: &str = include_str!("wgmma.cu");

/// NVRTC target of the module: `wgmma` exists only in the architecture-specific sm_90a set.
pub const TARGET: &str = "compute_90a";
/// Threads a block: one producer and two consumer warpgroups.
pub const THREADS: u32 = 384;

/// Pipeline stages: 5 of 32 KiB (x tile + weight tile), or 4 of 48 KiB with the up tile.
pub fn stages(fused: bool) -> u32 {
    if fused {
        4
    } else {
        5
    }
}

/// Dynamic shared memory of a launch: the stages plus 1 KiB so that they start 1024-aligned.
pub fn smem_bytes(fused: bool) -> u32 {
    let tiles = if fused { 3 } else { 2 };
    (tiles * WGMMA_BM * WGMMA_BK * 2) as u32 * stages(fused) + 1024
}

/// The module for a dtype and fusion flag.
pub fn source(f16: bool, fused: bool) -> KernelSource {
    KernelSource::new("wgmma", SOURCE)
        .target(TARGET)
        .define("WIDE_F16", f16 as u32)
        .define("FUSED", fused as u32)
        .define("STAGES", stages(fused))
}

/// Every variant shipped, for the compile-everything test.
pub fn kernel_variants() -> Vec<KernelSource> {
    [false, true].into_iter().flat_map(|f16| [false, true].into_iter().map(move |fused| source(f16, fused))).collect()
}

/// Can this device run the wgmma kernel (compute capability 9.0)?
pub fn supported(device: usize) -> bool {
    static C: OnceLock<Mutex<HashMap<usize, bool>>> = OnceLock::new();
    let c = C.get_or_init(Default::default);
    if let Some(&v) = c.lock().unwrap().get(&device) {
        return v;
    }
    let v = crate::cuda::compute_arch(device).map(|a| a == TARGET.trim_end_matches('a')).unwrap_or(false);
    c.lock().unwrap().insert(device, v);
    v
}

fn kernel(f16: bool, fused: bool, device: usize) -> Result<CudaKernel> {
    static K: OnceLock<Mutex<HashMap<(bool, bool, usize), CudaKernel>>> = OnceLock::new();
    let key = (f16, fused, device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&source(f16, fused), "gemm_mn_wgmma", device)?;
    k.set_max_dynamic_shared_mem(smem_bytes(fused))?;
    K.get_or_init(Default::default).lock().unwrap().insert(key, k);
    Ok(k)
}

/// Runs gemm_mn / gemm_mn_swiglu (`w2` = w_up) on the wgmma kernel.
pub(crate) fn launch(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tensor> {
    ensure!(
        wgmma_feasible(s),
        "the wgmma kernel cannot run {:?} with N {} K {} group {} (needs gemm_mn, 128 | group, 64 | K)",
        s.op,
        s.n,
        s.k,
        s.group
    );
    let (device, f16, x, w, w2) = cuda_inputs(s, x, w, w2)?;
    ensure!(supported(device), "the wgmma kernel needs a compute capability 9.0 (Hopper) GPU; device {device} is not one");
    let fused = s.op == RoutedOp::MnSwiglu;
    let k = kernel(f16, fused, device)?;
    let (perm, count) = layout.lists()?;
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    // A 1-D grid of tiles in banded order (see wgmma.cu); BAND * (N / 128) must fit an i32 too.
    let blocks = (s.m as u64).div_ceil(WGMMA_BM as u64) * (s.n / WGMMA_BN) as u64;
    ensure!(blocks <= i32::MAX as u64 && 16 * s.n / WGMMA_BN <= i32::MAX as i64, "too many tiles (M {} x N {}) for one wgmma launch", s.m, s.n);
    let cfg = LaunchConfig { grid: (blocks as u32, 1, 1), block: (THREADS, 1, 1), shared_mem_bytes: smem_bytes(fused) };
    let w_up = w2.as_ref().unwrap_or(&w);
    let args = [
        KernelArg::tensor(&x)?,
        KernelArg::tensor(&w)?,
        KernelArg::tensor(w_up)?,
        KernelArg::tensor(perm)?,
        KernelArg::tensor(count)?,
        KernelArg::tensor(&out)?,
        KernelArg::I32(s.m as i32),
        KernelArg::I32(s.n as i32),
        KernelArg::I32(s.k as i32),
        KernelArg::I32(s.group as i32),
    ];
    // SAFETY: the arguments follow gemm_mn_wgmma's signature; x is [M, K], w and w_up [N, K]
    // (contiguous, 16-byte aligned), perm [N / G, M] and count [N / G] come from this layout,
    // out is [M, N]; the grid has one block for each of ceil(M / 128) x N / 128 tiles.
    unsafe { k.launch(cfg, &args)? };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_one_block_a_multiprocessor() {
        // H100/H200: 227 KiB of dynamic shared memory a block at most.
        for fused in [false, true] {
            assert!(smem_bytes(fused) <= 227 * 1024, "{}", smem_bytes(fused));
            assert!(stages(fused) >= 3, "the producer hands a stage over STAGES - 2 stages later");
        }
        assert_eq!(smem_bytes(false), 5 * 32768 + 1024);
        assert_eq!(smem_bytes(true), 4 * 49152 + 1024);
    }

    #[test]
    fn variants_target_sm90a() {
        let v = kernel_variants();
        assert_eq!(v.len(), 4);
        assert!(v.iter().all(|k| k.target == Some("compute_90a")));
    }
}
