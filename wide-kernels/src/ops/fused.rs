//! Fused element-wise ops of the inference path, each with its tch reference (any device and
//! dtype) and a CUDA kernel (bf16/f16) from `infer.cu`:
//!
//! - [`add_rmsnorm`]: residual add and RMSNorm in one pass ([`add_rmsnorm_router`]: and the first
//!   layer of the router that reads the same residual; [`add_rmsnorm_router_gate`]: and the whole
//!   router with its gate);
//! - [`rope_qkv_cache`]: RoPE on the fused q/k/v projection, q out in attention layout, k and v
//!   written into the KV cache at each token's position;
//! - [`swiglu`]: `silu(gate) * up` from the fused gate|up projection, zero at skipped groups;
//! - [`router_gate`]: a token router (two linears) and its deterministic gate ([`router_prefill`]:
//!   the whole router in one clustered launch on Hopper).
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{ensure, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(include_str!("mma_sync.cuh"), include_str!("pdl.cuh"), include_str!("router_gate.cuh"), include_str!("mbarrier.cuh"), include_str!("rope.cuh"), include_str!("infer.cu"));

pub fn source(f16: bool) -> KernelSource {
    KernelSource::new("infer", SOURCE).define("WIDE_F16", f16 as u32)
}

pub fn kernel_variants() -> Vec<KernelSource> {
    vec![source(false), source(true)]
}

/// Loaded entry points by (f16, entry, device).
type KernelCache = Mutex<HashMap<(bool, &'static str, usize), CudaKernel>>;

fn kernel(f16: bool, entry: &'static str, device: usize) -> Result<CudaKernel> {
    static K: OnceLock<KernelCache> = OnceLock::new();
    let key = (f16, entry, device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&source(f16), entry, device)?;
    // The prefill router's launches ask for up to MAX_DYNAMIC_SMEM: the limit raised as it loads.
    if entry.starts_with("router_prefill") {
        k.set_max_dynamic_shared_mem(MAX_DYNAMIC_SMEM as u32)?;
    }
    K.get_or_init(Default::default).lock().unwrap().insert(key, k);
    Ok(k)
}

/// Whether the norm launch that also gates runs as one thread-block cluster a token
/// (`add_rmsnorm_router_cluster`): compute capability 9.0 or later, unless
/// `WIDE_ROUTER_CLUSTER=0` (read once) keeps the arrival-counter version.
fn cluster_router(device: usize) -> Result<bool> {
    static OFF: OnceLock<bool> = OnceLock::new();
    if *OFF.get_or_init(|| crate::knobs::switch("WIDE_ROUTER_CLUSTER") == Some(false)) {
        return Ok(false);
    }
    Ok(crate::cuda::compute_major(device)? >= 9)
}

/// The CUDA device and f16 flag when `t` can take the kernels (CUDA, bf16 or f16), unless
/// `WIDE_FUSED=ref` forces the references (to compare the two on a GPU).
fn cuda_of(t: &Tensor) -> Option<(usize, bool)> {
    static FORCE_REF: OnceLock<bool> = OnceLock::new();
    if *FORCE_REF.get_or_init(|| crate::knobs::choice("WIDE_FUSED", &["ref"]).is_some()) {
        return None;
    }
    match (t.device(), t.kind()) {
        (Device::Cuda(d), Kind::BFloat16) => Some((d, false)),
        (Device::Cuda(d), Kind::Half) => Some((d, true)),
        _ => None,
    }
}

/// RMSNorm as the backbone computes it (f32 statistics, normalised value rounded to the input
/// dtype, then scaled by the weight in that dtype).
pub fn rmsnorm_reference(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let h = x.to_kind(Kind::Float);
    let var = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    w * (h * (var + eps).rsqrt()).to_kind(kind)
}

/// `x, delta: [M, H]` (delta optional), `w: [H]` -> `(x + delta, rmsnorm(x + delta) * w)`.
pub fn add_rmsnorm(x: &Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (res, out, _, _) = add_rmsnorm_impl(x, delta, w, eps, None, None, false)?;
    Ok((res, out))
}

/// [`add_rmsnorm`] where the caller promises that the launch just before wrote neither `x` nor
/// `w` (a decode step's residual, two or more launches old, with `delta` the projection just
/// before): on CUDA the kernel then loads x's rows and the weights before it waits for that
/// launch (programmatic dependent launch), and only delta after.
pub fn add_rmsnorm_settled(x: &Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (res, out, _, _) = add_rmsnorm_impl(x, delta, w, eps, None, None, norm_early())?;
    Ok((res, out))
}

/// `WIDE_NORM_EARLY=0`: [`add_rmsnorm_settled`] loads everything after the wait, like
/// [`add_rmsnorm`] (read once; for A/B benchmarks).
fn norm_early() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_NORM_EARLY") != Some(false))
}

/// [`add_rmsnorm`] and the first layer of a router reading the same residual (`w1: [R, H]`,
/// `b1: [R]`): returns `(res, norm, res W1^T + b1)`. On CUDA one launch does both (decode: a
/// GEMV launch fewer per router); the hidden `[M, R]` then feeds [`router_gate_from_hidden`].
pub fn add_rmsnorm_router(x: &Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f64, w1: &Tensor, b1: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (res, out, h1, _) = add_rmsnorm_impl(x, delta, w, eps, Some((w1, b1)), None, false)?;
    let h1 = match h1 {
        Some(h) => h,
        None => res.linear(w1, Some(b1)),
    };
    Ok((res, out, h1))
}

/// Outputs of [`add_rmsnorm_router_gate`].
pub struct NormRouterGate {
    pub res: Tensor,
    pub norm: Tensor,
    /// The router's first layer on `res`, `[M, R]`.
    pub hidden: Tensor,
    /// The execute mask bool `[M, groups]` and, with `extra > 0`, the extended mask.
    pub mask: Tensor,
    pub ext: Option<Tensor>,
}

/// [`add_rmsnorm`], the whole router on the residual and its gate (as
/// [`router_gate_from_hidden`] with `offset` and `extra`). On CUDA, for up to 65536 tokens, one
/// launch does all of it: the last block to finish a token's router hidden runs the second
/// layer and the gate (decode: no router launch at all).
pub fn add_rmsnorm_router_gate(x: &Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f64, r: &RouterWeights, offset: f64, extra: i64) -> Result<NormRouterGate> {
    let (res, norm, h1, gated) = add_rmsnorm_impl(x, delta, w, eps, Some((r.w1, r.b1)), Some((r, offset, extra)), false)?;
    let hidden = match h1 {
        Some(h) => h,
        None => res.linear(r.w1, Some(r.b1)),
    };
    let (mask, ext) = match gated {
        Some(g) => g,
        None => router_gate_from_hidden(&hidden, r, offset, extra)?,
    };
    Ok(NormRouterGate { res, norm, hidden, mask, ext })
}

/// Blocks that share one row's writes in the plain norm launch, for up to NORM_SPLIT_MAX_M rows
/// (decode batches; every block reads the row and computes its statistics, the same way).
/// `WIDE_NORM_SPLIT=N` (read once, 1-32) sets the count; 1 is one block a row.
fn norm_split() -> u32 {
    static V: OnceLock<u32> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_NORM_SPLIT", 1..=32, "blocks sharing a row").map_or(8, |n| n as u32))
}
const NORM_SPLIT_MAX_M: i64 = 16;

/// Dynamic shared memory a launch may use without opting in (48 KiB): the clustered norm +
/// router's block 0 copies the gate (second router layer and its bias) next to the residual row
/// only while both fit.
const DEFAULT_DYNAMIC_SMEM: i64 = 48 * 1024;

/// Tokens the fused gate takes (the kernel's arrival counters, `ROUTER_TICKETS` in infer.cu).
const ROUTER_TICKETS: i64 = 65536;

type Gated = Option<(Tensor, Option<Tensor>)>;

fn add_rmsnorm_impl(
    x: &Tensor,
    delta: Option<&Tensor>,
    w: &Tensor,
    eps: f64,
    router: Option<(&Tensor, &Tensor)>,
    gate: Option<(&RouterWeights, f64, i64)>,
    pre: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>, Gated)> {
    let (m, h) = x.size2()?;
    if let Some(d) = delta {
        ensure!(d.size() == [m, h], "add_rmsnorm: delta {:?} must match x [{m}, {h}]", d.size());
    }
    ensure!(w.size() == [h], "add_rmsnorm: weight {:?} must be [{h}]", w.size());
    if let Some((w1, b1)) = router {
        ensure!(w1.dim() == 2 && w1.size()[1] == h && b1.size() == [w1.size()[0]], "add_rmsnorm_router: router {:?} / {:?} does not take hidden size {h}", w1.size(), b1.size());
    }
    // The kernels read every tensor as x's element type; other dtypes take the reference.
    let same = |t: &Tensor| t.kind() == x.kind() && t.device() == x.device();
    match cuda_of(x) {
        Some((dev, f16)) if h <= 16 * 512 && x.is_contiguous() && delta.is_none_or(|d| d.is_contiguous() && same(d)) && same(w) => {
            // Contiguous copies live until the launch: a temporary freed before it could be
            // handed back by the caching allocator to an output allocated below.
            let w_c = w.contiguous();
            let router_c = router.map(|(w1, b1)| (w1.contiguous(), b1.contiguous()));
            let gate_c = gate.map(|(rw, _, _)| (rw.w2.contiguous(), rw.b2.contiguous()));
            let res = match delta {
                Some(_) => x.empty_like(),
                None => x.shallow_clone(),
            };
            let out = x.empty_like();
            let threads = (((h + 15) / 16).clamp(32, 512) as u32).div_ceil(32) * 32;
            let mut args = vec![
                KernelArg::tensor(x)?,
                KernelArg::tensor(delta.unwrap_or(x))?,
                KernelArg::tensor(&w_c)?,
                KernelArg::tensor(&res)?,
                KernelArg::tensor(&out)?,
                KernelArg::I32(h as i32),
                KernelArg::F32(eps as f32),
                KernelArg::I32(delta.is_some() as i32),
            ];
            // The router kernels read the residual row in 16-byte pieces.
            let aligned = |t: &Tensor| t.data_ptr() as usize % 16 == 0;
            let fused = router_c.as_ref().filter(|(w1, b1)| h % 8 == 0 && same(w1) && same(b1) && aligned(x) && delta.is_none_or(aligned));
            let mut gated = None;
            let mut cluster = None;
            let (entry, grid, smem, h1) = match fused {
                Some((w1, b1)) => {
                    let r = w1.size()[0];
                    let h1 = Tensor::empty([m, r], (x.kind(), x.device()));
                    let g = gate.zip(gate_c.as_ref()).filter(|(_, (w2, b2))| m <= ROUTER_TICKETS && r <= 256.min(h) && same(w2) && same(b2) && w2.dim() == 2 && w2.size()[1] == r);
                    // With the gate on a Hopper GPU: one cluster of at most 8 blocks a token
                    // (add_rmsnorm_router_cluster), 16 warps, RPB outputs a block.
                    let rpb_cluster = (r as u32).div_ceil(8).next_power_of_two();
                    if g.is_some() && r <= 128 && rpb_cluster <= 16 && cluster_router(dev)? {
                        cluster = Some((r as u32).div_ceil(rpb_cluster));
                    }
                    // Router outputs a block: its warps split each output's row four ways (at
                    // H = 4096: 8 warps, 2 outputs a block, 1024 elements a warp).
                    let rpb = match cluster {
                        Some(_) => rpb_cluster,
                        None => ((threads / 32) / 4).max(1),
                    };
                    args.extend([KernelArg::tensor(w1)?, KernelArg::tensor(b1)?, KernelArg::tensor(&h1)?, KernelArg::I32(r as i32), KernelArg::I32(rpb as i32)]);
                    match g {
                        Some(((_, offset, extra), (w2, b2))) => {
                            let ng = gate_groups(w2, b2, r)?;
                            let mask = Tensor::empty([m, ng], (Kind::Bool, x.device()));
                            let ext = (extra > 0).then(|| Tensor::empty([m, ng + extra], (Kind::Bool, x.device())));
                            args.extend([
                                KernelArg::tensor(w2)?,
                                KernelArg::tensor(b2)?,
                                KernelArg::F32(offset as f32),
                                KernelArg::tensor(&mask)?,
                                match &ext {
                                    Some(t) => KernelArg::tensor(t)?,
                                    None => KernelArg::Ptr(0),
                                },
                                KernelArg::I32(ng as i32),
                                KernelArg::I32(extra as i32),
                            ]);
                            gated = Some((mask, ext));
                        }
                        None => args.extend([KernelArg::Ptr(0), KernelArg::Ptr(0), KernelArg::F32(0.0), KernelArg::Ptr(0), KernelArg::Ptr(0), KernelArg::I32(0), KernelArg::I32(0)]),
                    }
                    // The clustered kernel's block 0 holds the gate's weights in shared memory
                    // (16-byte rows) when they are small.
                    let gate_bytes = g.map_or(0, |(_, (w2, b2))| (w2.numel() + b2.numel()) as i64 * x.kind().elt_size_in_bytes() as i64);
                    let w2_shared = cluster.is_some() && r % 8 == 0 && 4 * h + gate_bytes <= DEFAULT_DYNAMIC_SMEM;
                    args.push(KernelArg::I32(w2_shared as i32));
                    // The residual row in shared memory (H floats; the gate reuses it for h1).
                    match cluster {
                        Some(nb) => ("add_rmsnorm_router_cluster", (m as u32, nb, 1), 4 * h as u32 + if w2_shared { gate_bytes as u32 } else { 0 }, Some(h1)),
                        None => ("add_rmsnorm_router", (m as u32, 1 + (r as u32).div_ceil(rpb), 1), 4 * h as u32, Some(h1)),
                    }
                }
                // A few tokens (decode): each row's writes over norm_split() blocks (res is a new
                // tensor whenever there is a delta; without one nothing is written to res).
                None => {
                    // A non-contiguous weight is copied by the launch just before: not early then.
                    args.push(KernelArg::I32((pre && w.is_contiguous()) as i32));
                    ("add_rmsnorm", (m as u32, if m <= NORM_SPLIT_MAX_M { norm_split() } else { 1 }, 1), 0, None)
                }
            };
            let k = kernel(f16, entry, dev)?;
            match cluster {
                Some(nb) => unsafe { k.launch_pdl_cluster(LaunchConfig { grid, block: (512, 1, 1), shared_mem_bytes: smem }, (1, nb, 1), &args)? },
                None => unsafe { k.launch_pdl(LaunchConfig { grid, block: (threads, 1, 1), shared_mem_bytes: smem }, &args)? },
            }
            Ok((res, out, h1, gated))
        }
        _ => {
            let res = match delta {
                Some(d) => x + d,
                None => x.shallow_clone(),
            };
            let out = rmsnorm_reference(&res, w, eps);
            Ok((res, out, None, None))
        }
    }
}

/// Where [`rope_qkv_cache`] puts its outputs.
pub struct QkvShape {
    pub batch: i64,
    pub tokens: i64,
    pub q_heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
}

/// Reference of [`rope_qkv_cache`].
pub fn rope_qkv_cache_reference(qkv: &Tensor, pos: &Tensor, inv_freq: &Tensor, s: &QkvShape, k_cache: &Tensor, v_cache: &Tensor) -> Tensor {
    let (b, t, hq, hkv, d) = (s.batch, s.tokens, s.q_heads, s.kv_heads, s.head_dim);
    let kind = qkv.kind();
    let x = qkv.view([b, t, hq + 2 * hkv, d]);
    let q = x.narrow(2, 0, hq).transpose(1, 2);
    let k = x.narrow(2, hq, hkv).transpose(1, 2);
    let v = x.narrow(2, hq + hkv, hkv).transpose(1, 2);
    let p = pos.to_kind(Kind::Float).view([b, 1, t, 1]);
    let freqs = p * inv_freq.view([1, 1, 1, -1]);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    let (cos, sin) = (emb.cos().to_kind(kind), emb.sin().to_kind(kind));
    let rot = |x: &Tensor| {
        let half = d / 2;
        let rotated = Tensor::cat(&[&(-x.narrow(3, half, half)), &x.narrow(3, 0, half)], 3);
        x * &cos + rotated * &sin
    };
    let (q, k) = (rot(&q), rot(&k));
    // Scatter each row's k/v to its positions: index [B, HKV, T, D] along the slot dimension.
    let idx = pos.to_kind(Kind::Int64).view([b, 1, t, 1]).expand([b, hkv, t, d], false);
    let _ = k_cache.shallow_clone().scatter_(2, &idx, &k);
    let _ = v_cache.shallow_clone().scatter_(2, &idx, &v.contiguous());
    q.contiguous()
}

/// `qkv: [B*T, (HQ + 2 HKV) * D]` (token m = b T + t), `pos: [B*T]` i32 positions. Rotates q and
/// k by position, returns q `[B, HQ, T, D]` and writes k, v into the caches `[B, HKV, CAP, D]`
/// at slot = position. Positions must lie in `[0, CAP)`.
pub fn rope_qkv_cache(qkv: &Tensor, pos: &Tensor, inv_freq: &Tensor, s: &QkvShape, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
    rope_qkv_cache_with(qkv, pos, inv_freq, s, k_cache, v_cache, false)
}

/// [`rope_qkv_cache`]; with `token_major_q` the returned q `[B, HQ, T, D]` is a transposed view
/// of `[B, T, HQ, D]` storage, so that an attention whose output follows q's layout (SDPA) gives
/// `[B, T, HQ * D]` without a copy.
pub fn rope_qkv_cache_with(qkv: &Tensor, pos: &Tensor, inv_freq: &Tensor, s: &QkvShape, k_cache: &Tensor, v_cache: &Tensor, token_major_q: bool) -> Result<Tensor> {
    rope_impl(qkv, pos, inv_freq, s, k_cache, v_cache, token_major_q, false)
}

/// [`rope_qkv_cache_with`] where the caller promises that the launch just before (the Q|K|V
/// projection) wrote neither the positions nor `inv_freq` (the engine's layers: positions are
/// set before the embedding): on CUDA the rotation is then computed before the kernel waits for
/// that launch. Positions that need a conversion first (not i32, not contiguous) run as
/// [`rope_qkv_cache_with`].
pub fn rope_qkv_cache_settled(qkv: &Tensor, pos: &Tensor, inv_freq: &Tensor, s: &QkvShape, k_cache: &Tensor, v_cache: &Tensor, token_major_q: bool) -> Result<Tensor> {
    let pre = rope_early() && pos.kind() == Kind::Int && pos.is_contiguous() && inv_freq.is_contiguous() && inv_freq.kind() == Kind::Float;
    rope_impl(qkv, pos, inv_freq, s, k_cache, v_cache, token_major_q, pre)
}

/// `WIDE_ROPE_EARLY=0`: [`rope_qkv_cache_settled`] computes the rotation after the wait, like
/// [`rope_qkv_cache_with`] (read once; for A/B benchmarks).
fn rope_early() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_ROPE_EARLY") != Some(false))
}

#[allow(clippy::too_many_arguments)]
fn rope_impl(qkv: &Tensor, pos: &Tensor, inv_freq: &Tensor, s: &QkvShape, k_cache: &Tensor, v_cache: &Tensor, token_major_q: bool, pre: bool) -> Result<Tensor> {
    let (b, t, hq, hkv, d) = (s.batch, s.tokens, s.q_heads, s.kv_heads, s.head_dim);
    ensure!(qkv.size() == [b * t, (hq + 2 * hkv) * d], "rope_qkv_cache: qkv {:?} must be [{}, {}]", qkv.size(), b * t, (hq + 2 * hkv) * d);
    ensure!(pos.size() == [b * t], "rope_qkv_cache: positions {:?} must be [{}]", pos.size(), b * t);
    let cs = k_cache.size();
    ensure!(cs.len() == 4 && cs[0] == b && cs[1] == hkv && cs[3] == d, "rope_qkv_cache: cache {cs:?} does not fit [{b}, {hkv}, _, {d}]");
    ensure!(v_cache.size() == cs, "rope_qkv_cache: v cache {:?} must match the k cache {cs:?}", v_cache.size());
    ensure!(d % 2 == 0 && inv_freq.size() == [d / 2], "rope_qkv_cache: inverse frequencies {:?} must be [{}] (head_dim {d} even)", inv_freq.size(), d / 2);
    let same = |t: &Tensor| t.kind() == qkv.kind() && t.device() == qkv.device();
    match cuda_of(qkv) {
        Some((dev, f16)) if qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && same(k_cache) && same(v_cache) && d <= 1024 => {
            // The kernels read f32 inverse frequencies; a converted copy is written by the launch
            // just before, so the rotation is then not computed before the wait.
            let inv_ok = inv_freq.kind() == Kind::Float && inv_freq.is_contiguous() && inv_freq.device() == qkv.device();
            let inv = if inv_ok { inv_freq.shallow_clone() } else { inv_freq.to_device(qkv.device()).to_kind(Kind::Float).contiguous() };
            let pre = pre && inv_ok;
            let q = if token_major_q {
                Tensor::empty([b, t, hq, d], (qkv.kind(), qkv.device())).transpose(1, 2)
            } else {
                Tensor::empty([b, hq, t, d], (qkv.kind(), qkv.device()))
            };
            let pos = pos.to_kind(Kind::Int).contiguous();
            let aligned = [qkv, &q, k_cache, v_cache].iter().all(|t| t.data_ptr() as usize % 16 == 0);
            // 16-byte accesses where head_dim and every buffer allow them; else the scalar
            // kernel: up to 512 threads a block, D / 2 a head, several heads of one token.
            let (entry, cfg) = if d % 16 == 0 && aligned {
                let threads = (b * t * (hq + hkv) * d / 16) as u64;
                ("rope_qkv_cache8", LaunchConfig { grid: (threads.div_ceil(256) as u32, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 })
            } else {
                let heads = (512 / (d / 2)).clamp(1, hq + hkv);
                ("rope_qkv_cache", LaunchConfig { grid: ((b * t) as u32, ((hq + hkv + heads - 1) / heads) as u32, 1), block: ((d / 2) as u32, heads as u32, 1), shared_mem_bytes: 0 })
            };
            let k = kernel(f16, entry, dev)?;
            // SAFETY: both entries take these arguments: qkv [B*T, (HQ + 2 HKV) D], positions
            // [B*T] i32, inv_freq [D / 2] f32, q as allocated above, the caches [B, HKV, CAP, D]
            // (all contiguous); the 16-byte one only with D % 16 == 0 and aligned buffers.
            unsafe {
                k.launch_pdl(
                    cfg,
                    &[
                        KernelArg::tensor(qkv)?,
                        KernelArg::tensor(&pos)?,
                        KernelArg::I32(0),
                        KernelArg::tensor(&inv)?,
                        KernelArg::tensor(&q)?,
                        KernelArg::tensor(k_cache)?,
                        KernelArg::tensor(v_cache)?,
                        KernelArg::I64(b * t),
                        KernelArg::I32(t as i32),
                        KernelArg::I32(hq as i32),
                        KernelArg::I32(hkv as i32),
                        KernelArg::I32(d as i32),
                        KernelArg::I32(cs[2] as i32),
                        KernelArg::I32(token_major_q as i32),
                        KernelArg::I32(pre as i32),
                    ],
                )?;
            }
            Ok(q)
        }
        _ => {
            let q = rope_qkv_cache_reference(qkv, pos, inv_freq, s, k_cache, v_cache);
            Ok(if token_major_q { q.transpose(1, 2).contiguous().transpose(1, 2) } else { q })
        }
    }
}

/// Reference of [`swiglu`].
pub fn swiglu_reference(gu: &Tensor, mask: Option<&Tensor>, group: i64) -> Tensor {
    let (m, n2) = gu.size2().unwrap();
    let i = n2 / 2;
    let h = gu.narrow(1, 0, i).silu() * gu.narrow(1, i, i);
    match mask {
        Some(mk) => {
            let off = mk.to_kind(Kind::Bool).logical_not().unsqueeze(-1);
            h.view([m, i / group, group]).masked_fill(&off, 0.0).view([m, i])
        }
        None => h,
    }
}

/// `gu: [M, 2I]` (gate outputs, then up outputs) -> `[M, I]` = `silu(gate) * up`, exactly 0 where
/// the token's group is off (`mask: [M, I / group]` bool/u8; `None` = all on).
pub fn swiglu(gu: &Tensor, mask: Option<&Tensor>, group: i64) -> Result<Tensor> {
    let (m, n2) = gu.size2()?;
    ensure!(n2 % 2 == 0, "swiglu: {n2} columns are not gate|up halves");
    let i = n2 / 2;
    if let Some(mk) = mask {
        ensure!(group > 0 && i % group == 0 && mk.size() == [m, i / group], "swiglu: mask {:?} does not fit [{m}, {i} / {group}]", mk.size());
    }
    match cuda_of(gu) {
        // Without a mask the group width is irrelevant (the dense engine passes 1).
        Some((dev, f16)) if gu.is_contiguous() && gu.data_ptr() as usize % 16 == 0 && i % 8 == 0 && (mask.is_none() || group % 8 == 0) => {
            let out = Tensor::empty([m, i], (gu.kind(), gu.device()));
            let mk = mask.map(|t| {
                let t = t.to_device(gu.device());
                if t.kind() == Kind::Bool { t.contiguous().view_dtype(Kind::Uint8) } else { t.to_kind(Kind::Uint8).contiguous() }
            });
            let k = kernel(f16, "swiglu_masked", dev)?;
            let grid = crate::cuda::row_loop_grid(dev, ((i / 8) as u32).div_ceil(128), m)?;
            unsafe {
                k.launch_pdl(
                    LaunchConfig { grid, block: (128, 1, 1), shared_mem_bytes: 0 },
                    &[
                        KernelArg::tensor(gu)?,
                        match &mk {
                            Some(t) => KernelArg::tensor(t)?,
                            None => KernelArg::Ptr(0),
                        },
                        KernelArg::tensor(&out)?,
                        KernelArg::I64(m),
                        KernelArg::I32(i as i32),
                        KernelArg::I32(if mask.is_some() { group as i32 } else { i as i32 }),
                        KernelArg::I32(if mask.is_some() { (i / group) as i32 } else { 1 }),
                    ],
                )?;
            }
            Ok(out)
        }
        _ => Ok(swiglu_reference(gu, mask, group)),
    }
}

/// A router's weights: `Linear(hidden -> rank)` then `Linear(rank -> 2 * groups)`.
pub struct RouterWeights<'a> {
    pub w1: &'a Tensor,
    pub b1: &'a Tensor,
    pub w2: &'a Tensor,
    pub b2: &'a Tensor,
}

/// Groups a router's second layer gates: `w2` `[2 groups, rank]` (rank given) with `b2`
/// `[2 groups]`; an error naming the shapes otherwise.
fn gate_groups(w2: &Tensor, b2: &Tensor, rank: i64) -> Result<i64> {
    ensure!(
        w2.dim() == 2 && w2.size()[1] == rank && w2.size()[0] % 2 == 0 && b2.size() == [w2.size()[0]],
        "router gate: second layer {:?} with bias {:?} must be [2 groups, {rank}] and [2 groups]",
        w2.size(),
        b2.size()
    );
    Ok(w2.size()[0] / 2)
}

/// Reference of [`router_gate`]: execute mask bool `[M, groups]`.
pub fn router_gate_reference(x: &Tensor, r: &RouterWeights, offset: f64) -> Tensor {
    gate_from_hidden_reference(&x.linear(r.w1, Some(r.b1)), r, offset)
}

fn gate_from_hidden_reference(h: &Tensor, r: &RouterWeights, offset: f64) -> Tensor {
    let logits = h.linear(r.w2, Some(r.b2)).to_kind(Kind::Float).view([h.size()[0], -1, 2]);
    (logits.select(-1, 1) - logits.select(-1, 0) + offset).le(0.0)
}

/// The router on `x: [M, hidden]` and the deterministic gate (a group runs iff
/// `skip - execute + offset <= 0`): returns the mask bool `[M, groups]` and, with `extra > 0`,
/// the same mask with `extra` always-on groups appended, `[M, groups + extra]`. On a Hopper GPU
/// one launch ([`router_prefill`]) where it applies; else on CUDA the first layer runs on cuBLAS
/// (a GEMV or GEMM over all SMs), then [`router_gate_from_hidden`].
pub fn router_gate(x: &Tensor, r: &RouterWeights, offset: f64, extra: i64) -> Result<(Tensor, Option<Tensor>)> {
    let (_, hidden) = x.size2()?;
    ensure!(r.w1.size2()?.1 == hidden, "router_gate: compressor {:?} does not take hidden size {hidden}", r.w1.size());
    if let Some((mask, ext, _)) = router_prefill(x, r, offset, extra, false)? {
        return Ok((mask, ext));
    }
    router_gate_from_hidden(&x.linear(r.w1, Some(r.b1)), r, offset, extra)
}

/// Token rows of a clustered router tile and the k one of its blocks multiplies (`RP_BM`,
/// `RP_KB` in infer.cu; a block has RP_BM * 2 threads).
const ROUTER_PREFILL_BM: i64 = 128;
/// x chunks of 64 k a block of the ring variant holds at once (`router_prefill_R`).
const ROUTER_PREFILL_STAGES: i64 = 3;
const ROUTER_PREFILL_KB: i64 = 512;
/// Dynamic shared memory a router block may use: 227 KiB on compute capability 9.0 counts the
/// kernel's static part too (its barriers), so the limit is set a little under it.
const MAX_DYNAMIC_SMEM: i64 = 225 * 1024;
/// Dynamic shared memory under which two blocks fit a multiprocessor.
const TWO_BLOCKS_SMEM: i64 = 112 * 1024;

/// Whether [`router_prefill`] may run its kernel (the default on compute capability 9.0+), unless
/// `WIDE_ROUTER_PREFILL=0` (read once) keeps cuBLAS's first layer + the gate kernel, for A/B runs.
fn router_prefill_enabled(device: usize) -> Result<bool> {
    static OFF: OnceLock<bool> = OnceLock::new();
    if *OFF.get_or_init(|| crate::knobs::switch("WIDE_ROUTER_PREFILL") == Some(false)) {
        return Ok(false);
    }
    Ok(crate::cuda::compute_major(device)? >= 9)
}

/// The whole router of `x: [M, hidden]` in one launch on a Hopper GPU (`router_prefill_R` in
/// infer.cu: clusters of hidden / 512 blocks split the first layer's k, their operands loaded by
/// TMA, so x is read once and W1 once a 128-token tile; the same cluster sums the partials in a
/// fixed order, rounds the hidden like the unfused first layer and gates): the mask, the
/// extended mask (with `extra > 0`) and,
/// with `want_hidden`, the rounded first layer `[M, rank]`. None where it does not apply (not
/// CUDA bf16/f16, compute capability below 9.0, hidden not a multiple of 512 or above 4096, rank
/// not 16, 32 or 64, or the gate's weights of another dtype); the caller then runs cuBLAS + the
/// gate kernel.
pub fn router_prefill(x: &Tensor, r: &RouterWeights, offset: f64, extra: i64, want_hidden: bool) -> Result<Option<(Tensor, Option<Tensor>, Option<Tensor>)>> {
    let Some((dev, f16)) = cuda_of(x) else { return Ok(None) };
    let (m, h) = x.size2()?;
    let (rank, h1k) = r.w1.size2()?;
    let rs = h / ROUTER_PREFILL_KB;
    if ![16, 32, 64].contains(&rank) {
        return Ok(None);
    }
    let same = |t: &Tensor| t.kind() == x.kind() && t.device() == x.device();
    if h1k != h || h % ROUTER_PREFILL_KB != 0 || !(1..=8).contains(&rs) || m < 1 || m > i32::MAX as i64 || !same(r.w1) || !same(r.b1) || !same(r.w2) || !same(r.b2) {
        return Ok(None);
    }
    let ng = gate_groups(r.w2, r.b2, rank)?;
    ensure!(r.b1.size() == [rank], "router_gate: first-layer bias {:?} must be [{rank}]", r.b1.size());
    if !router_prefill_enabled(dev)? {
        return Ok(None);
    }
    // The tensor maps need 16-byte-aligned data. Every copy lives until the launch.
    let (x, w1) = (x.contiguous(), r.w1.contiguous());
    let (b1, w2, b2) = (r.b1.contiguous(), r.w2.contiguous(), r.b2.contiguous());
    if x.data_ptr() as usize % 16 != 0 || w1.data_ptr() as usize % 16 != 0 {
        return Ok(None);
    }
    let elt = x.kind().elt_size_in_bytes() as i64;
    // A grid that fits one wave at one block a multiprocessor keeps every x chunk resident (one
    // request each, no ring); a larger one takes the 3-stage ring, two blocks a multiprocessor.
    let tiles = (m + ROUTER_PREFILL_BM - 1) / ROUTER_PREFILL_BM;
    let resident = tiles * rs <= crate::cuda::multiprocessor_count(dev)? as i64 * 7 / 8;
    let stages = if resident { ROUTER_PREFILL_KB / 64 } else { ROUTER_PREFILL_STAGES };
    let entry = match (rank, resident) {
        (16, false) => "router_prefill_16",
        (32, false) => "router_prefill_32",
        (64, false) => "router_prefill_64",
        (16, true) => "router_prefill_resident_16",
        (32, true) => "router_prefill_resident_32",
        _ => "router_prefill_resident_64",
    };
    // The x chunks and W1's (128-byte rows, 1024-aligned: +1 KiB slack); the gate's weights
    // beside them (each group's pair of rows padded by 16 bytes) where that keeps as many blocks
    // a multiprocessor.
    let base = (stages * ROUTER_PREFILL_BM + rank * ROUTER_PREFILL_KB / 64) * 128 + 1024;
    let gate_bytes = ng * (2 * rank + 8) * elt + 2 * ng * elt + 16;
    let cap = if base <= TWO_BLOCKS_SMEM { TWO_BLOCKS_SMEM } else { MAX_DYNAMIC_SMEM };
    let aligned = |t: &Tensor| t.data_ptr() as usize % 16 == 0;
    let w2_shared = base + gate_bytes <= cap && rank % 8 == 0 && aligned(&w2) && aligned(&b2);
    let smem = (base + if w2_shared { gate_bytes } else { 0 }) as u32;
    let mask = Tensor::empty([m, ng], (Kind::Bool, x.device()));
    let ext = (extra > 0).then(|| Tensor::empty([m, ng + extra], (Kind::Bool, x.device())));
    let hidden = want_hidden.then(|| Tensor::empty([m, rank], (x.kind(), x.device())));
    let k = kernel(f16, entry, dev)?;
    let cfg = LaunchConfig { grid: (rs as u32, ((m + ROUTER_PREFILL_BM - 1) / ROUTER_PREFILL_BM) as u32, 1), block: (2 * ROUTER_PREFILL_BM as u32, 1, 1), shared_mem_bytes: smem };
    let opt = |t: &Option<Tensor>| -> Result<KernelArg> {
        Ok(match t {
            Some(t) => KernelArg::tensor(t)?,
            None => KernelArg::Ptr(0),
        })
    };
    let args = [
        crate::cuda::tensor_map_2d(&x, f16, ROUTER_PREFILL_BM as u32, 64)?,
        crate::cuda::tensor_map_2d(&w1, f16, rank as u32, 64)?,
        KernelArg::tensor(&b1)?,
        KernelArg::tensor(&w2)?,
        KernelArg::tensor(&b2)?,
        KernelArg::F32(offset as f32),
        KernelArg::tensor(&mask)?,
        opt(&ext)?,
        opt(&hidden)?,
        KernelArg::I32(m as i32),
        KernelArg::I32(ng as i32),
        KernelArg::I32(extra as i32),
        KernelArg::I32(w2_shared as i32),
    ];
    unsafe {
        if rs > 1 {
            k.launch_pdl_cluster(cfg, (rs as u32, 1, 1), &args)?;
        } else {
            k.launch_pdl(cfg, &args)?;
        }
    }
    Ok(Some((mask, ext, hidden)))
}

/// The router's second layer and the gate on its first layer's output `h: [M, rank]` (from
/// [`router_gate`] or [`add_rmsnorm_router`]); one kernel on CUDA.
pub fn router_gate_from_hidden(h: &Tensor, r: &RouterWeights, offset: f64, extra: i64) -> Result<(Tensor, Option<Tensor>)> {
    let (m, rank) = h.size2()?;
    let ng = gate_groups(r.w2, r.b2, rank)?;
    let same = |t: &Tensor| t.kind() == h.kind() && t.device() == h.device();
    match cuda_of(h) {
        Some((dev, f16)) if rank <= 256 && m <= i32::MAX as i64 && same(r.w2) && same(r.b2) => {
            let (h, w2, b2) = (h.contiguous(), r.w2.contiguous(), r.b2.contiguous());
            let mask = Tensor::empty([m, ng], (Kind::Bool, h.device()));
            let ext = (extra > 0).then(|| Tensor::empty([m, ng + extra], (Kind::Bool, h.device())));
            let k = kernel(f16, "router_gate", dev)?;
            unsafe {
                k.launch_pdl(
                    LaunchConfig { grid: (m as u32, 1, 1), block: (128, 1, 1), shared_mem_bytes: 0 },
                    &[
                        KernelArg::tensor(&h)?,
                        KernelArg::tensor(&w2)?,
                        KernelArg::tensor(&b2)?,
                        KernelArg::F32(offset as f32),
                        KernelArg::tensor(&mask)?,
                        match &ext {
                            Some(t) => KernelArg::tensor(t)?,
                            None => KernelArg::Ptr(0),
                        },
                        KernelArg::I32(rank as i32),
                        KernelArg::I32(ng as i32),
                        KernelArg::I32(extra as i32),
                    ],
                )?;
            }
            Ok((mask, ext))
        }
        _ => {
            let mask = gate_from_hidden_reference(h, r, offset);
            let ext = (extra > 0).then(|| Tensor::cat(&[&mask, &Tensor::ones([m, extra], (Kind::Bool, h.device()))], 1));
            Ok((mask, ext))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_reference_masks_groups() {
        let gu = Tensor::randn([3, 16], (Kind::Float, Device::Cpu));
        let mask = Tensor::from_slice(&[true, false, false, true, true, true]).view([3, 2]);
        let h = swiglu(&gu, Some(&mask), 4).unwrap();
        let dense = gu.narrow(1, 0, 8).silu() * gu.narrow(1, 8, 8);
        assert!(h.get(0).narrow(0, 4, 4).abs().sum(Kind::Float).double_value(&[]) == 0.0);
        assert!((h.get(2) - dense.get(2)).abs().max().double_value(&[]) == 0.0);
    }

    #[test]
    fn rope_reference_writes_cache_at_positions() {
        let s = QkvShape { batch: 2, tokens: 3, q_heads: 2, kv_heads: 1, head_dim: 4 };
        let qkv = Tensor::randn([6, 16], (Kind::Float, Device::Cpu));
        let pos = Tensor::from_slice(&[0i32, 1, 2, 4, 5, 6]);
        let inv = Tensor::from_slice(&[1.0f32, 0.1]);
        let kc = Tensor::zeros([2, 1, 8, 4], (Kind::Float, Device::Cpu));
        let vc = kc.zeros_like();
        let q = rope_qkv_cache(&qkv, &pos, &inv, &s, &kc, &vc).unwrap();
        assert_eq!(q.size(), [2, 2, 3, 4]);
        // v of row 1, token 0 sits at slot 4 unrotated; slot 3 of row 1 is untouched.
        assert!((vc.get(1).get(0).get(4) - qkv.get(3).narrow(0, 12, 4)).abs().max().double_value(&[]) == 0.0);
        assert_eq!(kc.get(1).get(0).get(3).abs().sum(Kind::Float).double_value(&[]), 0.0);
        // Position 0 leaves k unrotated.
        assert!((kc.get(0).get(0).get(0) - qkv.get(0).narrow(0, 8, 4)).abs().max().double_value(&[]) < 1e-7);
        // Token-major q: the same values, stored [B, T, HQ, D].
        let qt = rope_qkv_cache_with(&qkv, &pos, &inv, &s, &kc.zeros_like(), &vc.zeros_like(), true).unwrap();
        assert_eq!(qt.size(), [2, 2, 3, 4]);
        assert_eq!(qt.stride(), [24, 4, 8, 1]);
        assert!((&qt - &q).abs().max().double_value(&[]) == 0.0);
    }

    #[test]
    fn mismatched_router_and_cache_shapes_are_errors() {
        let h = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
        let w2 = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let (short, odd) = (Tensor::zeros([4], (Kind::Float, Device::Cpu)), Tensor::randn([5, 4], (Kind::Float, Device::Cpu)));
        let err = router_gate_from_hidden(&h, &RouterWeights { w1: &w2, b1: &short, w2: &w2, b2: &short }, 0.0, 0).unwrap_err().to_string();
        assert!(err.contains("[6, 4]") && err.contains("[4]"), "{err}");
        assert!(router_gate_from_hidden(&h, &RouterWeights { w1: &w2, b1: &short, w2: &odd, b2: &Tensor::zeros([5], (Kind::Float, Device::Cpu)) }, 0.0, 0).is_err());
        let s = QkvShape { batch: 1, tokens: 2, q_heads: 2, kv_heads: 1, head_dim: 4 };
        let qkv = Tensor::randn([2, 16], (Kind::Float, Device::Cpu));
        let pos = Tensor::from_slice(&[0i32, 1]);
        let kc = Tensor::zeros([1, 1, 8, 4], (Kind::Float, Device::Cpu));
        let err = rope_qkv_cache(&qkv, &pos, &Tensor::from_slice(&[1.0f32, 0.1]), &s, &kc, &Tensor::zeros([1, 1, 4, 4], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
        assert!(err.contains("v cache"), "{err}");
        let err = rope_qkv_cache(&qkv, &pos, &Tensor::from_slice(&[1.0f32]), &s, &kc, &kc.zeros_like()).unwrap_err().to_string();
        assert!(err.contains("inverse frequencies"), "{err}");
    }

    #[test]
    fn router_gate_offset_shifts_decisions() {
        let x = Tensor::randn([5, 8], (Kind::Float, Device::Cpu));
        let (w1, b1) = (Tensor::randn([4, 8], (Kind::Float, Device::Cpu)), Tensor::zeros([4], (Kind::Float, Device::Cpu)));
        let (w2, b2) = (Tensor::randn([6, 4], (Kind::Float, Device::Cpu)), Tensor::zeros([6], (Kind::Float, Device::Cpu)));
        let r = RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
        let (all, ext) = router_gate(&x, &r, -1e9, 2).unwrap();
        assert_eq!(all.sum(Kind::Int64).int64_value(&[]), 15);
        assert_eq!(ext.unwrap().size(), [5, 5]);
        let (none, _) = router_gate(&x, &r, 1e9, 0).unwrap();
        assert_eq!(none.sum(Kind::Int64).int64_value(&[]), 0);
    }
}
