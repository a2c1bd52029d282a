//! Hopper gemm_mn for 2-128 tokens on `wgmma` with the product transposed (source `skinny_wg.cu`):
//! the weight rows on the instruction's 64-row side, the tokens (padded to 16, 32, 64 or 128) on
//! its narrow side, both operands brought by tensor copies (TMA) through a multi-stage
//! shared-memory pipeline, the group mask applied as the results are written.
//!
//! At these sizes a routed product reads almost every weight byte (a group is skipped only where
//! none of the tokens uses it: at 16 tokens and 50% skip, one group in 65536), so the alternatives
//! are cuBLAS followed by a second launch that writes the zeros, and the `mma.sync` small-M kernel
//! (2-16 tokens), which reads x again for every 16 weight rows. This kernel streams the weights
//! once, stages x once a block, and writes the zeros in the same pass. The dispatch measures it
//! against those two (see [`super::dispatch::skinny_wg_feasible`]).
use super::dispatch::{skinny_wg_feasible, GemmShape, RoutedOp, SKINNY_WG_MAX_M};
use super::gemm::cuda_inputs;
use super::layout::RouteLayout;
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{ensure, Context, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::Tensor;

const SOURCE: &str = concat!(include_str!("mbarrier.cuh"), include_str!("wgmma_common.cuh"), include_str!("cluster.cuh"), include_str!("skinny_wg.cu"));

/// One specialisation of the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SkinnyWgConfig {
    /// Token tile (the wgmma N): 16, 32, 64 or 128; a launch takes at most this many tokens.
    pub nt: u32,
    /// Consumer warpgroups a block: 64 `r` weight rows a block.
    pub r: u32,
    /// Shared-memory pipeline stages.
    pub stages: u32,
    /// 1, or 2: clusters of two blocks on neighbouring row blocks, each loading half of x's rows
    /// and multicasting them to both (x then crosses from L2 once for two blocks).
    pub cluster: u32,
    /// 1, or 2 (unpaired otherwise): clusters of two blocks on the same rows, each taking half of
    /// K, the second's partial sums added by the first through distributed shared memory.
    pub split: u32,
    /// With the split: the second block stores its partial sums into the first's shared memory
    /// (false: the first reads them from the second's, one f32 at a time).
    pub push: bool,
    /// The block's mask bytes copied into shared memory while the weights stream (false: the
    /// write-out reads them from global memory).
    pub mask_pre: bool,
}

/// Shared memory one block may use so that two blocks of one consumer warpgroup share a
/// multiprocessor (227 KiB on compute capability 9.0, minus the static barriers and slack).
const SMEM_PER_PAIR: u32 = 110 * 1024;

impl SkinnyWgConfig {
    /// The configuration for `m` tokens and `n` output channels on a device of `sms`
    /// multiprocessors: the smallest token tile that holds them; two consumer warpgroups (128
    /// rows a block, one block a multiprocessor) from 64 tokens where the grid still has a
    /// block for most multiprocessors, since each block reads all of x (M x K) from L2 once and
    /// twice the rows halve that traffic; else one (two blocks a multiprocessor). As many stages
    /// as fit, up to 8. `WIDE_SKINNY_WG_R` (1 or 2, read once) forces the warpgroups and
    /// `WIDE_SKINNY_WG_CLUSTER=2` (read once) pairs the blocks where their count is even. K is
    /// split over two blocks (each half of K) where one warpgroup's row blocks are fewer than the
    /// multiprocessors (Q 4096 x 4096: 64 blocks) and 128 | K; `WIDE_SKINNY_WG_SPLIT=1|2` (read
    /// once) forces it off or on (where 128 | K). For A/B runs (each read once):
    /// `WIDE_SKINNY_WG_STAGES=n` sets the pipeline depth, clamped to what one block's shared
    /// memory holds; `WIDE_SKINNY_WG_PUSH=0|1` the split's hand-off; `WIDE_SKINNY_WG_MASKPRE=0|1`
    /// where the write-out reads the mask.
    pub fn for_shape(m: i64, n: i64, k: i64, sms: i64) -> Self {
        let mut c = Self::for_shape_default(m, n, k, sms);
        if let Some(s) = env_stages() {
            c.stages = s.min(c.max_stages());
        }
        if let Some(p) = env_push() {
            c.push = p && c.split == 2;
        }
        if let Some(p) = env_mask_pre() {
            c.mask_pre = p;
        }
        c
    }

    /// The most stages one block's shared memory holds for this tile (4 KiB left for the
    /// kernel's static shared memory: barriers and the mask bytes).
    pub fn max_stages(&self) -> u32 {
        (super::wgmma::SMEM_LIMIT - 1024 - 4096) / self.stage_bytes()
    }

    fn for_shape_default(m: i64, n: i64, k: i64, sms: i64) -> Self {
        let nt = [16u32, 32, 64, 128].into_iter().find(|&t| t as i64 >= m).unwrap_or(128);
        let wide = nt >= 64 && n % 128 == 0 && n / 128 >= sms * 3 / 4;
        let r = match env_r() {
            Some(2) if n % 128 == 0 => 2,
            Some(_) => 1,
            None if wide => 2,
            None => 1,
        };
        let c = Self::with(nt, r);
        let split_ok = k % 128 == 0;
        let split = match env_split() {
            Some(2) if split_ok => 2,
            Some(_) => 1,
            None if split_ok && r == 1 && n / c.rows() < sms => 2,
            None => 1,
        };
        let c = if split == 2 {
            c.split_k()
        } else if env_cluster() == 2 && (n / c.rows()) % 2 == 0 {
            Self { cluster: 2, ..c }
        } else {
            c
        };
        // A grid of at most one block a multiprocessor leaves the second block's shared memory
        // free: the deepest pipeline (Q 4096 x 4096 split: 9 stages at 128 tokens instead of 4).
        if n / c.rows() * c.split as i64 <= sms {
            Self { stages: c.max_stages(), ..c }
        } else {
            c
        }
    }

    /// The same tile with K split over two blocks, the second's sums pushed into the first's
    /// shared memory.
    pub fn split_k(self) -> Self {
        Self { split: 2, push: true, ..self }
    }

    /// A token tile and warpgroup count with the stages that fit (up to 8; with one warpgroup,
    /// two blocks a multiprocessor), no cluster, the mask bytes read while the weights stream.
    pub fn with(nt: u32, r: u32) -> Self {
        let stage = 64 * r * 128 + nt * 128;
        let budget = SMEM_PER_PAIR * if r == 1 { 1 } else { 2 } - 1024;
        Self { nt, r, stages: (budget / stage).min(8), cluster: 1, split: 1, push: false, mask_pre: true }
    }

    pub fn rows(&self) -> i64 {
        64 * self.r as i64
    }
    pub fn threads(&self) -> u32 {
        128 * (self.r + 1)
    }
    pub fn stage_bytes(&self) -> u32 {
        64 * self.r * 128 + self.nt * 128
    }
    /// Dynamic shared memory a launch asks for: the stages and 1 KiB of alignment slack.
    pub fn smem_bytes(&self) -> u32 {
        self.stages * self.stage_bytes() + 1024
    }
    /// The configuration is well formed: a supported tile, at least two stages, and room in
    /// the stages for the transposed results (NT rows of 64 r + 8 elements).
    pub fn valid(&self) -> bool {
        [16, 32, 64, 128].contains(&self.nt)
            && (self.r == 1 || self.r == 2)
            && self.stages >= 2
            && self.nt * (64 * self.r + 8) * 2 <= self.stages * self.stage_bytes()
            && self.smem_bytes() <= super::wgmma::SMEM_LIMIT
            && (self.cluster == 1 || self.cluster == 2)
            && (self.split == 1 || (self.split == 2 && self.cluster == 1))
            && (self.split == 1 || self.nt / 2 * 128 * self.r * 4 <= self.stages * self.stage_bytes())
            && (!self.push || self.split == 2)
    }
    pub fn label(&self) -> String {
        format!(
            "wgmma-skinny nt{} r{} s{}{}{}{}{}",
            self.nt,
            self.r,
            self.stages,
            if self.cluster == 2 { " c2" } else { "" },
            if self.split == 2 { " k2" } else { "" },
            if self.push { " push" } else { "" },
            if self.mask_pre { " maskpre" } else { "" }
        )
    }
}

/// `WIDE_SKINNY_WG_R`: None unset; an unusable value is named in a warning and ignored.
fn env_r() -> Option<u32> {
    static V: OnceLock<Option<u32>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_SKINNY_WG_R", 1..=2, "consumer warpgroups a block").map(|r| r as u32))
}

/// `WIDE_SKINNY_WG_CLUSTER`: 2 pairs the blocks (x multicast), 1 (the default) leaves them
/// unpaired; another value is named in a warning and ignored.
fn env_cluster() -> u32 {
    static V: OnceLock<u32> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_SKINNY_WG_CLUSTER", 1..=2, "blocks a cluster").map_or(1, |c| c as u32))
}

/// `WIDE_SKINNY_WG_STAGES`: None unset; a count of at least 2 forces the pipeline depth (clamped
/// to what fits); another value is named in a warning and ignored.
fn env_stages() -> Option<u32> {
    static V: OnceLock<Option<u32>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_SKINNY_WG_STAGES", 2..=64, "pipeline stages").map(|n| n as u32))
}

/// `WIDE_SKINNY_WG_PUSH` (read once): the split's hand-off by remote stores (1) or loads (0).
fn env_push() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_SKINNY_WG_PUSH"))
}

/// `WIDE_SKINNY_WG_MASKPRE` (read once): the mask bytes read while the weights stream (1) or by
/// the write-out (0).
fn env_mask_pre() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_SKINNY_WG_MASKPRE"))
}

/// `WIDE_SKINNY_WG_SPLIT`: None unset; 1 or 2 forces the split of K; another value is named in a
/// warning and ignored.
fn env_split() -> Option<u32> {
    static V: OnceLock<Option<u32>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_SKINNY_WG_SPLIT", 1..=2, "blocks sharing K").map(|n| n as u32))
}

pub fn source(f16: bool, c: SkinnyWgConfig) -> KernelSource {
    KernelSource::new("skinny_wg", SOURCE)
        .target(super::wgmma::TARGET)
        .define("WIDE_F16", f16 as u32)
        .define("NT", c.nt)
        .define("R", c.r)
        .define("STAGES", c.stages)
        .define("CLUSTER", c.cluster)
        .define("SPLITK", c.split)
        .define("PUSH", c.push as u32)
        .define("MASKPRE", c.mask_pre as u32)
}

/// Every variant shipped: each token tile with one and two consumer warpgroups, unpaired, in
/// clusters of two that share x and in clusters of two that split K, each unpaired and split
/// form also with the deepest pipeline one block holds, both dtypes.
pub fn kernel_variants() -> Vec<KernelSource> {
    let mut v = vec![];
    for f16 in [false, true] {
        for nt in [16, 32, 64, 128] {
            for r in [1, 2] {
                let c = SkinnyWgConfig::with(nt, r);
                v.push(source(f16, c));
                v.push(source(f16, SkinnyWgConfig { cluster: 2, ..c }));
                v.push(source(f16, c.split_k()));
                // One block a multiprocessor: the deepest pipeline.
                let deep = SkinnyWgConfig { stages: c.max_stages(), ..c };
                if deep.stages != c.stages {
                    v.push(source(f16, deep));
                }
                v.push(source(f16, deep.split_k()));
            }
        }
    }
    v
}

fn kernel(f16: bool, c: SkinnyWgConfig, device: usize) -> Result<CudaKernel> {
    static K: OnceLock<Mutex<HashMap<(bool, SkinnyWgConfig, usize), CudaKernel>>> = OnceLock::new();
    let key = (f16, c, device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&source(f16, c), "skinny_wg", device)?;
    k.set_max_dynamic_shared_mem(c.smem_bytes())?;
    K.get_or_init(Default::default).lock().unwrap().insert(key, k);
    Ok(k)
}

/// Runs a plain gemm_mn on this kernel in its configuration for the shape.
pub(crate) fn launch(s: &GemmShape, x: &Tensor, w: &Tensor, layout: &RouteLayout) -> Result<Tensor> {
    let device = match x.device() {
        tch::Device::Cuda(d) => d,
        d => anyhow::bail!("the wgmma small-M kernel needs CUDA tensors, got {d:?}"),
    };
    let sms = crate::cuda::multiprocessor_count(device)? as i64;
    launch_with(s, x, w, layout, SkinnyWgConfig::for_shape(s.m, s.n, s.k, sms))
}

/// gemm_mn (`x` [M, K], `w` [N, K], `group` channels a group of the layout's mask) on this kernel
/// in one given configuration (for tests and sweeps).
pub fn gemm_mn_with(config: SkinnyWgConfig, x: &Tensor, w: &Tensor, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    let s = super::gemm::shape_of(RoutedOp::Mn, x, w, None, layout, group)?;
    launch_with(&s, x, w, layout, config)
}

fn launch_with(s: &GemmShape, x: &Tensor, w: &Tensor, layout: &RouteLayout, c: SkinnyWgConfig) -> Result<Tensor> {
    ensure!(
        skinny_wg_feasible(s),
        "the wgmma small-M kernel takes a plain gemm_mn with 2..={SKINNY_WG_MAX_M} tokens, 64 | N, 64 | K and 8 | group; got {:?} M {} N {} K {} group {}",
        s.op,
        s.m,
        s.n,
        s.k,
        s.group
    );
    ensure!(c.valid(), "wgmma small-M configuration {} is not valid", c.label());
    ensure!(
        s.m <= c.nt as i64 && s.n % (c.rows() * c.cluster as i64) == 0 && s.k % (64 * c.split as i64) == 0,
        "{} cannot run M {} N {} K {} (needs M <= {}, {} | N and {} | K)",
        c.label(),
        s.m,
        s.n,
        s.k,
        c.nt,
        c.rows() * c.cluster as i64,
        64 * c.split
    );
    let (device, f16, x, w, _) = cuda_inputs(s, x, w, None)?;
    ensure!(super::wgmma::supported(device), "the wgmma small-M kernel needs a compute capability 9.0 (Hopper) GPU; device {device} is not one");
    let k = kernel(f16, c, device).with_context(|| format!("loading {}", c.label()))?;
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    let args = [
        crate::cuda::tensor_map_2d(&w, f16, c.rows() as u32, 64)?,
        crate::cuda::tensor_map_2d(&x, f16, c.nt / c.cluster, 64)?,
        KernelArg::tensor(layout.mask())?,
        KernelArg::tensor(&out)?,
        KernelArg::I32(s.m as i32),
        KernelArg::I32(s.n as i32),
        KernelArg::I32(s.k as i32),
        KernelArg::I32(s.group as i32),
        KernelArg::I32((s.n / s.group) as i32),
    ];
    let cfg = LaunchConfig { grid: ((s.n / c.rows() * c.split as i64) as u32, 1, 1), block: (c.threads(), 1, 1), shared_mem_bytes: c.smem_bytes() };
    // SAFETY: the arguments follow skinny_wg's signature: tensor maps of w [N, K] (boxes of 64 k
    // x 64 r rows) and x [M, K] (64 k x NT / cluster rows, M <= NT: rows past M read as zeros),
    // the layout's mask [M, N / group] (u8), out [M, N]; one block for each 64 r rows (64 r
    // cluster | N, so the grid is whole clusters), two with the split of K (64 split | K),
    // 8 | group.
    unsafe { k.launch(cfg, &args)? };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_fit_and_cover_the_token_range() {
        for nt in [16, 32, 64, 128] {
            for r in [1, 2] {
                let c = SkinnyWgConfig::with(nt, r);
                assert!(c.valid(), "{c:?}");
                assert!(c.stages >= 4, "{c:?}: too shallow a pipeline to stream");
                if r == 1 {
                    assert!(2 * (c.smem_bytes() + 1024) <= 228 * 1024, "{c:?}: two blocks must share a multiprocessor");
                }
            }
        }
        // 132 multiprocessors: up (14336 rows, 112 blocks of 128) takes two warpgroups from 64
        // tokens; Q (4096 rows) keeps one (32 blocks of 128 would leave most idle).
        assert_eq!(SkinnyWgConfig::for_shape(16, 14336, 4096, 132), SkinnyWgConfig::with(16, 1));
        assert_eq!(SkinnyWgConfig::for_shape(17, 14336, 4096, 132).nt, 32);
        assert_eq!(SkinnyWgConfig::for_shape(128, 14336, 4096, 132), SkinnyWgConfig::with(128, 2));
        // Q: 64 row blocks of one warpgroup on 132 multiprocessors: K split over two blocks
        // (where 128 | K), one block a multiprocessor, so the deepest pipeline.
        let q = SkinnyWgConfig::for_shape(100, 4096, 4096, 132);
        assert_eq!(q, SkinnyWgConfig { stages: 9, ..SkinnyWgConfig::with(128, 1).split_k() });
        assert!(q.push && q.mask_pre && q.valid());
        assert_eq!(SkinnyWgConfig::for_shape(100, 4096, 4032, 132), SkinnyWgConfig { stages: 9, ..SkinnyWgConfig::with(128, 1) });
        // 8192 rows: 128 row blocks, split into 256: two blocks a multiprocessor, the pair's depth.
        assert_eq!(SkinnyWgConfig::for_shape(100, 8192, 4096, 132), SkinnyWgConfig::with(128, 1).split_k());
        assert_eq!(SkinnyWgConfig::for_shape(16, 14336, 4096, 132).split, 1, "224 row blocks: no split");
        assert_eq!(SkinnyWgConfig::for_shape(2, 64, 64, 132).nt, 16);
        assert!(!SkinnyWgConfig { stages: 1, ..SkinnyWgConfig::with(128, 2) }.valid());
        assert!(!SkinnyWgConfig { nt: 48, ..SkinnyWgConfig::with(32, 1) }.valid());
        assert!(!SkinnyWgConfig { cluster: 3, ..SkinnyWgConfig::with(32, 1) }.valid());
        assert!(SkinnyWgConfig { cluster: 2, ..SkinnyWgConfig::with(16, 2) }.valid());
        assert!(SkinnyWgConfig { split: 2, ..SkinnyWgConfig::with(128, 2) }.valid());
        assert!(!SkinnyWgConfig { split: 2, cluster: 2, ..SkinnyWgConfig::with(64, 1) }.valid());
    }

    #[test]
    fn deepest_pipelines_fit_one_block() {
        for nt in [16, 32, 64, 128] {
            for r in [1, 2] {
                for split in [1, 2] {
                    let c = SkinnyWgConfig { split, ..SkinnyWgConfig::with(nt, r) };
                    let deep = SkinnyWgConfig { stages: c.max_stages(), ..c };
                    assert!(deep.valid(), "{deep:?}");
                    assert!(deep.stages >= c.stages, "{deep:?}");
                    let over = SkinnyWgConfig { stages: deep.stages + 1, ..c };
                    assert!(!over.valid() || over.smem_bytes() + 4096 > super::super::wgmma::SMEM_LIMIT, "{over:?} should not be the deepest");
                    // The hand-off by remote stores exists only for the split of K.
                    assert_eq!(SkinnyWgConfig { push: true, mask_pre: true, ..deep }.valid(), split == 2);
                }
            }
        }
        // Q at 128 tokens: 24 KiB stages, 4 with two blocks a multiprocessor, 9 with one.
        assert_eq!(SkinnyWgConfig::with(128, 1).stages, 4);
        assert_eq!(SkinnyWgConfig::with(128, 1).max_stages(), 9);
    }

    #[test]
    fn variants_target_sm90a() {
        let v = kernel_variants();
        assert_eq!(v.len(), 78);
        assert!(v.iter().all(|k| k.name == "skinny_wg" && k.target == Some("compute_90a")));
        // Every configuration the launch rule can pick is shipped (precompiled machine code
        // covers it: the GPU machine keeps no cache between calls).
        for m in [2, 16, 17, 33, 64, 65, 128] {
            for n in [64, 4096, 8192, 14336] {
                let c = SkinnyWgConfig::for_shape(m, n, 4096, 132);
                assert!(v.iter().any(|k| k.defines == source(false, c).defines), "{c:?} is not among the variants");
            }
        }
    }
}
