//! Hopper routed GEMM for large M: `gemm_mn` (plain, and gate+up with the SwiGLU epilogue) on
//! `wgmma.mma_async` (sm_90a), source `wgmma.cu`.
//!
//! Per group of G output channels the work is a dense product of the group's active token rows
//! of x (gathered through the layout's `perm`) with the group's G contiguous weight rows. One
//! block computes a (128 * mi)-token x 128-channel tile: a producer warpgroup gathers x rows with
//! 16-byte `cp.async` (or, where the tile's listed tokens are consecutive, loads them with TMA)
//! and one of its threads loads the weight tile(s) with TMA, both into the
//! 128-byte-swizzled K-major shared layout (k steps of 64, a multi-stage mbarrier pipeline; the
//! sweep keeps the all-cp.async and cluster-multicast variants), two consumer warpgroups run
//! m64n128k16 `wgmma` on them and scatter the results to the token rows; the inactive tokens
//! listed after the active ones get exact zeros. Groups narrower than the 128-channel tile (8 |
//! G | 128) run on tiles of 128 / G neighbouring groups: the token lists are those of the
//! mask's OR over the tile's groups ([`RouteLayout::coarse_lists`]), the tile is computed for
//! every listed token, and the write-out stores zeros where the token skips a channel's own
//! group (`FINE` in wgmma.cu). Compiled with NVRTC for `compute_90a`, so it
//! runs on compute capability 9.0 devices only ([`supported`]).
use super::dispatch::{wgmma_feasible, GemmShape, RoutedOp, WGMMA_BK, WGMMA_BM, WGMMA_BN};
use super::gemm::cuda_inputs;
use super::layout::RouteLayout;
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{ensure, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::Tensor;

/// The module source: the shared Hopper helpers, then the kernel.
const SOURCE: &str = concat!(include_str!("mbarrier.cuh"), include_str!("wgmma_common.cuh"), include_str!("cluster.cuh"), include_str!("wgmma.cu"));

/// NVRTC target of the module: `wgmma` exists only in the architecture-specific sm_90a set.
pub const TARGET: &str = "compute_90a";
/// Threads a block: one producer and two consumer warpgroups.
pub const THREADS: u32 = 384;

/// Shared-memory matrix descriptor of a K-major wgmma operand in the 128-byte swizzle layout, as
/// `sw128_desc` in wgmma.cu builds it (PTX ISA, "matrix descriptor"): start address >> 4 in bits
/// 0-13, leading byte offset >> 4 in bits 16-29 (unused for this layout, 1), stride byte offset
/// >> 4 in bits 32-45 (1024 bytes between 8-row groups), base offset 0 in bits 49-51, swizzle mode
/// 1 (128B) in bits 62-63. The NVRTC test checks that the compiled kernel carries
/// `sw128_desc(0)` as its descriptor constant.
pub const fn sw128_desc(addr: u32) -> u64 {
    ((addr & 0x3FFFF) >> 4) as u64 | (1 << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// Byte offset of element (r, k) of a `[rows x 64]` 2-byte block in the 128-byte swizzle layout
/// (block base 1024-aligned): row r at r * 128, its 16-byte chunk k / 8 at position
/// (k / 8) ^ (r % 8). The producer writes chunk c of row r at `sw128_off(r, c)` in wgmma.cu.
pub const fn sw128_offset(r: u32, k: u32) -> u32 {
    r * 128 + (((k / 8) ^ (r % 8)) * 16) + (k % 8) * 2
}

/// One specialisation of the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgmmaConfig {
    /// 64-row sub-tiles a consumer warpgroup computes: the tile is 128 * mi tokens.
    pub mi: u32,
    /// Shared-memory pipeline stages.
    pub stages: u32,
    /// Copies arrive on the stage barrier by themselves (`cp.async.mbarrier.arrive.noinc`);
    /// else the producer waits for them `stages - 2` stages behind.
    pub async_arrive: bool,
    /// 1, or 2: clusters of two blocks on consecutive token tiles of a group share the weight
    /// tiles (each loads half with TMA and multicasts it to both).
    pub cluster: u32,
    /// Without clusters: one producer thread loads the weight tile(s) with TMA (else 128
    /// threads' cp.async); needs `async_arrive`.
    pub tma: bool,
    /// L2 policies: the gathered x rows evict-last, the outputs evict-first.
    pub l2_hint: bool,
    /// Persistent grid (`gemm_mn_wgmma_persist`): one block a multiprocessor taking tiles from a
    /// global counter, the stage ring running on across tiles; needs mi 1, tma, no cluster.
    pub persist: bool,
    /// A tile whose listed rows are consecutive tokens (an always-on group's, a contiguous run
    /// of a mask) loads them with TMA as well; the others keep the cp.async gather. Takes effect
    /// with `tma` on the plain entry ([`WgmmaConfig::row_tma_on`]).
    pub row_tma: bool,
    /// Stream-K schedule (`gemm_mn_wgmma_sk`): one block a multiprocessor, whole computing
    /// tiles for all but the last one to two waves, whose k steps are split evenly over the
    /// blocks with an f32 fix-up, so that every multiprocessor ends at about the same time;
    /// needs tma, no cluster, no persist, no l2_hint.
    pub stream_k: bool,
    /// A group's last computing tile takes up to 64 list entries past the tile height (a
    /// 320-token tile; the extra rows run as one more sub-tile split by columns over the two
    /// consumer warpgroups, 160 accumulators a thread by `setmaxnreg`), so the few rows by which
    /// a group's count passes a multiple of the tile need no tile of their own. Plain 256-token
    /// tiles on the TMA path of the plain entry, without L2 hints.
    pub tall: bool,
}

/// Rows a tall last tile takes past the 256-token tile (one more 64-row wgmma sub-tile).
const TALL_ROWS: i64 = 64;

impl WgmmaConfig {
    /// Plain: 256 x 128 tiles, 4 stages of 48 KiB (x 32 KiB, weight 16 KiB). Fused: 128 x 128
    /// tiles with the gate and up weight tiles, 4 stages of 48 KiB. Both keep 128 accumulators
    /// a consumer thread. The weight tiles come by TMA: against 128 threads' cp.async, H200, s =
    /// 0.5, cold, two interleaved runs each, routed ms at M = 2048 / 4096 / 16384: up 0.238-0.239
    /// / 0.447-0.464 / 1.729-1.859 against 0.241-0.242 / 0.479-0.481 / 1.874-1.912, gate+up
    /// 0.444 / 0.869-0.875 / 3.445-3.500 against 0.438-0.453 / 0.889-0.907 / 3.463-3.485.
    /// Contiguous tiles take x by TMA as well (`row_tma`): with every group keeping the same
    /// first half of the tokens (`bench kernels --mask-pattern prefix`, one call, H200, cold),
    /// routed ms up 0.204 / 0.356 at 2048 / 4096 tokens against 0.205 / 0.358 with the cp.async
    /// gather, gate+up 0.367 / 0.736 against 0.369 / 0.749, Q 0.065 / 0.112 against 0.071 / 0.113.
    pub fn default_for(fused: bool) -> Self {
        Self { mi: if fused { 1 } else { 2 }, stages: 4, async_arrive: true, cluster: 1, tma: true, l2_hint: false, persist: false, row_tma: true, stream_k: false, tall: false }
    }
    /// Token rows of a tile (the step between a group's tiles; a tall last tile has 64 more).
    pub fn bm(&self) -> i64 {
        WGMMA_BM * self.mi as i64
    }
    /// Rows a tall last tile takes past [`WgmmaConfig::bm`] (none without `tall`; the kernel's
    /// `BMA - BM`).
    pub fn tall_rows(&self) -> i64 {
        if self.tall {
            TALL_ROWS
        } else {
            0
        }
    }
    /// Token rows of a stage's x tile: [`WgmmaConfig::bm`] plus [`WgmmaConfig::tall_rows`].
    pub fn stage_rows(&self) -> i64 {
        self.bm() + self.tall_rows()
    }
    /// Dynamic shared memory of a launch: the stages plus 1 KiB so that they start 1024-aligned.
    pub fn smem_bytes(&self, fused: bool) -> u32 {
        let b_tiles = if fused { 2 } else { 1 };
        ((self.stage_rows() + b_tiles * WGMMA_BN) * WGMMA_BK * 2) as u32 * self.stages + 1024
    }
    /// A group's computing tiles for `count` listed active tokens: ceil(count / bm), or with
    /// `tall` the fewest whose last one takes at most 64 rows past bm.
    pub fn computing_tiles(&self, count: i64) -> i64 {
        if count <= 0 {
            0
        } else {
            ((count - self.tall_rows() + self.bm() - 1) / self.bm()).max(1)
        }
    }
    /// Can this configuration run (registers: at most 128 accumulators a consumer thread;
    /// shared memory: 227 KiB a block; the producer hand-over needs 3 stages)?
    pub fn valid(&self, fused: bool) -> bool {
        let accs = self.mi * if fused { 2 } else { 1 } * 64;
        (1..=2).contains(&self.mi)
            && accs <= 128
            && self.stages >= 3
            && self.smem_bytes(fused) <= 227 * 1024
            && (self.cluster == 1 || (self.cluster == 2 && self.async_arrive))
            && (!self.tma || (self.cluster == 1 && self.async_arrive))
            && (!self.persist || (self.mi == 1 && self.tma && !self.l2_hint))
            && (!self.stream_k || (self.tma && self.cluster == 1 && !self.persist && !self.l2_hint))
            && (!self.tall || (self.mi == 2 && !fused && self.tma && !self.persist && !self.stream_k && !self.l2_hint))
    }
    /// Does this configuration load contiguous tiles' x rows by TMA (`ROW_TMA`)?
    pub fn row_tma_on(&self) -> bool {
        self.row_tma && self.tma && !self.persist && !self.stream_k
    }
    /// The kernel's entry point.
    pub fn entry(&self) -> &'static str {
        if self.persist {
            "gemm_mn_wgmma_persist"
        } else if self.stream_k {
            "gemm_mn_wgmma_sk"
        } else {
            "gemm_mn_wgmma"
        }
    }
    pub fn label(&self) -> String {
        format!(
            "wgmma{}{}x128x64s{}{}{}{}{}{}{}{}",
            self.bm(),
            if self.tall { "+64" } else { "" },
            self.stages,
            if self.async_arrive { "" } else { "w" },
            if self.cluster == 2 { "c2" } else { "" },
            if self.tma { "t" } else { "" },
            if self.l2_hint { "h" } else { "" },
            if self.persist { "p" } else { "" },
            if self.row_tma_on() { "r" } else { "" },
            if self.stream_k { "k" } else { "" }
        )
    }
}

/// The configurations a benchmark sweep can force with `WIDE_WGMMA` (see [`config_for`]); each is
/// compiled by the NVRTC test.
pub fn sweep(fused: bool) -> Vec<WgmmaConfig> {
    let mut v = vec![WgmmaConfig::default_for(fused)];
    for mi in [1, 2] {
        for (stages, async_arrive, cluster, tma) in [(4, true, 1, true), (4, true, 1, false), (4, false, 1, false), (5, true, 1, true), (6, true, 1, true), (7, true, 1, true), (4, true, 2, false), (5, true, 2, false)] {
            for l2_hint in [false, true] {
                let c = WgmmaConfig { mi, stages, async_arrive, cluster, tma, l2_hint, persist: false, row_tma: true, stream_k: false, tall: false };
                if c.valid(fused) && !v.contains(&c) && (!l2_hint || (stages == 4 && tma)) {
                    v.push(c);
                }
                // The stream-K schedule at each depth of the TMA path.
                let k = WgmmaConfig { stream_k: true, ..c };
                if !l2_hint && k.valid(fused) && !v.contains(&k) {
                    v.push(k);
                }
                // The persistent grid at each depth of the TMA path.
                let p = WgmmaConfig { persist: true, ..c };
                if !l2_hint && p.valid(fused) && !v.contains(&p) {
                    v.push(p);
                }
                // The cp.async gather on contiguous tiles too, on the default and the deep tile.
                let r = WgmmaConfig { row_tma: false, ..c };
                if !l2_hint && c.row_tma_on() && (stages == 4 || stages == 7) && r.valid(fused) && !v.contains(&r) {
                    v.push(r);
                }
                // Tall last tiles, with and without contiguous tiles by TMA (and the plain tile
                // when they are the default).
                for t in [WgmmaConfig { tall: !c.tall, ..c }, WgmmaConfig { tall: !c.tall, row_tma: false, ..c }] {
                    if stages == 4 && t.valid(fused) && !v.contains(&t) {
                        v.push(t);
                    }
                }
            }
        }
    }
    v
}

/// The configuration of one launch: `WIDE_WGMMA` where set; the fused kernel's one
/// configuration; below 512 tokens the plain 256-token tile; else the cheapest of three by a
/// wave count ([`tile_costs`]): the plain 256-token tile, the same with tall last tiles
/// ([`WgmmaConfig::tall`]), and the 128-token tile with 7 stages (twice the blocks, each with more
/// of its weight tiles in flight).
pub fn config_for(s: &GemmShape, sparsity: f64, sms: i64) -> WgmmaConfig {
    config_for_groups(s, sparsity, 0, sms)
}

/// [`config_for`] for a layout whose last `on_groups` groups keep every token (the fused
/// Q|K|V's K|V), `sparsity` the skip rate of the others.
pub fn config_for_groups(s: &GemmShape, sparsity: f64, on_groups: i64, sms: i64) -> WgmmaConfig {
    let fused = s.op == RoutedOp::MnSwiglu;
    if let Some(c) = env_config(fused) {
        return c;
    }
    let d = WgmmaConfig::default_for(fused);
    if fused || s.m < 512 {
        return d;
    }
    let mut best = d;
    let mut best_cost = f64::INFINITY;
    for (c, cost) in tile_costs(s, sparsity, on_groups, sms) {
        if cost < best_cost {
            (best, best_cost) = (c, cost);
        }
    }
    best
}

/// Cost of the plain grid's one wave of 256-token tiles: 1. A wave of 128-token tiles with 7
/// stages costs `SMALL_WAVE`, plus `SMALL_FIXED` a launch; tall last tiles cost `TALL_EXTRA` of a
/// wave more than their wave count says.
const SMALL_WAVE: f64 = 0.56;
const SMALL_FIXED: f64 = 0.11;
const TALL_EXTRA: f64 = 0.3;

/// The candidate configurations of a plain product from 512 tokens and their costs in waves
/// of 256-token tiles (ceil(expected computing tiles / `sms`) from [`expected_tiles`]): the
/// plain tile (first: it wins ties), the 128-token 7-stage tile, and tall last tiles (unless
/// `WIDE_WGMMA_TALL=0`). Calibrated on the H200 (cold, G = 128, routed ms forced to each of the
/// three, 2026-12-04, `benchmarks/RESULTS.md`): a one-wave grid of 128-token tiles took 0.67-0.69
/// of a one-wave grid of 256-token ones (Q at 512 / 1024 tokens), several waves of them 0.54-0.57
/// a wave (Q 1024 / 2048, up 512 / 1024 / 2048); where tall tiles take waves off they cost 0.3-0.8
/// of a wave more than their count (up 1024, s = 0.5: 2 waves, 0.127 ms against 3 plain, 0.140,
/// and 4 small, 0.129; Q 4096, s = 0.25: 3 waves 0.176 against 4 plain 0.189 and 6 small 0.186).
/// With these constants the cheapest candidate is the measured fastest in each of the 25 cases of
/// those calls (Q and up at 512-16384 tokens, s = 0.25 / 0.5 / 0.75; test
/// `launches_take_the_tile_measured_fastest`), two of them ties within 2% (16384 tokens).
pub fn tile_costs(s: &GemmShape, sparsity: f64, on_groups: i64, sms: i64) -> Vec<(WgmmaConfig, f64)> {
    let fused = s.op == RoutedOp::MnSwiglu;
    let d = WgmmaConfig::default_for(fused);
    let tiles = s.n / WGMMA_BN;
    let on_tiles = (on_groups * s.group.max(0) / WGMMA_BN).clamp(0, tiles);
    let waves = |c: &WgmmaConfig| (expected_tiles(c, s.m, tiles - on_tiles, sparsity, on_tiles) / sms.max(1) as f64 - 1e-6).ceil().max(1.0);
    let mut v = vec![(d, waves(&d))];
    let small = WgmmaConfig { mi: 1, stages: 7, ..d };
    if small.valid(fused) {
        v.push((small, SMALL_WAVE * waves(&small) + SMALL_FIXED));
    }
    let tall = WgmmaConfig { tall: true, ..d };
    if tall.valid(fused) && tall_allowed() {
        v.push((tall, waves(&tall) + TALL_EXTRA));
    }
    v
}

/// `WIDE_WGMMA_TALL=0` (read once) keeps [`config_for`] off tall last tiles, for A/B runs.
fn tall_allowed() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_WGMMA_TALL") != Some(false))
}

/// Expected computing tiles of a grid in configuration `c` at `m` tokens: `routed_tiles` channel
/// tiles whose group keeps each token with probability 1 - `sparsity` (the count binomial, taken
/// as normal with a continuity correction) and `on_tiles` that keep all `m`. A plain grid runs
/// ceil(count / bm) tiles a group, a tall one max(1, ceil((count - 64) / bm)) for a count above 0.
pub fn expected_tiles(c: &WgmmaConfig, m: i64, routed_tiles: i64, sparsity: f64, on_tiles: i64) -> f64 {
    let bm = c.bm();
    let tiles_of = |count: i64| c.computing_tiles(count) as f64;
    let p = 1.0 - sparsity.clamp(0.0, 1.0);
    let (mu, sd) = (m as f64 * p, (m as f64 * p * (1.0 - p)).sqrt());
    // P(count > x) for an integer x; exactly 1 or 0 beyond 8 sd (erfc's tail there is below
    // 1e-15), so a launch evaluates erfc only at the few thresholds near the mean.
    let above = |x: i64| -> f64 {
        let z = x as f64 + 0.5 - mu;
        if z < -8.0 * sd {
            1.0
        } else if z > 8.0 * sd {
            0.0
        } else {
            0.5 * erfc(z / (sd * std::f64::consts::SQRT_2))
        }
    };
    // E[T(count)] as a sum of the thresholds T steps over: count > 0, count > k bm + tall rows
    // (k >= 1).
    let mut e = above(0);
    let mut k = 1;
    while k * bm + c.tall_rows() < m {
        e += above(k * bm + c.tall_rows());
        k += 1;
    }
    routed_tiles as f64 * e + on_tiles as f64 * tiles_of(m)
}

/// The complementary error function (the Chebyshev-fitted exponential form of Numerical Recipes'
/// `erfcc`: fractional error below 1.2e-7 everywhere).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t * (-z * z - 1.26551223
        + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
        .exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// `WIDE_WGMMA` (`mi=1,stages=5,arrive=wait,cluster=2`, `tma=1`, `hint=1`, `persist=1`, `rowtma=0`, `sk=1`, `tall=1`; read once), over the
/// default of this op. A spec with a setting it does not know, or one that gives a configuration
/// this op cannot run, is named in a warning (once) and ignored: the launches keep their own
/// choice ([`config_for`]).
fn env_config(fused: bool) -> Option<WgmmaConfig> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    let spec = V.get_or_init(|| crate::knobs::value("WIDE_WGMMA")).as_ref()?;
    let c = crate::knobs::report(config_from(spec, WgmmaConfig::default_for(fused)).map(Some))?;
    crate::knobs::report(if c.valid(fused) { Ok(Some(c)) } else { Err(format!("WIDE_WGMMA='{spec}' is not a configuration the {} wgmma kernel can run", if fused { "fused" } else { "plain" })) })
}

/// [`env_config`]'s parse of `spec` over `c`: an unknown key or a value that is not a number or
/// a 0 / 1 switch is an error naming it.
fn config_from(spec: &str, mut c: WgmmaConfig) -> Result<WgmmaConfig, String> {
    let bad = |kv: &str| format!("WIDE_WGMMA takes mi=N, stages=N, cluster=N, arrive=wait|async and tma, hint, persist, rowtma, sk, tall =0|1, comma separated; got '{kv}' in '{spec}'");
    let num = |kv: &str, v: &str| v.trim().parse::<u32>().map_err(|_| bad(kv));
    let flag = |kv: &str, v: &str| match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(bad(kv)),
    };
    for kv in spec.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        match kv.split_once('=').map(|(k, v)| (k.trim(), v)) {
            Some(("mi", v)) => c.mi = num(kv, v)?,
            Some(("stages", v)) => c.stages = num(kv, v)?,
            Some(("cluster", v)) => c.cluster = num(kv, v)?,
            Some(("arrive", v)) => {
                c.async_arrive = match v.trim() {
                    "wait" => false,
                    "async" => true,
                    _ => return Err(bad(kv)),
                }
            }
            Some(("tma", v)) => c.tma = flag(kv, v)?,
            Some(("hint", v)) => c.l2_hint = flag(kv, v)?,
            Some(("persist", v)) => c.persist = flag(kv, v)?,
            Some(("rowtma", v)) => c.row_tma = flag(kv, v)?,
            Some(("sk", v)) => c.stream_k = flag(kv, v)?,
            Some(("tall", v)) => c.tall = flag(kv, v)?,
            _ => return Err(bad(kv)),
        }
    }
    Ok(c)
}

/// Token tiles a band of the tile order (see wgmma.cu) for a launch of `m` tokens in tiles of
/// `bm`, whose routed groups skip a share `sparsity` of the tokens (None: unknown): about 2048
/// list entries, moved by up to two tiles so that the last, partial tile of a group (its index
/// is count / bm, the count about m (1 - s) +- 2 sd) is not the first of a band. Such a tile
/// otherwise runs in a band where no other tile of its group computes, and reads the group's
/// whole weight tile again from DRAM: at 50%, 4096 tokens and the 256-token tile every group
/// keeps 2048 +- 32 tokens, so about half of them have a few rows in tile 8, which opened the
/// second band of 8 and cost nearly a whole wave (random masks with exactly 2080 tokens a group
/// ran up in 0.416 ms against 0.366 with 2048, on the H200). Clusters keep the plain band.
pub fn band_tiles(bm: i64, cluster: u32, m: i64, sparsity: Option<f64>) -> i64 {
    let base = (2048 / bm).max(1);
    match env_band() {
        Some(0) => return base,
        Some(b) => return b,
        None => {}
    }
    let Some(s) = sparsity.filter(|_| cluster == 1) else { return base };
    let s = s.clamp(0.0, 1.0);
    let (mf, bf) = (m as f64, bm as f64);
    let (mu, sd) = (mf * (1.0 - s), (mf * s * (1.0 - s)).sqrt());
    let lo = ((mu - 2.0 * sd).max(0.0) / bf).floor() as i64;
    let hi = ((mu + 2.0 * sd).min(mf) / bf).floor() as i64;
    let full = m / bm; // a count of m leaves no partial tile past these
    for b in [base, base + 1, base - 1, base + 2, base - 2] {
        if b >= 1 && (lo..=hi).all(|p| p == 0 || p >= full.max(1) || p % b != 0) {
            return b;
        }
    }
    base
}

/// `WIDE_WGMMA_BAND` (read once): a number of token tiles forces that band on every launch,
/// `plain` (returned as 0) the plain 2048 list entries; for sweeps.
fn env_band() -> Option<i64> {
    static V: OnceLock<Option<i64>> = OnceLock::new();
    *V.get_or_init(|| {
        let v = crate::knobs::value("WIDE_WGMMA_BAND")?;
        if v == "plain" {
            Some(0)
        } else {
            crate::knobs::report(crate::knobs::int_from("WIDE_WGMMA_BAND", Some(&v), 1..=i64::MAX, "token tiles a band, or plain"))
        }
    })
}

/// `WIDE_WGMMA_SK_MODE` (read once; measurement knobs of the stream-K entry, 0-7, default 0):
/// bit 0 writes the zero-only tiles after a block's last item instead of between its k steps,
/// bit 1 runs whole tiles only (a persistent data-parallel grid, no split), bit 2 staggers the
/// blocks' whole tiles.
fn env_sk_mode() -> i32 {
    static V: OnceLock<i32> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_WGMMA_SK_MODE", 0..=7, "stream-K mode bits").map_or(0, |m| m as i32))
}

/// The module for a dtype, fusion flag and configuration.
pub fn source(f16: bool, fused: bool, c: WgmmaConfig) -> KernelSource {
    source_fine(f16, fused, c, false)
}

/// [`source`], with `fine` the variant for groups narrower than the 128-channel tile (`FINE`
/// in wgmma.cu: lists of the 128-channel OR of the mask, the fine mask applied as the tile is
/// written). Only the plain entry has it.
pub fn source_fine(f16: bool, fused: bool, c: WgmmaConfig, fine: bool) -> KernelSource {
    let k = KernelSource::new("wgmma", SOURCE)
        .target(TARGET)
        .define("WIDE_F16", f16 as u32)
        .define("FUSED", fused as u32)
        .define("MI", c.mi)
        .define("STAGES", c.stages)
        .define("ASYNC_ARRIVE", c.async_arrive as u32)
        .define("CLUSTER", c.cluster)
        .define("TMA_B", c.tma as u32)
        .define("L2_HINT", c.l2_hint as u32)
        .define("PERSIST", c.persist as u32)
        .define("ROW_TMA", c.row_tma_on() as u32)
        .define("STREAMK", c.stream_k as u32)
        .define("TALL", c.tall as u32);
    if fine {
        k.define("FINE", 1)
    } else {
        k
    }
}

/// The configurations [`config_for`] can pick for an op (the fused kernel's one, the plain
/// kernel's candidates of [`tile_costs`]), without `WIDE_WGMMA`.
fn picked_configs(fused: bool) -> Vec<WgmmaConfig> {
    let d = WgmmaConfig::default_for(fused);
    if fused {
        return vec![d];
    }
    [d, WgmmaConfig { mi: 1, stages: 7, ..d }, WgmmaConfig { tall: true, ..d }].into_iter().filter(|c| c.valid(false)).collect()
}

/// Every variant shipped (the defaults and the sweep), for the compile-everything test.
pub fn kernel_variants() -> Vec<KernelSource> {
    let mut v = vec![];
    for f16 in [false, true] {
        for fused in [false, true] {
            v.extend(sweep(fused).into_iter().map(|c| source(f16, fused, c)));
            // Groups narrower than the tile: the configurations the launch rule picks.
            v.extend(picked_configs(fused).into_iter().map(|c| source_fine(f16, fused, c, true)));
        }
    }
    v
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

/// The kernel of a configuration and the most dynamic shared memory a launch of it can have.
fn kernel(f16: bool, fused: bool, c: WgmmaConfig, fine: bool, device: usize) -> Result<(CudaKernel, u32)> {
    static K: OnceLock<Mutex<HashMap<(bool, bool, WgmmaConfig, bool, usize), (CudaKernel, u32)>>> = OnceLock::new();
    let key = (f16, fused, c, fine, device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&source_fine(f16, fused, c, fine), c.entry(), device)?;
    // The stream-K entry's schedule follows its stages in the dynamic shared memory (sized a
    // launch): its limit is what the static shared memory leaves of the multiprocessor's.
    let max = if c.stream_k { SMEM_LIMIT.saturating_sub(k.static_shared_mem()?) } else { c.smem_bytes(fused) };
    k.set_max_dynamic_shared_mem(max)?;
    K.get_or_init(Default::default).lock().unwrap().insert(key, (k, max));
    Ok((k, max))
}

/// Dynamic shared memory a block can have on compute capability 9.0 (227 KiB).
pub const SMEM_LIMIT: u32 = 227 * 1024;

/// The stream-K schedule's shared memory after the stages (bytes): each (band, N-tile) cell's
/// prefix of computing tiles (cells + 1 entries) and each N-tile's count.
pub fn stream_k_schedule_bytes(bm: i64, m: i64, n: i64, band: i64) -> u32 {
    let (mt, nt) = ((m + bm - 1) / bm, n / WGMMA_BN);
    let cells = (mt + band - 1) / band * nt;
    (4 * (cells + 1 + nt)) as u32
}

/// The stream-K kernel's f32 slots ([2 x multiprocessors] tiles of 32 K floats, the largest
/// tile's 256 x 128 or 128 x (128 + 128)) and their flags on this device and libtorch's current
/// stream (zeroed once; each launch leaves them zeroed, and launches on one stream do not
/// overlap).
fn stream_k_workspace(device: usize, sms: i64) -> Result<(Tensor, Tensor)> {
    static C: OnceLock<Mutex<HashMap<(usize, usize), (Tensor, Tensor)>>> = OnceLock::new();
    let key = (device, crate::shim::current_stream(device)? as usize);
    let mut m = C.get_or_init(Default::default).lock().unwrap();
    let (a, b) = m.entry(key).or_insert_with(|| {
        let d = tch::Device::Cuda(device);
        (Tensor::zeros([2 * sms, 256 * 128], (tch::Kind::Float, d)), Tensor::zeros([2 * sms], (tch::Kind::Int, d)))
    });
    Ok((a.shallow_clone(), b.shallow_clone()))
}

/// The persistent kernel's tile counter pair on this device and libtorch's current stream
/// (zeroed once; each launch leaves it zeroed, and launches on one stream do not overlap).
fn tile_counter(device: usize) -> Result<Tensor> {
    static C: OnceLock<Mutex<HashMap<(usize, usize), Tensor>>> = OnceLock::new();
    let key = (device, crate::shim::current_stream(device)? as usize);
    let mut m = C.get_or_init(Default::default).lock().unwrap();
    Ok(m.entry(key).or_insert_with(|| Tensor::zeros([2], (tch::Kind::Int, tch::Device::Cuda(device)))).shallow_clone())
}

/// Runs gemm_mn / gemm_mn_swiglu (`w2` = w_up) on the wgmma kernel.
pub(crate) fn launch(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tensor> {
    launch_config(s, x, w, w2, layout, None, None)
}

/// gemm_mn (`w_up` None) or gemm_mn_swiglu on the wgmma kernel in one given configuration (for
/// tests and sweeps; the routed ops pick theirs with [`config_for`]). `group` channels a group,
/// the layout's groups over the output width.
pub fn gemm_mn_with(config: WgmmaConfig, x: &Tensor, w: &Tensor, w_up: Option<&Tensor>, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    gemm_mn_banded(config, None, x, w, w_up, layout, group)
}

/// [`gemm_mn_with`] with the tile order's band forced to `band` token tiles (None: the one
/// [`band_tiles`] picks), for tests of the order.
pub fn gemm_mn_banded(config: WgmmaConfig, band: Option<i64>, x: &Tensor, w: &Tensor, w_up: Option<&Tensor>, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    ensure!(band.map_or(true, |b| b >= 1 && b % config.cluster as i64 == 0), "gemm_mn_banded: band {band:?} must be a positive multiple of the cluster size {}", config.cluster);
    let op = if w_up.is_some() { RoutedOp::MnSwiglu } else { RoutedOp::Mn };
    ensure!(config.valid(op == RoutedOp::MnSwiglu), "wgmma configuration {} cannot run {op:?}", config.label());
    let (xs, ws) = (x.size(), w.size());
    ensure!(xs.len() == 2 && ws.len() == 2 && xs[1] == ws[1], "gemm_mn_with: x {xs:?} and w {ws:?} must be [M, K] and [N, K]");
    ensure!(group > 0 && ws[0] % group == 0, "gemm_mn_with: group {group} must divide the {} output channels", ws[0]);
    ensure!(
        layout.tokens() == xs[0] && layout.groups() == ws[0] / group,
        "gemm_mn_with: the layout is for a mask [{}, {}] but x has {} tokens and w {} groups of {group}",
        layout.tokens(),
        layout.groups(),
        xs[0],
        ws[0] / group
    );
    let s = GemmShape { op, m: xs[0], n: ws[0], k: xs[1], group };
    launch_config(&s, x, w, w_up, layout, Some(config), band)
}

fn launch_config(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, config: Option<WgmmaConfig>, band: Option<i64>) -> Result<Tensor> {
    ensure!(
        wgmma_feasible(s),
        "the wgmma kernel cannot run {:?} with N {} K {} group {} (needs gemm_mn, 128 | N, 64 | K, and a group size that is a multiple of 128 or a multiple of 8 dividing 128)",
        s.op,
        s.n,
        s.k,
        s.group
    );
    let (device, f16, x, w, w2) = cuda_inputs(s, x, w, w2)?;
    ensure!(supported(device), "the wgmma kernel needs a compute capability 9.0 (Hopper) GPU; device {device} is not one");
    let fused = s.op == RoutedOp::MnSwiglu;
    let sms = crate::cuda::multiprocessor_count(device)? as u64;
    // The routed groups' skip rate (always-on groups, such as the fused Q|K|V's K|V, keep every
    // token and have no partial tile).
    let routed = layout.sparsity_hint().map(|h| (h * layout.groups() as f64 / layout.always_on_from().max(1) as f64).min(1.0));
    // Groups narrower than the 128-channel tile (FINE in wgmma.cu): the tiles run on the lists of
    // the mask's OR over each tile's `factor` groups, which skips a token only where it skips
    // all of them (about s^factor of the tokens for independent groups).
    let fine = s.group < WGMMA_BN;
    let factor = if fine { WGMMA_BN / s.group } else { 1 };
    let routed = routed.map(|h| h.powi(factor as i32));
    let c = match config {
        Some(c) => {
            ensure!(!fine || !(c.persist || c.stream_k), "wgmma configuration {} has no form for groups of {} (narrower than the 128-channel tile): use the plain grid", c.label(), s.group);
            c
        }
        // A sweep's persistent or stream-K grid has no fine form: its plain grid runs instead.
        None => match config_for_groups(s, routed.unwrap_or(0.5f64.powi(factor as i32)), layout.groups() - layout.always_on_from(), sms as i64) {
            c if fine && (c.persist || c.stream_k) => WgmmaConfig { persist: false, stream_k: false, ..c },
            c => c,
        },
    };
    // The tile order's band, and for the stream-K schedule the shared memory it needs (a
    // launch whose schedule does not fit next to the stages takes the plain grid).
    let band = band.unwrap_or_else(|| band_tiles(c.bm(), c.cluster, s.m, routed));
    let band = if c.cluster == 2 { (band - band % 2).max(2) } else { band };
    let mut smem = c.smem_bytes(fused);
    let (mut k, max) = kernel(f16, fused, c, fine, device)?;
    let c = if c.stream_k {
        let need = smem + stream_k_schedule_bytes(c.bm(), s.m, s.n, band);
        if need <= max {
            smem = need;
            c
        } else {
            let plain = WgmmaConfig { stream_k: false, ..c };
            k = kernel(f16, fused, plain, fine, device)?.0;
            plain
        }
    } else {
        c
    };
    let (perm, count) = if fine { layout.coarse_lists(factor)? } else { layout.lists()? };
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    // A 1-D grid of tiles (units of `cluster` token tiles) in banded order (see wgmma.cu); a band
    // of (N / 128) * 32 tiles at most must fit an i32 too.
    let units = (s.m as u64).div_ceil(c.bm() as u64).div_ceil(c.cluster as u64);
    let blocks = units * c.cluster as u64 * (s.n / WGMMA_BN) as u64;
    ensure!(blocks <= i32::MAX as u64 && 32 * s.n / WGMMA_BN <= i32::MAX as i64, "too many tiles (M {} x N {}) for one wgmma launch", s.m, s.n);
    // The persistent grid: one block a multiprocessor (at most one a tile).
    let grid = if c.persist { blocks.min(sms) } else if c.stream_k { sms } else { blocks };
    let cfg = LaunchConfig { grid: (grid as u32, 1, 1), block: (THREADS, 1, 1), shared_mem_bytes: smem };
    let w_up = w2.as_ref().unwrap_or(&w);
    // Clusters (half a tile, 64 rows x 64 k, a block) and the TMA path (two such boxes a tile)
    // load the weight tiles with TMA.
    let (map_w, map_up) = if c.cluster == 2 || c.tma {
        (crate::cuda::tensor_map_2d(&w, f16, 64, 64)?, crate::cuda::tensor_map_2d(w_up, f16, 64, 64)?)
    } else {
        (KernelArg::TensorMap([0; 16]), KernelArg::TensorMap([0; 16]))
    };
    // Contiguous tiles (ROW_TMA) load x by TMA too, in the weights' boxes.
    let map_x = if c.row_tma_on() { crate::cuda::tensor_map_2d(&x, f16, 64, 64)? } else { KernelArg::TensorMap([0; 16]) };
    let mut args = vec![
        KernelArg::tensor(&x)?,
        KernelArg::tensor(&w)?,
        KernelArg::tensor(w_up)?,
        KernelArg::tensor(perm)?,
        KernelArg::tensor(count)?,
        KernelArg::tensor(&out)?,
        KernelArg::I32(s.m as i32),
        KernelArg::I32(s.n as i32),
        KernelArg::I32(s.k as i32),
        KernelArg::I32((if fine { WGMMA_BN } else { s.group }) as i32),
        map_w,
        map_up,
        map_x,
    ];
    if c.persist {
        args.push(KernelArg::tensor(&tile_counter(device)?)?);
        args.push(KernelArg::I32(blocks as i32));
    }
    if c.stream_k {
        let (slots, flags) = stream_k_workspace(device, sms as i64)?;
        args.push(KernelArg::tensor(&slots)?);
        args.push(KernelArg::tensor(&flags)?);
    }
    args.push(KernelArg::I32(band as i32));
    if !c.persist && !c.stream_k {
        // The plain entry's fine mask (FINE; unread otherwise).
        if fine {
            args.push(KernelArg::tensor(layout.mask())?);
            args.push(KernelArg::I32(s.group as i32));
            args.push(KernelArg::I32(layout.groups() as i32));
        } else {
            args.extend([KernelArg::Ptr(0), KernelArg::I32(0), KernelArg::I32(0)]);
        }
    }
    let trace = if c.stream_k && std::env::var_os("WIDE_WGMMA_SK_TRACE").is_some() {
        Some(Tensor::zeros([sms as i64, 64, 8], (tch::Kind::Int64, x.device())))
    } else {
        None
    };
    if c.stream_k {
        args.push(KernelArg::I32(env_sk_mode()));
        args.push(match &trace {
            Some(t) => KernelArg::tensor(t)?,
            None => KernelArg::Ptr(0),
        });
    }
    // SAFETY: the arguments follow gemm_mn_wgmma's signature; x is [M, K], w and w_up [N, K]
    // (contiguous, 16-byte aligned), perm [N / G, M] and count [N / G] come from this layout (G
    // the 128-channel tile for narrower groups, whose fine mask [M, N / group] is the layout's),
    // out is [M, N]; the grid has one block for each of ceil(M / bm) x N / 128 tiles (rounded
    // up to whole clusters; the persistent entry: at most one a multiprocessor, with its zeroed
    // counter pair, which every launch leaves zeroed, and the tile count; the stream-K entry:
    // one block a multiprocessor, with its zeroed slots of 2 x multiprocessors tiles and flags,
    // which every launch leaves zeroed, and its schedule's shared memory); the tensor maps
    // describe w and w_up, and x where the configuration reads it by TMA (a zero map otherwise,
    // unread).
    unsafe { k.launch(cfg, &args)? };
    if let (Some(t), Some(path)) = (trace, std::env::var_os("WIDE_WGMMA_SK_TRACE")) {
        // A measurement knob: the stamps of this launch (each launch overwrites the file).
        let v: Vec<i64> = Vec::<i64>::try_from(t.flatten(0, -1).to_device(tch::Device::Cpu))?;
        let text: Vec<String> = v.iter().map(|x| x.to_string()).collect();
        std::fs::write(&path, format!("{} {} {}\n{}\n", s.m, s.n, sms, text.join(" ")))
            .map_err(|e| anyhow::anyhow!("writing the stream-K stamps to {} (WIDE_WGMMA_SK_TRACE): {e}", std::path::Path::new(&path).display()))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_take_the_tile_measured_fastest() {
        use crate::ops::dispatch::GemmShape;
        if std::env::var("WIDE_WGMMA").is_ok() || std::env::var("WIDE_WGMMA_TALL").is_ok() {
            return; // the overrides win everywhere
        }
        // The fastest of the three forced on the H200 (cold, G = 128, routed ms; Q: N 4096, up:
        // N 14336; RESULTS, 2026-12-04 third session), as (tokens, N, skip rate, config).
        #[derive(Debug, PartialEq)]
        enum T {
            Plain,
            Small,
            Tall,
        }
        let measured = [
            (512, 4096, 0.25, T::Small),
            (512, 4096, 0.5, T::Small),
            (512, 4096, 0.75, T::Small),
            (1024, 4096, 0.25, T::Plain),
            (1024, 4096, 0.5, T::Plain),
            (1024, 4096, 0.75, T::Small),
            (2048, 4096, 0.25, T::Plain),
            (2048, 4096, 0.5, T::Tall),
            (2048, 4096, 0.75, T::Plain),
            (4096, 4096, 0.25, T::Tall),
            (4096, 4096, 0.5, T::Tall),
            (4096, 4096, 0.75, T::Tall),
            (16384, 4096, 0.5, T::Plain),
            (512, 14336, 0.25, T::Small),
            (512, 14336, 0.5, T::Tall),
            (512, 14336, 0.75, T::Plain),
            (1024, 14336, 0.25, T::Plain),
            (1024, 14336, 0.5, T::Tall),
            (1024, 14336, 0.75, T::Tall),
            (2048, 14336, 0.25, T::Plain),
            (2048, 14336, 0.5, T::Plain),
            (2048, 14336, 0.75, T::Tall),
            (4096, 14336, 0.5, T::Tall),
            (4096, 14336, 0.75, T::Plain),
            (16384, 14336, 0.5, T::Plain),
        ];
        for (m, n, s, want) in measured {
            let c = config_for(&GemmShape { op: RoutedOp::Mn, m, n, k: 4096, group: 128 }, s, 132);
            let got = if c.tall { T::Tall } else if c.mi == 1 { T::Small } else { T::Plain };
            assert_eq!(got, want, "m {m} n {n} s {s}: {}", c.label());
            assert!(c.valid(false));
        }
        // Below 512 tokens the plain tile; the fused kernel keeps its one configuration.
        assert_eq!(config_for(&GemmShape { op: RoutedOp::Mn, m: 256, n: 14336, k: 4096, group: 128 }, 0.5, 132), WgmmaConfig::default_for(false));
        assert_eq!(config_for(&GemmShape { op: RoutedOp::MnSwiglu, m: 1024, n: 14336, k: 4096, group: 128 }, 0.5, 132), WgmmaConfig::default_for(true));
        // The fused Q|K|V at 2048 tokens: 16 always-on K|V tiles of 8 token tiles and 32 routed Q
        // tiles of about 4.5 (3 waves) or 4 with tall last tiles (2 waves).
        let qkv = GemmShape { op: RoutedOp::Mn, m: 2048, n: 6144, k: 4096, group: 512 };
        assert!(config_for_groups(&qkv, 0.5, 4, 132).tall);
        // The plain tile is first among the candidates (ties keep it).
        assert_eq!(tile_costs(&qkv, 0.5, 4, 132)[0].0, WgmmaConfig::default_for(false));
    }

    #[test]
    fn expected_tiles_follow_the_counts() {
        let d = WgmmaConfig::default_for(false);
        let t = WgmmaConfig { tall: true, ..d };
        assert_eq!((d.computing_tiles(0), d.computing_tiles(1), d.computing_tiles(256), d.computing_tiles(257)), (0, 1, 1, 2));
        assert_eq!((t.computing_tiles(0), t.computing_tiles(1), t.computing_tiles(320), t.computing_tiles(321), t.computing_tiles(576), t.computing_tiles(577)), (0, 1, 1, 2, 2, 3));
        // All on or all off: exact.
        assert!((expected_tiles(&d, 4096, 10, 0.0, 0) - 160.0).abs() < 1e-9);
        assert!((expected_tiles(&t, 4100, 10, 0.0, 0) - 160.0).abs() < 1e-9, "4100 = 15 x 256 + 260");
        assert!(expected_tiles(&d, 4096, 10, 1.0, 0).abs() < 1e-9);
        // 50% of 4096: 2048 +- 32 a group, half of them a partial ninth tile (plain), almost none tall.
        let (ed, et) = (expected_tiles(&d, 4096, 112, 0.5, 0), expected_tiles(&t, 4096, 112, 0.5, 0));
        assert!((ed - 112.0 * 8.5).abs() < 1.0 && (et - 112.0 * 8.0).abs() < 3.0, "{ed} {et}");
        // Always-on tiles count whole.
        assert!((expected_tiles(&d, 2048, 0, 0.5, 16) - 128.0).abs() < 1e-9);
        assert!((erfc(0.0) - 1.0).abs() < 1e-7 && (erfc(1.0) - 0.157_299_207).abs() < 1e-7 && (erfc(-1.0) - 1.842_700_793).abs() < 1e-7);
    }

    #[test]
    fn wgmma_knob_specs_parse_or_are_named() {
        let d = WgmmaConfig::default_for(false);
        let c = config_from(" mi=1, stages=7 ,tall=1,arrive=wait,rowtma=0", d).unwrap();
        assert_eq!((c.mi, c.stages, c.tall, c.async_arrive, c.row_tma), (1, 7, true, false, false));
        assert_eq!((c.cluster, c.tma, c.persist, c.stream_k), (d.cluster, d.tma, d.persist, d.stream_k));
        assert_eq!(config_from("", d), Ok(d));
        for bad in ["stage=7", "mi=x", "tall=yes", "arrive=later", "persist"] {
            let e = config_from(bad, d).unwrap_err();
            assert!(e.starts_with("WIDE_WGMMA takes") && e.contains(&format!("got '{bad}'")), "{e}");
        }
    }

    #[test]
    fn bands_keep_the_partial_tiles_with_their_groups() {
        if std::env::var("WIDE_WGMMA_BAND").is_ok() {
            return; // the override wins everywhere
        }
        // 50%: the partial tile of a group (index count / bm) near m / 2 / bm must not open a band.
        for (bm, m) in [(256, 4096), (256, 16384), (128, 4096), (128, 8192), (256, 8192), (256, 32768)] {
            let b = band_tiles(bm, 1, m, Some(0.5));
            assert!((b - 2048 / bm).abs() <= 2, "bm {bm} m {m}: band {b}");
            let sd = (m as f64 * 0.25).sqrt();
            for c in [m / 2 - (2.0 * sd) as i64, m / 2, m / 2 + 1, m / 2 + (2.0 * sd) as i64] {
                let p = c / bm;
                assert!(p == 0 || p % b != 0, "bm {bm} m {m} count {c}: tile {p} opens a band of {b}");
            }
        }
        // Where the plain band already keeps them, it stays; unknown skip rates and clusters too.
        assert_eq!(band_tiles(256, 1, 2048, Some(0.5)), 8);
        assert_eq!(band_tiles(128, 1, 2048, Some(0.5)), 16);
        assert_eq!(band_tiles(256, 1, 4096, None), 8);
        assert_eq!(band_tiles(256, 2, 4096, Some(0.5)), 8);
        assert_eq!(band_tiles(256, 1, 4096, Some(0.5)), 9);
        // All-on (s = 0) and all-off groups have no partial tile to place.
        assert_eq!(band_tiles(256, 1, 4096, Some(0.0)), 8);
        assert_eq!(band_tiles(256, 1, 4096, Some(1.0)), 8);
    }

    #[test]
    fn configurations_fit_the_multiprocessor() {
        // H100/H200: 227 KiB of dynamic shared memory a block at most.
        for fused in [false, true] {
            let d = WgmmaConfig::default_for(fused);
            assert!(d.valid(fused), "{d:?}");
            assert!(sweep(fused).iter().all(|c| c.valid(fused)));
            assert_eq!(sweep(fused)[0], d);
        }
        assert_eq!(WgmmaConfig::default_for(false).smem_bytes(false), 4 * (32768 + 16384) + 1024);
        assert_eq!(WgmmaConfig::default_for(true).smem_bytes(true), 4 * (16384 + 32768) + 1024);
        assert_eq!(WgmmaConfig::default_for(false).bm(), 256);
        // Fused with 256-token tiles would need 256 accumulators a thread.
        assert!(!WgmmaConfig { mi: 2, stages: 3, async_arrive: true, cluster: 1, tma: false, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(true));
        assert!(!WgmmaConfig { mi: 1, stages: 2, async_arrive: true, cluster: 1, tma: false, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(false));
        assert!(!WgmmaConfig { mi: 2, stages: 5, async_arrive: true, cluster: 1, tma: false, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(false), "240 KiB");
        assert!(!WgmmaConfig { mi: 2, stages: 4, async_arrive: false, cluster: 2, tma: false, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(false), "clusters need the async arrive");
        assert!(!WgmmaConfig { mi: 2, stages: 4, async_arrive: false, cluster: 1, tma: true, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(false), "TMA weights need the async arrive");
        assert!(!WgmmaConfig { mi: 1, stages: 4, async_arrive: true, cluster: 2, tma: true, l2_hint: false, persist: false, row_tma: false, stream_k: false, tall: false }.valid(true), "TMA weights are the cluster-free path");
        assert!(sweep(false).iter().any(|c| !c.tma && c.cluster == 1) && sweep(true).iter().any(|c| !c.tma && c.cluster == 1), "the cp.async weight path stays in the sweep");
        assert!(WgmmaConfig::default_for(true).tma && WgmmaConfig::default_for(false).tma);
        assert!(sweep(false).iter().any(|c| c.cluster == 2) && sweep(true).iter().any(|c| c.cluster == 2));
        // The persistent grid: 128-token tiles on the TMA path only, in both sweeps.
        let p = WgmmaConfig { persist: true, ..WgmmaConfig::default_for(true) };
        assert!(p.valid(true) && p.entry() == "gemm_mn_wgmma_persist" && p.label().ends_with('p'));
        assert!(!WgmmaConfig { persist: true, ..WgmmaConfig::default_for(false) }.valid(false), "256-token tiles");
        assert!(!WgmmaConfig { persist: true, tma: false, ..WgmmaConfig::default_for(true) }.valid(true), "cp.async weights");
        assert!(sweep(false).iter().any(|c| c.persist) && sweep(true).iter().any(|c| c.persist));
        // The stream-K schedule: the TMA path without clusters, persist or hints; both sweeps.
        let k = WgmmaConfig { stream_k: true, ..WgmmaConfig::default_for(false) };
        assert!(k.valid(false) && k.entry() == "gemm_mn_wgmma_sk" && k.label().ends_with('k') && !k.row_tma_on());
        assert!(WgmmaConfig { stream_k: true, ..WgmmaConfig::default_for(true) }.valid(true));
        assert!(!WgmmaConfig { stream_k: true, tma: false, ..k }.valid(false), "cp.async weights");
        assert!(!WgmmaConfig { stream_k: true, mi: 1, persist: true, ..k }.valid(false), "persist and stream-K");
        assert!(!WgmmaConfig { stream_k: true, l2_hint: true, ..k }.valid(false), "L2 hints");
        assert!(sweep(false).iter().any(|c| c.stream_k) && sweep(true).iter().any(|c| c.stream_k));
    }

    #[test]
    fn stream_k_schedule_fits_beside_the_stages() {
        // Up at 16384 tokens in 256-token tiles, bands of 8: 8 x 112 cells, their prefix + the counts.
        assert_eq!(stream_k_schedule_bytes(256, 16384, 14336, 8), 4 * (8 * 112 + 1 + 112));
        // A partial last band is a band of its own.
        assert_eq!(stream_k_schedule_bytes(256, 4096, 14336, 9), 4 * (2 * 112 + 1 + 112));
        // The deepest 128-token tile (7 stages of 32 KiB) still takes Q at 16384 tokens.
        let small = WgmmaConfig { mi: 1, stages: 7, stream_k: true, row_tma: false, ..WgmmaConfig::default_for(false) };
        assert!(small.smem_bytes(false) + stream_k_schedule_bytes(128, 16384, 4096, 16) <= SMEM_LIMIT);
        // The fused kernel's at 32768 tokens.
        let f = WgmmaConfig { stream_k: true, ..WgmmaConfig::default_for(true) };
        assert!(f.smem_bytes(true) + stream_k_schedule_bytes(128, 32768, 14336, 16) <= SMEM_LIMIT);
    }

    #[test]
    fn gemm_mn_with_rejects_bad_inputs() {
        use tch::{Device, Kind};
        let x = Tensor::zeros([8, 128], (Kind::BFloat16, Device::Cpu));
        let w = Tensor::zeros([256, 128], (Kind::BFloat16, Device::Cpu));
        let lay = crate::ops::layout::route_layout(&Tensor::ones([8, 2], (Kind::Bool, Device::Cpu))).unwrap();
        let err = |c: WgmmaConfig, l: &RouteLayout, g: i64| gemm_mn_with(c, &x, &w, None, l, g).unwrap_err().to_string();
        let persist_plain = WgmmaConfig { persist: true, ..WgmmaConfig::default_for(false) };
        assert!(err(persist_plain, &lay, 128).contains("cannot run"), "{}", err(persist_plain, &lay, 128));
        let ok = WgmmaConfig { mi: 1, persist: true, ..WgmmaConfig::default_for(false) };
        assert!(err(ok, &lay, 100).contains("must divide"), "{}", err(ok, &lay, 100));
        let other = crate::ops::layout::route_layout(&Tensor::ones([8, 4], (Kind::Bool, Device::Cpu))).unwrap();
        assert!(err(ok, &other, 128).contains("the layout is for a mask [8, 4]"), "{}", err(ok, &other, 128));
        assert!(err(ok, &lay, 128).contains("CUDA"), "{}", err(ok, &lay, 128));
        let bad_band = gemm_mn_banded(ok, Some(0), &x, &w, None, &lay, 128).unwrap_err().to_string();
        assert!(bad_band.contains("band Some(0) must be a positive multiple"), "{bad_band}");
    }

    #[test]
    fn descriptor_fields() {
        let d = sw128_desc(0);
        assert_eq!(d, 0x4000_0040_0001_0000);
        assert_eq!(d >> 62, 1, "128-byte swizzle");
        assert_eq!((d >> 32) & 0x3FFF, 64, "stride byte offset 1024 >> 4");
        assert_eq!((d >> 16) & 0x3FFF, 1);
        assert_eq!((d >> 49) & 7, 0, "base offset");
        // Start address: 16-byte units, 18-bit shared window; k + 16 elements = +32 bytes = +2.
        assert_eq!(sw128_desc(1024 * 5) & 0x3FFF, 320);
        assert_eq!(sw128_desc(1024 + 32) - sw128_desc(1024), 2);
        assert_eq!(sw128_desc(0x3FFF0) & 0x3FFF, 0x3FFF);
    }

    #[test]
    fn swizzle_permutes_chunks_within_each_row() {
        // Each 8-row, 1024-byte group holds every (r, k) once; 8 consecutive k share a 16-byte
        // chunk; chunk c of row r sits at chunk position c ^ (r % 8) of the row.
        let mut seen = vec![false; 1024];
        for r in 0..8 {
            for k in 0..64 {
                let o = sw128_offset(r, k) as usize;
                assert!(o < 1024 && o % 2 == 0 && !seen[o], "r {r} k {k}");
                seen[o] = true;
                assert_eq!(o / 128, r as usize);
                assert_eq!(o % 128 / 16, ((k / 8) ^ r) as usize);
            }
        }
        assert!(seen.iter().step_by(2).all(|&b| b));
        assert_eq!(sw128_offset(9, 0), 9 * 128 + 16, "row 9 is row 1 of the next group");
        // The same column of rows 0..8 spreads over 8 distinct 16-byte bank groups.
        let banks: std::collections::HashSet<u32> = (0..8).map(|r| sw128_offset(r, 0) % 128 / 16).collect();
        assert_eq!(banks.len(), 8);
    }

    #[test]
    fn variants_target_sm90a() {
        let v = kernel_variants();
        assert!(v.iter().all(|k| k.target == Some("compute_90a")));
        // No variant is compiled twice, and every grid the launch rule picks is shipped (so
        // precompiled machine code covers it: the GPU machine keeps no cache between calls).
        let defines: std::collections::HashSet<_> = v.iter().map(|k| format!("{:?}", k.defines)).collect();
        assert_eq!(defines.len(), v.len(), "two variants with the same defines");
        let shipped = |fused: bool, c: WgmmaConfig| v.iter().any(|k| k.defines == source(false, fused, c).defines);
        for fused in [false, true] {
            let s = GemmShape { op: if fused { RoutedOp::MnSwiglu } else { RoutedOp::Mn }, m: 4096, n: 14336, k: 4096, group: 128 };
            for (c, _) in tile_costs(&s, 0.5, 0, 132) {
                assert!(shipped(fused, c), "{c:?} (fused {fused}) can be picked but is not among the variants");
                // and its form for groups narrower than the tile
                assert!(v.iter().any(|k| k.defines == source_fine(false, fused, c, true).defines), "{c:?} (fused {fused}) has no FINE variant");
            }
        }
        // Only the plain entry has a FINE form.
        assert!(v.iter().filter(|k| k.defines.iter().any(|(d, _)| d == "FINE")).all(|k| k.defines.iter().any(|(d, v)| d == "PERSIST" && v == "0")
            && k.defines.iter().any(|(d, v)| d == "STREAMK" && v == "0")));
    }
}
