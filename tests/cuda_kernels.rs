//! GPU tests of the routed kernels (feature `cuda-tests`; run on the GPU machine through the
//! device tool): the routing layout, gemm_mn (plain and fused SwiGLU) and gemm_k on every
//! path (GEMV, each mma.sync tile, the sm_90a wgmma kernel on Hopper, dispatch), against the
//! tch reference computed in f32.
//!
//! Outputs are poisoned: before each call a NaN-filled block of the output's size is freed
//! back to libtorch's caching allocator, which hands that block to the op's output, so an
//! entry the kernel fails to write reads NaN.
#![cfg(feature = "cuda-tests")]

mod common;

use tch::{Device, Kind, Tensor};
use wide_kernels::ops::wgmma::WgmmaConfig;
use wide_kernels::ops::dispatch::{feasible_tiles, skinny_feasible, skinny_wg_feasible, wgmma_feasible, GemmPath, GemmShape, RoutedOp, TILES};
use wide_kernels::ops::skinny_wg::SkinnyWgConfig;
use wide_kernels::ops::gemm::{gemm_k_reference, gemm_mn_reference, routed_gemm};
use wide_kernels::ops::layout::{route_layout, route_layout_reference};
use wide_kernels::ops::attention::PREFILL_TILES;
use wide_kernels::ops::fused;
use wide_kernels::{CudaGraph, DecodeMerge};

fn gpu() -> Device {
    common::exclusive_gpu()
}

/// The GPU (as `gpu`), or None with a note where the wgmma kernel cannot run (compute
/// capability other than 9.0): the Hopper-only tests return then.
fn hopper_gpu() -> Option<Device> {
    let dev = gpu();
    if wide_kernels::ops::wgmma::supported(0) {
        Some(dev)
    } else {
        eprintln!("skipped: the wgmma kernel needs a compute capability 9.0 GPU");
        None
    }
}

fn poison(m: i64, n: i64, kind: Kind) {
    let p = Tensor::full([m, n], f64::NAN, (kind, gpu()));
    drop(p);
}

/// Random mask with `p_active` of entries on; 1.0 and 0.0 give all-active / all-inactive.
fn mask(m: i64, ng: i64, p_active: f64) -> Tensor {
    Tensor::rand([m, ng], (Kind::Float, gpu())).lt(p_active)
}

/// Checks y against the f32 reference: no NaN, skipped entries exactly 0, relative error.
fn check(y: &Tensor, r: &Tensor, off: Option<&Tensor>, what: &str) {
    let yf = y.to_kind(Kind::Float);
    let nan = yf.isnan().sum(Kind::Int64).int64_value(&[]);
    assert_eq!(nan, 0, "{what}: {nan} NaN outputs (unwritten or wrong)");
    if let Some(off) = off {
        let leak = yf.masked_fill(&off.logical_not(), 0.0).abs().max().double_value(&[]);
        assert_eq!(leak, 0.0, "{what}: skipped entries must be exactly 0");
    }
    let rn = r.norm().double_value(&[]);
    let err = (&yf - r).norm().double_value(&[]);
    if rn == 0.0 {
        assert_eq!(err, 0.0, "{what}: reference is all zero, output is not");
    } else {
        let rel = err / rn;
        assert!(rel < 1e-2, "{what}: relative error {rel:.3e}");
    }
}

fn paths_for(s: &GemmShape) -> Vec<GemmPath> {
    let mut p = vec![GemmPath::DenseMasked];
    if s.m <= 16 {
        p.push(GemmPath::Gemv);
    }
    if skinny_feasible(s) {
        p.push(GemmPath::GemvMma);
    }
    p.extend(feasible_tiles(s).into_iter().map(GemmPath::Tiled));
    if wgmma_feasible(s) && wide_kernels::ops::wgmma::supported(0) {
        p.push(GemmPath::Wgmma);
    }
    if skinny_wg_feasible(s) && wide_kernels::ops::wgmma::supported(0) {
        p.push(GemmPath::SkinnyWg);
    }
    p
}

/// A gemm_mn case: x `[m, k]`, w and w_up `[n, k]`, a mask with `p_active` of its groups on, its
/// layout, the f32 reference and the mask of skipped outputs.
struct MnCase {
    x: Tensor,
    w: Tensor,
    w2: Tensor,
    msk: Tensor,
    l: wide_kernels::RouteLayout,
    r: Tensor,
    off: Tensor,
}

fn mn_case(kind: Kind, m: i64, n: i64, k: i64, g: i64, p_active: f64, fused: bool) -> MnCase {
    mn_case_masked(kind, mask(m, n / g, p_active), n, k, g, fused)
}

/// Random inputs, the layout and the f32 reference of a gemm_mn over a given `[M, N / G]` mask.
fn mn_case_masked(kind: Kind, msk: Tensor, n: i64, k: i64, g: i64, fused: bool) -> MnCase {
    let dev = gpu();
    let m = msk.size()[0];
    let x = Tensor::randn([m, k], (kind, dev));
    let w = Tensor::randn([n, k], (kind, dev)) * 0.05;
    let w2 = Tensor::randn([n, k], (kind, dev)) * 0.05;
    let l = route_layout(&msk).unwrap();
    let up = if fused { Some(w2.to_kind(Kind::Float)) } else { None };
    let r = gemm_mn_reference(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), up.as_ref(), &msk, g);
    let off = msk.logical_not().unsqueeze(-1).expand([m, n / g, g], false).reshape([m, n]);
    MnCase { x, w, w2, msk, l, r, off }
}

fn run_mn_case(kind: Kind, m: i64, n: i64, k: i64, g: i64, p_active: f64, fused: bool) {
    let MnCase { x, w, w2, msk, l, r, off } = mn_case(kind, m, n, k, g, p_active, fused);
    let op = if fused { RoutedOp::MnSwiglu } else { RoutedOp::Mn };
    let up = if fused { Some(&w2) } else { None };
    let s = GemmShape { op, m, n, k, group: g };
    for p in paths_for(&s) {
        poison(m, n, kind);
        let (y, _) = routed_gemm(op, &x, &w, up, &l, g, Some(p)).unwrap();
        check(&y, &r, Some(&off), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} {}", p.label()));
    }
    if fused {
        // Gate and up as views of one stacked weight (the engine's layout; dense+mask then runs
        // one GEMM over both and the SwiGLU kernel).
        let stacked = Tensor::cat(&[&w, &w2], 0);
        let (ws, us) = (stacked.narrow(0, 0, n), stacked.narrow(0, n, n));
        for p in paths_for(&s) {
            poison(m, n, kind);
            let (y, _) = routed_gemm(op, &x, &ws, Some(&us), &l, g, Some(p)).unwrap();
            check(&y, &r, Some(&off), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} {}, stacked weights", p.label()));
        }
    }
    if m <= 16 {
        // Trailing groups declared always on (the fused Q|K|V's K|V groups; all of them for a
        // dense projection): their warps load weights before the wait and never read the mask.
        let ng = n / g;
        for fix in [(ng / 4).max(1), ng] {
            let mf = msk.copy();
            let _ = mf.narrow(1, ng - fix, fix).fill_(1);
            let rf = gemm_mn_reference(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), up.map(|u| u.to_kind(Kind::Float)).as_ref(), &mf, g);
            let offf = mf.logical_not().unsqueeze(-1).expand([m, ng, g], false).reshape([m, n]);
            let mut small = vec![GemmPath::Gemv];
            if skinny_feasible(&s) {
                small.push(GemmPath::GemvMma);
            }
            // Early: the GEMV reads the mask and loads weights before its wait (the mask was
            // written launches before this one).
            for early in [false, true] {
                let lf = route_layout(&mf).unwrap().with_always_on_from(ng - fix).unwrap();
                let lf = if early { lf.with_early_mask() } else { lf };
                for &p in &small {
                    poison(m, n, kind);
                    let (y, _) = routed_gemm(op, &x, &w, up, &lf, g, Some(p)).unwrap();
                    check(&y, &rf, Some(&offf), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} {}, groups {} on, early {early}", p.label(), ng - fix));
                }
            }
        }
        let le = route_layout(&msk).unwrap().with_early_mask();
        poison(m, n, kind);
        let (y, _) = routed_gemm(op, &x, &w, up, &le, g, Some(GemmPath::Gemv)).unwrap();
        check(&y, &r, Some(&off), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} gemv, early mask"));
    }
}

/// The next router folded into a one-token gemm_k GEMV: the projection's output bit for bit the
/// plain GEMV's; the router's hidden (the kernel's partial sums) the f64 value of
/// `w1 xres + (w1 w) x`; the decision bit for bit the gate kernel's on that hidden, and the
/// unfused router's on `xres + out` wherever its margin exceeds the rounding; the arrival
/// counter back at zero, so a second call decides the same.
fn run_fold_case(kind: Kind, n: i64, k: i64, g: i64, h: i64, rank: i64, rng: i64, extra: i64, p_active: f64) {
    use wide_kernels::ops::fused::{router_gate_from_hidden, router_gate_reference, RouterWeights};
    use wide_kernels::ops::gemm::{gemm_k_fold_router, RouterFold};
    let dev = gpu();
    let ng = k / g;
    let msk = mask(1, ng, p_active);
    let x = (Tensor::randn([1, k], (kind, dev))).view([1, ng, g]).masked_fill(&msk.logical_not().unsqueeze(-1), 0.0).view([1, k]);
    let w = Tensor::randn([n, k], (kind, dev)) * (1.0 / (k as f64).sqrt());
    let xres = Tensor::randn([1, h], (kind, dev));
    let w1 = Tensor::randn([rank, h], (kind, dev)) * (1.0 / (h as f64).sqrt());
    let b1 = Tensor::randn([rank], (kind, dev)) * 0.1;
    let w2 = Tensor::randn([2 * rng, rank], (kind, dev)) * (1.0 / (rank as f64).sqrt());
    let b2 = Tensor::randn([2 * rng], (kind, dev)) * 0.1;
    // The fold of the router over the projection w (h = n here: the output adds the residual).
    let fold = w1.matmul(&w);
    let scratch = Tensor::zeros([rank + 1], (Kind::Float, dev));
    let offset = 0.1;
    let f = RouterFold { xres: &xres, w1: &w1, b1: &b1, fold: &fold, w2: &w2, b2: &b2, offset, extra, scratch: &scratch };
    let what = format!("fold {kind:?} N={n} K={k} G={g} rank={rank} groups={rng}+{extra} active={p_active}");
    for settled in [false, true] {
        let l = route_layout(&msk).unwrap();
        let l = if settled { l.with_settled_mask() } else { l };
        poison(1, n, kind);
        let _ = Tensor::full([1, rng + extra], 7, (Kind::Uint8, dev));
        let (y, fmask, fext) = gemm_k_fold_router(&x, &w, &l, g, &f).unwrap();
        for (t, which) in [(Some(&fmask), "mask"), (fext.as_ref(), "extended mask")] {
            if let Some(t) = t {
                assert!(t.view_dtype(Kind::Uint8).max().int64_value(&[]) <= 1, "{what}: {which} has unwritten bytes");
            }
        }
        let (plain, _) = routed_gemm(RoutedOp::KPremasked, &x, &w, None, &l, g, Some(GemmPath::Gemv)).unwrap();
        assert!(y.equal(&plain), "{what}: output differs from the plain GEMV's");
        let hp = scratch.narrow(0, 0, rank).to_kind(Kind::Double);
        let d = |t: &Tensor| t.to_kind(Kind::Double);
        let want = d(&w1).matmul(&d(&xres).view([h])) + d(&fold).matmul(&d(&x).view([k]));
        let scale = d(&w1).abs().matmul(&d(&xres).abs().view([h])) + d(&fold).abs().matmul(&d(&x).abs().view([k]));
        let bad = ((&hp - &want).abs() - &scale * 1e-5).gt(0.0).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(bad, 0, "{what}: router hidden off (kernel {hp}, f64 {want})");
        assert_eq!(scratch.get(rank).double_value(&[]), 0.0, "{what}: arrival counter not reset");
        // The gate kernel on the same hidden, rounded as the fold rounds it.
        let h1 = (scratch.narrow(0, 0, rank).view([1, rank]) + b1.to_kind(Kind::Float)).to_kind(kind);
        let rw = RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
        let (gm, ge) = router_gate_from_hidden(&h1, &rw, offset, extra).unwrap();
        assert!(fmask.equal(&gm), "{what}: decision differs from the gate kernel's on the same hidden");
        assert_eq!(fext.is_some(), extra > 0, "{what}: extended mask iff extra groups");
        if let (Some(a), Some(b)) = (&fext, &ge) {
            assert!(a.equal(b), "{what}: extended mask differs");
        }
        // Against the unfused router on the residual the projection's output adds to.
        let xn = (&xres.to_kind(Kind::Float) + y.to_kind(Kind::Float)).to_kind(kind);
        let unfused = router_gate_reference(&xn, &rw, offset);
        let logits = d(&xn).matmul(&d(&w1).tr()).g_add(&d(&b1)).matmul(&d(&w2).tr()).g_add(&d(&b2)).view([rng, 2]);
        let margin = (logits.select(1, 1) - logits.select(1, 0) + offset).abs();
        let sure = margin.gt(0.05);
        let differ = fmask.view([rng]).ne_tensor(&unfused.view([rng])).logical_and(&sure).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(differ, 0, "{what}: {differ} decisions with margin > 0.05 differ from the unfused router's");
    }
}

#[test]
fn gemm_k_fold_router_matches_unfused_router() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(21);
    for kind in [Kind::BFloat16, Kind::Half] {
        // Down-like (FFN width in, FFN router groups out), O-like (attention router with the
        // Q|K|V extension), a rank whose blocks do not fill a power of two, few rows.
        run_fold_case(kind, 512, 2048, 64, 512, 32, 28, 0, 0.5);
        run_fold_case(kind, 512, 512, 64, 512, 32, 8, 4, 0.5);
        run_fold_case(kind, 1024, 1024, 128, 1024, 6, 5, 2, 0.7);
        run_fold_case(kind, 64, 256, 32, 64, 32, 3, 0, 1.0);
        run_fold_case(kind, 512, 1024, 64, 512, 32, 16, 0, 0.0);
    }
}

fn run_k_case(kind: Kind, m: i64, n: i64, k: i64, g: i64, p_active: f64) {
    let dev = gpu();
    let x = Tensor::randn([m, k], (kind, dev));
    let w = Tensor::randn([n, k], (kind, dev)) * 0.02;
    let msk = mask(m, k / g, p_active);
    let l = route_layout(&msk).unwrap();
    let r = gemm_k_reference(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), &msk, g);
    // Tokens that run no group at all must get exactly 0.
    let idle = msk.any_dim(1, false).logical_not().unsqueeze(-1).expand([m, n], false);
    // KPremasked takes an input already zero at skipped slices (as routed SwiGLU produces).
    let xpre = x.view([m, k / g, g]).masked_fill(&msk.logical_not().unsqueeze(-1), 0.0).view([m, k]);
    for (op, xin) in [(RoutedOp::K, &x), (RoutedOp::KPremasked, &xpre)] {
        let s = GemmShape { op, m, n, k, group: g };
        for p in paths_for(&s) {
            poison(m, n, kind);
            let (y, _) = routed_gemm(op, xin, &w, None, &l, g, Some(p)).unwrap();
            check(&y, &r, Some(&idle), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} {}", p.label()));
            if p == GemmPath::Gemv {
                // A settled layout: the GEMV lists its groups and loads its first weights before
                // it waits for the launch before it (the mask was written launches ago: the
                // poison fills and x come after it).
                let ls = route_layout(&msk).unwrap().with_settled_mask();
                poison(m, n, kind);
                let (y, _) = routed_gemm(op, xin, &w, None, &ls, g, Some(p)).unwrap();
                check(&y, &r, Some(&idle), &format!("{op:?} {kind:?} M={m} N={n} K={k} G={g} active={p_active} gemv, settled mask"));
            }
        }
    }
}

/// The dispatch itself (no path given) at 16 tokens of a wide (N >= 8192) output-width product, where the
/// static rule leaves it to dense + mask: the autotuner measures the small-M kernel against it,
/// records both times, and whichever it takes matches the reference with exact zeros.
#[test]
fn dispatch_measures_small_m_kernel_against_dense() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(29);
    // On by default; set here so that a caller's WIDE_TUNE_SMALL_M=0 does not skip the test,
    // and put back as it was at the end.
    let before = std::env::var_os("WIDE_TUNE_SMALL_M");
    std::env::set_var("WIDE_TUNE_SMALL_M", "1");
    let (m, n, k, g) = (16, 8192, 512, 128);
    for kind in [Kind::BFloat16, Kind::Half] {
        let c = mn_case(kind, m, n, k, g, 0.5, false);
        let s = GemmShape { op: RoutedOp::Mn, m, n, k, group: g };
        assert!(wide_kernels::ops::dispatch::small_m_tunable(&s, c.l.sparsity()).unwrap(), "{s:?} at {} should be measured", c.l.sparsity());
        poison(m, n, kind);
        let (y, path) = routed_gemm(RoutedOp::Mn, &c.x, &c.w, None, &c.l, g, None).unwrap();
        assert!(matches!(path, GemmPath::GemvMma | GemmPath::SkinnyWg | GemmPath::DenseMasked), "{path:?}");
        check(&y, &c.r, Some(&c.off), &format!("dispatch {kind:?} M={m} N={n} K={k} G={g} ({})", path.label()));
        let recs = wide_kernels::ops::gemm::tuned_records();
        let rec = recs.iter().find(|(key, _)| key.n == n && key.k == k && key.m_bucket == 16 && key.f16 == (kind == Kind::Half));
        let (_, t) = rec.unwrap_or_else(|| panic!("no autotune record for {s:?}: {recs:?}"));
        let hopper = wide_kernels::ops::wgmma::supported(0);
        assert!(t.skinny_ms.is_some_and(|ms| ms > 0.0) && t.dense_ms > 0.0 && t.tiles.is_empty() && t.wgmma_ms.is_none(), "{t:?}");
        assert_eq!(t.skinny_wg_ms.is_some_and(|ms| ms > 0.0), hopper, "{t:?}");
        // The same candidates timed again on a warm L2.
        let w = t.warm.unwrap_or_else(|| panic!("no warm timings in {t:?}"));
        assert!(w.dense_ms > 0.0 && w.skinny_ms.is_some_and(|ms| ms > 0.0) && w.skinny_wg_ms.is_some() == hopper, "{t:?}");
        eprintln!("{kind:?} M={m}: dense + mask {:.4} ms, small-M kernel {:.4} ms, wgmma small-M {:?} ms, warm {w:?}, took {}", t.dense_ms, t.skinny_ms.unwrap(), t.skinny_wg_ms, path.label());
        if hopper {
            // A narrow product (as Q) at 16 tokens: the rule takes the mma.sync kernel; on Hopper
            // the two small-M kernels are measured against each other, cold and warm.
            let (n, g) = (2048, 256);
            let c = mn_case(kind, m, n, k, g, 0.5, false);
            let s = GemmShape { op: RoutedOp::Mn, m, n, k, group: g };
            assert_eq!(wide_kernels::choose(&s, c.l.sparsity(), None), GemmPath::GemvMma);
            assert!(wide_kernels::ops::dispatch::small_m_tunable(&s, c.l.sparsity()).unwrap(), "{s:?}");
            poison(m, n, kind);
            let (y, path) = routed_gemm(RoutedOp::Mn, &c.x, &c.w, None, &c.l, g, None).unwrap();
            assert!(matches!(path, GemmPath::GemvMma | GemmPath::SkinnyWg | GemmPath::DenseMasked), "{path:?}");
            check(&y, &c.r, Some(&c.off), &format!("dispatch {kind:?} M={m} N={n} K={k} G={g} ({})", path.label()));
            let recs = wide_kernels::ops::gemm::tuned_records();
            let (_, t) = recs.iter().find(|(key, _)| key.n == n && key.k == k && key.m_bucket == 16 && key.f16 == (kind == Kind::Half)).expect("a record for the narrow product");
            let w = t.warm.unwrap_or_else(|| panic!("no warm timings in {t:?}"));
            assert!(t.skinny_ms.is_some() && t.skinny_wg_ms.is_some() && w.skinny_ms.is_some() && w.skinny_wg_ms.is_some(), "{t:?}");
            eprintln!("{kind:?} M={m} N={n}: {t:?}, took {}", path.label());
        }
        if hopper {
            // Past the mma.sync kernel's 16 tokens, the wgmma one alone is measured.
            let m = 100;
            let c = mn_case(kind, m, n, k, g, 0.5, false);
            poison(m, n, kind);
            let (y, path) = routed_gemm(RoutedOp::Mn, &c.x, &c.w, None, &c.l, g, None).unwrap();
            assert!(matches!(path, GemmPath::SkinnyWg | GemmPath::DenseMasked), "{path:?}");
            check(&y, &c.r, Some(&c.off), &format!("dispatch {kind:?} M={m} N={n} K={k} G={g} ({})", path.label()));
            let recs = wide_kernels::ops::gemm::tuned_records();
            let (_, t) = recs.iter().find(|(key, _)| key.n == n && key.k == k && key.m_bucket == 128 && key.f16 == (kind == Kind::Half)).expect("a record at 100 tokens");
            assert!(t.skinny_ms.is_none() && t.skinny_wg_ms.is_some_and(|ms| ms > 0.0) && t.tiles.is_empty() && t.wgmma_ms.is_none(), "{t:?}");
            eprintln!("{kind:?} M={m}: dense + mask {:.4} ms, wgmma small-M {:?} ms, took {}", t.dense_ms, t.skinny_wg_ms, path.label());
        }
    }
    match before {
        Some(v) => std::env::set_var("WIDE_TUNE_SMALL_M", v),
        None => std::env::remove_var("WIDE_TUNE_SMALL_M"),
    }
}

/// The transposed small-M wgmma gemm_mn in every shipped configuration: token counts up to each
/// tile's (rows past M come as zeros from the tensor copy), one and two consumer warpgroups,
/// groups of 8 to 512 channels (narrower and wider than a block's rows), all-on and all-off
/// masks, a K of one k step (two with K split), blocks alone, in clusters of two that share x and in
/// clusters of two that split K. Hopper only.
#[test]
fn gemm_mn_wgmma_skinny_matches_reference() {
    if hopper_gpu().is_none() {
        return;
    }
    tch::manual_seed(41);
    for kind in [Kind::BFloat16, Kind::Half] {
        for nt in [16u32, 32, 64, 128] {
            for (r, cluster, split, alt) in [(1u32, 1u32, 1u32, false), (2, 1, 1, false), (1, 2, 1, false), (2, 2, 1, false), (1, 1, 2, false), (2, 1, 2, false), (1, 1, 1, true), (2, 2, 1, true), (1, 1, 2, true), (2, 1, 2, true)] {
                let c = SkinnyWgConfig { cluster, split, ..SkinnyWgConfig::with(nt, r) };
                // Both forms of each option: the mask bytes in shared memory (default) or read
                // by the write-out; the split's sums pulled from the second block or pushed by it
                // (the split's default); the pair's pipeline depth or the deepest one block holds.
                let c = if alt { SkinnyWgConfig { stages: c.max_stages(), push: split == 2, mask_pre: false, ..c } } else { c };
                for (m, n, k, g, p) in [(nt as i64, 14336, 4096, 128, 0.5), (nt as i64 / 2 + 1, 4096, 512, 32, 0.5), (2, 1024, 64, 8, 0.5), (nt as i64 - 3, 512, 192, 512, 0.3), (nt as i64, 256, 128, 64, 1.0), (5, 256, 128, 128, 0.0)] {
                    let MnCase { x, w, l, r: reference, off, .. } = mn_case(kind, m, n, k, g, p, false);
                    if k % (64 * c.split as i64) != 0 {
                        let e = wide_kernels::ops::skinny_wg::gemm_mn_with(c, &x, &w, &l, g).unwrap_err().to_string();
                        assert!(e.contains("128 | K"), "{e}");
                        continue;
                    }
                    poison(m, n, kind);
                    let y = wide_kernels::ops::skinny_wg::gemm_mn_with(c, &x, &w, &l, g).unwrap();
                    check(&y, &reference, Some(&off), &format!("{} {kind:?} M={m} N={n} K={k} G={g} active={p}", c.label()));
                }
            }
        }
        // Refused: more tokens than the tile, rows that do not fill a block, a K off the k step.
        let MnCase { x, w, l, .. } = mn_case(kind, 20, 256, 128, 64, 0.5, false);
        assert!(wide_kernels::ops::skinny_wg::gemm_mn_with(SkinnyWgConfig::with(16, 1), &x, &w, &l, 64).is_err());
        let MnCase { x, w, l, .. } = mn_case(kind, 8, 192, 128, 64, 0.5, false);
        let e = wide_kernels::ops::skinny_wg::gemm_mn_with(SkinnyWgConfig::with(16, 2), &x, &w, &l, 64).unwrap_err().to_string();
        assert!(e.contains("128 | N"), "{e}");
        let MnCase { x, w, l, .. } = mn_case(kind, 8, 256, 96, 64, 0.5, false);
        assert!(wide_kernels::ops::skinny_wg::gemm_mn_with(SkinnyWgConfig::with(16, 1), &x, &w, &l, 64).unwrap_err().to_string().contains("64 | K"));
    }
}

#[test]
fn route_layout_kernel_matches_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(11);
    // One-pass partition: up to 32 indices a thread (32768 with 1024 threads: (32768, 2) takes
    // exactly 32); longer columns take the chunked form ((40000, 3)).
    for (m, ng) in [(1, 1), (1, 112), (37, 112), (1000, 448), (4096, 112), (16384, 8), (3000, 32), (1025, 5), (32768, 2), (40000, 3)] {
        for p in [0.0, 0.3, 0.5, 1.0] {
            let msk = mask(m, ng, p);
            let l = route_layout(&msk).unwrap();
            let (perm, count) = l.lists().unwrap();
            let (rp, rc) = route_layout_reference(&msk);
            assert_eq!(count.size(), [ng]);
            assert!(count.equal(&rc), "count M={m} NG={ng} p={p}");
            assert!(perm.equal(&rp), "perm M={m} NG={ng} p={p}");
        }
    }
}

#[test]
fn gemm_mn_all_paths_match_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(12);
    for kind in [Kind::BFloat16, Kind::Half] {
        // 112 groups of 128 (14336 / 128), M not a multiple of any tile, one token, all on/off.
        for (m, p) in [(1, 0.5), (3, 0.5), (16, 0.5), (77, 0.5), (300, 0.5), (1029, 0.5), (64, 1.0), (129, 0.0)] {
            run_mn_case(kind, m, 14336, 256, 128, p, false);
        }
        for g in [32, 64, 256, 512] {
            run_mn_case(kind, 200, 4096, 512, g, 0.5, false);
        }
        // 896 groups: more than the GEMV holds in registers (its second mask pass).
        run_mn_case(kind, 2, 14336, 256, 16, 0.5, false);
        // The small-M mma kernel: 11 k blocks over 8 warps (two warps without any), a partial
        // second token tile; two full token tiles over a long K.
        run_mn_case(kind, 13, 4096, 352, 32, 0.5, false);
        run_mn_case(kind, 16, 14336, 4096, 128, 0.7, false);
    }
}

/// The dense path's batched mask kernel where a thread takes more rows than one batch: at an
/// up-like width (14 column blocks, 150 row slots on 132 multiprocessors) 5000 tokens are 34 rows
/// a thread (the batched kernel from 16), a batch of 32 and one of 2 (all three modes: zeros in
/// place, the SwiGLU of two products, the masked copy of a gemm_k input).
#[test]
fn dense_mask_pass_takes_many_rows_a_thread() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(21);
    run_mn_case(Kind::BFloat16, 5000, 14336, 64, 128, 0.5, false);
    run_mn_case(Kind::Half, 5000, 14336, 64, 32, 0.3, true);
    run_k_case(Kind::BFloat16, 5000, 64, 14336, 128, 0.5);
}

#[test]
fn gemm_mn_swiglu_all_paths_match_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(13);
    for kind in [Kind::BFloat16, Kind::Half] {
        for (m, p) in [(1, 0.5), (5, 0.3), (12, 0.5), (16, 0.9), (250, 0.5), (1024, 0.75), (96, 1.0), (33, 0.0)] {
            run_mn_case(kind, m, 14336, 256, 128, p, true);
        }
        run_mn_case(kind, 300, 2048, 512, 32, 0.5, true);
    }
}

/// The wgmma kernel at prefill-like sizes (long K pipelines, 112 groups of 128, M not a
/// multiple of the 128-token tile, all-active and all-inactive masks). Hopper only.
#[test]
fn gemm_mn_wgmma_matches_reference() {
    let Some(_) = hopper_gpu() else { return };
    tch::manual_seed(18);
    for fused in [false, true] {
        for (m, p) in [(2500, 0.5), (1000, 0.3), (300, 1.0), (257, 0.0), (4096, 0.5)] {
            run_mn_case(Kind::BFloat16, m, 14336, 4096, 128, p, fused);
        }
        run_mn_case(Kind::Half, 777, 14336, 4096, 128, 0.5, fused);
        // k steps of 64: one, two (the producer's hand-over lag) and three.
        for k in [64, 128, 192] {
            run_mn_case(Kind::BFloat16, 515, 1024, k, 128, 0.5, fused);
        }
        run_mn_case(Kind::BFloat16, 300, 2048, 512, 256, 0.6, fused);
    }
    // The persistent grid (a sweep configuration): 128-token tiles, the fused kernel's 4 stages and
    // the plain kernel's 7; grids of more tiles than multiprocessors, fewer, all-zero tiles, k
    // loops of one to three steps, two launches in a row on one counter.
    let fused_p = WgmmaConfig { persist: true, ..WgmmaConfig::default_for(true) };
    let plain_p = WgmmaConfig { mi: 1, stages: 7, persist: true, ..WgmmaConfig::default_for(false) };
    for (cfg, fused) in [(fused_p, true), (plain_p, false)] {
        for &(kind, m, n, k, g, p) in PERSISTENT_GRID_CASES {
            run_wgmma_config_case(cfg, kind, m, n, k, g, p, fused);
        }
    }
}

/// The persistent grids' cases (kind, M, N, K, G, share of active tokens): more tiles than
/// multiprocessors, all-active and all-inactive masks, f16, k loops of one and three steps,
/// groups of 256.
const PERSISTENT_GRID_CASES: &[(Kind, i64, i64, i64, i64, f64)] = &[
    (Kind::BFloat16, 2500, 14336, 4096, 128, 0.5),
    (Kind::BFloat16, 257, 14336, 4096, 128, 0.0),
    (Kind::BFloat16, 300, 14336, 1024, 128, 1.0),
    (Kind::Half, 777, 14336, 4096, 128, 0.5),
    (Kind::BFloat16, 515, 1024, 64, 128, 0.5),
    (Kind::BFloat16, 515, 1024, 192, 128, 0.5),
    (Kind::BFloat16, 300, 2048, 512, 256, 0.6),
];

/// The stream-K schedule (`stream_k`: whole tiles, then the last one to two waves' k steps
/// split evenly over one block a multiprocessor, f32 slots summed by each tile's last segment)
/// against the f32 reference, two calls each (the second on the slots the first left zeroed):
/// grids of several waves (whole tiles, then split ones), of fewer tiles than multiprocessors
/// (each tile cut into many segments), all-active and all-inactive masks, k loops of one to
/// three steps, groups of 256, the plain kernel's 256- and 128-token tiles and the fused one.
/// Outputs poisoned before every call. Hopper only.
#[test]
fn gemm_mn_wgmma_stream_k_matches_reference() {
    let Some(_) = hopper_gpu() else { return };
    tch::manual_seed(24);
    let plain = WgmmaConfig { stream_k: true, row_tma: false, ..WgmmaConfig::default_for(false) };
    let plain_small = WgmmaConfig { mi: 1, stages: 7, ..plain };
    let fused = WgmmaConfig { stream_k: true, row_tma: false, ..WgmmaConfig::default_for(true) };
    for (cfg, is_fused) in [(plain, false), (plain_small, false), (fused, true)] {
        assert!(cfg.valid(is_fused) && cfg.entry() == "gemm_mn_wgmma_sk", "{cfg:?}");
        // Several waves (whole tiles, then split ones); fewer tiles than multiprocessors.
        let own = [(Kind::BFloat16, 4096, 14336, 4096, 128, 0.5), (Kind::BFloat16, 300, 1024, 4096, 128, 0.5)];
        for &(kind, m, n, k, g, p) in own.iter().chain(PERSISTENT_GRID_CASES) {
            run_wgmma_config_case(cfg, kind, m, n, k, g, p, is_fused);
        }
    }
}

/// Contiguous tiles (`row_tma`: x rows by TMA where a tile's listed tokens are consecutive)
/// against the f32 reference, with the cp.async gather on the same inputs beside it: every
/// group all-on (every tile contiguous, the last one running past M), the same first tokens in
/// every group (contiguous tiles, then a partial one whose rows past the active ones are tokens
/// the group skips), trailing groups all-on over a random mask (the fused Q|K|V's shape:
/// contiguous and gathered tiles in one grid). Outputs poisoned before every call. Hopper only.
#[test]
fn gemm_mn_wgmma_contiguous_tiles_match_reference() {
    let Some(dev) = hopper_gpu() else { return };
    tch::manual_seed(19);
    for fused in [false, true] {
        let d = WgmmaConfig::default_for(fused);
        assert!(d.row_tma_on(), "contiguous tiles by TMA are the default");
        // The plain kernel's deep 128-token tile too (the fused kernel has one tile).
        let mut cfgs = vec![d, WgmmaConfig { row_tma: false, ..d }];
        if !fused {
            cfgs.push(WgmmaConfig { mi: 1, stages: 7, ..d });
        }
        for (kind, m, n, k, g) in [(Kind::BFloat16, 700, 4096, 1024, 128), (Kind::Half, 333, 2048, 192, 256), (Kind::BFloat16, 2048, 14336, 4096, 128)] {
            let ng = n / g;
            let all = Tensor::ones([m, ng], (Kind::Bool, dev));
            let prefix = Tensor::arange(m, (Kind::Int64, dev)).lt(m * 3 / 5).unsqueeze(1).expand([m, ng], false).contiguous();
            let mixed = mask(m, ng, 0.5);
            let _ = mixed.narrow(1, ng - ng / 4, ng / 4).fill_(1);
            for (name, msk) in [("all on", all), ("prefix", prefix), ("trailing groups on", mixed)] {
                let MnCase { x, w, w2, l, r, off, .. } = mn_case_masked(kind, msk, n, k, g, fused);
                let up = if fused { Some(&w2) } else { None };
                for &cfg in &cfgs {
                    for call in 0..2 {
                        poison(m, n, kind);
                        let y = wide_kernels::ops::wgmma::gemm_mn_with(cfg, &x, &w, up, &l, g).unwrap();
                        check(&y, &r, Some(&off), &format!("{} {kind:?} M={m} N={n} K={k} G={g} {name} fused={fused} call {call}", cfg.label()));
                    }
                }
            }
        }
    }
}

/// A mask whose group j keeps exactly `counts[j % counts.len()]` tokens, drawn at random.
fn mask_with_counts(m: i64, ng: i64, counts: &[i64]) -> Tensor {
    let dev = gpu();
    let cols: Vec<Tensor> = (0..ng)
        .map(|j| {
            let c = counts[j as usize % counts.len()].min(m);
            let keep = Tensor::randperm(m, (Kind::Int64, dev)).narrow(0, 0, c);
            Tensor::zeros([m], (Kind::Bool, dev)).index_fill(0, &keep, 1)
        })
        .collect();
    Tensor::stack(&cols, 1)
}

/// Groups whose last tile keeps a few rows, in tile orders of several bands (the band the host
/// picks, and bands of 1, 3, 7 and 17 token tiles: a partial last band, bands that do not
/// divide the token tiles), against the f32 reference: group counts whose last tile keeps 1,
/// 17, 63, 64 or 65 rows, none, or a whole tile, k loops of an odd and an even number of steps,
/// the fused and plain kernels and the plain kernel's 128-token tile. Outputs poisoned before
/// every call. Hopper only.
#[test]
fn gemm_mn_wgmma_tiny_tiles_match_reference() {
    let Some(_) = hopper_gpu() else { return };
    tch::manual_seed(23);
    for fused in [false, true] {
        let d = WgmmaConfig::default_for(fused);
        let mut bases = vec![d, WgmmaConfig { stream_k: true, ..d }];
        if !fused {
            bases.push(WgmmaConfig { mi: 1, stages: 7, ..d });
        }
        for base in bases {
            let bm = base.bm();
            let counts = [bm + 1, 2 * bm + 17, bm + 63, 64, 2 * bm + 65, 0, 3 * bm, 1];
            for (kind, m, n, k, g) in [(Kind::BFloat16, 900, 2048, 192, 128), (Kind::Half, 1000, 14336, 4096, 128), (Kind::BFloat16, 777, 4096, 1024, 512)] {
                let MnCase { x, w, w2, l, r, off, .. } = mn_case_masked(kind, mask_with_counts(m, n / g, &counts), n, k, g, fused);
                let l = l.with_sparsity_hint(0.5);
                let up = if fused { Some(&w2) } else { None };
                for band in [None, Some(1), Some(3), Some(7), Some(17)] {
                    for call in 0..2 {
                        poison(m, n, kind);
                        let y = wide_kernels::ops::wgmma::gemm_mn_banded(base, band, &x, &w, up, &l, g).unwrap();
                        check(&y, &r, Some(&off), &format!("{} band {band:?} {kind:?} M={m} N={n} K={k} G={g} fused={fused} call {call}", base.label()));
                    }
                }
            }
        }
    }
}

/// Tall last tiles (`tall`: a group's last computing tile takes up to 64 rows past the 256-token
/// tile, the extra rows as a column-split sub-tile of both consumers, the zero tile after it
/// starting at the count) against the f32 reference, with and without contiguous tiles by TMA:
/// group counts whose last tile keeps 1, 63, 64 and 65 rows past a whole tile (tall, tall, tall,
/// a tile of its own), none or a whole tile, 64 and 1 rows alone; bands the host picks and bands
/// of 1 and 3 token tiles; every group on with the tall tile running past M; random masks at
/// 2500 and 4096 tokens. bf16 and f16, k loops of three steps and of 64. Outputs poisoned before
/// every call. Hopper only.
#[test]
fn gemm_mn_wgmma_tall_tiles_match_reference() {
    let Some(dev) = hopper_gpu() else { return };
    tch::manual_seed(25);
    let d = WgmmaConfig { tall: true, ..WgmmaConfig::default_for(false) };
    let cfgs = [d, WgmmaConfig { row_tma: false, ..d }];
    assert!(cfgs.iter().all(|c| c.valid(false) && c.row_tma_on() == c.row_tma), "{cfgs:?}");
    assert!(!WgmmaConfig { tall: true, ..WgmmaConfig::default_for(true) }.valid(true), "the fused tile has no room for the extra rows");
    let bm = d.bm();
    let counts = [bm + 1, 2 * bm + 63, bm + 64, 2 * bm + 65, 0, 3 * bm, 64, 1, 2 * bm + 17];
    for (kind, m, n, k, g) in [(Kind::BFloat16, 900, 2048, 192, 128), (Kind::Half, 1000, 14336, 4096, 128), (Kind::BFloat16, 777, 4096, 1024, 512)] {
        let MnCase { x, w, l, r, off, .. } = mn_case_masked(kind, mask_with_counts(m, n / g, &counts), n, k, g, false);
        let l = l.with_sparsity_hint(0.5);
        for &cfg in &cfgs {
            for band in [None, Some(1), Some(3)] {
                for call in 0..2 {
                    poison(m, n, kind);
                    let y = wide_kernels::ops::wgmma::gemm_mn_banded(cfg, band, &x, &w, None, &l, g).unwrap();
                    check(&y, &r, Some(&off), &format!("{} band {band:?} counts {kind:?} M={m} N={n} K={k} G={g} call {call}", cfg.label()));
                }
            }
        }
    }
    // Every group on: one tall tile past M (300 tokens), eight tiles whose last keeps 308 (2100).
    for (kind, m, n, k) in [(Kind::BFloat16, 300, 2048, 192), (Kind::Half, 2100, 1024, 256)] {
        let all = Tensor::ones([m, n / 128], (Kind::Bool, dev));
        let MnCase { x, w, l, r, off, .. } = mn_case_masked(kind, all, n, k, 128, false);
        for &cfg in &cfgs {
            for call in 0..2 {
                poison(m, n, kind);
                let y = wide_kernels::ops::wgmma::gemm_mn_with(cfg, &x, &w, None, &l, 128).unwrap();
                check(&y, &r, Some(&off), &format!("{} all on {kind:?} M={m} N={n} K={k} call {call}", cfg.label()));
            }
        }
    }
    for &cfg in &cfgs {
        for (kind, m, p) in [(Kind::BFloat16, 2500, 0.5), (Kind::BFloat16, 4096, 0.5), (Kind::Half, 1000, 0.3)] {
            run_wgmma_config_case(cfg, kind, m, 14336, 4096, 128, p, false);
        }
        run_wgmma_config_case(cfg, Kind::BFloat16, 515, 1024, 64, 128, 0.5, false);
    }
}

/// Groups narrower than the 128-channel tile (8 | G | 128) on the wgmma kernel: tiles of 128 / G
/// groups computed for the tokens that keep any of them, each group's mask applied as the tile
/// is written. Plain and fused, bf16 and f16, G = 8 / 16 / 32 / 64, random masks at several
/// rates, all-on and all-off, a mask where tokens keep one group of a tile and skip its
/// neighbours, M not a multiple of the tile; each of the configurations the launch rule picks
/// (the 256-token tile, the 128-token 7-stage one, tall last tiles), two calls each on poisoned
/// outputs; a persistent or stream-K configuration is refused with a clear error. Hopper only.
#[test]
fn gemm_mn_wgmma_narrow_groups_match_reference() {
    let Some(dev) = hopper_gpu() else { return };
    tch::manual_seed(31);
    for fused in [false, true] {
        for (kind, m, n, k, g, p) in [
            (Kind::BFloat16, 2500, 14336, 1024, 32, 0.5),
            (Kind::BFloat16, 4096, 14336, 512, 64, 0.25),
            (Kind::Half, 777, 4096, 512, 16, 0.75),
            (Kind::BFloat16, 1029, 2048, 256, 8, 0.9),
            (Kind::Half, 300, 1024, 128, 64, 1.0),
            (Kind::BFloat16, 257, 1024, 192, 32, 0.0),
        ] {
            run_mn_case(kind, m, n, k, g, p, fused);
        }
    }
    let d = WgmmaConfig::default_for(false);
    for cfg in [d, WgmmaConfig { mi: 1, stages: 7, ..d }, WgmmaConfig { tall: true, ..d }, WgmmaConfig { tall: true, row_tma: false, ..d }] {
        run_wgmma_config_case(cfg, Kind::BFloat16, 2100, 4096, 256, 32, 0.6, false);
        run_wgmma_config_case(cfg, Kind::Half, 600, 2048, 128, 64, 0.5, false);
    }
    run_wgmma_config_case(WgmmaConfig::default_for(true), Kind::BFloat16, 1500, 2048, 256, 32, 0.7, true);
    // Each token keeps exactly one group of every tile (a different one a token): every tile
    // computes all its tokens, and 3 / 4 of what it computes is written as zeros.
    let (m, n, k, g) = (700, 1024, 128, 32);
    let pick = Tensor::randint(4, [m, n / 128, 1], (Kind::Int64, dev));
    let one = Tensor::arange(4, (Kind::Int64, dev)).view([1, 1, 4]).eq_tensor(&pick).reshape([m, n / g]);
    for fused in [false, true] {
        run_wgmma_config_masked(WgmmaConfig::default_for(fused), Kind::BFloat16, one.shallow_clone(), n, k, g, fused, "one group of each tile a token");
    }
    let MnCase { x, w, l, .. } = mn_case(Kind::BFloat16, 300, 1024, 128, 32, 0.5, false);
    for cfg in [WgmmaConfig { persist: true, mi: 1, ..d }, WgmmaConfig { stream_k: true, ..d }] {
        let e = wide_kernels::ops::wgmma::gemm_mn_with(cfg, &x, &w, None, &l, 32).unwrap_err();
        assert!(e.to_string().contains("narrower than the 128-channel tile"), "{e}");
    }
}

/// One product on the wgmma kernel in a given configuration against the f32 reference, twice.
#[allow(clippy::too_many_arguments)]
fn run_wgmma_config_case(cfg: WgmmaConfig, kind: Kind, m: i64, n: i64, k: i64, g: i64, p_active: f64, fused: bool) {
    run_wgmma_config_masked(cfg, kind, mask(m, n / g, p_active), n, k, g, fused, &format!("active={p_active}"));
}

/// [`run_wgmma_config_case`] over a given `[M, N / G]` mask (`what` names it in failures).
#[allow(clippy::too_many_arguments)]
fn run_wgmma_config_masked(cfg: WgmmaConfig, kind: Kind, msk: Tensor, n: i64, k: i64, g: i64, fused: bool, what: &str) {
    let m = msk.size()[0];
    let MnCase { x, w, w2, l, r, off, .. } = mn_case_masked(kind, msk, n, k, g, fused);
    let up = if fused { Some(&w2) } else { None };
    for call in 0..2 {
        poison(m, n, kind);
        let y = wide_kernels::ops::wgmma::gemm_mn_with(cfg, &x, &w, up, &l, g).unwrap();
        check(&y, &r, Some(&off), &format!("{} {kind:?} M={m} N={n} K={k} G={g} {what} fused={fused} call {call}", cfg.label()));
    }
}

#[test]
fn gemm_k_all_paths_match_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(14);
    for kind in [Kind::BFloat16, Kind::Half] {
        for (m, p) in [(1, 0.5), (2, 0.5), (16, 0.5), (77, 0.5), (300, 0.5), (1029, 0.5), (64, 1.0), (129, 0.0), (200, 0.02)] {
            run_k_case(kind, m, 256, 14336, 128, p);
        }
        for g in [32, 64, 256, 512] {
            run_k_case(kind, 200, 512, 4096, g, 0.5);
        }
        // GEMV with a slice of 3 chunks (not a power of two) and group counts past a warp.
        for m in [1, 2, 5] {
            run_k_case(kind, m, 96, 24 * 70, 24, 0.5);
        }
    }
}

#[test]
fn dispatch_end_to_end_matches_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(15);
    let dev = gpu();
    for (m, k, n, g) in [(1i64, 4096i64, 14336i64, 128i64), (2, 4096, 14336, 128), (8, 4096, 14336, 128), (2048, 4096, 14336, 128)] {
        let x = Tensor::randn([m, k], (Kind::BFloat16, dev));
        let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.02;
        let msk = mask(m, n / g, 0.5);
        let l = route_layout(&msk).unwrap();
        let y = wide_kernels::gemm_mn(&x, &w, &l, g).unwrap();
        let r = gemm_mn_reference(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), None, &msk, g);
        check(&y, &r, None, &format!("dispatch gemm_mn M={m}"));
        // down projection shape
        let xk = Tensor::randn([m, n], (Kind::BFloat16, dev));
        let wk = Tensor::randn([k, n], (Kind::BFloat16, dev)) * 0.02;
        let y = wide_kernels::gemm_k(&xk, &wk, &l, g).unwrap();
        let r = gemm_k_reference(&xk.to_kind(Kind::Float), &wk.to_kind(Kind::Float), &msk, g);
        check(&y, &r, None, &format!("dispatch gemm_k M={m}"));
    }
}

#[test]
fn gemv_path_replays_in_a_cuda_graph() {
    let dev = gpu();
    let (k, n, g) = (4096, 14336, 128);
    let mut x = Tensor::randn([1, k], (Kind::BFloat16, dev));
    let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.02;
    let msk = mask(1, n / g, 0.5);
    let l = route_layout(&msk).unwrap().with_sparsity_hint(0.5);
    let _ = wide_kernels::gemm_mn(&x, &w, &l, g).unwrap(); // load outside capture
    let mut graph = CudaGraph::new(0).unwrap();
    let y = graph.capture(|| wide_kernels::gemm_mn(&x, &w, &l, g)).unwrap();
    // New inputs and a new mask in place, then replay.
    x.copy_(&Tensor::randn([1, k], (Kind::BFloat16, dev)));
    let m2 = mask(1, n / g, 0.5);
    l.mask().shallow_clone().copy_(&m2.to_kind(Kind::Uint8));
    graph.replay().unwrap();
    wide_kernels::shim::synchronize(0).unwrap();
    let r = gemm_mn_reference(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), None, &m2, g);
    check(&y, &r, None, "graph replay gemv");
}

/// The decode step's pure-read stand-in (`WIDE_STEP_READS`): zeros of the asked shape whatever
/// was in the memory before, on views with a storage offset too, and one error for bytes past
/// the tensor.
#[test]
fn step_read_writes_zeros_and_refuses_bytes_past_the_weights() {
    let dev = gpu();
    let w = Tensor::randn([2 * 1024, 512], (Kind::BFloat16, dev));
    let (g, u) = (w.narrow(0, 0, 1024), w.narrow(0, 1024, 1024));
    for (rows, n) in [(1024, 1024), (333, 4096), (0, 8)] {
        poison(1, n, Kind::BFloat16);
        let y = wide_kernels::ops::attention::step_read(&g, rows * 1024, &u, rows * 1024, (1, n), 2).unwrap();
        assert_eq!(y.size(), [1, n]);
        assert_eq!(y.kind(), Kind::BFloat16);
        let nonzero = y.to_kind(Kind::Float).abs().sum(Kind::Float).double_value(&[]);
        assert!(nonzero == 0.0, "rows {rows}, n {n}: the output is not all zeros ({nonzero})");
    }
    let e = wide_kernels::ops::attention::step_read(&g, 1025 * 1024, &u, 0, (1, 8), 2).unwrap_err().to_string();
    assert!(e.contains("within a tensor of [1024, 512]"), "{e}");
    let e = wide_kernels::ops::attention::step_read(&g, 1024, &u, 0, (1, 7), 2).unwrap_err().to_string();
    assert!(e.contains("16-byte words"), "{e}");
}

/// Small shapes of every op and path, for one `compute-sanitizer --tool memcheck` run.
#[test]
fn sanitizer_small_all_ops() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(16);
    for (m, p) in [(1, 0.5), (3, 1.0), (14, 0.5), (70, 0.5), (129, 0.0)] {
        run_mn_case(Kind::BFloat16, m, 1024, 64, 128, p, false);
        run_mn_case(Kind::BFloat16, m, 1024, 64, 128, p, true);
        run_k_case(Kind::BFloat16, m, 128, 1024, 128, p);
    }
    run_mn_case(Kind::Half, 65, 512, 96, 32, 0.5, true);
    // The dense path's mask kernel (in rows of 4) with threads of one and of two rows (2112 row
    // slots).
    run_mn_case(Kind::BFloat16, 2200, 1024, 64, 128, 0.5, false);
    // The wgmma kernel (Hopper): k loops of 2 and 3 steps, a partial token tile.
    run_mn_case(Kind::BFloat16, 200, 512, 128, 128, 0.5, false);
    run_mn_case(Kind::Half, 200, 512, 192, 128, 0.5, true);
    // Its contiguous tiles (every group on): x rows by TMA, the last tile past M.
    run_mn_case(Kind::BFloat16, 300, 512, 128, 128, 1.0, false);
    run_mn_case(Kind::Half, 300, 512, 192, 128, 1.0, true);
    // Its 128-token, 7-stage tile (100 computing tiles at 512 tokens; see wgmma::config_for).
    run_mn_case(Kind::BFloat16, 512, 12800, 128, 128, 0.5, false);
    // Groups narrower than its tile (the fine mask read as the tile is written).
    run_mn_case(Kind::BFloat16, 300, 1024, 128, 32, 0.5, false);
    run_mn_case(Kind::Half, 200, 512, 192, 64, 0.5, true);
    if wide_kernels::ops::wgmma::supported(0) {
        // The persistent grid: more tiles than a block takes first, zero-only tiles among them.
        run_wgmma_config_case(WgmmaConfig { persist: true, ..WgmmaConfig::default_for(true) }, Kind::BFloat16, 700, 4096, 128, 128, 0.5, true);
        run_wgmma_config_case(WgmmaConfig { mi: 1, stages: 7, persist: true, ..WgmmaConfig::default_for(false) }, Kind::Half, 700, 4096, 192, 128, 0.5, false);
        // The stream-K schedule: tiles cut into many segments (fewer tiles than multiprocessors).
        run_wgmma_config_case(WgmmaConfig { stream_k: true, ..WgmmaConfig::default_for(false) }, Kind::BFloat16, 700, 4096, 192, 128, 0.5, false);
        run_wgmma_config_case(WgmmaConfig { stream_k: true, ..WgmmaConfig::default_for(true) }, Kind::Half, 700, 4096, 128, 128, 0.5, true);
        // Tall last tiles: one past M (every group on), counts 1, 64 and 65 rows past a tile.
        let tall = WgmmaConfig { tall: true, ..WgmmaConfig::default_for(false) };
        run_wgmma_config_case(tall, Kind::BFloat16, 300, 512, 128, 128, 1.0, false);
        let msk = mask_with_counts(700, 4, &[257, 320, 321, 0]);
        let x = Tensor::randn([700, 192], (Kind::Half, gpu()));
        let w = Tensor::randn([512, 192], (Kind::Half, gpu())) * 0.05;
        let _ = wide_kernels::ops::wgmma::gemm_mn_banded(tall, Some(1), &x, &w, None, &route_layout(&msk).unwrap(), 128).unwrap();
        // Tiles of a few rows in bands of 3 token tiles (a partial last band), an odd k loop.
        let msk = mask_with_counts(600, 4, &[257, 17, 64, 0]);
        let l = route_layout(&msk).unwrap();
        for fused in [false, true] {
            let x = Tensor::randn([600, 192], (Kind::BFloat16, gpu()));
            let w = Tensor::randn([512, 192], (Kind::BFloat16, gpu())) * 0.05;
            let up = if fused { Some(&w) } else { None };
            let _ = wide_kernels::ops::wgmma::gemm_mn_banded(WgmmaConfig::default_for(fused), Some(3), &x, &w, up, &l, 128).unwrap();
        }
        // The transposed small-M kernel with K split over pairs of blocks (the partial sums
        // read from the other block's shared memory), one and two consumer warpgroups.
        for (m, nt, r, alt) in [(14i64, 16u32, 1u32, false), (100, 128, 2, false), (14, 16, 1, true), (100, 128, 1, true)] {
            let c = SkinnyWgConfig { split: 2, ..SkinnyWgConfig::with(nt, r) };
            let c = if alt { SkinnyWgConfig { stages: c.max_stages(), push: true, mask_pre: true, ..c } } else { c };
            let msk = mask(m, 512 / 64, 0.5);
            let x = Tensor::randn([m, 384], (Kind::BFloat16, gpu()));
            let w = Tensor::randn([512, 384], (Kind::BFloat16, gpu())) * 0.05;
            let _ = wide_kernels::ops::skinny_wg::gemm_mn_with(c, &x, &w, &route_layout(&msk).unwrap(), 64).unwrap();
        }
    }
    run_k_case(Kind::Half, 65, 256, 512, 32, 0.5);
    run_fold_case(Kind::BFloat16, 512, 1024, 64, 512, 32, 12, 4, 0.5);
    run_decode_case(Kind::BFloat16, 2, 8, 2, 300, 128, 2, &[1, 300], 0.5);
    run_decode_case(Kind::BFloat16, 1, 16, 2, 200, 64, 4, &[150], 0.5);
    run_decode_rope_case(Kind::BFloat16, 2, 8, 2, 300, 128, 2, &[1, 300], 0.5);
    run_decode_rope_case(Kind::Half, 1, 16, 2, 1200, 64, 4, &[1100], 0.5);
    prefill_small_cases();
    let msk = mask(1000, 112, 0.5);
    let l = route_layout(&msk).unwrap();
    let (perm, _) = l.lists().unwrap();
    assert!(perm.equal(&route_layout_reference(&msk).0));
    assert!(!TILES.is_empty());
}

fn run_decode_case(kind: Kind, b: i64, hq: i64, hkv: i64, tcap: i64, d: i64, gh: i64, lengths: &[i32], p_active: f64) {
    let dev = gpu();
    let q = Tensor::randn([b, hq, d], (kind, dev));
    let k = Tensor::randn([b, hkv, tcap, d], (kind, dev));
    let v = Tensor::randn([b, hkv, tcap, d], (kind, dev));
    let len = Tensor::from_slice(lengths).to_device(dev);
    let msk = mask(b, hq / gh, p_active);
    let scale = 1.0 / (d as f64).sqrt();
    let r = wide_kernels::attention_decode_reference(
        &q.to_kind(Kind::Float),
        &k.to_kind(Kind::Float),
        &v.to_kind(Kind::Float),
        &len,
        &msk,
        gh,
        scale,
    );
    let off = msk.logical_not().repeat_interleave_self_int(gh, 1, None::<i64>).unsqueeze(-1).expand([b, hq, d], false);
    // Splits merged by the split kernel's last block of each KV head, by the second launch, and
    // (caches of at most 1024 positions, lengths up to 512) not split: one block a KV head.
    for merge in [DecodeMerge::InKernel { single_max: 0 }, DecodeMerge::Separate, DecodeMerge::InKernel { single_max: 512 }] {
        poison(b * hq, d, kind);
        let y = wide_kernels::attention_decode_with(&q, &k, &v, &len, &msk, gh, scale, merge).unwrap();
        check(&y, &r, Some(&off), &format!("attention_decode {kind:?} B={b} HQ={hq} HKV={hkv} T={tcap} D={d} gh={gh} lens={lengths:?} active={p_active} {merge:?}"));
    }
    // As in a decode step: each sequence's newest row is written by the launches just before
    // (NaN until then). The kernel's loads before its wait stop short of that row; a missing
    // reload of its tile after the wait would read it as zeros and fail the check.
    let (ks, vs) = (k.copy(), v.copy());
    for (i, &l) in lengths.iter().enumerate() {
        let p = (l as i64 - 1).clamp(0, tcap - 1);
        let _ = ks.get(i as i64).narrow(1, p, 1).fill_(f64::NAN);
        let _ = vs.get(i as i64).narrow(1, p, 1).fill_(f64::NAN);
    }
    poison(b * hq, d, kind);
    for (i, &l) in lengths.iter().enumerate() {
        let p = (l as i64 - 1).clamp(0, tcap - 1);
        ks.get(i as i64).narrow(1, p, 1).copy_(&k.get(i as i64).narrow(1, p, 1));
        vs.get(i as i64).narrow(1, p, 1).copy_(&v.get(i as i64).narrow(1, p, 1));
    }
    let y = wide_kernels::attention_decode_step(&q, &ks, &vs, &len, &msk, gh, scale).unwrap();
    check(&y, &r, Some(&off), &format!("attention_decode_step {kind:?} B={b} HQ={hq} HKV={hkv} T={tcap} D={d} gh={gh} lens={lengths:?} active={p_active}"));
}

#[test]
fn attention_decode_matches_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(17);
    for kind in [Kind::BFloat16, Kind::Half] {
        // Llama-3.1-8B: 32 query heads, 8 KV heads, groups of 4 heads (one KV head each).
        run_decode_case(kind, 1, 32, 8, 32768, 128, 4, &[32768], 0.5);
        run_decode_case(kind, 1, 32, 8, 2048, 128, 4, &[2048], 1.0);
        run_decode_case(kind, 1, 32, 8, 2048, 128, 4, &[2048], 0.0);
        // Short caches (the decode of a generation): splits merged in the split kernel.
        run_decode_case(kind, 1, 32, 8, 256, 128, 4, &[200], 0.5);
        let lens16: Vec<i32> = (0..16).map(|i| 129 + 8 * i).collect();
        run_decode_case(kind, 16, 32, 8, 256, 128, 4, &lens16, 0.5);
        // Groups that straddle KV heads, ragged lengths (one token; not a multiple of the split).
        run_decode_case(kind, 3, 8, 2, 1000, 64, 2, &[1, 513, 1000], 0.5);
        run_decode_case(kind, 2, 16, 2, 777, 64, 4, &[700, 5], 0.5);
        run_decode_case(kind, 2, 4, 4, 300, 128, 1, &[300, 299], 0.5);
        // 8 query heads a KV head; a batch large enough that each sequence gets a few blocks.
        run_decode_case(kind, 2, 16, 2, 4000, 128, 4, &[4000, 1717], 0.5);
        let lens: Vec<i32> = (0..40).map(|i| 1 + 37 * i).collect();
        run_decode_case(kind, 40, 32, 8, 1500, 128, 4, &lens, 0.5);
        // Fewer blocks a sequence than KV heads would leave heads unread: all of them active.
        run_decode_case(kind, 40, 32, 8, 1500, 128, 4, &lens, 1.0);
    }
}

/// A decode step with the new token's RoPE and cache write fused into the attention launch
/// (`attention_decode_step_rope`) against the two launches it replaces (`rope_qkv_cache`, then
/// `attention_decode_step`): both caches bit for bit, the output against the f32 reference on
/// those caches and against the two launches' output (the fused kernel takes the new token as a
/// tile of its own, so the softmax sums in another order). The fused call's caches hold NaN in
/// each sequence's newest row until it writes it, so a read of that row from the cache (instead
/// of from qkv) shows.
#[allow(clippy::too_many_arguments)]
fn run_decode_rope_case(kind: Kind, b: i64, hq: i64, hkv: i64, tcap: i64, d: i64, gh: i64, lengths: &[i32], p_active: f64) {
    let dev = gpu();
    let qkv = Tensor::randn([b, (hq + 2 * hkv) * d], (kind, dev));
    let k = Tensor::randn([b, hkv, tcap, d], (kind, dev));
    let v = Tensor::randn([b, hkv, tcap, d], (kind, dev));
    let len = Tensor::from_slice(lengths).to_device(dev);
    let pos = Tensor::from_slice(&lengths.iter().map(|l| l - 1).collect::<Vec<i32>>()).to_device(dev);
    let inv_freq = (Tensor::arange(d / 2, (Kind::Float, dev)) * (-2.0 * (500000f64).ln() / d as f64)).exp();
    let msk = mask(b, hq / gh, p_active);
    let scale = 1.0 / (d as f64).sqrt();
    let shape = fused::QkvShape { batch: b, tokens: 1, q_heads: hq, kv_heads: hkv, head_dim: d };
    let what = format!("attention_decode_step_rope {kind:?} B={b} HQ={hq} HKV={hkv} T={tcap} D={d} gh={gh} lens={lengths:?} active={p_active}");
    let (k1, v1) = (k.copy(), v.copy());
    let q = fused::rope_qkv_cache(&qkv, &pos, &inv_freq, &shape, &k1, &v1).unwrap();
    let y1 = wide_kernels::attention_decode_step(&q.view([b, hq, d]), &k1, &v1, &len, &msk, gh, scale).unwrap();
    let (k2, v2) = (k.copy(), v.copy());
    for (i, &l) in lengths.iter().enumerate() {
        let _ = k2.get(i as i64).narrow(1, l as i64 - 1, 1).fill_(f64::NAN);
        let _ = v2.get(i as i64).narrow(1, l as i64 - 1, 1).fill_(f64::NAN);
    }
    poison(b * hq, d, kind);
    let y2 = wide_kernels::attention_decode_step_rope(&qkv, &inv_freq, &k2, &v2, &len, &msk, gh, scale).unwrap();
    assert!(k2.equal(&k1) && v2.equal(&v1), "{what}: caches differ from rope_qkv_cache's");
    let f = |t: &Tensor| t.to_kind(Kind::Float);
    let r = wide_kernels::attention_decode_reference(&f(&q.view([b, hq, d])), &f(&k1), &f(&v1), &len, &msk, gh, scale);
    let off = msk.logical_not().repeat_interleave_self_int(gh, 1, None::<i64>).unsqueeze(-1).expand([b, hq, d], false);
    check(&y2, &r, Some(&off), &what);
    check(&y2, &f(&y1), Some(&off), &format!("{what} (against the two launches)"));
}

#[test]
fn attention_decode_step_rope_matches_the_two_launches() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(19);
    for kind in [Kind::BFloat16, Kind::Half] {
        // Llama-3.1-8B heads: one block a KV head (short cache), split and merged in the
        // kernel, merged by the second launch (> 16 splits); the newest row at the last slot.
        for p in [0.5, 0.0, 1.0] {
            run_decode_rope_case(kind, 1, 32, 8, 256, 128, 4, &[200], p);
        }
        run_decode_rope_case(kind, 1, 32, 8, 1024, 128, 4, &[1000], 0.5);
        run_decode_rope_case(kind, 1, 32, 8, 4096, 128, 4, &[4096], 0.5);
        let lens16: Vec<i32> = (0..16).map(|i| 129 + 8 * i).collect();
        run_decode_rope_case(kind, 16, 32, 8, 256, 128, 4, &lens16, 0.5);
        // head_dim 64, groups straddling KV heads, ragged lengths (one token).
        run_decode_rope_case(kind, 3, 8, 2, 1000, 64, 2, &[1, 513, 1000], 0.5);
        run_decode_rope_case(kind, 2, 16, 2, 777, 64, 8, &[700, 5], 0.5);
    }
}

/// Routed prefill attention on every block shape and through the dispatch, against the f32
/// reference: no NaN (outputs poisoned), skipped (token, head) rows exactly 0. `cap` > t runs
/// k/v as narrowed views of a longer cache (the engine's case).
#[allow(clippy::too_many_arguments)]
fn run_prefill_case(kind: Kind, b: i64, hq: i64, hkv: i64, t: i64, cap: i64, d: i64, gh: i64, p_active: f64) {
    let dev = gpu();
    let q = Tensor::randn([b, hq, t, d], (kind, dev));
    let kc = Tensor::randn([b, hkv, cap, d], (kind, dev));
    let vc = Tensor::randn([b, hkv, cap, d], (kind, dev));
    let (k, v) = (kc.narrow(2, 0, t), vc.narrow(2, 0, t));
    let msk = Tensor::rand([b, t, hq / gh], (Kind::Float, dev)).lt(p_active);
    let scale = 1.0 / (d as f64).sqrt();
    let f = |x: &Tensor| x.to_kind(Kind::Float);
    let r = wide_kernels::attention_prefill_reference(&f(&q), &f(&k), &f(&v), None, &msk, gh, scale);
    let off = msk.logical_not().repeat_interleave_self_int(gh, 2, None::<i64>).transpose(1, 2).unsqueeze(-1).expand([b, hq, t, d], false);
    let what = format!("attention_prefill {kind:?} B={b} HQ={hq} HKV={hkv} T={t} cap={cap} D={d} gh={gh} active={p_active}");
    let dev_index = match dev {
        Device::Cuda(i) => i,
        _ => unreachable!(),
    };
    for tile in PREFILL_TILES.into_iter().filter(|x| x.supports(d, dev_index)) {
        poison(b * hq * t, d, kind);
        let y = wide_kernels::attention_prefill_routed(&q, &k, &v, &msk, gh, scale, tile).unwrap();
        check(&y, &r, Some(&off), &format!("{what} routed {}", tile.name()));
        assert!(y.transpose(1, 2).is_contiguous(), "{what}: routed output must be [B, T, HQ, D] in memory");
    }
    poison(b * hq * t, d, kind);
    let y = wide_kernels::attention_prefill(&q, &k, &v, None, &msk, gh, scale).unwrap();
    check(&y, &r, Some(&off), &format!("{what} dispatch"));
    poison(b * hq * t, d, kind);
    let y = wide_kernels::attention_prefill_with(&q, &k, &v, None, &msk, gh, scale, Some(1.0 - p_active)).unwrap();
    check(&y, &r, Some(&off), &format!("{what} dispatch with the skip rate"));
    // The dense path: SDPA and the in-place zero kernel over the skipped rows.
    let y = wide_kernels::attention_prefill_dense(&q, &k, &v, &msk, gh, scale).unwrap();
    check(&y, &r, Some(&off), &format!("{what} sdpa+zero"));
}

/// Small prefill shapes (also run under compute-sanitizer through `sanitizer_small_all_ops`).
fn prefill_small_cases() {
    run_prefill_case(Kind::BFloat16, 2, 8, 2, 150, 150, 128, 2, 0.5);
    run_prefill_case(Kind::Half, 1, 4, 4, 70, 96, 64, 1, 0.5);
    run_prefill_case(Kind::BFloat16, 1, 8, 2, 1, 1, 128, 4, 1.0);
}

#[test]
fn prefill_sanitizer_small() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(19);
    prefill_small_cases();
}

#[test]
fn attention_prefill_matches_reference() {
    let _ = gpu(); // the device first (one GPU test at a time)
    tch::manual_seed(18);
    for kind in [Kind::BFloat16, Kind::Half] {
        // Llama-3.1-8B heads: 32 query, 8 KV, groups of 4 heads (one KV head each); T not a
        // multiple of any tile.
        run_prefill_case(kind, 1, 32, 8, 1000, 1000, 128, 4, 0.5);
        // B = 2, one head a group (groups inside a KV head), a narrowed KV cache.
        run_prefill_case(kind, 2, 32, 8, 777, 1024, 128, 1, 0.5);
        // All active, all inactive, one token, few active tokens.
        run_prefill_case(kind, 1, 32, 8, 300, 300, 128, 4, 1.0);
        run_prefill_case(kind, 2, 32, 8, 300, 300, 128, 4, 0.0);
        run_prefill_case(kind, 2, 32, 8, 1, 1, 128, 4, 0.5);
        run_prefill_case(kind, 1, 32, 8, 1, 4, 128, 1, 1.0);
        run_prefill_case(kind, 1, 32, 8, 500, 500, 128, 4, 0.05);
        // Longer prompt (many key tiles, the heaviest-first tile order), mostly skipped.
        run_prefill_case(kind, 1, 32, 8, 2048, 2048, 128, 4, 0.5);
        run_prefill_case(kind, 1, 32, 8, 2100, 2100, 128, 4, 0.25);
        // head_dim 64, groups straddling KV heads (2 heads a group, 4 query heads a KV head).
        run_prefill_case(kind, 2, 8, 2, 513, 513, 64, 2, 0.5);
        run_prefill_case(kind, 3, 16, 16, 129, 200, 64, 8, 0.7);
    }
}

/// Once each kernel is loaded, the ops' launch paths must not hash kernel sources again (a
/// lookup by source hashes all of it: `route_layout` did that on every build, ~0.1 ms of host
/// time per layout, which made a 512-token routed prefill wait on the host).
#[test]
fn launch_paths_do_not_rehash_kernel_sources() {
    let dev = gpu();
    tch::manual_seed(23);
    let (m, k, n, g) = (512i64, 256i64, 512i64, 128i64);
    let x = Tensor::randn([m, k], (Kind::BFloat16, dev));
    let w = Tensor::randn([n, k], (Kind::BFloat16, dev));
    let xk = Tensor::randn([m, n], (Kind::BFloat16, dev));
    let wk = Tensor::randn([k, n], (Kind::BFloat16, dev));
    let x1 = x.narrow(0, 0, 1);
    let (b, hq, hkv, d, gh, t) = (1i64, 8i64, 2i64, 128i64, 4i64, 256i64);
    let q = Tensor::randn([b, hq, t, d], (Kind::BFloat16, dev));
    let kv = Tensor::randn([b, hkv, t, d], (Kind::BFloat16, dev));
    let qd = Tensor::randn([b, hq, d], (Kind::BFloat16, dev));
    let len = Tensor::from_slice(&[t as i32]).to_device(dev);
    let scale = 1.0 / (d as f64).sqrt();
    let round = || {
        let msk = mask(m, n / g, 0.5);
        let lay = route_layout(&msk).unwrap();
        let _ = lay.lists().unwrap();
        let s = GemmShape { op: RoutedOp::Mn, m, n, k, group: g };
        for p in paths_for(&s) {
            let _ = routed_gemm(RoutedOp::Mn, &x, &w, None, &lay, g, Some(p)).unwrap();
        }
        let _ = routed_gemm(RoutedOp::KPremasked, &xk, &wk, None, &lay, g, Some(GemmPath::DenseMasked)).unwrap();
        let lay1 = route_layout(&msk.narrow(0, 0, 1)).unwrap();
        let _ = routed_gemm(RoutedOp::Mn, &x1, &w, None, &lay1, g, Some(GemmPath::Gemv)).unwrap();
        let _ = routed_gemm(RoutedOp::KPremasked, &xk.narrow(0, 0, 1), &wk, None, &lay1, g, Some(GemmPath::Gemv)).unwrap();
        let pm = Tensor::rand([b, t, hq / gh], (Kind::Float, dev)).lt(0.5);
        for tile in PREFILL_TILES.into_iter().filter(|x| x.supports(d, 0)) {
            let _ = wide_kernels::attention_prefill_routed(&q, &kv, &kv, &pm, gh, scale, tile).unwrap();
        }
        let _ = wide_kernels::attention_prefill_dense(&q, &kv, &kv, &pm, gh, scale).unwrap();
        let dm = mask(b, hq / gh, 0.5);
        let _ = wide_kernels::attention_decode(&qd, &kv, &kv, &len, &dm, gh, scale).unwrap();
        let _ = wide_kernels::attention_decode_step(&qd, &kv, &kv, &len, &dm, gh, scale).unwrap();
        // The engine's fused kernels and the NVRTC template op.
        let nw = Tensor::randn([k], (Kind::BFloat16, dev));
        let _ = fused::add_rmsnorm(&x, Some(&x), &nw, 1e-5).unwrap();
        let _ = fused::add_rmsnorm_settled(&x, Some(&x), &nw, 1e-5).unwrap();
        let (w1, b1) = (Tensor::randn([32, k], (Kind::BFloat16, dev)), Tensor::randn([32], (Kind::BFloat16, dev)));
        let (w2, b2) = (Tensor::randn([2 * (n / g), 32], (Kind::BFloat16, dev)), Tensor::randn([2 * (n / g)], (Kind::BFloat16, dev)));
        let rw = fused::RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
        let _ = fused::router_gate(&x, &rw, 0.0, 2).unwrap();
        let _ = fused::add_rmsnorm_router_gate(&x.narrow(0, 0, 4), None, &nw, 1e-5, &rw, 0.0, 2).unwrap();
        let _ = fused::swiglu(&Tensor::randn([m, 2 * n], (Kind::BFloat16, dev)), Some(&msk), g).unwrap();
        let _ = wide_kernels::ops::scale_shift::scale_shift(&x, 2.0, 1.0).unwrap();
    };
    round(); // loads every kernel once
    let before = wide_kernels::nvrtc::source_hashes();
    for _ in 0..3 {
        round();
    }
    tch::Cuda::synchronize(0);
    let after = wide_kernels::nvrtc::source_hashes();
    assert_eq!(after, before, "{} kernel sources hashed again by launches whose kernels were already loaded", after - before);
}

/// The clock probe reads an SM clock a GPU can run at, in every slot it wrote and in no other,
/// from a spin of at least its length.
#[test]
fn clock_probe_reads_the_sm_clock() {
    let dev = gpu();
    let p = wide_kernels::ops::probe::ClockProbe::new(dev, 3, 200).unwrap();
    p.record(0).unwrap();
    let x = Tensor::randn([2048, 2048], (Kind::BFloat16, dev));
    let _ = x.matmul(&x);
    p.record(2).unwrap();
    let mhz = p.mhz().unwrap();
    assert_eq!(mhz[1], None, "slot 1 was never written: {mhz:?}");
    for m in [mhz[0], mhz[2]] {
        let m = m.unwrap_or_else(|| panic!("a written slot reads no clock: {mhz:?}"));
        assert!((300.0..4000.0).contains(&m), "{m} MHz is no SM clock");
    }
    assert!(p.record(3).is_err(), "slot 3 is out of range");
}
