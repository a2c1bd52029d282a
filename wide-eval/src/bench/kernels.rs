//! `wide bench kernels`: routed projections against cuBLAS dense in the same process, on
//! Llama-3.1-8B shapes (Q/O 4096x4096 with 8 groups of 4 heads; gate/up 4096->14336; down
//! 14336->4096), over M, group size and sparsity, with cold L2 (a buffer of at least twice the
//! L2 size is written between timed runs: `cold`; or read: `cold-clean`, which leaves clean
//! lines, as the weight reads of an inference step do) and warm.
//!
//! Every timed iteration draws a fresh mask (random by default; the other `MaskPattern`s are
//! diagnostics of the row gather and of uneven group counts) outside the timed regions and times
//! every variant of the case on it, interleaved in a rotating order, with CUDA events: dense = the cuBLAS product(s) alone (plus SiLU-multiply for gate+up); routed =
//! building the routing layout + the routed kernel (GEMV for M <= 16, else the autotuned best
//! of the mma.sync tiles and, on Hopper, the wgmma kernel); dispatch = layout + whatever the policy picks. Outputs are checked against the f32
//! tch reference before timing. A 200 us device spin precedes each timed region so the host
//! has queued its launches before it starts: the events time device work (as under CUDA-graph
//! replay), not launch overhead.
use super::device_label;
use crate::report::{write_json, Provenance};
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};
use wide_kernels::ops::dispatch::{skinny_feasible, GemmPath, GemmShape, RoutedOp, GEMV_MAX_M};
use wide_kernels::ops::gemm::{gemm_k_reference, gemm_mn_reference, routed_gemm, tuned_for};
use wide_kernels::ops::layout::route_layout;
use wide_kernels::GpuTimer;

#[derive(Debug, Clone)]
pub struct KernelBenchConfig {
    /// Any of `up`, `gate_up`, `down`, `q`, `o`, `attn_decode`, `attn_prefill`.
    pub ops: Vec<String>,
    /// KV-cache lengths for `attn_decode`, prompt lengths for `attn_prefill` (batch 1).
    pub contexts: Vec<i64>,
    pub m: Vec<i64>,
    /// Group sizes for up/gate_up/down (q/o always use 512 = 4 heads of 128).
    pub groups: Vec<i64>,
    pub sparsity: Vec<f64>,
    /// Any of `cold` (flush buffer written), `cold-clean` (flush buffer read), `warm`.
    pub l2: Vec<String>,
    /// How the projections' masks are drawn.
    pub mask_pattern: MaskPattern,
    pub warmup: usize,
    pub iters: usize,
    pub device: Device,
    pub kind: Kind,
    pub out: Option<PathBuf>,
    pub commit: String,
    pub seed: i64,
}

/// How `bench kernels` draws a projection's mask `[M, groups]` at skip rate s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskPattern {
    /// Each (token, group) kept with probability 1 - s, independently: what the targets use.
    Random,
    /// Every group keeps the same first ceil((1 - s) M) tokens: each group's gathered rows are
    /// consecutive tokens, so the routed kernels' row gather reads contiguous memory (a
    /// diagnostic of the gather's cost, not a routing anyone would learn).
    Prefix,
    /// Each group keeps exactly ceil((1 - s) M) tokens drawn at random: random rows, equal
    /// counts (no group has a partial last tile where (1 - s) M fills whole tiles).
    RandomEven,
    /// Each group keeps its first c tokens, c the count a random mask gives that group:
    /// consecutive rows, the random masks' uneven counts.
    PrefixUneven,
}

impl std::str::FromStr for MaskPattern {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "random" => Ok(Self::Random),
            "prefix" => Ok(Self::Prefix),
            "random-even" => Ok(Self::RandomEven),
            "prefix-uneven" => Ok(Self::PrefixUneven),
            o => bail!("unknown mask pattern `{o}`: use random, prefix, random-even or prefix-uneven"),
        }
    }
}

impl MaskPattern {
    /// A fresh `[m, ng]` boolean mask at skip rate `s`.
    fn draw(self, m: i64, ng: i64, s: f64, device: Device) -> Tensor {
        // ceil((1 - s) m), without rounding error lifting an exact count (0.3 * 50) to the next.
        let keep = ((1.0 - s) * m as f64 - 1e-9).ceil() as i64;
        let tokens = || Tensor::arange(m, (Kind::Int64, device)).unsqueeze(1);
        match self {
            Self::Random => Tensor::rand([m, ng], (Kind::Float, device)).ge(s),
            Self::Prefix => tokens().lt(keep).expand([m, ng], false).contiguous(),
            Self::RandomEven => {
                // Each column's rank among m random draws: below `keep` for exactly `keep` tokens.
                let rank = Tensor::rand([m, ng], (Kind::Float, device)).argsort(0, false).argsort(0, false);
                rank.lt(keep)
            }
            Self::PrefixUneven => {
                let counts = Tensor::rand([m, ng], (Kind::Float, device)).ge(s).sum_dim_intlist([0i64].as_slice(), true, Kind::Int64);
                tokens().lt_tensor(&counts)
            }
        }
    }
    /// A fresh `[m, ng]` head-group mask of an attention op at skip rate `s`: `random` as for
    /// the projections; `random-even` keeps exactly ceil((1 - s) ng) groups of every token, at
    /// random (at batch 1 and 8 groups a random mask's active count is Binomial(8, 1 - s), and
    /// the call's time follows it; this fixes the count). Other patterns are projection
    /// diagnostics and are refused here.
    fn draw_attention(self, m: i64, ng: i64, s: f64, device: Device) -> Result<Tensor> {
        match self {
            Self::Random => Ok(Tensor::rand([m, ng], (Kind::Float, device)).ge(s)),
            Self::RandomEven => Ok(Self::RandomEven.draw(ng, m, s, device).transpose(0, 1).contiguous()),
            o => bail!("--mask-pattern {} applies to the projections only; attention ops take random or random-even", o.label()),
        }
    }
    fn label(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Prefix => "prefix",
            Self::RandomEven => "random-even",
            Self::PrefixUneven => "prefix-uneven",
        }
    }
}

struct OpSpec {
    name: &'static str,
    op: RoutedOp,
    n: i64,
    k: i64,
    fixed_group: Option<i64>,
}

fn spec(name: &str) -> Result<OpSpec> {
    Ok(match name {
        "up" => OpSpec { name: "up", op: RoutedOp::Mn, n: 14336, k: 4096, fixed_group: None },
        "gate_up" => OpSpec { name: "gate_up", op: RoutedOp::MnSwiglu, n: 14336, k: 4096, fixed_group: None },
        // down and O take inputs that are already zero at skipped slices (the routed SwiGLU's
        // and routed attention's outputs), so their dense fallback needs no masking pass.
        "down" => OpSpec { name: "down", op: RoutedOp::KPremasked, n: 4096, k: 14336, fixed_group: None },
        "q" => OpSpec { name: "q", op: RoutedOp::Mn, n: 4096, k: 4096, fixed_group: Some(512) },
        "o" => OpSpec { name: "o", op: RoutedOp::KPremasked, n: 4096, k: 4096, fixed_group: Some(512) },
        o => bail!("unknown op `{o}` for bench kernels: use up, gate_up, down, q, o, attn_decode or attn_prefill"),
    })
}

/// Measured ceilings of this device: device-to-device copy bandwidth and dense bf16 matmul.
fn ceilings(device: Device, timer: &GpuTimer) -> Result<serde_json::Value> {
    let n = 1i64 << 30; // 2 GiB of bf16 each way
    let a = Tensor::randn([n], (Kind::BFloat16, device));
    let mut b = Tensor::empty([n], (Kind::BFloat16, device));
    let mut v = vec![];
    for _ in 0..6 {
        timer.start()?;
        b.copy_(&a);
        v.push(timer.stop_ms()?);
    }
    let copy_ms = super::median(&mut v[1..].to_vec());
    drop((a, b));
    let s = 8192i64;
    let x = Tensor::randn([s, s], (Kind::BFloat16, device));
    let y = Tensor::randn([s, s], (Kind::BFloat16, device));
    let mut v = vec![];
    for _ in 0..6 {
        timer.start()?;
        let _ = x.matmul(&y);
        v.push(timer.stop_ms()?);
    }
    let mm_ms = super::median(&mut v[1..].to_vec());
    let gbps = 2.0 * (n as f64 * 2.0) / (copy_ms * 1e-3) / 1e9;
    let tflops = 2.0 * (s as f64).powi(3) / (mm_ms * 1e-3) / 1e12;
    eprintln!("ceilings: copy {gbps:.0} GB/s (read+write), bf16 matmul 8192^3 {tflops:.0} TFLOP/s");
    Ok(json!({"copy_gb_per_s": gbps, "matmul_bf16_tflops": tflops}))
}

pub fn run(cfg: &KernelBenchConfig) -> Result<serde_json::Value> {
    super::check_counts(cfg.iters, None, &[("--m", &cfg.m)])?;
    let _g = tch::no_grad_guard();
    tch::manual_seed(cfg.seed);
    for mode in &cfg.l2 {
        l2_mode(mode)?;
    }
    let device = cfg.device;
    let dev = cuda_index(device)?;
    let kind = cfg.kind;
    if !matches!(kind, Kind::BFloat16 | Kind::Half) {
        bail!("bench kernels runs bf16 or f16, got {kind:?}");
    }
    let timer = GpuTimer::new(dev)?;
    let ceil = ceilings(device, &timer)?;
    let l2 = wide_kernels::cuda::l2_cache_bytes(dev)?;
    let mut flush = wide_kernels::ops::l2_flush_buffer(dev, 256 << 20)?;
    let mut records = vec![];
    for opname in &cfg.ops {
        if opname == "attn_decode" {
            records.extend(bench_attn_decode(cfg, &timer, &mut flush)?);
            continue;
        }
        if opname == "attn_prefill" {
            records.extend(bench_attn_prefill(cfg, &timer, &mut flush)?);
            continue;
        }
        let sp = spec(opname)?;
        let groups = sp.fixed_group.map(|g| vec![g]).unwrap_or_else(|| cfg.groups.clone());
        for &m in &cfg.m {
            let x = Tensor::randn([m, sp.k], (kind, device));
            // Gate and up are views of one stacked weight, as in the inference engine; its dense
            // gate+up, one GEMM over both and the SwiGLU kernel, is a second dense baseline
            // beside the two GEMMs plus tch's activation.
            let w_gate_up = (sp.op == RoutedOp::MnSwiglu).then(|| Tensor::randn([2 * sp.n, sp.k], (kind, device)) * 0.02);
            let w = match &w_gate_up {
                Some(s) => s.narrow(0, 0, sp.n),
                None => Tensor::randn([sp.n, sp.k], (kind, device)) * 0.02,
            };
            let w2 = w_gate_up.as_ref().map(|s| s.narrow(0, sp.n, sp.n));
            let (xf, wf, w2f) = (x.to_kind(Kind::Float), w.to_kind(Kind::Float), w2.as_ref().map(|u| u.to_kind(Kind::Float)));
            for &g in &groups {
                let routed_dim = if sp.op.reduces_over_groups() { sp.k } else { sp.n };
                if routed_dim % g != 0 {
                    bail!("group size {g} does not divide {routed_dim} for op {}", sp.name);
                }
                let ng = routed_dim / g;
                for &s in &cfg.sparsity {
                    let new_mask = || cfg.mask_pattern.draw(m, ng, s, device);
                    // Check first: dispatch and the routed kernel against the f32 reference.
                    // Inputs of gemm_k ops are zero at skipped slices, as in the model.
                    let input = |msk: &Tensor| -> Tensor {
                        if sp.op.reduces_over_groups() {
                            let off = msk.logical_not().unsqueeze(-1);
                            x.view([m, ng, g]).masked_fill(&off, 0.0).view([m, sp.k])
                        } else {
                            x.shallow_clone()
                        }
                    };
                    let msk = new_mask();
                    let lay = route_layout(&msk)?.with_sparsity_hint(s);
                    let xin = input(&msk);
                    let r = match sp.op {
                        RoutedOp::K | RoutedOp::KPremasked => gemm_k_reference(&xf, &wf, &msk, g),
                        _ => gemm_mn_reference(&xf, &wf, w2f.as_ref(), &msk, g),
                    };
                    let shape = GemmShape { op: sp.op, m, n: sp.n, k: sp.k, group: g };
                    let routed_path = if skinny_feasible(&shape) {
                        GemmPath::GemvMma
                    } else if m <= GEMV_MAX_M {
                        GemmPath::Gemv
                    } else {
                        match tuned_for(sp.op, &xin, &w, w2.as_ref(), &lay, g)?.best_path() {
                            Some((p, _)) => p,
                            None => GemmPath::DenseMasked,
                        }
                    };
                    let rel = |y: &Tensor| -> f64 {
                        let y = y.to_kind(Kind::Float);
                        if y.isnan().any().int64_value(&[]) != 0 {
                            return f64::NAN;
                        }
                        let rn = r.norm().double_value(&[]);
                        (y - &r).norm().double_value(&[]) / rn.max(1e-30)
                    };
                    let (yr, _) = routed_gemm(sp.op, &xin, &w, w2.as_ref(), &lay, g, Some(routed_path))?;
                    let (yd, dispatch_path) = routed_gemm(sp.op, &xin, &w, w2.as_ref(), &lay, g, None)?;
                    let err = rel(&yr).max(rel(&yd));
                    if !(err < 1e-2) {
                        bail!("{} M={m} G={g} s={s}: relative error {err:.3e} against the f32 reference", sp.name);
                    }
                    drop(r);
                    for l2mode in &cfg.l2 {
                        let l2m = l2_mode(l2mode)?;
                        // Decode sizes are memory-bound: there the case also times a launch that only
                        // reads the weight bytes each call must read (`stream_read`, best of three grid
                        // sizes): all of W for dense, the groups some token uses for routed. The read is of
                        // that many contiguous bytes; gemm_k's routed slices are 2G-byte pieces of each row.
                        let ceiling = m <= 16;
                        let ng_all = routed_dim / g;
                        let group_bytes = g * if sp.op.reduces_over_groups() { sp.n } else { sp.k } * kind.elt_size_in_bytes() as i64;
                        let setup = || -> Result<(Tensor, Tensor, i64)> {
                            let msk = new_mask();
                            let x = input(&msk);
                            let used = if ceiling { msk.any_dim(0, false).sum(Kind::Int64).int64_value(&[]) } else { 0 };
                            Ok((msk, x, used))
                        };
                        let mut names = vec!["dense", "routed", "dispatch"];
                        if w_gate_up.is_some() {
                            names.push("dense_fused");
                        }
                        if ceiling {
                            names.extend(["read_dense_2", "read_dense_4", "read_dense_8", "read_routed_2", "read_routed_4", "read_routed_8"]);
                        }
                        let t = medians_ms(cfg, &timer, &mut flush, dev, l2m, setup, &names, |what, (msk, x, used)| {
                            if let Some(rest) = what.strip_prefix("read_") {
                                let groups = if rest.starts_with("routed") { *used } else { ng_all };
                                let bps = rest.rsplit('_').next().and_then(|b| b.parse().ok()).unwrap_or(2);
                                let bytes = groups * group_bytes;
                                return match &w2 {
                                    Some(u) => wide_kernels::ops::attention::stream_read(&w, bytes, u, bytes, bps),
                                    None => wide_kernels::ops::attention::stream_read(&w, bytes, &w, 0, bps),
                                };
                            }
                            match what {
                                "dense" => {
                                    let _ = match sp.op {
                                        RoutedOp::MnSwiglu => x.linear::<&Tensor>(&w, None).silu() * x.linear::<&Tensor>(w2.as_ref().unwrap(), None),
                                        _ => x.linear::<&Tensor>(&w, None),
                                    };
                                }
                                "dense_fused" => {
                                    let _ = wide_kernels::ops::fused::swiglu(&x.linear::<&Tensor>(w_gate_up.as_ref().unwrap(), None), None, 1)?;
                                }
                                "routed" => {
                                    let lay = route_layout(msk)?.with_sparsity_hint(s);
                                    let _ = routed_gemm(sp.op, x, &w, w2.as_ref(), &lay, g, Some(routed_path))?;
                                }
                                _ => {
                                    let lay = route_layout(msk)?.with_sparsity_hint(s);
                                    let _ = routed_gemm(sp.op, x, &w, w2.as_ref(), &lay, g, None)?;
                                }
                            }
                            Ok(())
                        })?;
                        let at = |name: &str| names.iter().position(|n| *n == name).map(|i| t[i]);
                        let (dense_ms, routed_ms, dispatch_ms) = (t[0], t[1], t[2]);
                        let dense_fused_ms = at("dense_fused");
                        let best = |prefix: &str| names.iter().zip(&t).filter(|(n, _)| n.starts_with(prefix)).map(|(_, &v)| v).fold(f64::INFINITY, f64::min);
                        let (read_dense_ms, read_routed_ms) = (best("read_dense"), best("read_routed"));
                        let mut rec = json!({
                            "op": sp.name, "M": m, "N": sp.n, "K": sp.k, "G": g, "sparsity": s, "l2": l2mode,
                            "dense_ms": dense_ms, "routed_ms": routed_ms, "speedup": dense_ms / routed_ms,
                            "routed_kernel": routed_path.label(),
                            "dispatch_path": dispatch_path.label(), "dispatch_ms": dispatch_ms,
                            "dispatch_speedup": dense_ms / dispatch_ms,
                            "max_rel_err": err,
                        });
                        if ceiling {
                            rec["read_dense_ms"] = json!(read_dense_ms);
                            rec["read_routed_ms"] = json!(read_routed_ms);
                            rec["read_ceiling_speedup"] = json!(read_dense_ms / read_routed_ms);
                            eprintln!(
                                "{:>7} M={m:>5} G={g:>3} s={s:.2} {l2mode}: read ceiling (the weight bytes alone) dense {read_dense_ms:.4} ms, routed {read_routed_ms:.4} ms ({:.2}x); routed at {:.0}% of its ceiling",
                                sp.name,
                                read_dense_ms / read_routed_ms,
                                100.0 * read_routed_ms / routed_ms
                            );
                        }
                        if let Some(f) = dense_fused_ms {
                            rec["dense_fused_ms"] = json!(f);
                            rec["speedup_vs_dense_fused"] = json!(f / routed_ms);
                            rec["dispatch_speedup_vs_dense_fused"] = json!(f / dispatch_ms);
                            eprintln!("{:>7} M={m:>5} G={g:>3} s={s:.2} {l2mode}: dense fused (one GEMM + SwiGLU kernel) {f:.4} ms: routed {:.2}x, dispatch {:.2}x", sp.name, f / routed_ms, f / dispatch_ms);
                        }
                        eprintln!(
                            "{:>7} M={m:>5} G={g:>3} s={s:.2} {l2mode}: dense {dense_ms:.4} ms  routed[{}] {routed_ms:.4} ms ({:.2}x)  dispatch[{}] {dispatch_ms:.4} ms ({:.2}x)  err {err:.1e}",
                            sp.name,
                            routed_path.label(),
                            dense_ms / routed_ms,
                            dispatch_path.label(),
                            dense_ms / dispatch_ms
                        );
                        records.push(rec);
                    }
                }
            }
        }
    }
    let tuned = super::autotune_json();
    let prov = Provenance::new(&cfg.commit, &device_label(device));
    let result = json!({
        "benchmark": "kernels",
        "provenance": prov,
        "settings": {"dtype": format!("{:?}", kind), "warmup": cfg.warmup, "iters": cfg.iters, "l2_bytes": l2,
                     "flush_bytes": flush.numel() * 4,
                     "timing": "median of CUDA-event-timed iterations, the variants of a case interleaved (each iteration times all of them on one fresh mask, in a rotating order); routed and dispatch include building the routing layout",
                     "mask_pattern": cfg.mask_pattern.label()},
        "ceilings": ceil,
        "records": records,
        "autotune": tuned,
    });
    print_table(&result);
    if let Some(out) = &cfg.out {
        write_json(out, &result).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(result)
}

fn print_table(r: &serde_json::Value) {
    println!("\n| op | M | G | sparsity | L2 | dense ms | routed ms | speedup | dispatch | dispatch x | rel err |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for c in r["records"].as_array().into_iter().flatten() {
        let f = |k: &str| c[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {} | {:.2} | {} | {:.4} | {:.4} ({}) | {:.2}x | {} | {:.2}x | {:.1e} |",
            c["op"].as_str().unwrap_or(""),
            c["M"],
            c["G"],
            f("sparsity"),
            c["l2"].as_str().unwrap_or(""),
            f("dense_ms"),
            f("routed_ms"),
            c["routed_kernel"].as_str().unwrap_or(""),
            f("speedup"),
            c["dispatch_path"].as_str().unwrap_or(""),
            f("dispatch_speedup"),
            f("max_rel_err")
        );
    }
    let fused: Vec<_> = r["records"].as_array().into_iter().flatten().filter(|c| c.get("dense_fused_ms").is_some()).collect();
    if !fused.is_empty() {
        println!("\ngate+up against the engine's dense (one GEMM over gate|up, then the SwiGLU kernel):\n");
        println!("| op | M | G | sparsity | L2 | dense fused ms | routed x | dispatch x |");
        println!("|---|---|---|---|---|---|---|---|");
        for c in fused {
            let f = |k: &str| c[k].as_f64().unwrap_or(f64::NAN);
            println!(
                "| {} | {} | {} | {:.2} | {} | {:.4} | {:.2}x | {:.2}x |",
                c["op"].as_str().unwrap_or(""),
                c["M"],
                c["G"],
                f("sparsity"),
                c["l2"].as_str().unwrap_or(""),
                f("dense_fused_ms"),
                f("speedup_vs_dense_fused"),
                f("dispatch_speedup_vs_dense_fused")
            );
        }
    }
}

/// What happens to the L2 between timed runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum L2Mode {
    /// The same call run once, untimed, just before the timed one: its own operands are in L2,
    /// as when a product repeats on the same weights. (Before `warm` meant whatever the variant
    /// timed before it left there; with the rotation that was always the same neighbour, and the
    /// same cuBLAS call read 5-7% apart in two slots of one iteration.)
    Warm,
    /// `cold`: the flush buffer (at least twice the L2) is written, so the timed call starts on
    /// an L2 full of dirty lines of another buffer and pays their write-back as it evicts them.
    ColdDirty,
    /// `cold-clean`: the flush buffer is read (summed), so the timed call starts on an L2 full of
    /// clean lines of another buffer, as after the weight reads of an inference step; none of
    /// its operands are resident either way.
    ColdClean,
}

/// Parses an `--l2` mode.
fn l2_mode(mode: &str) -> Result<L2Mode> {
    match mode {
        "cold" => Ok(L2Mode::ColdDirty),
        "cold-clean" => Ok(L2Mode::ColdClean),
        "warm" => Ok(L2Mode::Warm),
        o => bail!("--l2 takes cold, cold-clean or warm, got {o}"),
    }
}

/// Median device times (ms) of the variants `names`, timed interleaved: each of the
/// `cfg.warmup + cfg.iters` iterations draws one set of inputs with `setup` (outside the timed
/// regions) and times every variant on it once, in an order rotated by one each iteration, so
/// that clock and power drift over a case and the position after the input draw fall on all
/// variants alike (timed one after another, the same dense product differed by up to 17% between
/// cases at 16384 tokens). Before each timed call the L2 is prepared per `l2` (the flush buffer
/// written or read, or the same call run once untimed) and a device spin is queued so the host
/// enqueues the timed launches ahead of the GPU (as a CUDA-graph replay would run them).
#[allow(clippy::too_many_arguments)]
fn medians_ms<S>(
    cfg: &KernelBenchConfig,
    timer: &GpuTimer,
    flush: &mut Tensor,
    dev: usize,
    l2: L2Mode,
    mut setup: impl FnMut() -> Result<S>,
    names: &[&str],
    mut call: impl FnMut(&str, &S) -> Result<()>,
) -> Result<Vec<f64>> {
    let n = names.len();
    let mut v = vec![Vec::with_capacity(cfg.iters); n];
    for it in 0..cfg.warmup + cfg.iters {
        let inputs = setup()?;
        for j in 0..n {
            let i = (it + j) % n;
            match l2 {
                L2Mode::ColdDirty => {
                    let _ = flush.fill_((it * n + j) as f64);
                }
                L2Mode::ColdClean => {
                    let _ = flush.sum(Kind::Float);
                }
                L2Mode::Warm => call(names[i], &inputs)?,
            }
            wide_kernels::ops::gpu_spin(dev, 200)?;
            timer.start()?;
            call(names[i], &inputs)?;
            let ms = timer.stop_ms()?;
            if it >= cfg.warmup {
                v[i].push(ms);
            }
        }
    }
    Ok(v.iter_mut().map(|x| super::median(x)).collect())
}

/// The attention benchmarks' heads: Llama-3.1-8B's 32 query and 8 KV heads of 128, in groups of
/// 4 query heads (one KV head).
const LLAMA_8B_HEADS: (i64, i64, i64, i64) = (32, 8, 128, 4);

fn cuda_index(device: Device) -> Result<usize> {
    match device {
        Device::Cuda(d) => Ok(d),
        _ => bail!("bench kernels needs a CUDA device (--device cuda)"),
    }
}

/// Decode attention, Llama-3.1-8B heads (32 query, 8 KV, head dim 128, groups of 4 query
/// heads = one KV head), batch 1. Dense = the faster of SDPA (GQA) and our kernel with every
/// group active; routed = our kernel with a fresh random head-group mask.
fn bench_attn_decode(cfg: &KernelBenchConfig, timer: &GpuTimer, flush: &mut Tensor) -> Result<Vec<serde_json::Value>> {
    let device = cfg.device;
    let dev = cuda_index(device)?;
    let (hq, hkv, d, gh) = LLAMA_8B_HEADS;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![];
    for &t in &cfg.contexts {
        let q = Tensor::randn([1, hq, d], (cfg.kind, device));
        let k = Tensor::randn([1, hkv, t, d], (cfg.kind, device));
        let v = Tensor::randn([1, hkv, t, d], (cfg.kind, device));
        let len = Tensor::from_slice(&[t as i32]).to_device(device);
        let all = Tensor::ones([1, hq / gh], (Kind::Bool, device));
        for &s in &cfg.sparsity {
            let new_mask = || cfg.mask_pattern.draw_attention(1, hq / gh, s, device);
            let msk = new_mask()?;
            let r = wide_kernels::attention_decode_reference(&q.to_kind(Kind::Float), &k.to_kind(Kind::Float), &v.to_kind(Kind::Float), &len, &msk, gh, scale);
            let y = wide_kernels::attention_decode(&q, &k, &v, &len, &msk, gh, scale)?.to_kind(Kind::Float);
            let err = if r.norm().double_value(&[]) == 0.0 {
                y.abs().max().double_value(&[])
            } else {
                (&y - &r).norm().double_value(&[]) / r.norm().double_value(&[])
            };
            if !(err < 1e-2) {
                bail!("attn_decode T={t} s={s}: relative error {err:.3e} against the f32 reference");
            }
            for l2mode in &cfg.l2 {
                let l2m = l2_mode(l2mode)?;
                // K/V bytes of one KV head (what a call reads per active head).
                let head_bytes = t * d * cfg.kind.elt_size_in_bytes() as i64;
                let setup = || -> Result<(Tensor, i64)> {
                    let msk = new_mask()?;
                    // Active KV heads of this mask (groups of 4 heads = one KV head each).
                    let act = msk.sum(Kind::Int64).int64_value(&[]);
                    Ok((msk, act))
                };
                // The read ceiling: one launch reading the same K/V bytes and nothing else, at a
                // few grid sizes (2, 4, 8 blocks a multiprocessor); the best of them counts.
                let names = ["sdpa", "own_dense", "routed", "read_dense_2", "read_dense_4", "read_dense_8", "read_routed_2", "read_routed_4", "read_routed_8"];
                let tm = medians_ms(cfg, timer, flush, dev, l2m, setup, &names, |what, &(ref msk, act)| {
                    match what {
                        "sdpa" => {
                            let _ = Tensor::scaled_dot_product_attention(&q.unsqueeze(2), &k, &v, None::<Tensor>, 0.0, false, scale, true);
                        }
                        "own_dense" => {
                            let _ = wide_kernels::attention_decode(&q, &k, &v, &len, &all, gh, scale)?;
                        }
                        "routed" => {
                            let _ = wide_kernels::attention_decode(&q, &k, &v, &len, msk, gh, scale)?;
                        }
                        r => {
                            let heads = if r.starts_with("read_routed") { act } else { hkv };
                            let bps = r.rsplit('_').next().and_then(|b| b.parse().ok()).unwrap_or(2);
                            wide_kernels::ops::attention::stream_read(&k, heads * head_bytes, &v, heads * head_bytes, bps)?;
                        }
                    }
                    Ok(())
                })?;
                let (sdpa_ms, own_ms, routed_ms) = (tm[0], tm[1], tm[2]);
                let dense_ms = sdpa_ms.min(own_ms);
                let read_dense_ms = tm[3..6].iter().cloned().fold(f64::INFINITY, f64::min);
                let read_routed_ms = tm[6..9].iter().cloned().fold(f64::INFINITY, f64::min);
                eprintln!(
                    "attn_decode T={t:>6} s={s:.2} {l2mode}: sdpa {sdpa_ms:.4} ms  own all-active {own_ms:.4} ms  routed {routed_ms:.4} ms ({:.2}x)  err {err:.1e}  read ceiling {read_dense_ms:.4} / {read_routed_ms:.4} ms ({:.2}x)",
                    dense_ms / routed_ms,
                    read_dense_ms / read_routed_ms
                );
                out.push(json!({
                    "op": "attn_decode", "M": 1, "N": t, "K": d, "G": gh, "sparsity": s, "l2": l2mode, "mask_pattern": cfg.mask_pattern.label(),
                    "dense_ms": dense_ms, "routed_ms": routed_ms, "speedup": dense_ms / routed_ms,
                    "sdpa_ms": sdpa_ms, "own_dense_ms": own_ms, "routed_kernel": "attn_decode_split",
                    "read_dense_ms": read_dense_ms, "read_routed_ms": read_routed_ms, "read_ceiling_speedup": read_dense_ms / read_routed_ms,
                    "dispatch_path": "attn_decode_split", "dispatch_ms": routed_ms, "dispatch_speedup": dense_ms / routed_ms,
                    "max_rel_err": err, "shape": "batch 1, 32 query heads, 8 KV heads, head dim 128; N = context tokens",
                }));
            }
        }
    }
    Ok(out)
}

/// Prefill attention, Llama-3.1-8B heads (32 query, 8 KV, head dim 128, 8 groups of 4 query
/// heads), batch 1, causal, prompt lengths from `--contexts`. Dense = SDPA (flash, GQA) alone;
/// dense+zero = SDPA and the zero pass over the skipped rows (the dense path of
/// `attention_prefill`); routed = `attention_prefill_routed` (layout + kernel) for every block
/// shape, the one `PrefillTile::choose` picks being `routed_ms`; dispatch = `attention_prefill`
/// (from 8192 tokens it measures the mask's skip rate: one sync), hinted =
/// `attention_prefill_with` given the skip rate. Outputs are checked
/// against an f32 reference on the first 4 query heads (one KV head) before timing.
fn bench_attn_prefill(cfg: &KernelBenchConfig, timer: &GpuTimer, flush: &mut Tensor) -> Result<Vec<serde_json::Value>> {
    use wide_kernels::ops::attention::{attention_prefill_dense, attention_prefill_routed, PrefillTile, PREFILL_TILES};
    let device = cfg.device;
    let dev = cuda_index(device)?;
    let (hq, hkv, d, gh) = LLAMA_8B_HEADS;
    let ng = hq / gh;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![];
    for &t in &cfg.contexts {
        let q = Tensor::randn([1, hq, t, d], (cfg.kind, device));
        let k = Tensor::randn([1, hkv, t, d], (cfg.kind, device));
        let v = Tensor::randn([1, hkv, t, d], (cfg.kind, device));
        // Causal FLOPs of the dense op (QK^T and PV over the lower triangle incl. the diagonal).
        let dense_flops = 4.0 * (hq * d) as f64 * (t as f64) * (t as f64 + 1.0) / 2.0;
        for &s in &cfg.sparsity {
            let default_tile = PrefillTile::choose_for(dev, d, 1, hq, t, s);
            let new_mask = || -> Result<Tensor> { Ok(cfg.mask_pattern.draw_attention(t, ng, s, device)?.unsqueeze(0)) };
            let msk = new_mask()?;
            // f32 reference on one KV head's 4 query heads (group 0): SDPA in f32 (the
            // memory-efficient kernel, no [T, T] scores in memory), then the zero rows.
            let f = |x: &Tensor| x.to_kind(Kind::Float);
            let (q4, k1, v1) = (f(&q.narrow(1, 0, 4)), f(&k.narrow(1, 0, 1)), f(&v.narrow(1, 0, 1)));
            let r = Tensor::scaled_dot_product_attention(&q4, &k1.expand([1, 4, t, d], false).contiguous(), &v1.expand([1, 4, t, d], false).contiguous(), None::<Tensor>, 0.0, true, scale, false);
            let off0 = msk.narrow(2, 0, 1).logical_not().view([1, 1, t, 1]);
            let r = r.masked_fill(&off0, 0.0);
            let rel = |y: &Tensor| -> f64 {
                let y4 = f(&y.narrow(1, 0, 4));
                let rn = r.norm().double_value(&[]);
                let e = (&y4 - &r).norm().double_value(&[]);
                if rn == 0.0 { e } else { e / rn }
            };
            let mut errs = vec![];
            for tile in PREFILL_TILES.into_iter().filter(|x| x.supports(d, dev)) {
                let y = attention_prefill_routed(&q, &k, &v, &msk, gh, scale, tile)?;
                let nan = y.isnan().any().int64_value(&[]);
                let err = rel(&y);
                if nan != 0 || !(err < 1e-2) {
                    bail!("attn_prefill T={t} s={s} {}: relative error {err:.3e} against the f32 reference (NaN: {nan})", tile.name());
                }
                errs.push(err);
            }
            let err = errs.iter().cloned().fold(0.0, f64::max);
            let dense_err = rel(&attention_prefill_dense(&q, &k, &v, &msk, gh, scale)?);
            for l2mode in &cfg.l2 {
                let l2m = l2_mode(l2mode)?;
                let tiles_on: Vec<PrefillTile> = PREFILL_TILES.into_iter().filter(|x| x.supports(d, dev)).collect();
                let tile_names: Vec<String> = tiles_on.iter().map(|x| x.name()).collect();
                let mut names = vec!["sdpa", "sdpa_zero", "dispatch", "dispatch_hint"];
                names.extend(tile_names.iter().map(|x| x.as_str()));
                let tm = medians_ms(cfg, timer, flush, dev, l2m, new_mask, &names, |what, msk| {
                    match what {
                        "sdpa" => {
                            let _ = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, scale, true);
                        }
                        "sdpa_zero" => {
                            let _ = attention_prefill_dense(&q, &k, &v, msk, gh, scale)?;
                        }
                        "dispatch" => {
                            let _ = wide_kernels::attention_prefill(&q, &k, &v, None, msk, gh, scale)?;
                        }
                        "dispatch_hint" => {
                            let _ = wide_kernels::ops::attention::attention_prefill_with(&q, &k, &v, None, msk, gh, scale, Some(s))?;
                        }
                        name => {
                            let tile = PrefillTile::parse(name).context("unknown prefill tile")?;
                            let _ = attention_prefill_routed(&q, &k, &v, msk, gh, scale, tile)?;
                        }
                    }
                    Ok(())
                })?;
                let (sdpa_ms, zero_ms, dispatch_ms, dispatch_hint_ms) = (tm[0], tm[1], tm[2], tm[3]);
                let mut tiles = vec![];
                let mut routed_ms = f64::NAN;
                for (tile, &ms) in tiles_on.iter().zip(&tm[4..]) {
                    if *tile == default_tile {
                        routed_ms = ms;
                    }
                    tiles.push(json!({"tile": tile.name(), "ms": ms, "tflops_active": (1.0 - s) * dense_flops / (ms * 1e-3) / 1e12}));
                }
                // The hinted dispatch follows the rule; so does the unhinted one with the wgmma kernel
                // (no skip rate needed), while for the mma.sync kernel it measures the skip rate
                // only from PREFILL_MEASURE_MIN_TOKENS and runs SDPA + zero below.
                let wg = wide_kernels::ops::attention::PREFILL_WGMMA.supports(d, dev);
                let rule = wide_kernels::ops::attention::prefill_routed_pays(t, s, wg);
                let dispatch_hint_path = if rule { "routed" } else { "sdpa+zero" };
                let dispatch_path = if rule && (wg || t >= wide_kernels::ops::attention::PREFILL_MEASURE_MIN_TOKENS) { "routed" } else { "sdpa+zero" };
                let tiles_txt: Vec<String> = tiles.iter().map(|x| format!("{} {:.4}", x["tile"].as_str().unwrap_or(""), x["ms"].as_f64().unwrap_or(f64::NAN))).collect();
                eprintln!(
                    "attn_prefill T={t:>6} s={s:.2} {l2mode}: sdpa {sdpa_ms:.4} ms ({:.0} TFLOP/s)  sdpa+zero {zero_ms:.4}  routed {routed_ms:.4} ms ({:.2}x sdpa, {:.2}x sdpa+zero; {:.0} TFLOP/s active)  [{}]  dispatch {dispatch_ms:.4} ({dispatch_path}) / hinted {dispatch_hint_ms:.4} ({dispatch_hint_path})  err {err:.1e}",
                    dense_flops / (sdpa_ms * 1e-3) / 1e12,
                    sdpa_ms / routed_ms,
                    zero_ms / routed_ms,
                    (1.0 - s) * dense_flops / (routed_ms * 1e-3) / 1e12,
                    tiles_txt.join(", ")
                );
                out.push(json!({
                    "op": "attn_prefill", "M": t, "N": t, "K": d, "G": gh, "sparsity": s, "l2": l2mode, "mask_pattern": cfg.mask_pattern.label(),
                    "dense_ms": sdpa_ms, "routed_ms": routed_ms, "speedup": sdpa_ms / routed_ms,
                    "sdpa_ms": sdpa_ms, "sdpa_zero_ms": zero_ms, "speedup_vs_sdpa_zero": zero_ms / routed_ms,
                    "routed_kernel": format!("attn_prefill {}", default_tile.name()), "tiles": tiles,
                    "dispatch_path": dispatch_path, "dispatch_ms": dispatch_ms, "dispatch_speedup": sdpa_ms / dispatch_ms,
                    "dispatch_hint_ms": dispatch_hint_ms, "dispatch_hint_path": dispatch_hint_path,
                    "dense_gflop": dense_flops / 1e9, "routed_gflop_expected": (1.0 - s) * dense_flops / 1e9,
                    "dense_tflops": dense_flops / (sdpa_ms * 1e-3) / 1e12,
                    "max_rel_err": err, "sdpa_zero_rel_err": dense_err,
                    "shape": "batch 1, causal, 32 query heads, 8 KV heads, head dim 128, 8 groups of 4 heads; M = N = prompt tokens; error on query heads 0-3 against f32",
                }));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_masks_fix_the_count_per_token() {
        for s in [0.25, 0.5, 0.75] {
            let m = MaskPattern::RandomEven.draw_attention(5, 8, s, Device::Cpu).unwrap();
            assert_eq!(m.size(), [5, 8]);
            let per_token: Vec<i64> = Vec::try_from(m.to_kind(Kind::Int64).sum_dim_intlist([1i64].as_slice(), false, Kind::Int64)).unwrap();
            assert_eq!(per_token, vec![((1.0 - s) * 8.0) as i64; 5], "s = {s}");
        }
        let e = MaskPattern::Prefix.draw_attention(1, 8, 0.5, Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("projections only"), "{e}");
    }

    #[test]
    fn mask_patterns() {
        let (m, ng) = (10, 3);
        let p = MaskPattern::Prefix.draw(m, ng, 0.5, Device::Cpu);
        assert_eq!(p.size(), [m, ng]);
        // The same first ceil(0.5 * 10) = 5 tokens in every group.
        let rows: Vec<i64> = Vec::try_from(p.to_kind(Kind::Int64).sum_dim_intlist([1i64].as_slice(), false, Kind::Int64)).unwrap();
        assert_eq!(rows, [3, 3, 3, 3, 3, 0, 0, 0, 0, 0]);
        let p = MaskPattern::Prefix.draw(m, ng, 0.75, Device::Cpu);
        assert_eq!(p.sum(Kind::Int64).int64_value(&[]), 3 * 3, "ceil(0.25 * 10) = 3 tokens");
        let r = MaskPattern::Random.draw(1000, 8, 0.25, Device::Cpu);
        let kept = r.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!((kept - 0.75).abs() < 0.03, "{kept}");
        // Exactly ceil(0.3 * 50) = 15 random tokens a group.
        let e = MaskPattern::RandomEven.draw(50, 6, 0.7, Device::Cpu);
        let per_group: Vec<i64> = Vec::try_from(e.to_kind(Kind::Int64).sum_dim_intlist([0i64].as_slice(), false, Kind::Int64)).unwrap();
        assert_eq!(per_group, [15; 6]);
        assert_ne!(e.narrow(1, 0, 1), e.narrow(1, 1, 1), "groups draw their own tokens");
        // A prefix of each group's own (random) count.
        let u = MaskPattern::PrefixUneven.draw(400, 5, 0.5, Device::Cpu).to_kind(Kind::Int64);
        let counts: Vec<i64> = Vec::try_from(u.sum_dim_intlist([0i64].as_slice(), false, Kind::Int64)).unwrap();
        for (g, &c) in counts.iter().enumerate() {
            assert!((140..260).contains(&c), "group {g}: {c}");
            assert_eq!(u.narrow(1, g as i64, 1).narrow(0, 0, c).sum(Kind::Int64).int64_value(&[]), c, "the first {c} tokens");
        }
        assert_eq!("prefix".parse::<MaskPattern>().unwrap(), MaskPattern::Prefix);
        assert_eq!("random-even".parse::<MaskPattern>().unwrap(), MaskPattern::RandomEven);
        assert!("striped".parse::<MaskPattern>().unwrap_err().to_string().contains("use random, prefix"));
    }
}
