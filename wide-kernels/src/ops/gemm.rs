//! Routed projections on tch tensors (`x @ w^T` with `w` in the torch `[out, in]` layout):
//!
//! - [`gemm_mn`]: output-width routed, `out[m, n] = x[m] . w[n]` where token m runs group
//!   `n / G`, else exactly 0 (Q, gate, up projections).
//! - [`gemm_mn_swiglu`]: the same for gate and up at once, `silu(x . w_gate[n]) * (x . w_up[n])`.
//! - [`gemm_k`]: reduction-width routed, `out[m] = sum over groups g run by token m of
//!   x[m, gG..(g+1)G] . w[:, gG..(g+1)G]^T`; a token that runs no group gets exactly 0
//!   (down and O projections).
//!
//! On CUDA (bf16, f16; fp32 accumulation) the op picks a path with [`super::dispatch::choose`];
//! elsewhere, and for other dtypes, the tch reference runs.
use super::dispatch::{self, GemmPath, GemmShape, RoutedOp, TileConfig, TuneKey, TuneMode, Tuned, GEMV_K_MAX_GROUPS, GEMV_MAX_M};
use super::wgmma;
use super::layout::RouteLayout;
use super::routed_kernel;
use crate::cuda::{GpuTimer, KernelArg, LaunchConfig};
use anyhow::{bail, ensure, Context, Result};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

/// Output-width routed projection. x `[M, K]`, w `[N, K]`, layout of a mask `[M, N / group]`;
/// returns `[M, N]` in x's dtype.
pub fn gemm_mn(x: &Tensor, w: &Tensor, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    Ok(routed_gemm(RoutedOp::Mn, x, w, None, layout, group, None)?.0)
}

/// Fused gate+up with the SwiGLU epilogue. x `[M, K]`, w_gate and w_up `[N, K]`, layout of a
/// mask `[M, N / group]`; returns `silu(x w_gate^T) * (x w_up^T)` masked, `[M, N]`.
pub fn gemm_mn_swiglu(x: &Tensor, w_gate: &Tensor, w_up: &Tensor, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    Ok(routed_gemm(RoutedOp::MnSwiglu, x, w_gate, Some(w_up), layout, group, None)?.0)
}

/// Reduction-width routed projection. x `[M, K]`, w `[N, K]`, layout of a mask
/// `[M, K / group]`; returns `[M, N]`.
pub fn gemm_k(x: &Tensor, w: &Tensor, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    Ok(routed_gemm(RoutedOp::K, x, w, None, layout, group, None)?.0)
}

/// Reference for [`gemm_mn`] / [`gemm_mn_swiglu`] (with `w_up`) in tch on any device, in x's
/// dtype (pass f32/f64 inputs for a high-precision reference). mask `[M, N / group]`.
pub fn gemm_mn_reference(x: &Tensor, w: &Tensor, w_up: Option<&Tensor>, mask: &Tensor, group: i64) -> Tensor {
    let (m, n) = (x.size()[0], w.size()[0]);
    let mut y = x.linear::<&Tensor>(w, None);
    if let Some(u) = w_up {
        y = y.silu() * x.linear::<&Tensor>(u, None);
    }
    // masked_fill writes +0 (a product with 0 would give -0 for negative values).
    let off = mask.to_kind(Kind::Bool).logical_not().unsqueeze(-1);
    y.view([m, n / group, group]).masked_fill(&off, 0.0).view([m, n])
}

/// [`gemm_k`] for an input that is already exactly zero at the skipped (token, group) slices
/// (the output of [`gemm_mn_swiglu`] or of routed attention): same result, but the dense
/// fallback is the plain cuBLAS product with no masking pass.
pub fn gemm_k_premasked(x: &Tensor, w: &Tensor, layout: &RouteLayout, group: i64) -> Result<Tensor> {
    Ok(routed_gemm(RoutedOp::KPremasked, x, w, None, layout, group, None)?.0)
}

/// Reference for [`gemm_k`] in tch on any device, in x's dtype. mask `[M, K / group]`.
pub fn gemm_k_reference(x: &Tensor, w: &Tensor, mask: &Tensor, group: i64) -> Tensor {
    let (m, k) = (x.size()[0], x.size()[1]);
    let off = mask.to_kind(Kind::Bool).logical_not().unsqueeze(-1);
    let xm = x.view([m, k / group, group]).masked_fill(&off, 0.0).view([m, k]);
    xm.linear::<&Tensor>(w, None)
}

pub(super) fn shape_of(op: RoutedOp, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, group: i64) -> Result<GemmShape> {
    ensure!((op == RoutedOp::MnSwiglu) == w2.is_some(), "w_up is given exactly for the fused SwiGLU projection");
    let name = match op {
        RoutedOp::Mn => "gemm_mn",
        RoutedOp::MnSwiglu => "gemm_mn_swiglu",
        RoutedOp::K | RoutedOp::KPremasked => "gemm_k",
    };
    let (xs, ws) = (x.size(), w.size());
    ensure!(xs.len() == 2, "{name}: x must be [tokens, in_features], got {xs:?}");
    ensure!(ws.len() == 2, "{name}: w must be [out_features, in_features], got {ws:?}");
    ensure!(xs[1] == ws[1], "{name}: x has {} input features but w {:?} expects {}", xs[1], ws, ws[1]);
    if let Some(u) = w2 {
        ensure!(u.size() == ws, "{name}: w_up has shape {:?}, w_gate {:?}; they must match", u.size(), ws);
        ensure!(u.kind() == w.kind() && u.device() == w.device(), "{name}: w_up and w_gate differ in dtype or device");
    }
    ensure!(x.kind() == w.kind(), "{name}: x is {:?} but w is {:?}", x.kind(), w.kind());
    ensure!(x.device() == w.device() && x.device() == layout.device(), "{name}: x, w and the layout must be on one device");
    ensure!(group > 0, "{name}: group size must be positive, got {group}");
    let (m, k, n) = (xs[0], xs[1], ws[0]);
    let routed = if op.reduces_over_groups() { k } else { n };
    let what = if op.reduces_over_groups() { "input features" } else { "output features" };
    if routed % group != 0 {
        bail!("{name}: group size {group} does not divide the {routed} {what}");
    }
    ensure!(
        layout.tokens() == m && layout.groups() == routed / group,
        "{name}: the layout is for a mask [{}, {}] but x has {m} tokens and {routed} {what} / group {group} = {} groups",
        layout.tokens(),
        layout.groups(),
        routed / group
    );
    Ok(GemmShape { op, m, n, k, group })
}

/// Runs one routed projection, on `path` if given (else [`choose_path`]), and returns the
/// output with the path taken. `w2` is w_up for [`RoutedOp::MnSwiglu`].
pub fn routed_gemm(
    op: RoutedOp,
    x: &Tensor,
    w: &Tensor,
    w2: Option<&Tensor>,
    layout: &RouteLayout,
    group: i64,
    path: Option<GemmPath>,
) -> Result<(Tensor, GemmPath)> {
    let s = shape_of(op, x, w, w2, layout, group)?;
    let path = match path {
        Some(p) => p,
        None => choose_path_for(&s, x, w, w2, layout)?,
    };
    let out = run_path(&s, x, w, w2, layout, path)?;
    Ok((out, path))
}

/// The path [`routed_gemm`] takes without one given: `WIDE_ROUTED` if set, else the dispatch
/// policy with the autotuner's record for large M and for the 2-16 token products the static
/// rule leaves to dense + mask (`dispatch::small_m_tunable`), measured on first use of the
/// shape's M bucket and skip rate: a device sync, so not inside CUDA-graph capture. Callers with a
/// faster dense fallback of their own (the inference engine's fused gate|up GEMM) use it to
/// decide, and run the routed kernel only when this is not `DenseMasked`.
pub fn choose_path(op: RoutedOp, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, group: i64) -> Result<GemmPath> {
    let s = shape_of(op, x, w, w2, layout, group)?;
    choose_path_for(&s, x, w, w2, layout)
}

fn choose_path_for(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<GemmPath> {
    let cuda_ok = matches!(x.device(), Device::Cuda(_)) && matches!(x.kind(), Kind::BFloat16 | Kind::Half);
    if !cuda_ok {
        return Ok(GemmPath::DenseMasked);
    }
    Ok(match dispatch::env_override() {
        Some("dense") => GemmPath::DenseMasked,
        Some("gemv") => GemmPath::Gemv,
        Some("gemv-mma") if dispatch::skinny_feasible(s) => GemmPath::GemvMma,
        Some("tiled") => match tuned(s, x, w, w2, layout)?.best() {
            Some((t, _)) => GemmPath::Tiled(t),
            None => GemmPath::DenseMasked,
        },
        Some("wgmma") if wgmma_usable(s, x) => GemmPath::Wgmma,
        Some("wgmma-skinny") if skinny_wg_usable(s, x) => GemmPath::SkinnyWg,
        _ => {
            let sp = layout.sparsity();
            // Below LARGE_M_MIN a measurement only where one of the small-M kernels can run
            // here (the wgmma one needs compute capability 9.0).
            let small = s.m < dispatch::LARGE_M_MIN && dispatch::small_m_tunable(s, sp).map_err(anyhow::Error::msg)? && (dispatch::skinny_feasible(s) || skinny_wg_usable(s, x));
            let t = if s.m >= dispatch::LARGE_M_MIN || small { Some(tuned(s, x, w, w2, layout)?) } else { None };
            dispatch::choose(s, sp, t.as_ref())
        }
    })
}

fn run_path(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, path: GemmPath) -> Result<Tensor> {
    match path {
        GemmPath::DenseMasked => dense_masked(s, x, w, w2, layout),
        GemmPath::Gemv => launch_gemv(s, x, w, w2, layout),
        GemmPath::GemvMma => launch_skinny(s, x, w, w2, layout),
        GemmPath::SkinnyWg => super::skinny_wg::launch(s, x, w, layout),
        GemmPath::Tiled(t) => launch_tiled(s, x, w, w2, layout, t),
        GemmPath::Wgmma => wgmma::launch(s, x, w, w2, layout),
    }
}

/// The wgmma kernel can run this call: a feasible shape, bf16/f16 on a compute capability 9.0
/// device (groups narrower than its tile unless `WIDE_WGMMA_NARROW=0`).
fn wgmma_usable(s: &GemmShape, x: &Tensor) -> bool {
    let dev = match x.device() {
        Device::Cuda(d) if matches!(x.kind(), Kind::BFloat16 | Kind::Half) => d,
        _ => return false,
    };
    dispatch::wgmma_feasible(s) && (s.group >= dispatch::WGMMA_BN || narrow_allowed()) && wgmma::supported(dev)
}

/// The transposed small-M wgmma kernel can run this call: a feasible shape, bf16/f16 on a
/// compute capability 9.0 device.
fn skinny_wg_usable(s: &GemmShape, x: &Tensor) -> bool {
    match x.device() {
        Device::Cuda(d) if matches!(x.kind(), Kind::BFloat16 | Kind::Half) => dispatch::skinny_wg_feasible(s) && wgmma::supported(d),
        _ => false,
    }
}

/// `WIDE_WGMMA_NARROW=0` (read once) keeps groups narrower than the wgmma tile off that kernel
/// (the earlier dispatch, for A/B runs).
fn narrow_allowed() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_WGMMA_NARROW") != Some(false))
}

pub(super) fn cuda_inputs(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>) -> Result<(usize, bool, Tensor, Tensor, Option<Tensor>)> {
    let device = match x.device() {
        Device::Cuda(d) => d,
        d => bail!("routed CUDA kernels need CUDA tensors, got {d:?}"),
    };
    let f16 = match x.kind() {
        Kind::BFloat16 => false,
        Kind::Half => true,
        k => bail!("routed CUDA kernels take bf16 or f16, got {k:?} (the dense path takes any float dtype)"),
    };
    ensure!(s.k % 8 == 0, "routed CUDA kernels need in_features divisible by 8 (16-byte loads), got {}", s.k);
    let (x, w, w2) = (x.contiguous(), w.contiguous(), w2.map(|u| u.contiguous()));
    for (t, n) in [(&x, "x"), (&w, "w")].into_iter().chain(w2.as_ref().map(|u| (u, "w_up"))) {
        ensure!(t.data_ptr() as usize % 16 == 0, "{n} is not 16-byte aligned (a view with an odd offset?)");
    }
    Ok((device, f16, x, w, w2))
}

fn launch_gemv(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tensor> {
    let (device, f16, x, w, w2) = cuda_inputs(s, x, w, w2)?;
    let ng = gemv_groups(s)?;
    let mm = [1, 2, 4, 8, 16].into_iter().find(|&v| v >= s.m).unwrap();
    let r = gemv_rows_override(mm, s.n).unwrap_or_else(|| if s.op.reduces_over_groups() { gemv_k_rows_per_block(mm, s.n) } else { gemv_rows_per_warp(mm, s.n) });
    let form = gemv_form(s, layout);
    let (ps, split) = (form == GemvForm::Persistent, form == GemvForm::Split);
    let r = if split || ps { GEMV_SPLIT_ROWS } else { r };
    let entry = match s.op {
        RoutedOp::Mn if ps => format!("gemv_mn_ps_{r}"),
        RoutedOp::MnSwiglu if ps => format!("gemv_mn_ps_swiglu_{r}"),
        RoutedOp::Mn if split => format!("gemv_mn_split_{r}"),
        RoutedOp::MnSwiglu if split => format!("gemv_mn_split_swiglu_{r}"),
        RoutedOp::Mn => format!("gemv_mn_{mm}_{r}"),
        RoutedOp::MnSwiglu => format!("gemv_mn_swiglu_{mm}_{r}"),
        RoutedOp::K | RoutedOp::KPremasked => format!("gemv_k_{mm}_{r}"),
    };
    let kernel = routed_kernel(f16, None, &entry, device)?;
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    let last = if s.op.reduces_over_groups() { layout.settled() as i32 } else { layout.always_on_from() as i32 };
    let mut args = small_m_args(s, &x, &w, w2.as_ref(), layout, &out, ng, last)?;
    if !s.op.reduces_over_groups() {
        args.push(KernelArg::I32(layout.early() as i32));
    }
    // gemm_mn: `gemv_mn_warps_per_block` warps a block, r rows a warp. gemm_k: 8 warps share r rows (split over the used
    // chunks); shared memory holds the block's group list (a group index, and with several
    // tokens which of them use it) and the warps' partial sums.
    let (blocks, threads, smem) = if s.op.reduces_over_groups() {
        let warps = 8u32;
        let list = ng as u32 * if mm > 1 { 8 } else { 4 };
        ((s.n / r) as u32, 32 * warps, list + 4 * warps * (r * mm) as u32)
    } else if ps {
        // A few blocks a multiprocessor, all resident at once, at most one a row set; the list
        // of groups [0, FIXED) in dynamic shared memory.
        let blocks = (gemv_ps_blocks_per_sm(s.n, layout.early()) * crate::cuda::multiprocessor_count(device)? as i64).min(s.n / r);
        (blocks as u32, 256, 4 * layout.always_on_from() as u32)
    } else if split {
        ((s.n / r) as u32, 256, 0)
    } else {
        let wpb = gemv_mn_warps_per_block();
        ((s.n as u32).div_ceil(wpb * r as u32), 32 * wpb, 0)
    };
    // Programmatic dependent launch: both GEMVs wait for the launch before (pdl.cuh).
    unsafe { kernel.launch_pdl(LaunchConfig { grid: (blocks, 1, 1), block: (threads, 1, 1), shared_mem_bytes: smem }, &args)? };
    Ok(out)
}

/// The next sublayer's token router, folded into a one-token gemm_k GEMV ([`gemm_k_fold_router`]).
/// That router reads the residual after the projection, `xres + x w^T`; its first layer is
/// linear, so its hidden is `w1 xres + fold x + b1` with `fold = w1 w` (`[rank, K]`, in x's
/// dtype, computed once by the caller).
pub struct RouterFold<'a> {
    /// `[1, H]`: the residual the projection's output is added to. With a settled layout it must
    /// be complete when the launch starts (written two or more launches back).
    pub xres: &'a Tensor,
    /// `[rank, H]`, `[rank]`: the router's first layer.
    pub w1: &'a Tensor,
    pub b1: &'a Tensor,
    /// `[rank, K]`: `w1 w`.
    pub fold: &'a Tensor,
    /// `[2 groups, rank]`, `[2 groups]`: its second layer.
    pub w2: &'a Tensor,
    pub b2: &'a Tensor,
    /// Added to `skip - execute` before the gate.
    pub offset: f64,
    /// Always-on groups appended to the extended mask (0: no extended mask).
    pub extra: i64,
    /// f32 `[rank + 1]`, zero: the kernel's partial sums and arrival counter (zero again after
    /// every launch, so one buffer serves every call on a stream).
    pub scratch: &'a Tensor,
}

/// Rank of a router [`gemm_k_fold_router`] takes: even (two hidden values a block), at most 256.
pub fn fold_rank_ok(rank: i64) -> bool {
    rank > 0 && rank % 2 == 0 && rank <= 256
}

/// [`gemm_k_premasked`] of one token on the GEMV, with the next router's decision from the same
/// launch: returns `(out, mask [1, groups] bool, extended mask [1, groups + extra] when extra > 0)`.
/// The router's hidden is `w1 xres + fold x + b1` in f32, rounded to x's dtype like an unfused
/// first layer; it equals the router on `xres + out` up to that rounding (the unfused path rounds
/// `out` and the sum first), so a decision within rounding of the threshold may differ.
pub fn gemm_k_fold_router(x: &Tensor, w: &Tensor, layout: &RouteLayout, group: i64, f: &RouterFold) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let s = shape_of(RoutedOp::KPremasked, x, w, None, layout, group)?;
    ensure!(s.m == 1, "gemm_k_fold_router takes one token, got {}", s.m);
    let (device, f16, x, w, _) = cuda_inputs(&s, x, w, None)?;
    let ng = gemv_groups(&s)?;
    let (rank, h) = f.w1.size2()?;
    ensure!(fold_rank_ok(rank), "gemm_k_fold_router: router rank {rank} must be even and at most 256");
    ensure!(h % 8 == 0, "gemm_k_fold_router: hidden size {h} must be divisible by 8");
    ensure!(f.xres.numel() == h as usize, "gemm_k_fold_router: residual {:?} does not have the router's {h} features", f.xres.size());
    ensure!(f.fold.size() == [rank, s.k], "gemm_k_fold_router: fold {:?} must be [{rank}, {}] (w1 w)", f.fold.size(), s.k);
    ensure!(f.b1.size() == [rank], "gemm_k_fold_router: b1 {:?} must be [{rank}]", f.b1.size());
    let (n2, r2) = f.w2.size2()?;
    ensure!(r2 == rank && n2 % 2 == 0 && f.b2.size() == [n2], "gemm_k_fold_router: second layer {:?} / {:?} does not take rank {rank}", f.w2.size(), f.b2.size());
    ensure!(f.extra >= 0, "gemm_k_fold_router: extra groups must be >= 0, got {}", f.extra);
    ensure!(
        f.scratch.kind() == Kind::Float && f.scratch.size() == [rank + 1] && f.scratch.is_contiguous(),
        "gemm_k_fold_router: scratch must be a contiguous f32 [{}] of zeros",
        rank + 1
    );
    let same = |t: &Tensor| t.kind() == x.kind() && t.device() == x.device();
    for (t, n) in [(f.xres, "xres"), (f.w1, "w1"), (f.b1, "b1"), (f.fold, "fold"), (f.w2, "w2"), (f.b2, "b2")] {
        ensure!(same(t), "gemm_k_fold_router: {n} must be {:?} on {:?} like x, got {:?} on {:?}", x.kind(), x.device(), t.kind(), t.device());
    }
    ensure!(f.scratch.device() == x.device(), "gemm_k_fold_router: scratch must be on {:?}", x.device());
    let (xres, w1, b1, fold, w2, b2) = (f.xres.contiguous(), f.w1.contiguous(), f.b1.contiguous(), f.fold.contiguous(), f.w2.contiguous(), f.b2.contiguous());
    for (t, n) in [(&xres, "xres"), (&w1, "w1"), (&fold, "fold"), (&w2, "w2")] {
        ensure!(t.data_ptr() as usize % 16 == 0, "gemm_k_fold_router: {n} is not 16-byte aligned (a view with an odd offset?)");
    }
    let rng = n2 / 2;
    let r = gemv_rows_override(1, s.n).unwrap_or_else(|| gemv_k_rows_per_block(1, s.n));
    let kernel = routed_kernel(f16, None, &format!("gemv_k_router_1_{r}"), device)?;
    let out = Tensor::empty([1, s.n], (x.kind(), x.device()));
    let mask = Tensor::empty([1, rng], (Kind::Bool, x.device()));
    let ext = (f.extra > 0).then(|| Tensor::empty([1, rng + f.extra], (Kind::Bool, x.device())));
    let mut args = small_m_args(&s, &x, &w, None, layout, &out, ng, layout.settled() as i32)?;
    args.extend([
        KernelArg::tensor(&fold)?,
        KernelArg::tensor(&xres)?,
        KernelArg::tensor(&w1)?,
        KernelArg::tensor(&b1)?,
        KernelArg::tensor(&w2)?,
        KernelArg::tensor(&b2)?,
        KernelArg::F32(f.offset as f32),
        KernelArg::tensor(f.scratch)?,
        KernelArg::tensor(&mask)?,
        match &ext {
            Some(t) => KernelArg::tensor(t)?,
            None => KernelArg::Ptr(0),
        },
        KernelArg::I32(rank as i32),
        KernelArg::I32(rng as i32),
        KernelArg::I32(f.extra as i32),
        KernelArg::I32(h as i32),
    ]);
    // The fold blocks (two hidden values each) first, then gemv_k's; shared memory as gemv_k's
    // for the larger of the two row counts, then (where the default 48 KiB hold them) a copy of
    // the gate's weights, so the last fold block gates without a round trip to L2.
    let blocks = (rank / 2 + s.n / r) as u32;
    let base = (ng + 8 * r.max(2) + 3) / 4 * 16;
    let gate_bytes = 2 * rng * (rank + 1) * 2;
    let shared = w2.data_ptr() as usize % 16 == 0 && rank % 8 == 0 && base + gate_bytes <= 48 * 1024;
    let smem = (base + if shared { gate_bytes } else { 0 }) as u32;
    args.push(KernelArg::I32(shared as i32));
    args.push(KernelArg::I32(fold_tail_on() as i32));
    unsafe { kernel.launch_pdl(LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: smem }, &args)? };
    Ok((out, mask, ext))
}

/// `WIDE_FOLD_TAIL=0` (read once; measurement only): the folded router's fold blocks compute
/// their hidden values but do not count in or gate, and the launch writes a fixed decision
/// (every other group on) instead, so that a decode step can be timed without the gate's tail
/// (the arrival count and the last fold block's gate). The decisions are then not the router's.
fn fold_tail_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_FOLD_TAIL") != Some(false))
}

/// The routed groups of a GEMV call, after the checks every GEMV launch needs (tokens, group
/// size, gemm_k's group-list capacity).
fn gemv_groups(s: &GemmShape) -> Result<i64> {
    ensure!(s.m <= GEMV_MAX_M, "the GEMV path takes at most {GEMV_MAX_M} tokens, got {}", s.m);
    ensure!(s.group % 8 == 0, "the GEMV path needs a group size divisible by 8, got {}", s.group);
    let ng = if s.op.reduces_over_groups() { s.k / s.group } else { s.n / s.group };
    ensure!(
        !s.op.reduces_over_groups() || ng <= GEMV_K_MAX_GROUPS,
        "the gemm_k GEMV takes at most {GEMV_K_MAX_GROUPS} groups, got {ng} (use a larger group size)"
    );
    Ok(ng)
}

/// Arguments of the small-M kernels (GEMVs and the mma gemm_mn): x, w[, w2], mask, out, M, N,
/// K, G, NG, then `last` (the gemm_k GEMV's settled flag, gemm_mn's first always-on group).
#[allow(clippy::too_many_arguments)]
fn small_m_args(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, out: &Tensor, ng: i64, last: i32) -> Result<Vec<KernelArg>> {
    let mut args = vec![KernelArg::tensor(x)?, KernelArg::tensor(w)?];
    if let Some(u) = w2 {
        args.push(KernelArg::tensor(u)?);
    }
    args.extend([
        KernelArg::tensor(layout.mask())?,
        KernelArg::tensor(out)?,
        KernelArg::I32(s.m as i32),
        KernelArg::I32(s.n as i32),
        KernelArg::I32(s.k as i32),
        KernelArg::I32(s.group as i32),
        KernelArg::I32(ng as i32),
        KernelArg::I32(last),
    ]);
    Ok(args)
}

fn launch_skinny(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tensor> {
    ensure!(
        dispatch::skinny_feasible(s),
        "the small-M mma gemm_mn takes gemm_mn with {}..={} tokens, 16 | group and 32 | K; got {:?} M {} K {} group {}",
        dispatch::SKINNY_MIN_M,
        dispatch::SKINNY_MAX_M,
        s.op,
        s.m,
        s.k,
        s.group
    );
    let (device, f16, x, w, w2) = cuda_inputs(s, x, w, w2)?;
    let nt = if s.m <= 8 { 1 } else { 2 };
    let entry = if s.op == RoutedOp::MnSwiglu { format!("skinny_mn_swiglu_{nt}_2") } else { format!("skinny_mn_{nt}_{}", skinny_unroll()) };
    let kernel = routed_kernel(f16, None, &entry, device)?;
    if let Some(pct) = skinny_carveout() {
        kernel.set_carveout(pct)?;
    }
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    let args = small_m_args(s, &x, &w, w2.as_ref(), layout, &out, s.n / s.group, layout.always_on_from() as i32)?;
    // One block of 8 warps for each 16 output rows; programmatic dependent launch as the GEMVs.
    unsafe { kernel.launch_pdl(LaunchConfig { grid: ((s.n / 16) as u32, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 }, &args)? };
    Ok(out)
}

/// The small-M mma gemm_mn's preferred shared-memory carveout (percent; see
/// [`CudaKernel::set_carveout`]), from `WIDE_SKINNY_CARVEOUT` (read once): unset leaves the
/// driver's choice; a value outside 0..=100 is named in a warning and ignored. Every block reads
/// all of x (16 x K) through L1 beside weights that bypass it, so a small carveout keeps more of
/// x in L1 (a measurement knob).
pub fn skinny_carveout() -> Option<i32> {
    static V: OnceLock<Option<i32>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_SKINNY_CARVEOUT", 0..=100, "percent of the multiprocessor's storage as shared memory").map(|p| p as i32))
}

/// k blocks of weights a warp of the plain small-M mma gemm_mn requests at a time (2 or 4; up to
/// twice that in flight). `WIDE_SKINNY_U=2|4` forces it for sweeps; the default is 4.
pub fn skinny_unroll() -> i64 {
    static V: OnceLock<i64> = OnceLock::new();
    *V.get_or_init(|| if crate::knobs::choice("WIDE_SKINNY_U", &["2", "4"]) == Some("2") { 2 } else { 4 })
}

/// Output rows per warp of the gemm_mn GEMV: more rows reuse each x chunk more often and put
/// more loads in flight per lane, but leave fewer warps; aim for at least ~2048 warps (15 a
/// multiprocessor on an H200) and keep `r * mm <= 16` accumulators. `r` divides N (and every group size that is a multiple of 8).
/// Measured on the H200 at M = 1, 50% skip (`WIDE_GEMV_ROWS` sweep, see wide-kernels/NOTES.md):
/// up 4096->14336 1.60x / 1.82x / 1.91x with 1 / 2 / 4 rows, q 4096->4096 1.16x / 1.24x / 1.23x.
pub fn gemv_rows_per_warp(mm: i64, n: i64) -> i64 {
    let cap = (16 / mm).clamp(1, 8);
    let mut r = 1;
    while r * 2 <= cap && n / (r * 2) >= 2048 && n % (r * 2) == 0 {
        r *= 2;
    }
    r
}

/// Output rows per block of the gemm_k GEMV (8 warps share them): as many as keep at least 512
/// blocks (4 a multiprocessor on an H200), at most `16 / mm`. Measured on the H200 (down
/// 14336->4096, M = 1, 50% skip, `WIDE_GEMV_ROWS` sweep): 1.40x / 1.65x / 1.76x / 1.91x with
/// 1 / 2 / 4 / 8 rows; O 0.89x / 1.30x / 1.57x / 1.61x.
pub fn gemv_k_rows_per_block(mm: i64, n: i64) -> i64 {
    let cap = (16 / mm).clamp(1, 8);
    let mut r = 1;
    while r * 2 <= cap && n / (r * 2) >= 512 && n % (r * 2) == 0 {
        r *= 2;
    }
    r
}

/// Rows a block of the split one-token gemm_mn GEMV (`gemv_mn_split_8` in routed.cu: 8 warps,
/// each reading one eighth of every row, partial sums meeting in shared memory).
pub const GEMV_SPLIT_ROWS: i64 = 8;

/// Which gemm_mn GEMV kernel a call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GemvForm {
    /// `gemv_mn_{M}_{R}`: each warp streams whole rows (any token count up to 16, any group size).
    Rows,
    /// `gemv_mn_split_8`: one token; 8 warps a block share 8 rows, each warp reading an eighth of
    /// every row, so all of a block's loads go out at once.
    Split,
    /// `gemv_mn_ps_8`: the split kernel's row sets on a grid of a few resident blocks a
    /// multiprocessor; each block reads the mask once, lists the used groups in shared memory and
    /// walks its row sets; the unused groups' zeros are written by the whole grid.
    Persistent,
}

/// The GEMV form of a call, from its shape, the layout's count of routed groups
/// (`always_on_from`: groups below it are routed, the rest on for every token) and the
/// environment's forcing knobs (`WIDE_GEMV_PS=0|1`, `WIDE_GEMV_SPLIT=0|1`, read once).
fn gemv_form(s: &GemmShape, layout: &RouteLayout) -> GemvForm {
    static V: OnceLock<(Option<bool>, Option<bool>)> = OnceLock::new();
    let (ps, split) = *V.get_or_init(|| (crate::knobs::switch("WIDE_GEMV_PS"), crate::knobs::switch("WIDE_GEMV_SPLIT")));
    gemv_form_for(s, layout.always_on_from(), ps, split)
}

/// The policy behind [`gemv_form`]. The split forms need one token, a gemm_mn and groups of a
/// multiple of 8 rows. By default a projection with routed groups (a mask to read) takes the
/// persistent form: the split grid's many short-lived blocks each waited for the mask before
/// their first load, the persistent grid pays that wait once a block; a dense projection (no
/// mask) takes the plain split form. Measured on the H200 (2026-12-03, NOTES v25): dense decode
/// step 4.208 -> 4.025 ms with the split form (gate+up 56.7 -> 51.7 us a call), 3.965 against
/// 3.920 ms with the persistent one; routed, the split form lost (up at one token 23.7 -> 26.2
/// us cold, gate+up in the step 32.2 -> 45.2 us), the persistent one won (up 23.7 -> 23.2 us, Q
/// 14.7 -> 11.5 us; in the step gate+up 32.3 -> 27.2 us, Q|K|V 10.3 -> 8.8 us, wide step 2.844 ->
/// 2.775 ms). `ps` / `split` force a form on (`Some(true)`, where the shape allows; ps first)
/// or off. The persistent form's used-group list takes 4 bytes a routed group of shared memory,
/// so it takes at most 8192 routed groups.
fn gemv_form_for(s: &GemmShape, always_on_from: i64, ps: Option<bool>, split: Option<bool>) -> GemvForm {
    let splittable = s.m == 1 && !s.op.reduces_over_groups() && s.group % GEMV_SPLIT_ROWS == 0;
    if splittable && always_on_from <= 8192 && ps.unwrap_or(always_on_from > 0) {
        GemvForm::Persistent
    } else if splittable && split.unwrap_or(always_on_from == 0) {
        GemvForm::Split
    } else {
        GemvForm::Rows
    }
}

/// Blocks a multiprocessor of the persistent split GEMV for a projection of `n` output rows
/// (per matrix when fused) whose mask is early or not: [`gemv_ps_blocks_for`] with the knobs
/// `WIDE_GEMV_PS_BPS` (1 to 8, every projection) and `WIDE_GEMV_PS_BPS_WIDE` (1 to 8, projections
/// of at least [`GEMV_PS_WIDE_ROWS`] rows without an early mask), read once.
fn gemv_ps_blocks_per_sm(n: i64, early: bool) -> i64 {
    static V: OnceLock<(Option<i64>, Option<i64>)> = OnceLock::new();
    let knob = |name: &str| crate::knobs::int(name, 1..=8, "blocks a multiprocessor");
    let (all, wide) = *V.get_or_init(|| (knob("WIDE_GEMV_PS_BPS"), knob("WIDE_GEMV_PS_BPS_WIDE")));
    gemv_ps_blocks_for(n, early, all, wide)
}

/// Output rows from which the persistent GEMV takes more blocks a multiprocessor.
pub const GEMV_PS_WIDE_ROWS: i64 = 8192;

/// The policy behind [`gemv_ps_blocks_per_sm`]: `all` forces one count; otherwise 2 blocks a
/// multiprocessor for a projection with an early mask (a decode step's: its launch starts while
/// the one before drains, programmatic dependent launch) or below [`GEMV_PS_WIDE_ROWS`] rows,
/// and `wide` (default 5) for the others. Measured on the H200 (2026-12-04, NOTES v26), one
/// token, s = 0.5, G = 128: cold and alone, up (14336 rows) 23.4 / 23.0-23.2 / 22.4 us and the
/// fused gate+up 38.8-38.9 / 38.3-38.5 / 37.6-37.8 at 2 / 4 / 5, but Q (4096 rows) 11.5 us at 2
/// against 12.4 at 4 and 5; in the decode step the gate+up at 5 (Q|K|V at 2) made the step 3.082
/// -3.083 ms against 3.075-3.076 at 2.
fn gemv_ps_blocks_for(n: i64, early: bool, all: Option<i64>, wide: Option<i64>) -> i64 {
    all.unwrap_or(if !early && n >= GEMV_PS_WIDE_ROWS { wide.unwrap_or(5) } else { 2 })
}

/// Warps a block of the gemm_mn GEMV: `WIDE_GEMV_WARPS` (1, 2 or 4; read once), default 4.
/// The kernel's warps are independent (no shared memory), so this only changes how finely the
/// loading warps are dealt to the multiprocessors.
fn gemv_mn_warps_per_block() -> u32 {
    static V: OnceLock<u32> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::choice("WIDE_GEMV_WARPS", &["1", "2", "4"]).map_or(4, |w| w.parse().unwrap_or(4)))
}

/// Rows a warp (gemm_mn) or a block (gemm_k) forced by `WIDE_GEMV_ROWS` (read once; for
/// benchmark sweeps), if it names one of the compiled variants for this token bucket and
/// divides N.
fn gemv_rows_override(mm: i64, n: i64) -> Option<i64> {
    static V: OnceLock<Option<i64>> = OnceLock::new();
    let r = (*V.get_or_init(|| crate::knobs::choice("WIDE_GEMV_ROWS", &["1", "2", "4", "8"]).and_then(|r| r.parse().ok())))?;
    let compiled = match mm {
        1 | 2 => [1, 2, 4, 8].contains(&r),
        4 => [1, 2, 4].contains(&r),
        8 => [1, 2].contains(&r),
        _ => r == 1,
    };
    (compiled && n % r == 0).then_some(r)
}

/// Dense cuBLAS product(s) and the mask: one extra pass over the output (gemm_mn: zeros
/// written where groups are off; SwiGLU: activation, product and mask fused), a masked copy of
/// the input (gemm_k), or nothing (gemm_k with a premasked input).
/// The dense path's mask kernel for one launch: `apply_group_mask_rows4` (rows in batches of 4,
/// each batch's mask loads and then its stores, 30 registers a thread, so the grid's ~16 blocks a
/// multiprocessor are all resident), or `apply_group_mask` with `rb` rows a batch (all of a
/// batch's mask loads before its stores: one load round trip a batch, but 106 registers a
/// thread, 4 blocks a multiprocessor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MaskPass {
    Rows4,
    Batched(i32),
}

/// Rows a thread takes from which the batched kernel runs by default. Measured on an H100 (one
/// process each, two rounds, `WIDE_ROUTED=dense`, NOTES v51): at 2 rows a thread (Q, 1024 tokens)
/// the batched kernel added 5.5-5.6 us to cuBLAS against 3.7-3.8, at 7 (up, 1024) 6.5-9.0 against
/// 6.3-8.6, at 8 (Q, 4096) 6.2-7.6 against 6.3-7.3; at 28 (up, 4096) 4.0-28.7 against 19.1-37.6 and
/// from 32 (Q and up at 16384) 13.1-128.0 against 20.4-127.1, fewer records below 0.97x at both.
const MASK_BATCHED_FROM_ROWS: i64 = 16;

/// The mask kernel and its batch for `m` rows over the grid's `gy` row slots: a thread's share
/// of the rows, ceil(m / gy); the batched kernel from [`MASK_BATCHED_FROM_ROWS`] rows a thread,
/// in batches of the whole share up to 32 (the kernel's `MASK_RB_MAX`). For A/B runs (read once):
/// `WIDE_MASK_PASS=rows4|batched` takes one kernel everywhere, `WIDE_MASK_ROWS=1..32` sets the
/// batched kernel's batch.
fn mask_pass(m: i64, gy: u32) -> MaskPass {
    mask_pass_with(m, gy, env_mask_pass(), env_mask_rows())
}

fn mask_pass_with(m: i64, gy: u32, forced: Option<bool>, rows: Option<i32>) -> MaskPass {
    let share = (m.max(1) as u64).div_ceil(gy.max(1) as u64) as i64;
    let batched = forced.unwrap_or(share >= MASK_BATCHED_FROM_ROWS);
    if batched {
        MaskPass::Batched(rows.unwrap_or(share.clamp(1, MASK_ROWS_MAX as i64) as i32))
    } else {
        MaskPass::Rows4
    }
}

/// The kernel's `MASK_RB_MAX`.
const MASK_ROWS_MAX: i32 = 32;

/// `WIDE_MASK_PASS` (read once): Some(true) `batched`, Some(false) `rows4`, None unset (the
/// per-launch rule); another value is named in a warning and ignored.
fn env_mask_pass() -> Option<bool> {
    static V: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::choice("WIDE_MASK_PASS", &["batched", "rows4"]).map(|c| c == "batched"))
}

/// `WIDE_MASK_ROWS` (read once): the batched pass's rows a batch, 1 to the kernel's batch;
/// another value is named in a warning and ignored.
fn env_mask_rows() -> Option<i32> {
    static V: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_MASK_ROWS", 1..=MASK_ROWS_MAX as i64, "rows a batch of the zero pass").map(|n| n as i32))
}

fn dense_masked(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tensor> {
    let cuda = match x.device() {
        Device::Cuda(d) if matches!(x.kind(), Kind::BFloat16 | Kind::Half) && s.group % 8 == 0 => Some(d),
        _ => None,
    };
    let Some(device) = cuda else {
        return Ok(match s.op {
            RoutedOp::K | RoutedOp::KPremasked => gemm_k_reference(x, w, layout.mask(), s.group),
            _ => gemm_mn_reference(x, w, w2, layout.mask(), s.group),
        });
    };
    let f16 = x.kind() == Kind::Half;
    let apply = |a: &Tensor, b: Option<&Tensor>, dst: &Tensor, cols: i64, mode: i32| -> Result<()> {
        let grid = crate::cuda::row_loop_grid(device, (cols as u32 / 8).div_ceil(128), s.m)?;
        let pass = mask_pass(s.m, grid.1);
        let k = routed_kernel(f16, None, if pass == MaskPass::Rows4 { "apply_group_mask_rows4" } else { "apply_group_mask" }, device)?;
        // The batched entry takes its batch as one more argument.
        let (rb, n_args) = match pass {
            MaskPass::Batched(rb) => (rb, 10),
            MaskPass::Rows4 => (0, 9),
        };
        let args = [
            KernelArg::tensor(a)?,
            KernelArg::tensor(b.unwrap_or(a))?,
            KernelArg::tensor(dst)?,
            KernelArg::tensor(layout.mask())?,
            KernelArg::I64(s.m),
            KernelArg::I32(cols as i32),
            KernelArg::I32(s.group as i32),
            KernelArg::I32((cols / s.group) as i32),
            KernelArg::I32(mode),
            KernelArg::I32(rb),
        ];
        let cfg = LaunchConfig { grid, block: (128, 1, 1), shared_mem_bytes: 0 };
        // `WIDE_MASK_PDL=0` (read once, for A/B runs): the pass launched after cuBLAS without
        // programmatic dependent launch.
        static PDL_OFF: OnceLock<bool> = OnceLock::new();
        if *PDL_OFF.get_or_init(|| crate::knobs::switch("WIDE_MASK_PDL") == Some(false)) {
            unsafe { k.launch(cfg, &args[..n_args]) }
        } else {
            unsafe { k.launch_pdl(cfg, &args[..n_args]) }
        }
    };
    Ok(match s.op {
        RoutedOp::Mn => {
            let y = x.linear::<&Tensor>(w, None);
            apply(&y, None, &y, s.n, 0)?;
            y
        }
        RoutedOp::MnSwiglu => {
            let u = w2.context("w_up")?;
            if let Some(gu) = stacked(w, u) {
                // Gate and up rows adjacent in memory (the engine's fused weight): one GEMM over
                // both, then the SwiGLU kernel with the mask, as the engine's own dense path.
                return super::fused::swiglu(&x.linear::<&Tensor>(&gu, None), Some(layout.mask()), s.group);
            }
            let (g, u) = (x.linear::<&Tensor>(w, None), x.linear::<&Tensor>(u, None));
            apply(&g, Some(&u), &g, s.n, 2)?;
            g
        }
        RoutedOp::K => {
            // The mask kernel reads 16-byte pieces: a view at an odd offset is copied first.
            let x = x.contiguous();
            let x = if x.data_ptr() as usize % 16 == 0 { x } else { x.copy() };
            let xm = x.empty_like();
            apply(&x, None, &xm, s.k, 1)?;
            xm.linear::<&Tensor>(w, None)
        }
        RoutedOp::KPremasked => x.linear::<&Tensor>(w, None),
    })
}

/// `[2N, K]`: `w` and `u` (both `[N, K]`, contiguous) as one matrix when `u` starts right where
/// `w` ends in the same storage (views of a stacked gate|up weight); None otherwise.
fn stacked(w: &Tensor, u: &Tensor) -> Option<Tensor> {
    let (n, k) = w.size2().ok()?;
    let adjacent = u.size() == [n, k]
        && w.is_contiguous()
        && u.is_contiguous()
        && w.kind() == u.kind()
        && w.device() == u.device()
        && u.data_ptr() as usize == w.data_ptr() as usize + (n * k) as usize * w.kind().elt_size_in_bytes();
    if !adjacent {
        return None;
    }
    // A view of w's storage from w's offset: ATen refuses it (Err) unless that storage holds
    // the 2N rows, i.e. u's bytes are part of it (two live storages never overlap).
    w.f_as_strided([2 * n, k], [k, 1], None::<i64>).ok()
}

fn launch_tiled(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, t: TileConfig) -> Result<Tensor> {
    ensure!(
        dispatch::feasible_tiles(s).contains(&t),
        "tile {t:?} cannot run {:?} with N {} K {} group {}",
        s.op,
        s.n,
        s.k,
        s.group
    );
    let (device, f16, x, w, w2) = cuda_inputs(s, x, w, w2)?;
    let fused = s.op == RoutedOp::MnSwiglu;
    let limit = crate::cuda::max_shared_per_block_optin(device)?;
    ensure!(t.smem_bytes(fused) as usize <= limit, "tile {} needs {} bytes of shared memory; device {device} allows {limit} a block", t.label(), t.smem_bytes(fused));
    let entry = if s.op.reduces_over_groups() { "gemm_k_tiled" } else { "gemm_mn_tiled" };
    let kernel = routed_kernel(f16, Some((t, fused)), entry, device)?;
    let smem = t.smem_bytes(fused);
    let out = Tensor::empty([s.m, s.n], (x.kind(), x.device()));
    let grid = ((s.n / t.bn as i64) as u32, (s.m as u32).div_ceil(t.bm), 1);
    ensure!(grid.1 <= 65535, "too many tokens ({}) for one launch of tile {t:?}", s.m);
    let cfg = LaunchConfig { grid, block: (t.threads(), 1, 1), shared_mem_bytes: smem };
    let dims = [KernelArg::I32(s.m as i32), KernelArg::I32(s.n as i32), KernelArg::I32(s.k as i32), KernelArg::I32(s.group as i32)];
    if s.op.reduces_over_groups() {
        let mut args = vec![KernelArg::tensor(&x)?, KernelArg::tensor(&w)?, KernelArg::tensor(layout.mask())?, KernelArg::tensor(&out)?];
        args.extend(dims);
        unsafe { kernel.launch(cfg, &args)? };
    } else {
        let (perm, count) = layout.lists()?;
        let w_up = w2.as_ref().unwrap_or(&w);
        let mut args = vec![
            KernelArg::tensor(&x)?,
            KernelArg::tensor(&w)?,
            KernelArg::tensor(w_up)?,
            KernelArg::tensor(perm)?,
            KernelArg::tensor(count)?,
            KernelArg::tensor(&out)?,
        ];
        args.extend(dims);
        unsafe { kernel.launch(cfg, &args)? };
    }
    Ok(out)
}

/// The autotuner's record for this shape's bucket, measuring it on these inputs on first use:
/// dense+mask, every feasible tile and (on sm_90) the wgmma kernel (at 2-128 tokens: dense+mask
/// and the small-M kernels), each warmed up once, then
/// timed in interleaved rounds (median of 3, of 7 where the fastest routed kernel is a near tie
/// with dense), each run on a cold L2 and after a device spin so that the events time device
/// work alone, the routed kernels with the building of their token lists (see
/// [`TuneMode`] for the A/B modes); the small-M candidates then 3 more rounds on a warm L2
/// ([`dispatch::WarmTimes`]). It synchronises the device, so run a first (un-captured)
/// call before capturing a CUDA graph.
fn tuned(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tuned> {
    let device = match x.device() {
        Device::Cuda(d) => d,
        _ => bail!("autotuning needs a CUDA device"),
    };
    let key = TuneKey::new(s, layout.sparsity(), x.kind() == Kind::Half, device);
    if let Some(t) = dispatch::tune_cache().lock().unwrap().get(&key) {
        return Ok(t.clone());
    }
    let t = autotune(s, x, w, w2, layout).with_context(|| format!("autotuning {s:?}"))?;
    if dispatch::tune_log().map_err(anyhow::Error::msg)? {
        let us = |ms: Option<f64>| ms.map_or("-".to_string(), |v| format!("{:.1}", v * 1e3));
        let tiles: Vec<String> = t.tiles.iter().map(|(c, ms)| format!("{}x{}x{} {:.1}", c.bm, c.bn, c.bk, ms * 1e3)).collect();
        eprintln!(
            "autotune {:?} M={} N={} K={} G={} sparsity {:.3}: dense+mask {:.1} us, tiles [{}], wgmma {}, mma.sync small-M {}, wgmma small-M {}{} -> {:?}",
            s.op,
            s.m,
            s.n,
            s.k,
            s.group,
            layout.sparsity(),
            t.dense_ms * 1e3,
            tiles.join(", "),
            us(t.wgmma_ms),
            us(t.skinny_ms),
            us(t.skinny_wg_ms),
            t.warm.map_or(String::new(), |w| format!("; warm: dense+mask {:.1} us, mma.sync small-M {}, wgmma small-M {}", w.dense_ms * 1e3, us(w.skinny_ms), us(w.skinny_wg_ms))),
            dispatch::choose(s, layout.sparsity(), Some(&t))
        );
    }
    dispatch::tune_cache().lock().unwrap().insert(key, t.clone());
    Ok(t)
}

fn autotune(s: &GemmShape, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout) -> Result<Tuned> {
    let device = match x.device() {
        Device::Cuda(d) => d,
        _ => bail!("autotuning needs a CUDA device"),
    };
    // Tiles whose pipeline does not fit the device's shared memory (the 3-stage 64-deep ones
    // need 108 KiB; 99 KiB on compute capability 8.6 / 8.9) are not candidates there.
    // At 2-16 tokens (see `dispatch::small_m_tunable`) only the small-M kernel is measured
    // against dense + mask: the policy never takes the tiles or the wgmma kernel below
    // LARGE_M_MIN (`WIDE_ROUTED=tiled` still measures the tiles there).
    // From 2 to 128 tokens the transposed wgmma kernel is measured too (sm_90, unless
    // `WIDE_SKINNY_WG=0`).
    let wg_small = s.m < dispatch::LARGE_M_MIN && skinny_wg_usable(s, x) && dispatch::skinny_wg_enabled().map_err(anyhow::Error::msg)? && dispatch::env_override().is_none();
    let skinny_small = s.m < dispatch::LARGE_M_MIN && dispatch::skinny_feasible(s) && dispatch::env_override().is_none();
    let small = skinny_small || wg_small;
    let smem_limit = crate::cuda::max_shared_per_block_optin(device)? as u32;
    let tiles: Vec<TileConfig> = if small {
        Vec::new()
    } else {
        dispatch::feasible_tiles(s).into_iter().filter(|t| t.smem_bytes(s.op == RoutedOp::MnSwiglu) <= smem_limit).collect()
    };
    let mut paths = vec![GemmPath::DenseMasked];
    paths.extend(tiles.iter().map(|&t| GemmPath::Tiled(t)));
    if small {
        if skinny_small {
            paths.push(GemmPath::GemvMma);
        }
        if wg_small {
            paths.push(GemmPath::SkinnyWg);
        }
    } else if wgmma_usable(s, x) {
        paths.push(GemmPath::Wgmma);
    }
    // One warm-up each: compilation, module loading and the layout's cached lists stay out of
    // the timings.
    for &p in &paths {
        let _ = run_path(s, x, w, w2, layout, p)?;
    }
    let mode = dispatch::tune_mode().map_err(anyhow::Error::msg)?;
    dispatch::large_m_margin().map_err(anyhow::Error::msg)?;
    // Cold: read before each run, twice the L2's size (clean lines, as a layer's weight reads
    // leave them), so every candidate starts from DRAM as in a prefill's layer.
    let flush = match mode {
        TuneMode::Cold => Some(super::l2_flush_buffer(device, 0)?),
        _ => None,
    };
    let timer = GpuTimer::new(device)?;
    let time_in = |i: usize, cold: bool| -> Result<f64> {
        if let (Some(f), true) = (&flush, cold) {
            let _ = f.sum(Kind::Float);
        }
        if !cold {
            // Warm: the candidate's own operands in L2 (one untimed run of it first), not what
            // the candidate before it left there.
            let _ = run_path(s, x, w, w2, layout, paths[i])?;
        }
        if mode != TuneMode::Plain {
            super::gpu_spin(device, dispatch::TUNE_SPIN_US)?;
        }
        // Cold: the run builds its own token lists inside the timing (a fresh decision's cost).
        let fresh = (mode == TuneMode::Cold).then(|| layout.unbuilt());
        timer.start()?;
        let _ = run_path(s, x, w, w2, fresh.as_ref().unwrap_or(layout), paths[i])?;
        timer.stop_ms()
    };
    let time = |i: usize| time_in(i, true);
    let mut samples = vec![Vec::new(); paths.len()];
    let of = |samples: &[Vec<f64>], p: GemmPath| paths.iter().position(|&q| q == p).map(|i| dispatch::median(&samples[i]));
    let record = |samples: &[Vec<f64>]| Tuned {
        dense_ms: dispatch::median(&samples[0]),
        tiles: tiles.iter().zip(&samples[1..]).map(|(&t, v)| (t, dispatch::median(v))).collect(),
        wgmma_ms: of(samples, GemmPath::Wgmma),
        skinny_ms: of(samples, GemmPath::GemvMma),
        skinny_wg_ms: of(samples, GemmPath::SkinnyWg),
        warm: None,
    };
    if mode == TuneMode::Plain {
        // The earlier autotuner, for A/B runs: each candidate's runs back to back, no spin.
        for (i, v) in samples.iter_mut().enumerate() {
            for _ in 0..dispatch::TUNE_ROUNDS {
                v.push(time(i)?);
            }
        }
        return Ok(record(&samples));
    }
    dispatch::time_interleaved(&mut samples, dispatch::TUNE_ROUNDS, &time)?;
    let mut t = record(&samples);
    if dispatch::near_tie(&t) {
        dispatch::time_interleaved(&mut samples, dispatch::TUNE_MAX_ROUNDS - dispatch::TUNE_ROUNDS, &time)?;
        t = record(&samples);
    }
    if small && mode == TuneMode::Cold {
        // The small-M candidates again with the operands in L2: the choice takes the kernel whose
        // worse ratio to dense + mask over the two states is lowest (`dispatch::WarmTimes`).
        let mut warm = vec![Vec::new(); paths.len()];
        dispatch::time_interleaved(&mut warm, dispatch::TUNE_ROUNDS, |i| time_in(i, false))?;
        t.warm = Some(dispatch::WarmTimes {
            dense_ms: dispatch::median(&warm[0]),
            skinny_ms: of(&warm, GemmPath::GemvMma),
            skinny_wg_ms: of(&warm, GemmPath::SkinnyWg),
        });
    }
    Ok(t)
}

/// The autotuner's record for a routed projection on these inputs (measured on first use per
/// M bucket and sparsity eighth, then cached). CUDA bf16/f16 only.
pub fn tuned_for(op: RoutedOp, x: &Tensor, w: &Tensor, w2: Option<&Tensor>, layout: &RouteLayout, group: i64) -> Result<Tuned> {
    let s = shape_of(op, x, w, w2, layout, group)?;
    tuned(&s, x, w, w2, layout)
}

/// Records the autotuner has measured so far (for reports).
pub fn tuned_records() -> Vec<(TuneKey, Tuned)> {
    dispatch::tune_cache().lock().unwrap().iter().map(|(k, v)| (*k, v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::super::layout::route_layout;
    use super::*;

    #[test]
    fn stacked_weights_are_found_only_in_one_storage() {
        let cat = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let (w, u) = (cat.narrow(0, 0, 3), cat.narrow(0, 3, 3));
        let s = stacked(&w, &u).expect("adjacent views of one tensor");
        assert_eq!(s.size(), [6, 4]);
        assert!(s.equal(&cat));
        assert!(stacked(&u, &w).is_none(), "u before w");
        assert!(stacked(&w, &cat.narrow(0, 2, 3)).is_none(), "overlapping");
        assert!(stacked(&w, &u.copy()).is_none(), "separate storage");
        let (a, b) = (Tensor::randn([3, 4], (Kind::Float, Device::Cpu)), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)));
        assert!(stacked(&a, &b).is_none());
    }

    #[test]
    fn mask_kernel_batches_where_a_thread_has_many_rows() {
        // 132 multiprocessors: up (14 column blocks) has 150 row slots, Q (4) 528.
        assert_eq!(mask_pass_with(1024, 528, None, None), MaskPass::Rows4, "Q, 1024 tokens: 2 rows a thread");
        assert_eq!(mask_pass_with(1024, 150, None, None), MaskPass::Rows4, "up, 1024 tokens: 7 rows");
        assert_eq!(mask_pass_with(4096, 528, None, None), MaskPass::Rows4, "Q, 4096 tokens: 8 rows");
        assert_eq!(mask_pass_with(2400, 150, None, None), MaskPass::Batched(16), "16 rows: the first batched");
        assert_eq!(mask_pass_with(2250, 150, None, None), MaskPass::Rows4, "15 rows");
        assert_eq!(mask_pass_with(4096, 150, None, None), MaskPass::Batched(28), "up, 4096 tokens: the whole share");
        assert_eq!(mask_pass_with(16384, 150, None, None), MaskPass::Batched(MASK_ROWS_MAX), "at most the kernel's batch");
        assert_eq!(mask_pass_with(1, 1, None, None), MaskPass::Rows4);
        // The A/B knobs.
        assert_eq!(mask_pass_with(16384, 150, Some(false), None), MaskPass::Rows4);
        assert_eq!(mask_pass_with(128, 128, Some(true), None), MaskPass::Batched(1));
        assert_eq!(mask_pass_with(16384, 150, None, Some(4)), MaskPass::Batched(4));
        // The kernel's bound, as the NVRTC source declares it.
        let src = include_str!("routed.cu");
        assert!(src.contains(&format!("#define MASK_RB_MAX {MASK_ROWS_MAX}")));
    }

    fn rand_mask(m: i64, ng: i64, p_active: f64) -> Tensor {
        Tensor::rand([m, ng], (Kind::Float, Device::Cpu)).lt(p_active)
    }

    #[test]
    fn cpu_ops_match_an_explicit_loop() {
        tch::manual_seed(1);
        let (m, k, n, g) = (5, 16, 12, 4);
        let x = Tensor::randn([m, k], (Kind::Double, Device::Cpu));
        let w = Tensor::randn([n, k], (Kind::Double, Device::Cpu));
        let mask = rand_mask(m, n / g, 0.5);
        let l = route_layout(&mask).unwrap();
        let y = gemm_mn(&x, &w, &l, g).unwrap();
        let xv: Vec<f64> = Vec::try_from(x.view([-1])).unwrap();
        let wv: Vec<f64> = Vec::try_from(w.view([-1])).unwrap();
        let mv: Vec<u8> = Vec::try_from(mask.to_kind(Kind::Uint8).view([-1])).unwrap();
        let yv: Vec<f64> = Vec::try_from(y.view([-1])).unwrap();
        for t in 0..m as usize {
            for o in 0..n as usize {
                let on = mv[t * (n / g) as usize + o / g as usize] != 0;
                let d: f64 = (0..k as usize).map(|i| xv[t * k as usize + i] * wv[o * k as usize + i]).sum();
                let want = if on { d } else { 0.0 };
                assert!((yv[t * n as usize + o] - want).abs() < 1e-9);
                if !on {
                    assert_eq!(yv[t * n as usize + o].to_bits(), 0.0f64.to_bits(), "skipped entries are exactly +0");
                }
            }
        }
        // gemm_k: groups over the 16 inputs.
        let w2 = Tensor::randn([n, k], (Kind::Double, Device::Cpu));
        let mk = rand_mask(m, k / g, 0.5);
        let lk = route_layout(&mk).unwrap();
        let yk: Vec<f64> = Vec::try_from(gemm_k(&x, &w2, &lk, g).unwrap().view([-1])).unwrap();
        let w2v: Vec<f64> = Vec::try_from(w2.view([-1])).unwrap();
        let mkv: Vec<u8> = Vec::try_from(mk.to_kind(Kind::Uint8).view([-1])).unwrap();
        for t in 0..m as usize {
            for o in 0..n as usize {
                let d: f64 = (0..k as usize)
                    .filter(|i| mkv[t * (k / g) as usize + i / g as usize] != 0)
                    .map(|i| xv[t * k as usize + i] * w2v[o * k as usize + i])
                    .sum();
                assert!((yk[t * n as usize + o] - d).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn gemv_rows_per_warp_keeps_enough_warps() {
        // Llama-3.1-8B: 14336 rows -> 4 a warp (3584 warps); 4096 rows -> 2 (2048 warps).
        assert_eq!(gemv_rows_per_warp(1, 14336), 4);
        assert_eq!(gemv_rows_per_warp(1, 4096), 2);
        assert_eq!(gemv_rows_per_warp(16, 14336), 1, "16 tokens x 1 row = 16 accumulators");
        assert_eq!(gemv_rows_per_warp(4, 1 << 20), 4);
        assert_eq!(gemv_rows_per_warp(1, 1 << 20), 8);
        assert_eq!(gemv_rows_per_warp(1, 100), 1);
        // gemm_k: 4096 rows -> 8 a block of 8 warps (512 blocks); 16 tokens -> 1.
        assert_eq!(gemv_k_rows_per_block(1, 4096), 8);
        assert_eq!(gemv_k_rows_per_block(16, 4096), 1);
        assert_eq!(gemv_k_rows_per_block(1, 1024), 2);
        for (mm, n) in [(1, 12288), (2, 65536), (8, 8192)] {
            let r = gemv_rows_per_warp(mm, n);
            assert!(n % r == 0 && r * mm <= 16 && r <= 8);
        }
    }

    #[test]
    fn one_token_gemv_form_follows_the_mask_and_the_knobs() {
        let shape = |op, m, group| GemmShape { op, m, n: 14336, k: 4096, group };
        let up = shape(RoutedOp::Mn, 1, 128);
        // Routed groups: persistent; a dense projection (no routed group): split.
        assert_eq!(gemv_form_for(&up, 112, None, None), GemvForm::Persistent);
        assert_eq!(gemv_form_for(&shape(RoutedOp::MnSwiglu, 1, 128), 8, None, None), GemvForm::Persistent);
        assert_eq!(gemv_form_for(&up, 0, None, None), GemvForm::Split);
        // Forced off or on.
        assert_eq!(gemv_form_for(&up, 112, Some(false), None), GemvForm::Rows);
        assert_eq!(gemv_form_for(&up, 112, Some(false), Some(true)), GemvForm::Split);
        assert_eq!(gemv_form_for(&up, 0, Some(true), None), GemvForm::Persistent);
        assert_eq!(gemv_form_for(&up, 0, None, Some(false)), GemvForm::Rows);
        // Shapes the split forms cannot take: several tokens, gemm_k, groups not of 8 rows, a
        // used-group list over 32 KiB of shared memory.
        assert_eq!(gemv_form_for(&shape(RoutedOp::Mn, 2, 128), 112, None, None), GemvForm::Rows);
        assert_eq!(gemv_form_for(&shape(RoutedOp::K, 1, 128), 112, Some(true), Some(true)), GemvForm::Rows);
        assert_eq!(gemv_form_for(&shape(RoutedOp::Mn, 1, 4), 3584, None, None), GemvForm::Rows);
        assert_eq!(gemv_form_for(&shape(RoutedOp::Mn, 1, 8), 8193, None, None), GemvForm::Rows);
        assert_eq!(gemv_form_for(&shape(RoutedOp::Mn, 1, 8), 8192, None, None), GemvForm::Persistent);
    }

    #[test]
    fn persistent_gemv_blocks_follow_the_rows_and_the_knobs() {
        // Q|K|V (6144 rows), Q alone (4096): 2; up and gate+up (14336): 5, but 2 in a decode
        // step (early mask).
        assert_eq!(gemv_ps_blocks_for(6144, false, None, None), 2);
        assert_eq!(gemv_ps_blocks_for(4096, false, None, None), 2);
        assert_eq!(gemv_ps_blocks_for(14336, false, None, None), 5);
        assert_eq!(gemv_ps_blocks_for(14336, true, None, None), 2);
        assert_eq!(gemv_ps_blocks_for(GEMV_PS_WIDE_ROWS - 1, false, None, None), 2);
        assert_eq!(gemv_ps_blocks_for(GEMV_PS_WIDE_ROWS, false, None, None), 5);
        // WIDE_GEMV_PS_BPS_WIDE moves only the wide ones without an early mask; WIDE_GEMV_PS_BPS
        // forces every one.
        assert_eq!(gemv_ps_blocks_for(14336, false, None, Some(4)), 4);
        assert_eq!(gemv_ps_blocks_for(14336, true, None, Some(4)), 2);
        assert_eq!(gemv_ps_blocks_for(6144, false, None, Some(4)), 2);
        assert_eq!(gemv_ps_blocks_for(6144, false, Some(3), Some(4)), 3);
        assert_eq!(gemv_ps_blocks_for(14336, true, Some(3), Some(4)), 3);
    }

    #[test]
    fn swiglu_reference_is_silu_gate_times_up() {
        let (m, k, n, g) = (3, 8, 8, 2);
        let x = Tensor::randn([m, k], (Kind::Double, Device::Cpu));
        let (wg, wu) = (Tensor::randn([n, k], (Kind::Double, Device::Cpu)), Tensor::randn([n, k], (Kind::Double, Device::Cpu)));
        let mask = Tensor::ones([m, n / g], (Kind::Bool, Device::Cpu));
        let l = route_layout(&mask).unwrap();
        let y = gemm_mn_swiglu(&x, &wg, &wu, &l, g).unwrap();
        let want = x.linear::<&Tensor>(&wg, None).silu() * x.linear::<&Tensor>(&wu, None);
        assert!((y - want).abs().max().double_value(&[]) < 1e-12);
    }

    #[test]
    fn bad_shapes_are_clear_errors() {
        let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([12, 16], (Kind::Float, Device::Cpu));
        let l = route_layout(&rand_mask(4, 3, 0.5)).unwrap();
        let e = gemm_mn(&x, &w, &l, 5).unwrap_err().to_string();
        assert!(e.contains("does not divide"), "{e}");
        let e = gemm_k(&x, &w, &l, 4).unwrap_err().to_string();
        assert!(e.contains("layout"), "{e}");
        let e = gemm_mn(&x, &Tensor::randn([12, 8], (Kind::Float, Device::Cpu)), &l, 4).unwrap_err().to_string();
        assert!(e.contains("input features"), "{e}");
        let e = gemm_mn(&x.to_kind(Kind::Double), &w, &l, 4).unwrap_err().to_string();
        assert!(e.contains("Double"), "{e}");
    }
}
