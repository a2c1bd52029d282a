//! Which implementation a routed projection runs: a pure policy (testable on CPU) over the
//! shape, group size, sparsity and, for large M, the timings the autotuner measured on first
//! use per power-of-two M bucket. The rule is "never slower than dense": where a routed kernel
//! does not pay, the dense cuBLAS product runs and the mask is applied to it.
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Tile shape of the `mma.sync` kernels: block tile `bm x bn`, k step `bk`, `wm x wn` warps,
/// `stages` cp.async pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TileConfig {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    pub wm: u32,
    pub wn: u32,
    pub stages: u32,
}

impl TileConfig {
    pub const fn new(bm: u32, bn: u32, bk: u32, wm: u32, wn: u32, stages: u32) -> Self {
        Self { bm, bn, bk, wm, wn, stages }
    }
    pub fn threads(&self) -> u32 {
        self.wm * self.wn * 32
    }
    /// Dynamic shared memory: A tile plus one (or two, fused) B tiles per stage, rows padded
    /// by 8 elements of 2 bytes.
    pub fn smem_bytes(&self, fused: bool) -> u32 {
        let b = if fused { 2 } else { 1 };
        (self.bm + b * self.bn) * (self.bk + 8) * 2 * self.stages
    }
    pub fn label(&self) -> String {
        format!("tiled{}x{}x{}", self.bm, self.bn, self.bk)
    }
}

/// Every tile configuration shipped (each is an NVRTC specialisation).
pub const TILES: [TileConfig; 8] = [
    TileConfig::new(128, 128, 32, 2, 4, 3),
    TileConfig::new(128, 128, 64, 2, 4, 3),
    TileConfig::new(64, 128, 32, 2, 4, 4),
    TileConfig::new(128, 64, 32, 4, 2, 4),
    TileConfig::new(128, 64, 64, 4, 2, 3),
    TileConfig::new(64, 64, 32, 2, 2, 4),
    TileConfig::new(128, 32, 32, 4, 2, 4),
    TileConfig::new(64, 32, 32, 2, 2, 4),
];

/// The routed projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RoutedOp {
    /// Output-width routed (`gemm_mn`), groups over N.
    Mn,
    /// `gemm_mn` of gate and up with the SiLU-multiply epilogue.
    MnSwiglu,
    /// Reduction-width routed (`gemm_k`), groups over K.
    K,
    /// `gemm_k` whose input is already exactly zero at the skipped (token, group) slices (the
    /// output of the routed SwiGLU or of routed attention), so its dense path needs no mask.
    KPremasked,
}

impl RoutedOp {
    /// Groups run over the reduction (input) dimension.
    pub fn reduces_over_groups(&self) -> bool {
        matches!(self, RoutedOp::K | RoutedOp::KPremasked)
    }
}

/// How one call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPath {
    /// cuBLAS dense product, then the mask (the reference formula in the input dtype).
    DenseMasked,
    /// Small-M kernel reading the raw mask; inactive weight rows/slices are never loaded.
    Gemv,
    /// Small-M gemm_mn / SwiGLU on `mma.sync` (2..=16 tokens): the GEMV's skipping of unused
    /// groups, with each weight byte loaded once for all tokens ([`skinny_feasible`]).
    GemvMma,
    /// Hopper (sm_90a) gemm_mn for 2-128 tokens on `wgmma` with the product transposed (the
    /// weight rows on the 64-row side, the tokens on the narrow one) and the mask applied as it
    /// writes ([`super::skinny_wg`]); measured by the autotuner against dense + mask.
    SkinnyWg,
    /// `mma.sync` tiled kernel with block-level skipping.
    Tiled(TileConfig),
    /// Hopper (sm_90a) `wgmma` kernel for gemm_mn / SwiGLU, tiles of 128 channels x 256 (plain)
    /// or 128 (SwiGLU) tokens, k steps of 64 ([`super::wgmma`]); compute capability 9.0 only.
    Wgmma,
}

impl GemmPath {
    pub fn label(&self) -> String {
        match self {
            GemmPath::DenseMasked => "dense+mask".into(),
            GemmPath::Gemv => "gemv".into(),
            GemmPath::GemvMma => "gemv-mma".into(),
            GemmPath::SkinnyWg => "wgmma-skinny".into(),
            GemmPath::Tiled(t) => t.label(),
            GemmPath::Wgmma => "wgmma".into(),
        }
    }
}

/// Largest M the GEMV kernels take (their per-token accumulators live in registers).
pub const GEMV_MAX_M: i64 = 16;
/// Token range of the small-M `mma.sync` gemm_mn ([`GemmPath::GemvMma`]; one or two 8-token
/// tiles a block). At 32 tokens (four tiles) it measured 0.53-0.93x of cuBLAS on up 4096->14336 over three versions
/// (H200, 2026-12-01), behind cuBLAS + the zero pass.
pub const SKINNY_MIN_M: i64 = 2;
pub const SKINNY_MAX_M: i64 = 16;

/// Shapes the small-M `mma.sync` gemm_mn takes: gemm_mn or its SwiGLU, 2..=16 tokens, blocks of
/// 16 rows inside one group (16 | G) and k blocks of 32 (32 | K).
pub fn skinny_feasible(s: &GemmShape) -> bool {
    matches!(s.op, RoutedOp::Mn | RoutedOp::MnSwiglu)
        && (SKINNY_MIN_M..=SKINNY_MAX_M).contains(&s.m)
        && s.group % 16 == 0
        && s.n % s.group == 0
        && s.k % 32 == 0
        && s.k > 0
}
/// Token range of the transposed small-M wgmma gemm_mn ([`GemmPath::SkinnyWg`]).
pub const SKINNY_WG_MIN_M: i64 = 2;
pub const SKINNY_WG_MAX_M: i64 = 128;

/// Shapes the transposed small-M wgmma gemm_mn takes (the device must also be compute
/// capability 9.0): a plain gemm_mn (no SwiGLU) of 2..=128 tokens, blocks of 64 weight rows
/// (64 | N), k steps of 64 (64 | K), and groups of whole 16-byte pieces (8 | G).
pub fn skinny_wg_feasible(s: &GemmShape) -> bool {
    s.op == RoutedOp::Mn
        && (SKINNY_WG_MIN_M..=SKINNY_WG_MAX_M).contains(&s.m)
        && s.group > 0
        && s.group % 8 == 0
        && s.n % s.group == 0
        && s.n % 64 == 0
        && s.k % 64 == 0
        && s.k > 0
}

/// `WIDE_SKINNY_WG` (read at each call): unset, empty or `1` lets the autotuner measure the
/// transposed small-M wgmma kernel ([`skinny_wg_feasible`] shapes); `0` keeps it out (the
/// dispatch before it, for A/B runs); anything else is an error.
pub fn skinny_wg_enabled() -> Result<bool, String> {
    skinny_wg_switch_from(std::env::var("WIDE_SKINNY_WG").ok().as_deref())
}

pub fn skinny_wg_switch_from(v: Option<&str>) -> Result<bool, String> {
    on_by_default(v, "WIDE_SKINNY_WG", "measure the wgmma small-M kernel against dense + mask", "leave it out")
}

/// A switch that is on unless set to `0`: unset, empty or `1` on; anything else an error that
/// names the variable and both meanings.
fn on_by_default(v: Option<&str>, var: &str, on: &str, off: &str) -> Result<bool, String> {
    crate::knobs::switch_from(var, v).map(|b| b.unwrap_or(true)).map_err(|_| format!("{var} takes 1 (the default: {on}) or 0 ({off}), got '{}'", v.unwrap_or_default().trim()))
}

/// Smallest M for which the tiled / wgmma kernels may be chosen. Below it a product is a few
/// microseconds and the autotuner's three timed runs cannot rank the paths reliably: on the
/// H200 (2026-11-30, s = 0.5, G = 128, cold) it once chose wgmma for Q at M = 128, which the
/// benchmark then measured at 0.37x of cuBLAS (49 against 18 us), and the routed tiles lost at
/// M = 128 for every op (0.16-0.71x; gate+up wgmma 1.05x).
pub const LARGE_M_MIN: i64 = 256;
/// Most groups the gemm_k GEMV takes (each warp lists the used groups in shared memory).
pub const GEMV_K_MAX_GROUPS: i64 = 1024;
/// A routed kernel must beat dense by this factor to be chosen (timing noise margin).
pub const MARGIN: f64 = 0.97;

/// The factor a routed kernel from [`LARGE_M_MIN`] tokens must beat dense + mask by:
/// `WIDE_TUNE_MARGIN` (read once; for A/B runs) or [`MARGIN`]. A value that is not a number in
/// (0.5, 1.1] is an error (reported by the autotuner; [`choose`] then keeps [`MARGIN`]).
pub fn large_m_margin() -> Result<f64, String> {
    static P: OnceLock<Result<f64, String>> = OnceLock::new();
    P.get_or_init(|| large_m_margin_from(std::env::var("WIDE_TUNE_MARGIN").ok().as_deref())).clone()
}

/// [`large_m_margin`]'s parse.
pub fn large_m_margin_from(v: Option<&str>) -> Result<f64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(MARGIN),
        Some(o) => match o.parse::<f64>() {
            Ok(f) if f > 0.5 && f <= 1.1 => Ok(f),
            _ => Err(format!("WIDE_TUNE_MARGIN takes a factor in (0.5, 1.1] that a routed kernel must beat dense + mask by (default {MARGIN}), got '{o}'")),
        },
    }
}

/// `WIDE_TUNE_LOG=1` (read once): the autotuner prints each record it measures (the candidates'
/// times and the path the policy takes) to stderr. Unset, empty or `0` off; anything else an
/// error.
pub fn tune_log() -> Result<bool, String> {
    static P: OnceLock<Result<bool, String>> = OnceLock::new();
    P.get_or_init(|| tune_log_from(std::env::var("WIDE_TUNE_LOG").ok().as_deref())).clone()
}

/// [`tune_log`]'s parse.
pub fn tune_log_from(v: Option<&str>) -> Result<bool, String> {
    crate::knobs::switch_from("WIDE_TUNE_LOG", v)
        .map(|b| b.unwrap_or(false))
        .map_err(|_| format!("WIDE_TUNE_LOG takes 1 (print each autotuner record) or 0 (the default), got '{}'", v.unwrap_or_default().trim()))
}
/// At 2-16 tokens the measured choice is between two of our paths that both write the zeros
/// (the small-M kernel and cuBLAS + the zero pass) on a 15-60 us product, timed cold after a
/// spin: the faster one is taken. A/B of `314f1e5` (NOTES v32, two processes each, up / gate+up /
/// Q at 4-16 tokens, every G and skip rate, cold and warm): records below 0.97x of cuBLAS on the
/// H100 47 / 44 off, 28 / 30 on (up at 8 tokens 15 / 14 -> 0); on the H200 44 / 43 off, 45 / 46 on.
pub const SMALL_M_MARGIN: f64 = 1.0;

/// Whether the dispatch measures the small-M kernel against dense + mask for this shape: unless
/// `WIDE_TUNE_SMALL_M=0` (read at each call), where the kernel can run (2-16 tokens) and the
/// static rule of [`choose`] would leave the product to dense + mask ([`small_m_candidate`]).
/// An unknown value of the switch is an error.
pub fn small_m_tunable(s: &GemmShape, sparsity: f64) -> Result<bool, String> {
    let skinny = small_m_tuning_from(std::env::var("WIDE_TUNE_SMALL_M").ok().as_deref())?;
    let wg = skinny_wg_enabled()?;
    Ok(small_m_candidate_with(s, sparsity, skinny, wg))
}

/// [`small_m_tunable`]'s switch: unset, empty or `1` on (the default); `0` off; anything else
/// an error.
pub fn small_m_tuning_from(v: Option<&str>) -> Result<bool, String> {
    on_by_default(v, "WIDE_TUNE_SMALL_M", "measure the small-M kernel against dense + mask", "the static rule")
}

/// The shapes [`small_m_tunable`] measures once switched on.
pub fn small_m_candidate(s: &GemmShape, sparsity: f64) -> bool {
    small_m_candidate_with(s, sparsity, true, true)
}

/// [`small_m_candidate`] with each kernel's switch: the static rule leaves the product to dense
/// + mask, and the `mma.sync` small-M kernel (`skinny`) or the transposed wgmma kernel (`wg`)
/// can run it; or the rule takes the `mma.sync` kernel and the wgmma kernel can run it too
/// (both switches on), so the two are measured against each other.
pub fn small_m_candidate_with(s: &GemmShape, sparsity: f64, skinny: bool, wg: bool) -> bool {
    let rule = choose(s, sparsity, None);
    let feasible = (skinny && skinny_feasible(s)) || (wg && skinny_wg_feasible(s));
    let both = skinny && wg && skinny_feasible(s) && skinny_wg_feasible(s);
    s.m < LARGE_M_MIN && ((feasible && rule == GemmPath::DenseMasked) || (both && rule == GemmPath::GemvMma))
}

/// A routed projection's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub op: RoutedOp,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub group: i64,
}

/// Timings measured by the autotuner for one (op, N, K, G, dtype, M bucket).
#[derive(Debug, Clone, PartialEq)]
pub struct Tuned {
    pub dense_ms: f64,
    /// Each feasible tile with its time.
    pub tiles: Vec<(TileConfig, f64)>,
    /// The wgmma kernel's time, where it can run (sm_90 and a feasible shape).
    pub wgmma_ms: Option<f64>,
    /// The small-M `mma.sync` kernel's time: measured instead of the tiles and wgmma where the
    /// static rule leaves a 2-16 token product to dense + mask ([`small_m_tunable`]).
    pub skinny_ms: Option<f64>,
    /// The transposed small-M wgmma kernel's time (2-128 tokens, where the static rule leaves
    /// the product to dense + mask, on compute capability 9.0).
    pub skinny_wg_ms: Option<f64>,
    /// Small-M records: the same candidates timed again with the operands in L2 (the times
    /// above have the weights from DRAM).
    pub warm: Option<WarmTimes>,
}

/// A small-M record's timings with the operands in L2. A call may meet either state (a decode
/// layer's weights come from DRAM; a product repeated on the same weights finds them in L2),
/// so the small-M choice takes the kernel whose worse ratio to dense + mask over the two states
/// is lowest ([`small_m_measured`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmTimes {
    pub dense_ms: f64,
    pub skinny_ms: Option<f64>,
    pub skinny_wg_ms: Option<f64>,
}

impl Tuned {
    /// The fastest `mma.sync` tile.
    pub fn best(&self) -> Option<(TileConfig, f64)> {
        self.tiles.iter().copied().min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal))
    }
    /// The fastest routed kernel measured: a tile, the wgmma kernel or the small-M kernel.
    pub fn best_path(&self) -> Option<(GemmPath, f64)> {
        let tile = self.best().map(|(t, ms)| (GemmPath::Tiled(t), ms));
        let wgmma = self.wgmma_ms.map(|ms| (GemmPath::Wgmma, ms));
        let skinny = self.skinny_ms.map(|ms| (GemmPath::GemvMma, ms));
        let skinny_wg = self.skinny_wg_ms.map(|ms| (GemmPath::SkinnyWg, ms));
        [tile, wgmma, skinny, skinny_wg].into_iter().flatten().fold(None, |best: Option<(GemmPath, f64)>, c| match best {
            Some(b) if b.1 <= c.1 => Some(b),
            _ => Some(c),
        })
    }
    /// The factor by which the record's routed kernel must beat dense + mask to be taken.
    pub fn margin(&self) -> f64 {
        if self.skinny_ms.is_some() || self.skinny_wg_ms.is_some() {
            SMALL_M_MARGIN
        } else {
            large_m_margin().unwrap_or(MARGIN)
        }
    }
}

/// Tile units of the wgmma kernel: 128 output channels (a tile within one group, or spanning
/// 128 / G narrower groups), k steps of 64, token tiles a multiple of 128.
pub const WGMMA_BM: i64 = 128;
pub const WGMMA_BN: i64 = 128;
pub const WGMMA_BK: i64 = 64;

/// Shapes the wgmma kernel takes (the device must also be compute capability 9.0): gemm_mn
/// and its SwiGLU variant, the tile width dividing the group or a group of 8 | G | 128 (the
/// tile then spans 128 / G groups: computed for the tokens that keep any of them, written with
/// each group's mask), N a multiple of the tile, K a multiple of the k step.
pub fn wgmma_feasible(s: &GemmShape) -> bool {
    matches!(s.op, RoutedOp::Mn | RoutedOp::MnSwiglu)
        && s.group > 0
        && (s.group % WGMMA_BN == 0 || (WGMMA_BN % s.group == 0 && s.group % 8 == 0))
        && s.n % WGMMA_BN == 0
        && s.n / WGMMA_BN <= 65535
        && s.k % WGMMA_BK == 0
        && s.k > 0
}

/// Tiles the tiled kernel can run for this shape: `bn` must divide the routed group (gemm_mn)
/// or N (gemm_k), and K steps of 32 must tile K (gemm_mn) or the group (gemm_k).
pub fn feasible_tiles(s: &GemmShape) -> Vec<TileConfig> {
    TILES
        .iter()
        .copied()
        .filter(|t| match s.op {
            RoutedOp::Mn | RoutedOp::MnSwiglu => s.group % t.bn as i64 == 0 && s.k % t.bk as i64 == 0,
            RoutedOp::K | RoutedOp::KPremasked => s.n % t.bn as i64 == 0 && s.group % t.bk as i64 == 0 && s.k / s.group <= 2048,
        })
        .collect()
}

/// Fraction of weight bytes a GEMV over `m` tokens must read at skip rate `sparsity`, for
/// independent masks: a weight row (or slice) is needed if any of the tokens uses its group.
pub fn gemv_weight_fraction(m: i64, sparsity: f64) -> f64 {
    1.0 - sparsity.clamp(0.0, 1.0).powi(m as i32)
}

/// These fractions rule the GEMV (one token; several where the small-M `mma.sync` kernel cannot
/// run the shape) and, for several tokens, whether that kernel skips enough rows to be taken.
///
/// The output-width GEMV is chosen while it reads at most this fraction of the dense weight
/// bytes (it also streams x per used row, so at full use it is a little behind cuBLAS).
/// Measured on the H200 (bf16, Llama-3.1-8B shapes): at M = 1 it beats cuBLAS from 25% skip
/// (1.24-1.28x, fraction 0.75); at M = 4 only at 75% skip (1.13-1.17x, fraction 0.68).
pub const GEMV_MAX_FRACTION: f64 = 0.8;

/// Wide plain output-width products (N >= GEMV_WIDE_MIN_N, no SwiGLU) take the GEMV up to this
/// fraction: there the alternative is cuBLAS plus a separate zero-writing pass, and the GEMV at
/// 94% of the rows (M = 4, 50% skip) measured 1.01-1.04x of bare cuBLAS on up 4096->14336 (every
/// G, H200, 2026-11-30; 0.99x in a later run) against 0.92-0.95x for dense + mask. Not for Q
/// (N = 4096: the GEMV 0.78-0.81x) nor the fused SwiGLU (its dense pass is fused: 1.01-1.04x).
pub const GEMV_WIDE_MAX_FRACTION: f64 = 0.95;
/// Output features from which [`GEMV_WIDE_MAX_FRACTION`] applies.
pub const GEMV_WIDE_MIN_N: i64 = 8192;

/// A narrow plain output-width product (N < GEMV_WIDE_MIN_N, e.g. Q 4096 x 4096) with several
/// tokens takes the GEMV only up to this fraction: Q at M = 4, 75% skip (68% of the rows)
/// measured 0.86x of cuBLAS on the GEMV against 0.93x for dense + mask (H200, 2026-11-30,
/// `results/kernels-g128-h200.json.xz`); the small product's fixed cost leaves the GEMV only a
/// clear byte saving to win with.
pub const GEMV_NARROW_MAX_FRACTION: f64 = 0.5;

/// The reduction-width GEMV (one token only): with the rows shared by the warps of a block,
/// measured (H200, 2026-11-30, M = 1, cold L2, every G) 1.34-1.43x (down) and 1.39x (O) at 25%
/// skip (fraction 0.75) and 1.70-1.95x / 1.71x at 50% (the warp-per-row version: 0.94-1.06x
/// and 1.22-1.46x), while at M = 4 it lost everywhere (0.29-0.90x): each token's own group
/// slices make the x reads and the per-chunk group lookups dominate.
pub const GEMV_K_MAX_FRACTION: f64 = 0.8;

/// The policy. `tuned` is the autotuner's record for this shape's M bucket, if any.
pub fn choose(s: &GemmShape, sparsity: f64, tuned: Option<&Tuned>) -> GemmPath {
    let gemv_ok = s.m <= GEMV_MAX_M && s.k % 8 == 0 && s.group % 8 == 0 && (!s.op.reduces_over_groups() || s.k / s.group <= GEMV_K_MAX_GROUPS);
    let frac = gemv_weight_fraction(s.m, sparsity);
    let pays = match s.op {
        RoutedOp::K | RoutedOp::KPremasked => s.m == 1 && frac <= GEMV_K_MAX_FRACTION,
        RoutedOp::Mn if s.n >= GEMV_WIDE_MIN_N => frac <= GEMV_WIDE_MAX_FRACTION,
        RoutedOp::Mn if s.m > 1 => frac <= GEMV_NARROW_MAX_FRACTION,
        _ => frac <= GEMV_MAX_FRACTION,
    };
    if s.m > 1 && skinny_feasible(s) {
        let mma = match s.op {
            // Narrow (Q 4096 x 4096): the kernel with its masked write-out beat cuBLAS + the zero
            // pass at every measured M (2-16). Wide (up 4096 -> 14336): up to 4 tokens, and
            // beyond while it skips bytes; at 8-16 tokens with ~all rows used it lost to it.
            RoutedOp::Mn => s.n < GEMV_WIDE_MIN_N || s.m <= 4 || frac <= GEMV_WIDE_MAX_FRACTION,
            // SwiGLU: where it skips bytes (the dense fallback is one stacked GEMM + the SwiGLU pass).
            _ => frac <= GEMV_MAX_FRACTION,
        };
        if mma {
            // Where the autotuner also measured the transposed wgmma kernel (Hopper: Q at 2-16
            // tokens, up at 2-4), the measurement decides between the two and dense + mask.
            if tuned.is_some_and(|t| t.skinny_ms.is_some() && t.skinny_wg_ms.is_some()) && skinny_wg_feasible(s) {
                return small_m_measured(s, tuned);
            }
            return GemmPath::GemvMma;
        }
        // Where the rule leaves it to dense + mask, the autotuner's measurement decides.
        return small_m_measured(s, tuned);
    }
    if gemv_ok && pays {
        return GemmPath::Gemv;
    }
    if s.m < LARGE_M_MIN {
        return small_m_measured(s, tuned);
    }
    let margin = large_m_margin().unwrap_or(MARGIN);
    match tuned.and_then(|t| t.best_path().map(|b| (t.dense_ms, b))) {
        Some((dense, (GemmPath::Tiled(tile), ms))) if ms < margin * dense && feasible_tiles(s).contains(&tile) => GemmPath::Tiled(tile),
        Some((dense, (GemmPath::Wgmma, ms))) if ms < margin * dense && wgmma_feasible(s) => GemmPath::Wgmma,
        _ => GemmPath::DenseMasked,
    }
}

/// Below LARGE_M_MIN, where the static rule leaves a product to dense + mask (or, with both
/// small-M kernels measured, where it would take the `mma.sync` one): the small-M kernel the
/// autotuner measured (both write the zeros, as dense + mask does) whose time over dense +
/// mask's is lowest, if below 1. With warm timings in the record a kernel's ratio is the worse
/// of its cold and warm ones, so the choice holds whether the weights come from DRAM or L2.
fn small_m_measured(s: &GemmShape, tuned: Option<&Tuned>) -> GemmPath {
    let Some(t) = tuned else { return GemmPath::DenseMasked };
    let ratio = |cold: f64, warm: Option<f64>| {
        let c = cold / t.dense_ms;
        match (t.warm, warm) {
            (Some(w), Some(ms)) => c.max(ms / w.dense_ms),
            _ => c,
        }
    };
    let skinny = t.skinny_ms.filter(|_| skinny_feasible(s)).map(|ms| (GemmPath::GemvMma, ratio(ms, t.warm.and_then(|w| w.skinny_ms))));
    let wg = t.skinny_wg_ms.filter(|_| skinny_wg_feasible(s)).map(|ms| (GemmPath::SkinnyWg, ratio(ms, t.warm.and_then(|w| w.skinny_wg_ms))));
    match [skinny, wg].into_iter().flatten().min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal)) {
        Some((p, r)) if r < SMALL_M_MARGIN => p,
        _ => GemmPath::DenseMasked,
    }
}

/// Timed runs per candidate the autotuner starts with, and the most it takes where the choice
/// is a near tie (see [`near_tie`]).
pub const TUNE_ROUNDS: usize = 3;
pub const TUNE_MAX_ROUNDS: usize = 7;
/// Device time queued before each of the autotuner's timed runs, so the host issues the run's
/// launches while the device is still busy and the events time device work alone (as in a
/// prefill, where the host runs ahead of the device, and as `wide bench kernels` measures).
pub const TUNE_SPIN_US: u32 = 100;

/// How the autotuner times its candidates (`WIDE_TUNE`, read once; for A/B runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TuneMode {
    /// The default: interleaved rounds; before each run the L2 is refilled by reading a buffer
    /// of twice its size (so the weights come from DRAM, as for every layer of a prefill), then
    /// a device spin; each run builds its own token lists from the mask (the routed kernels
    /// pay for them, as they do once a decision in the engine and in `wide bench kernels`).
    Cold,
    /// `WIDE_TUNE=warm`: interleaved rounds after a spin, on a warm L2 and the layout's cached
    /// token lists (the autotuner of `fdc6c16`).
    Warm,
    /// `WIDE_TUNE=plain`: each candidate's runs back to back, no spin, warm L2, cached lists
    /// (the autotuner before `fdc6c16`).
    Plain,
}

/// The autotuner's timing mode from `WIDE_TUNE` (`cold`, the default; `warm`; `plain`).
pub fn tune_mode() -> Result<TuneMode, String> {
    static P: OnceLock<Result<TuneMode, String>> = OnceLock::new();
    P.get_or_init(|| tune_mode_from(std::env::var("WIDE_TUNE").ok().as_deref())).clone()
}

/// [`tune_mode`]'s parse: unset or empty is the default; anything else unknown is an error.
pub fn tune_mode_from(v: Option<&str>) -> Result<TuneMode, String> {
    match v.map(str::trim) {
        None | Some("") | Some("cold") => Ok(TuneMode::Cold),
        Some("warm") => Ok(TuneMode::Warm),
        Some("plain") => Ok(TuneMode::Plain),
        Some(o) => Err(format!("WIDE_TUNE takes cold (the default), warm or plain, got '{o}'")),
    }
}

/// Adds `rounds` rounds of timings to `samples` (one vector per candidate): each round times
/// every candidate once, starting one candidate later than the round before, so that slow
/// drift (clock boost, temperature, a neighbour's work) falls on every candidate alike instead
/// of on whichever was timed last, as timing each candidate's runs back to back would do.
pub fn time_interleaved<E>(samples: &mut [Vec<f64>], rounds: usize, mut time: impl FnMut(usize) -> Result<f64, E>) -> Result<(), E> {
    let n = samples.len();
    for _ in 0..rounds {
        let first = samples.first().map_or(0, |v| v.len()) % n.max(1);
        for j in 0..n {
            let i = (first + j) % n;
            let ms = time(i)?;
            samples[i].push(ms);
        }
    }
    Ok(())
}

/// Median of the timings (the lower middle one for an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[(v.len() - 1) / 2]
    }
}

/// The fastest routed kernel of the record is within 5% of the margin's line against dense:
/// three runs cannot tell which side it is on, so the autotuner times more rounds.
pub fn near_tie(t: &Tuned) -> bool {
    t.best_path().is_some_and(|(_, ms)| {
        let line = t.margin() * t.dense_ms;
        (ms - line).abs() <= 0.05 * line
    })
}

/// Key of the autotune cache: the M bucket is the next power of two; sparsity is bucketed to
/// eighths, since whether the tiled kernel beats dense depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TuneKey {
    pub op: RoutedOp,
    pub n: i64,
    pub k: i64,
    pub group: i64,
    pub m_bucket: i64,
    pub sparsity_eighths: i64,
    pub f16: bool,
    pub device: usize,
}

impl TuneKey {
    pub fn new(s: &GemmShape, sparsity: f64, f16: bool, device: usize) -> Self {
        Self {
            op: s.op,
            n: s.n,
            k: s.k,
            group: s.group,
            m_bucket: (s.m.max(1) as u64).next_power_of_two() as i64,
            sparsity_eighths: (sparsity.clamp(0.0, 1.0) * 8.0).round() as i64,
            f16,
            device,
        }
    }
}

pub(crate) fn tune_cache() -> &'static Mutex<HashMap<TuneKey, Tuned>> {
    static C: OnceLock<Mutex<HashMap<TuneKey, Tuned>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Forced path from `WIDE_ROUTED` (read once): `dense`, `gemv`, `gemv-mma`, `tiled` (the tuned
/// best tile), `wgmma` or `wgmma-skinny` (each where it can run, else the policy), or unset /
/// `auto` for the policy; another value is named in a warning and the policy runs.
pub fn env_override() -> Option<&'static str> {
    static V: OnceLock<Option<&'static str>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::choice("WIDE_ROUTED", &ROUTED_PATHS).filter(|v| *v != "auto"))
}

/// The values `WIDE_ROUTED` takes.
pub const ROUTED_PATHS: [&str; 7] = ["auto", "dense", "gemv", "gemv-mma", "tiled", "wgmma", "wgmma-skinny"];

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(op: RoutedOp, m: i64, g: i64) -> GemmShape {
        match op {
            RoutedOp::K | RoutedOp::KPremasked => GemmShape { op, m, n: 4096, k: 14336, group: g },
            _ => GemmShape { op, m, n: 14336, k: 4096, group: g },
        }
    }

    #[test]
    fn decode_takes_gemv_while_it_saves_bytes() {
        for op in [RoutedOp::Mn, RoutedOp::MnSwiglu, RoutedOp::K, RoutedOp::KPremasked] {
            assert_eq!(choose(&shape(op, 1, 128), 0.5, None), GemmPath::Gemv);
            // 4 independent tokens at 50% need 94% of the rows: dense is as good (except for a
            // wide plain gemm_mn, below).
            if op != RoutedOp::Mn {
                assert_eq!(choose(&shape(op, 4, 128), 0.5, None), GemmPath::DenseMasked);
            }
            assert_eq!(choose(&shape(op, 16, 128), 0.5, None), GemmPath::DenseMasked);
            // Nothing skipped: nothing to gain.
            assert_eq!(choose(&shape(op, 1, 128), 0.0, None), GemmPath::DenseMasked);
        }
        for op in [RoutedOp::Mn, RoutedOp::MnSwiglu] {
            assert_eq!(choose(&shape(op, 1, 128), 0.25, None), GemmPath::Gemv);
        }
        for op in [RoutedOp::K, RoutedOp::KPremasked] {
            // gemm_k's GEMV pays for one token only, from 25% skip on (not at 12.5%).
            assert_eq!(choose(&shape(op, 2, 128), 0.75, None), GemmPath::DenseMasked);
            assert_eq!(choose(&shape(op, 4, 128), 0.75, None), GemmPath::DenseMasked);
            assert_eq!(choose(&shape(op, 1, 128), 0.25, None), GemmPath::Gemv);
            assert_eq!(choose(&shape(op, 1, 128), 0.125, None), GemmPath::DenseMasked);
        }
    }

    #[test]
    fn several_tokens_take_the_mma_kernel_where_it_measured_ahead() {
        let q = |m| GemmShape { op: RoutedOp::Mn, m, n: 4096, k: 4096, group: 512 };
        // Narrow plain (Q): 2-16 tokens at any skip rate.
        for m in [2, 4, 9, 16] {
            for sp in [0.25, 0.5, 0.75] {
                assert_eq!(choose(&q(m), sp, None), GemmPath::GemvMma, "Q M={m} s={sp}");
            }
        }
        assert_eq!(choose(&q(17), 0.5, None), GemmPath::DenseMasked, "past the kernel's 16 tokens");
        // Wide plain (up): up to 4 tokens, then only while rows are skipped (8 tokens at 75%: 90%).
        assert_eq!(choose(&shape(RoutedOp::Mn, 2, 128), 0.25, None), GemmPath::GemvMma);
        assert_eq!(choose(&shape(RoutedOp::Mn, 4, 128), 0.25, None), GemmPath::GemvMma);
        assert_eq!(choose(&shape(RoutedOp::Mn, 8, 128), 0.75, None), GemmPath::GemvMma);
        assert_eq!(choose(&shape(RoutedOp::Mn, 8, 128), 0.5, None), GemmPath::DenseMasked);
        assert_eq!(choose(&shape(RoutedOp::Mn, 16, 128), 0.75, None), GemmPath::DenseMasked);
        // SwiGLU: while it skips bytes (4 tokens at 75%: 68% of the rows).
        assert_eq!(choose(&shape(RoutedOp::MnSwiglu, 4, 128), 0.75, None), GemmPath::GemvMma);
        assert_eq!(choose(&shape(RoutedOp::MnSwiglu, 2, 128), 0.5, None), GemmPath::GemvMma);
        assert_eq!(choose(&shape(RoutedOp::MnSwiglu, 4, 128), 0.5, None), GemmPath::DenseMasked);
        // Shapes it cannot take fall back to the GEMV rules: a group of 8 (16 rows a block), K
        // not a multiple of 32.
        assert!(!skinny_feasible(&GemmShape { op: RoutedOp::Mn, m: 4, n: 4096, k: 4096, group: 8 }));
        assert_eq!(choose(&GemmShape { op: RoutedOp::Mn, m: 2, n: 4096, k: 4008, group: 512 }, 0.75, None), GemmPath::Gemv);
        assert!(!skinny_feasible(&shape(RoutedOp::K, 4, 128)), "gemm_k has no mma small-M kernel");
        assert!(!skinny_feasible(&shape(RoutedOp::Mn, 1, 128)) && !skinny_feasible(&shape(RoutedOp::Mn, 17, 128)));
    }

    #[test]
    fn large_m_follows_the_measured_timings() {
        let s = shape(RoutedOp::Mn, 4096, 128);
        assert_eq!(choose(&s, 0.5, None), GemmPath::DenseMasked, "untuned large M stays dense");
        let t = Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], 0.6), (TILES[1], 0.7)], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&t)), GemmPath::Tiled(TILES[0]));
        let slow = Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], 0.98)], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&slow)), GemmPath::DenseMasked, "within the margin stays dense");
    }

    #[test]
    fn wgmma_is_chosen_only_where_it_measured_fastest() {
        let s = shape(RoutedOp::Mn, 4096, 128);
        let t = Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], 0.8)], wgmma_ms: Some(0.55), skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&t)), GemmPath::Wgmma);
        assert_eq!(choose(&shape(RoutedOp::MnSwiglu, 4096, 128), 0.5, Some(&t)), GemmPath::Wgmma);
        let tile_wins = Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], 0.5)], wgmma_ms: Some(0.55), skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&tile_wins)), GemmPath::Tiled(TILES[0]));
        let slow = Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: Some(0.99), skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&slow)), GemmPath::DenseMasked, "within the margin stays dense");
        // Not measured (not sm_90) or a shape it cannot run: never chosen.
        let none = Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&none)), GemmPath::DenseMasked);
        assert_eq!(choose(&shape(RoutedOp::Mn, 4096, 64), 0.5, Some(&t)), GemmPath::Wgmma, "G = 64: tiles of two groups");
        assert_eq!(choose(&shape(RoutedOp::Mn, 4096, 48), 0.5, Some(&t)), GemmPath::DenseMasked, "G = 48 does not divide the tile");
        assert_eq!(choose(&shape(RoutedOp::K, 4096, 128), 0.5, Some(&t)), GemmPath::DenseMasked, "gemm_k has no wgmma kernel");
        // Small M never autotunes, and M below LARGE_M_MIN stays dense whatever was measured.
        assert_eq!(choose(&shape(RoutedOp::Mn, 16, 128), 0.5, Some(&t)), GemmPath::DenseMasked);
        assert_eq!(choose(&shape(RoutedOp::Mn, 128, 128), 0.5, Some(&t)), GemmPath::DenseMasked);
        assert_eq!(choose(&shape(RoutedOp::Mn, LARGE_M_MIN, 128), 0.5, Some(&t)), GemmPath::Wgmma);
    }

    #[test]
    fn wgmma_shapes() {
        assert!(wgmma_feasible(&shape(RoutedOp::Mn, 4096, 128)));
        assert!(wgmma_feasible(&shape(RoutedOp::MnSwiglu, 5, 256)));
        // Narrower groups run on 128-channel tiles of merged groups (their mask applied as the
        // tile is written): 8 | group | 128.
        assert!(wgmma_feasible(&shape(RoutedOp::Mn, 4096, 32)));
        assert!(wgmma_feasible(&shape(RoutedOp::MnSwiglu, 4096, 64)));
        assert!(wgmma_feasible(&shape(RoutedOp::Mn, 4096, 8)));
        assert!(!wgmma_feasible(&shape(RoutedOp::Mn, 4096, 4)), "a 16-byte chunk would span groups");
        assert!(!wgmma_feasible(&shape(RoutedOp::Mn, 4096, 48)), "48 does not divide the tile");
        assert!(!wgmma_feasible(&shape(RoutedOp::Mn, 4096, 192)), "192 is not a multiple of the tile");
        assert!(!wgmma_feasible(&GemmShape { op: RoutedOp::Mn, m: 4096, n: 14336, k: 4000, group: 128 }), "K not a multiple of 64");
        assert!(!wgmma_feasible(&shape(RoutedOp::KPremasked, 4096, 128)));
    }

    #[test]
    fn tiles_must_divide_the_group() {
        let s = shape(RoutedOp::Mn, 4096, 32);
        let f = feasible_tiles(&s);
        assert!(!f.is_empty() && f.iter().all(|t| t.bn == 32));
        let k32 = feasible_tiles(&GemmShape { op: RoutedOp::K, m: 4096, n: 4096, k: 14336, group: 32 });
        assert!(!k32.is_empty() && k32.iter().all(|t| t.bk == 32), "a 64-deep k step cannot tile a group of 32");
        // A tuned tile that cannot run this group is never chosen.
        let t = Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], 0.1)], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&s, 0.5, Some(&t)), GemmPath::DenseMasked);
        let odd = GemmShape { op: RoutedOp::Mn, m: 4096, n: 14336 / 7 * 7, k: 4100, group: 128 };
        assert!(feasible_tiles(&odd).is_empty(), "K not a multiple of 32");
    }

    #[test]
    fn interleaved_timing_spreads_drift_over_every_candidate() {
        // A clock that slows down 10% a run: timed back to back, the last candidate would read
        // ~77% slower than the first though all take the same time.
        let mut clock = 1.0f64;
        let mut samples = vec![vec![]; 3];
        time_interleaved::<()>(&mut samples, 3, |_| {
            clock *= 1.1;
            Ok(clock)
        })
        .unwrap();
        assert!(samples.iter().all(|v| v.len() == 3));
        let sums: Vec<f64> = samples.iter().map(|v| v.iter().sum()).collect();
        let (lo, hi) = sums.iter().fold((f64::MAX, 0.0f64), |(a, b), &s| (a.min(s), b.max(s)));
        assert!(hi / lo < 1.11, "drift spread over the candidates: {sums:?}");
        // Every candidate is timed at every position of a round once (rotation).
        let order: Vec<f64> = samples.iter().map(|v| v[0]).collect();
        assert!(order[0] < order[1] && order[1] < order[2], "round 1 starts at candidate 0");
        assert!(samples[1][1] < samples[2][1] && samples[2][1] < samples[0][1], "round 2 starts at candidate 1");
        // More rounds append; an error stops at once.
        time_interleaved::<()>(&mut samples, 2, |_| Ok(1.0)).unwrap();
        assert!(samples.iter().all(|v| v.len() == 5));
        let mut calls = 0;
        assert!(time_interleaved(&mut samples, 2, |_| {
            calls += 1;
            Err("device fault")
        })
        .is_err());
        assert_eq!(calls, 1);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn tune_modes_parse_and_refuse_unknown_values() {
        assert_eq!(tune_mode_from(None), Ok(TuneMode::Cold));
        assert_eq!(tune_mode_from(Some(" ")), Ok(TuneMode::Cold));
        assert_eq!(tune_mode_from(Some("cold")), Ok(TuneMode::Cold));
        assert_eq!(tune_mode_from(Some("warm")), Ok(TuneMode::Warm));
        assert_eq!(tune_mode_from(Some("plain ")), Ok(TuneMode::Plain));
        let e = tune_mode_from(Some("hot")).unwrap_err();
        assert!(e.contains("WIDE_TUNE") && e.contains("'hot'"), "{e}");
    }

    #[test]
    fn near_ties_are_around_the_margin_line() {
        let t = |ms: f64| Tuned { dense_ms: 1.0, tiles: vec![(TILES[0], ms)], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None };
        assert!(near_tie(&t(0.97)));
        assert!(near_tie(&t(0.93)));
        assert!(near_tie(&t(1.01)));
        assert!(!near_tie(&t(0.80)), "a clear win");
        assert!(!near_tie(&t(1.20)), "a clear loss");
        assert!(!near_tie(&Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: None, skinny_ms: None, skinny_wg_ms: None, warm: None }), "nothing routed measured");
    }

    #[test]
    fn small_m_measures_the_kernel_where_the_rule_leaves_dense() {
        // The rule leaves up at 16 tokens (94%+ of the rows used) to dense + mask: measured.
        let up16 = shape(RoutedOp::Mn, 16, 128);
        assert_eq!(choose(&up16, 0.5, None), GemmPath::DenseMasked);
        assert!(small_m_candidate(&up16, 0.5));
        assert_eq!(small_m_tuning_from(None), Ok(true), "on by default");
        assert_eq!(small_m_tuning_from(Some("")), Ok(true));
        assert_eq!(small_m_tuning_from(Some(" 1 ")), Ok(true));
        assert_eq!(small_m_tuning_from(Some("0")), Ok(false));
        assert!(small_m_tuning_from(Some("yes")).unwrap_err().contains("WIDE_TUNE_SMALL_M takes 1"));
        let rec = |skinny: f64| Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: None, skinny_ms: Some(skinny), skinny_wg_ms: None, warm: None };
        assert_eq!(choose(&up16, 0.5, Some(&rec(0.99))), GemmPath::GemvMma, "faster than dense + mask");
        assert_eq!(choose(&up16, 0.5, Some(&rec(1.01))), GemmPath::DenseMasked, "slower");
        assert_eq!(choose(&up16, 0.5, Some(&Tuned { skinny_ms: None, ..rec(0.5) })), GemmPath::DenseMasked, "not measured");
        assert_eq!(rec(0.99).best_path(), Some((GemmPath::GemvMma, 0.99)));
        assert_eq!(rec(0.99).margin(), SMALL_M_MARGIN);
        // Near a tie with dense + mask itself (the small-M line), more rounds.
        assert!(near_tie(&rec(1.03)) && near_tie(&rec(0.97)));
        assert!(!near_tie(&rec(0.8)) && !near_tie(&rec(1.2)));
        // Where the rule takes the kernel (4 tokens of up, Q) it is a candidate only beside the
        // wgmma small-M kernel; never one token (the GEMV), gemm_k (no small-M kernel) nor groups
        // the kernel cannot tile.
        let q16 = GemmShape { op: RoutedOp::Mn, m: 16, n: 4096, k: 4096, group: 512 };
        assert!(small_m_candidate(&shape(RoutedOp::Mn, 4, 128), 0.5));
        assert!(small_m_candidate(&q16, 0.5));
        assert!(!small_m_candidate_with(&shape(RoutedOp::Mn, 4, 128), 0.5, true, false));
        assert!(!small_m_candidate_with(&q16, 0.5, true, false));
        assert!(!small_m_candidate_with(&q16, 0.5, false, true), "the rule's kernel switched off: not measured against it");
        assert!(!small_m_candidate(&shape(RoutedOp::Mn, 1, 128), 0.5));
        assert!(!small_m_candidate(&shape(RoutedOp::K, 16, 128), 0.5));
        let mma_only = |s: &GemmShape| small_m_candidate_with(s, 0.5, true, false);
        assert!(!mma_only(&shape(RoutedOp::Mn, 16, 8)));
        assert!(!mma_only(&shape(RoutedOp::Mn, 17, 128)), "past the mma.sync kernel's 16 tokens");
    }

    #[test]
    fn wgmma_small_m_kernel_is_measured_up_to_128_tokens() {
        // Where the rule leaves a plain gemm_mn of 2-128 tokens to dense + mask, the transposed
        // wgmma kernel is measured (with or without the mma.sync kernel beside it).
        for m in [16, 17, 77, 128] {
            let up = shape(RoutedOp::Mn, m, 128);
            assert!(skinny_wg_feasible(&up), "{up:?}");
            assert!(small_m_candidate_with(&up, 0.5, false, true), "{up:?}");
        }
        assert!(small_m_candidate(&shape(RoutedOp::Mn, 16, 8), 0.5), "groups of 8: the wgmma kernel's 16-byte pieces");
        // Not: 129+ tokens, SwiGLU, gemm_k, groups that are not whole 16-byte pieces, K or N off
        // its 64-wide steps, nor with its switch off.
        assert!(!small_m_candidate(&shape(RoutedOp::Mn, 129, 128), 0.5));
        assert!(!small_m_candidate_with(&shape(RoutedOp::Mn, 77, 128), 0.5, true, false));
        assert!(!skinny_wg_feasible(&shape(RoutedOp::MnSwiglu, 64, 128)));
        assert!(!skinny_wg_feasible(&shape(RoutedOp::K, 64, 128)));
        assert!(!skinny_wg_feasible(&GemmShape { op: RoutedOp::Mn, m: 64, n: 4096, k: 4096, group: 4 }));
        assert!(!skinny_wg_feasible(&GemmShape { op: RoutedOp::Mn, m: 64, n: 4096, k: 4032 + 32, group: 128 }));
        assert!(!skinny_wg_feasible(&GemmShape { op: RoutedOp::Mn, m: 64, n: 4096 + 32, k: 4096, group: 32 }));
        assert!(!skinny_wg_feasible(&shape(RoutedOp::Mn, 1, 128)), "one token: the GEMV");
        assert_eq!(skinny_wg_switch_from(None), Ok(true));
        assert_eq!(skinny_wg_switch_from(Some(" 0")), Ok(false));
        assert!(skinny_wg_switch_from(Some("off")).unwrap_err().contains("WIDE_SKINNY_WG takes 1"));
        // The measurement decides: the faster of the two small-M kernels, if faster than dense.
        let rec = |skinny: Option<f64>, wg: Option<f64>| Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: None, skinny_ms: skinny, skinny_wg_ms: wg, warm: None };
        let up16 = shape(RoutedOp::Mn, 16, 128);
        assert_eq!(choose(&up16, 0.5, Some(&rec(Some(0.99), Some(0.95)))), GemmPath::SkinnyWg);
        assert_eq!(choose(&up16, 0.5, Some(&rec(Some(0.95), Some(0.99)))), GemmPath::GemvMma);
        assert_eq!(choose(&up16, 0.5, Some(&rec(Some(1.02), Some(1.01)))), GemmPath::DenseMasked);
        let up128 = shape(RoutedOp::Mn, 128, 128);
        assert_eq!(choose(&up128, 0.5, None), GemmPath::DenseMasked);
        assert_eq!(choose(&up128, 0.5, Some(&rec(None, Some(0.9)))), GemmPath::SkinnyWg);
        assert_eq!(choose(&up128, 0.5, Some(&rec(None, Some(1.05)))), GemmPath::DenseMasked);
        // A record of the mma.sync kernel does not apply past its 16 tokens.
        assert_eq!(choose(&up128, 0.5, Some(&rec(Some(0.5), None))), GemmPath::DenseMasked);
        let r = rec(None, Some(0.9));
        assert_eq!(r.best_path(), Some((GemmPath::SkinnyWg, 0.9)));
        assert_eq!(r.margin(), SMALL_M_MARGIN);
    }

    #[test]
    fn small_m_choice_holds_in_both_l2_states() {
        // Q at 16 tokens: the rule's mma.sync kernel, unless both kernels were measured.
        let q16 = GemmShape { op: RoutedOp::Mn, m: 16, n: 4096, k: 4096, group: 512 };
        assert_eq!(choose(&q16, 0.5, None), GemmPath::GemvMma);
        let warm = |d: f64, mma: f64, wg: f64| Some(WarmTimes { dense_ms: d, skinny_ms: Some(mma), skinny_wg_ms: Some(wg) });
        // Figures of the kind the H100 measured for Q at 16 tokens (NOTES v50): the mma.sync
        // kernel 0.83 of dense + mask cold but 1.05 warm, the wgmma kernel 0.91 and 0.82: the
        // wgmma kernel's worse ratio is the lower.
        let t = Tuned { dense_ms: 23.5, tiles: vec![], wgmma_ms: None, skinny_ms: Some(19.6), skinny_wg_ms: Some(21.4), warm: warm(13.1, 13.8, 10.8) };
        assert_eq!(t.best_path().map(|p| p.0), Some(GemmPath::GemvMma), "the faster cold");
        assert_eq!(choose(&q16, 0.5, Some(&t)), GemmPath::SkinnyWg);
        // Without warm timings the cold ones decide.
        assert_eq!(choose(&q16, 0.5, Some(&Tuned { warm: None, ..t.clone() })), GemmPath::GemvMma);
        // Both slower than dense + mask in one state or the other: dense + mask.
        let slow = Tuned { warm: warm(10.0, 10.5, 10.2), ..t.clone() };
        assert_eq!(choose(&q16, 0.5, Some(&slow)), GemmPath::DenseMasked);
        // Only the mma.sync kernel measured (no Hopper): the rule's kernel.
        assert_eq!(choose(&q16, 0.5, Some(&Tuned { skinny_wg_ms: None, ..slow.clone() })), GemmPath::GemvMma);
        // Where the rule leaves dense + mask (up at 16 tokens), the same worse-ratio choice.
        let up16 = shape(RoutedOp::Mn, 16, 128);
        assert_eq!(choose(&up16, 0.5, Some(&Tuned { dense_ms: 1.0, ..t.clone() })), GemmPath::DenseMasked, "cold ratios of 19.6 and 21.4");
        let t = Tuned { dense_ms: 1.0, tiles: vec![], wgmma_ms: None, skinny_ms: Some(0.95), skinny_wg_ms: Some(0.97), warm: warm(1.0, 1.02, 0.96) };
        assert_eq!(choose(&up16, 0.5, Some(&t)), GemmPath::SkinnyWg);
    }

    #[test]
    fn margin_and_log_switches_parse() {
        assert_eq!(large_m_margin_from(None), Ok(MARGIN));
        assert_eq!(large_m_margin_from(Some(" ")), Ok(MARGIN));
        assert_eq!(large_m_margin_from(Some("1.0")), Ok(1.0));
        assert_eq!(large_m_margin_from(Some(" 0.99 ")), Ok(0.99));
        for bad in ["0.5", "1.2", "-1", "nan", "fast"] {
            assert!(large_m_margin_from(Some(bad)).unwrap_err().contains("WIDE_TUNE_MARGIN takes a factor"), "{bad}");
        }
        assert_eq!(tune_log_from(None), Ok(false));
        assert_eq!(tune_log_from(Some("0")), Ok(false));
        assert_eq!(tune_log_from(Some("1")), Ok(true));
        assert!(tune_log_from(Some("yes")).unwrap_err().contains("WIDE_TUNE_LOG takes 1"));
    }

    #[test]
    fn tune_key_buckets_m_and_sparsity() {
        let a = TuneKey::new(&shape(RoutedOp::K, 3000, 128), 0.49, false, 0);
        let b = TuneKey::new(&shape(RoutedOp::K, 4096, 128), 0.51, false, 0);
        assert_eq!(a, b);
        let c = TuneKey::new(&shape(RoutedOp::K, 4097, 128), 0.5, false, 0);
        assert_ne!(a, c);
        assert_eq!(c.m_bucket, 8192);
    }

    #[test]
    fn smem_fits_the_device_limit() {
        for t in TILES {
            assert!(t.smem_bytes(true) <= 227 * 1024, "{t:?}");
            assert_eq!(t.bm % (16 * t.wm), 0);
            assert_eq!(t.bn % (16 * t.wn), 0);
        }
    }
}
