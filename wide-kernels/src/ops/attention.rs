//! Head-group routed attention.
//!
//! - [`attention_decode`]: one new query per sequence against the KV cache; a head group that
//!   is off gets exactly 0, and a KV head whose query heads are all off is not read at all
//!   (CUDA split-K kernel; tch reference elsewhere).
//! - [`attention_prefill`]: causal attention over a prompt. Per query head only the tokens
//!   whose head group is active are computed (gathered query rows, K/V dense; on Hopper
//!   `attn_wgmma.cu`: TMA-fed K/V, wgmma products, softmax overlapped with the previous tile's
//!   PV; elsewhere `attn_prefill.cu`, FlashAttention-2 style on `mma.sync`), skipped (token,
//!   head) rows exactly 0; where that does not pay, dense SDPA (flash) and a zero pass. Padding
//!   runs the reference.
use super::routed_kernel;
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{bail, ensure, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

/// Shapes of a decode call, checked.
struct DecodeShape {
    b: i64,
    hq: i64,
    hkv: i64,
    tcap: i64,
    d: i64,
    group_heads: i64,
    ng: i64,
}

fn decode_shape(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64) -> Result<DecodeShape> {
    let (qs, ks) = (q.size(), k.size());
    ensure!(qs.len() == 3, "attention_decode: q must be [batch, q_heads, head_dim], got {qs:?}");
    ensure!(ks.len() == 4, "attention_decode: k cache must be [batch, kv_heads, capacity, head_dim], got {ks:?}");
    ensure!(v.size() == ks, "attention_decode: v cache {:?} must match k cache {ks:?}", v.size());
    let (b, hq, d) = (qs[0], qs[1], qs[2]);
    let (hkv, tcap) = (ks[1], ks[2]);
    ensure!(b > 0 && d > 0, "attention_decode: q {qs:?} has no rows to attend (batch and head_dim must be at least 1)");
    ensure!(ks[0] == b && ks[3] == d, "attention_decode: k cache {ks:?} does not match q {qs:?}");
    ensure!(hkv > 0 && hq % hkv == 0, "attention_decode: {hkv} KV heads do not divide {hq} query heads");
    ensure!(group_heads > 0 && hq % group_heads == 0, "attention_decode: group size {group_heads} heads does not divide {hq} query heads");
    ensure!(lengths.size() == [b], "attention_decode: lengths must be [batch] = [{b}], got {:?}", lengths.size());
    let ng = hq / group_heads;
    ensure!(mask.size() == [b, ng], "attention_decode: mask must be [batch, groups] = [{b}, {ng}], got {:?}", mask.size());
    ensure!(q.kind() == k.kind() && k.kind() == v.kind(), "attention_decode: q, k and v differ in dtype");
    Ok(DecodeShape { b, hq, hkv, tcap, d, group_heads, ng })
}

/// Reference decode attention in tch (any device), computed in q's dtype (pass f32 inputs for a
/// precise reference). q `[B, HQ, D]`, k/v `[B, HKV, T, D]`, lengths i32/i64 `[B]` (valid cache
/// positions), mask `[B, HQ / group_heads]`; returns `[B, HQ, D]`, skipped heads 0.
pub fn attention_decode_reference(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64) -> Tensor {
    let (b, hq, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let (hkv, t) = (k.size()[1], k.size()[2]);
    let rep = hq / hkv;
    let kr = k.repeat_interleave_self_int(rep, 1, None::<i64>);
    let vr = v.repeat_interleave_self_int(rep, 1, None::<i64>);
    let scores = q.unsqueeze(2).matmul(&kr.transpose(-1, -2)) * scale; // [B, HQ, 1, T]
    let pos = Tensor::arange(t, (Kind::Int64, q.device())).unsqueeze(0);
    let pad = pos.ge_tensor(&lengths.to_kind(Kind::Int64).unsqueeze(1)).view([b, 1, 1, t]);
    let p = scores.masked_fill(&pad, f64::NEG_INFINITY).softmax(-1, q.kind());
    let o = p.matmul(&vr).view([b, hq, d]);
    let off = mask.to_kind(Kind::Bool).logical_not().repeat_interleave_self_int(group_heads, 1, None::<i64>).unsqueeze(-1);
    o.masked_fill(&off, 0.0)
}

/// Decode attention with head-group routing. q `[B, HQ, D]`, k/v caches `[B, HKV, T, D]`
/// (contiguous), lengths i32 `[B]` (valid positions, at least 1 for a non-zero output), mask
/// bool/u8 `[B, HQ / group_heads]`; returns `[B, HQ, D]` in q's dtype, skipped heads exactly 0.
/// CUDA (bf16/f16, D in {64, 128}) runs the split-K kernel; other inputs the reference.
pub fn attention_decode(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64) -> Result<Tensor> {
    attention_decode_with(q, k, v, lengths, mask, group_heads, scale, DecodeMerge::default_policy())
}

/// How the CUDA decode-attention kernel combines the splits of a KV head's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeMerge {
    /// A second launch merges the splits, whatever the cache length.
    Separate,
    /// Caches of at most 1024 positions in one launch: a sequence whose length is at most
    /// `single_max` gives each active KV head one block, whose warps merge their tiles in shared
    /// memory and write the output; longer ones are split and the last split block of each KV
    /// head merges. Longer caches take the second launch.
    InKernel { single_max: i64 },
}

impl DecodeMerge {
    /// `WIDE_DECODE_COMBINE=separate` forces [`DecodeMerge::Separate`]; otherwise in the
    /// kernel, one block a KV head up to [`single_block_max`] positions.
    pub fn default_policy() -> Self {
        if separate_combine() {
            DecodeMerge::Separate
        } else {
            DecodeMerge::InKernel { single_max: single_block_max() }
        }
    }
}

/// [`attention_decode`] with the splits combined as `merge` says (CUDA; other devices run the
/// reference).
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_with(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64, merge: DecodeMerge) -> Result<Tensor> {
    decode(q, k, v, lengths, mask, group_heads, scale, merge, false, None)
}

/// [`attention_decode`] inside a decode step, where the caller promises that the launch just
/// before wrote only q and each sequence's newest cache row (position `lengths - 1`), and that
/// the mask and lengths were written two or more launches back (the engine's step: RoPE and the
/// cache write, then this). On CUDA the kernel then loads the mask, the lengths and the older
/// rows' first tiles before waiting for that launch (programmatic dependent launch), the newest
/// row after. Where the inputs need a conversion first (a non-contiguous mask, lengths not i32)
/// that promise cannot hold, and it runs as [`attention_decode`].
pub fn attention_decode_step(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64) -> Result<Tensor> {
    let settled = early_loads() && lengths.kind() == Kind::Int && lengths.is_contiguous() && mask.is_contiguous() && matches!(mask.kind(), Kind::Bool | Kind::Uint8);
    decode(q, k, v, lengths, mask, group_heads, scale, DecodeMerge::default_policy(), settled, None)
}

/// `WIDE_DECODE_EARLY=0`: [`attention_decode_step`] waits for the launch before like
/// [`attention_decode`] (read once; for A/B benchmarks).
fn early_loads() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::switch("WIDE_DECODE_EARLY") != Some(false))
}

/// One decode step's RoPE, cache write and attention in one launch: `qkv` `[B, (HQ + 2 HKV) D]`
/// is each sequence's new token (position `lengths - 1`, unrotated, straight from the Q|K|V
/// projection), `inv_freq` f32 `[D / 2]` the RoPE frequencies; q and k are rotated (rotate_half,
/// in the storage dtype like [`crate::ops::fused::rope_qkv_cache`]), k and v written into the
/// caches at slot `lengths - 1`, and q attends over the cache's first `lengths` rows, the newest
/// one included: what `rope_qkv_cache` followed by [`attention_decode_step`] gives (the caches bit
/// for bit; on CUDA the new token is a tile of its own, so the softmax sums in another order).
/// The caller promises, as for `attention_decode_step`, that the launch just before wrote only
/// `qkv` and that the mask and lengths are older. Inputs the fused kernel does not take (not CUDA, not bf16 / f16, head_dim
/// other than 64 / 128, caches or qkv not contiguous, lengths not i32, `WIDE_DECODE_ROPE=0`) run
/// those two calls.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_step_rope(qkv: &Tensor, inv_freq: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64) -> Result<Tensor> {
    let ks = k.size();
    ensure!(ks.len() == 4, "attention_decode_step_rope: k cache must be [batch, kv_heads, capacity, head_dim], got {ks:?}");
    let (b, hkv, d) = (ks[0], ks[1], ks[3]);
    let (qb, w) = qkv.size2().map_err(|_| anyhow::anyhow!("attention_decode_step_rope: qkv must be [batch, (q_heads + 2 kv_heads) head_dim], got {:?}", qkv.size()))?;
    ensure!(qb == b && d > 0 && w % d == 0 && w / d > 2 * hkv, "attention_decode_step_rope: qkv {:?} does not fit a cache of {b} sequences, {hkv} KV heads of {d}", qkv.size());
    let hq = w / d - 2 * hkv;
    ensure!(inv_freq.size() == [d / 2], "attention_decode_step_rope: inv_freq {:?} must be [{}]", inv_freq.size(), d / 2);
    let fused = decode_rope_enabled()
        && matches!(qkv.device(), Device::Cuda(_))
        && matches!(qkv.kind(), Kind::BFloat16 | Kind::Half)
        && qkv.kind() == k.kind()
        && hq % hkv == 0
        && matches!((d, hq / hkv), (64 | 128, 1 | 2 | 4 | 8))
        && qkv.is_contiguous()
        && k.is_contiguous()
        && v.is_contiguous()
        && inv_freq.kind() == Kind::Float
        && inv_freq.is_contiguous()
        && lengths.kind() == Kind::Int
        && lengths.is_contiguous();
    if !fused {
        let shape = crate::ops::fused::QkvShape { batch: b, tokens: 1, q_heads: hq, kv_heads: hkv, head_dim: d };
        let pos = (lengths.to_kind(Kind::Int) - 1).contiguous();
        let q = crate::ops::fused::rope_qkv_cache(qkv, &pos, inv_freq, &shape, k, v)?;
        return attention_decode_step(&q.view([b, hq, d]), k, v, lengths, mask, group_heads, scale);
    }
    // q's shape for the checks: the first HQ heads of each row (a view; never copied).
    let q = qkv.view([b, hq + 2 * hkv, d]).narrow(1, 0, hq);
    let settled = early_loads() && mask.is_contiguous() && matches!(mask.kind(), Kind::Bool | Kind::Uint8);
    decode(&q, k, v, lengths, mask, group_heads, scale, DecodeMerge::default_policy(), settled, Some((qkv, inv_freq)))
}

/// `WIDE_DECODE_ROPE=0`: [`attention_decode_step_rope`] runs RoPE and the cache write as their
/// own launch before the attention, and the engine's decode step keeps its separate RoPE launch
/// (read once; for A/B benchmarks).
pub fn decode_rope_enabled() -> bool {
    decode_rope_knob() != Some((false, false))
}

/// `WIDE_DECODE_ROPE` (read once): `0` / `1` force the fused decode RoPE off / on for every
/// attention the engine runs, `routed` on for routed attention only; unset (or another value, named
/// in a warning): `None`, the engine's default policy. Returns (dense, routed) when set.
pub fn decode_rope_knob() -> Option<(bool, bool)> {
    static V: std::sync::OnceLock<Option<(bool, bool)>> = std::sync::OnceLock::new();
    *V.get_or_init(|| match crate::knobs::choice("WIDE_DECODE_ROPE", &["0", "1", "routed"]) {
        Some("0") => Some((false, false)),
        Some("1") => Some((true, true)),
        Some(_routed) => Some((false, true)),
        None => None,
    })
}

#[allow(clippy::too_many_arguments)]
fn decode(q: &Tensor, k: &Tensor, v: &Tensor, lengths: &Tensor, mask: &Tensor, group_heads: i64, scale: f64, merge: DecodeMerge, settled: bool, rope: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
    let s = decode_shape(q, k, v, lengths, mask, group_heads)?;
    let device = match q.device() {
        Device::Cuda(dv) if matches!(q.kind(), Kind::BFloat16 | Kind::Half) => dv,
        _ => return Ok(attention_decode_reference(q, k, v, lengths, mask, group_heads, scale)),
    };
    let qpk = s.hq / s.hkv;
    if !matches!((s.d, qpk), (64 | 128, 1 | 2 | 4 | 8)) {
        bail!("attention_decode: the CUDA kernel takes head_dim 64 or 128 with at most 8 query heads per KV head, got head_dim {} with {qpk}", s.d);
    }
    ensure!(s.tcap <= i32::MAX as i64 / s.d, "attention_decode: cache too long for the kernel");
    let f16 = q.kind() == Kind::Half;
    // With the RoPE fused in, q is a view of qkv (read by the kernel from qkv) and the caches
    // are written in place (the caller checked that they are contiguous).
    let (q, k, v) = (if rope.is_some() { q.shallow_clone() } else { q.contiguous() }, k.contiguous(), v.contiguous());
    let lengths = lengths.to_kind(Kind::Int).contiguous();
    let mask = match mask.kind() {
        Kind::Bool => mask.contiguous().view_dtype(Kind::Uint8),
        Kind::Uint8 => mask.contiguous(),
        k => bail!("attention_decode: mask must be bool or u8, got {k:?}"),
    };
    // NB blocks a sequence, shared out on the device among its active KV heads, and at least
    // one for each KV head. More blocks do not stream faster (with the two-slot load pipeline,
    // one block of 4 warps a multiprocessor streams as fast as two) but each adds a fixed cost:
    // a partial result to write and to merge.
    // No more than one split of 64 positions a KV head can use: a short cache needs few blocks
    // (the splits, hence the results, are the same; the rest would only exit).
    let nb = (blocks_per_sm() * crate::cuda::multiprocessor_count(device)? as i64 / s.b)
        .min(s.hkv * ((s.tcap + 63) / 64))
        .clamp(s.hkv, 8192.max(s.hkv));
    ensure!(s.b <= 65535 && s.hkv <= 64, "attention_decode: the CUDA kernel takes at most 65535 sequences and 64 KV heads, got {} and {}", s.b, s.hkv);
    let part_o = Tensor::empty([s.b, s.hq, nb, s.d], (Kind::Float, q.device()));
    let part_ml = Tensor::empty([s.b, s.hq, nb, 2], (Kind::Float, q.device()));
    let out = Tensor::empty([s.b, s.hq, s.d], (q.kind(), q.device()));
    let split = routed_kernel(f16, None, &format!("attn_decode_{}_{}_{qpk}", if rope.is_some() { "rope" } else { "split" }, s.d), device)?;
    // Short caches (at most MERGE_MAX_SPLITS splits of 64 tokens): the last split block of each
    // KV head merges that head's splits, one launch. Longer ones: a second launch merges them
    // over many blocks (one block's serial pass over many splits would cost more than the launch:
    // on the H200 at 32768 tokens, 50% skip, 38.9 us merged against 32.5 us separate; at 2048,
    // 14.4 against 14.0).
    let (merged, single_max) = match merge {
        DecodeMerge::Separate => (false, 0),
        DecodeMerge::InKernel { single_max } => (s.b * s.hkv <= ATTN_TICKETS && (s.tcap + 63) / 64 <= MERGE_MAX_SPLITS, single_max.clamp(0, i32::MAX as i64)),
    };
    // attn_decode_rope takes qkv and inv_freq in q's place.
    let mut args = match rope {
        Some((qkv, f)) => vec![KernelArg::tensor(qkv)?, KernelArg::tensor(f)?],
        None => vec![KernelArg::tensor(&q)?],
    };
    unsafe {
        args.extend([
                KernelArg::tensor(&k)?,
                KernelArg::tensor(&v)?,
                KernelArg::tensor(&lengths)?,
                KernelArg::tensor(&mask)?,
                KernelArg::tensor(&part_o)?,
                KernelArg::tensor(&part_ml)?,
                if merged { KernelArg::tensor(&out)? } else { KernelArg::Ptr(0) },
                KernelArg::I32(s.hq as i32),
                KernelArg::I32(s.hkv as i32),
                KernelArg::I32(s.tcap as i32),
                KernelArg::I32(nb as i32),
                KernelArg::I32(s.group_heads as i32),
                KernelArg::I32(s.ng as i32),
                KernelArg::F32((scale * std::f64::consts::LOG2_E) as f32),
                KernelArg::I32(settled as i32),
                KernelArg::I32(if merged { single_max as i32 } else { 0 }),
        ]);
        split.launch_pdl(LaunchConfig { grid: (nb as u32, 1, s.b as u32), block: (128, 1, 1), shared_mem_bytes: 0 }, &args)?;
        if merged {
            return Ok(out);
        }
        let combine = routed_kernel(f16, None, &format!("attn_decode_combine_{}_{qpk}", s.d), device)?;
        combine.launch_pdl(
            LaunchConfig { grid: (s.hq as u32, s.b as u32, 1), block: (256, 1, 1), shared_mem_bytes: 0 },
            &[
                KernelArg::tensor(&part_o)?,
                KernelArg::tensor(&part_ml)?,
                KernelArg::tensor(&lengths)?,
                KernelArg::tensor(&mask)?,
                KernelArg::tensor(&out)?,
                KernelArg::I32(s.hq as i32),
                KernelArg::I32(s.hkv as i32),
                KernelArg::I32(s.tcap as i32),
                KernelArg::I32(nb as i32),
                KernelArg::I32(s.group_heads as i32),
                KernelArg::I32(s.ng as i32),
            ],
        )?;
    }
    Ok(out)
}

/// Reads the first `a_bytes` of `a` and `b_bytes` of `b` (contiguous CUDA tensors; byte counts
/// multiples of 16) in one launch that does nothing else, `blocks_per_sm` blocks of 256 threads
/// a multiprocessor: the time any kernel needs at least to read those bytes once. The
/// decode-attention benchmark times it on the K/V bytes a call must read (its ceiling).
pub fn stream_read(a: &Tensor, a_bytes: i64, b: &Tensor, b_bytes: i64, blocks_per_sm: u32) -> Result<()> {
    let device = read_operands("stream_read", a, a_bytes, b, b_bytes)?;
    let k = routed_kernel(false, None, "stream_read", device)?;
    let blocks = blocks_per_sm.clamp(1, 8) * crate::cuda::multiprocessor_count(device)? as u32;
    unsafe {
        k.launch(
            LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 },
            &[KernelArg::tensor(a)?, KernelArg::I64(a_bytes / 16), KernelArg::tensor(b)?, KernelArg::I64(b_bytes / 16), KernelArg::Ptr(0)],
        )
    }
}

/// The device of the read kernels' operands (`what` names the caller in the errors): contiguous
/// CUDA tensors on one device, each read for a multiple of 16 bytes within its storage.
fn read_operands(what: &str, a: &Tensor, a_bytes: i64, b: &Tensor, b_bytes: i64) -> Result<usize> {
    let device = match a.device() {
        Device::Cuda(d) => d,
        _ => bail!("{what}: needs CUDA tensors"),
    };
    for (t, n) in [(a, a_bytes), (b, b_bytes)] {
        ensure!(t.is_contiguous() && t.device() == a.device(), "{what}: tensors must be contiguous on one device");
        ensure!(n >= 0 && n % 16 == 0 && n <= t.numel() as i64 * t.kind().elt_size_in_bytes() as i64, "{what}: {n} bytes is not a multiple of 16 within a tensor of {:?}", t.size());
    }
    Ok(device)
}

/// Measurement only (the engine's `WIDE_STEP_READS`): a launch that reads the first `a_bytes`
/// of `a` and `b_bytes` of `b` (as [`stream_read`]) and returns a zeroed `[m, n]` tensor of
/// `a`'s dtype, standing in for a projection of the decode step whose weight bytes those are.
/// Programmatic dependent launch: its first weight loads go out before it waits for the launch
/// before it, as the projections' do. `blocks_per_sm` blocks of 256 threads a multiprocessor.
pub fn step_read(a: &Tensor, a_bytes: i64, b: &Tensor, b_bytes: i64, (m, n): (i64, i64), blocks_per_sm: u32) -> Result<Tensor> {
    let device = read_operands("step_read", a, a_bytes, b, b_bytes)?;
    let out_bytes = m * n * a.kind().elt_size_in_bytes() as i64;
    ensure!(m > 0 && out_bytes % 16 == 0, "step_read: an output of [{m}, {n}] {:?} is not a whole number of 16-byte words", a.kind());
    let out = Tensor::empty([m, n], (a.kind(), a.device()));
    let k = routed_kernel(false, None, "step_read", device)?;
    let blocks = blocks_per_sm.clamp(1, 8) * crate::cuda::multiprocessor_count(device)? as u32;
    unsafe {
        k.launch_pdl(
            LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 },
            &[KernelArg::tensor(a)?, KernelArg::I64(a_bytes / 16), KernelArg::tensor(b)?, KernelArg::I64(b_bytes / 16), KernelArg::tensor(&out)?, KernelArg::I64(out_bytes / 16), KernelArg::Ptr(0)],
        )?;
    }
    Ok(out)
}

/// (sequence, KV head) pairs the split kernel can merge itself (`ATTN_TICKETS` in routed.cu).
const ATTN_TICKETS: i64 = 65536;

/// Splits per KV head up to which the split kernel merges them itself (see attention_decode_with).
const MERGE_MAX_SPLITS: i64 = 16;

/// `WIDE_DECODE_COMBINE=separate`: always merge the splits in a second launch (read once; for
/// A/B benchmarks).
fn separate_combine() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::choice("WIDE_DECODE_COMBINE", &["separate"]).is_some())
}

/// Cache lengths up to which a sequence's active KV heads take one block each, whose warps merge
/// their tiles in shared memory and write the output (no partial results to publish, no fence,
/// no arrival count, no merge by another block): `WIDE_DECODE_SINGLE_MAX` (tokens, read once;
/// 0 turns it off), default 256. Measured in the batch-1 decode step on the H200 at 128-255
/// cached tokens (2026-12-03): attention 5.7 -> 5.1 us a call dense, 5.3 -> 4.6 wide 0.5.
pub fn single_block_max() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_DECODE_SINGLE_MAX", 0..=i64::from(i32::MAX), "cached tokens; 0 = always split").unwrap_or(256))
}

/// Decode-kernel blocks a multiprocessor (shared among the sequences of a batch): 1, or
/// `WIDE_DECODE_BLOCKS_PER_SM` (read once; for benchmark sweeps). The split kernel takes ~255
/// registers a thread, so at most 2 of its 128-thread blocks fit on a multiprocessor (3 or 4
/// run in two waves). Measured on the H200 (s = 0.5, cold, 30 timed calls, two runs each): 1
/// and 2 blocks ran 28.3-28.5 against 28.8-29.0 us at 32768 tokens, 15.5-15.7 against
/// 16.2-16.3 at 8192, 11.0 against 11.0-11.1 at 2048 (our kernel with every group on: 45.6-45.7
/// against 47.1-47.2 at 32768).
fn blocks_per_sm() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::knobs::int("WIDE_DECODE_BLOCKS_PER_SM", 1..=64, "decode-attention blocks a multiprocessor").unwrap_or(1))
}

/// Causal prefill attention with padding and head-group routing, reference in tch. q
/// `[B, HQ, T, D]`, k/v `[B, HKV, T, D]`, key_padding bool `[B, T]` (true = padded key),
/// mask `[B, T, HQ / group_heads]` (per token and head group); returns `[B, HQ, T, D]` with
/// skipped (token, head) rows exactly 0.
pub fn attention_prefill_reference(q: &Tensor, k: &Tensor, v: &Tensor, key_padding: Option<&Tensor>, mask: &Tensor, group_heads: i64, scale: f64) -> Tensor {
    let (b, hq, t, _) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let rep = hq / k.size()[1];
    let kr = k.repeat_interleave_self_int(rep, 1, None::<i64>);
    let vr = v.repeat_interleave_self_int(rep, 1, None::<i64>);
    let scores = q.matmul(&kr.transpose(-1, -2)) * scale; // [B, HQ, T, T]
    let causal = Tensor::ones([t, t], (Kind::Bool, q.device())).triu(1);
    let mut blocked = causal.view([1, 1, t, t]);
    if let Some(p) = key_padding {
        blocked = blocked.logical_or(&p.view([b, 1, 1, t]));
    }
    // A fully padded row would be all -inf: give it zeros instead of NaN.
    let p = scores.masked_fill(&blocked, f64::NEG_INFINITY).softmax(-1, q.kind()).nan_to_num(0.0, None::<f64>, None::<f64>);
    let o = p.matmul(&vr);
    let off = mask.to_kind(Kind::Bool).logical_not().repeat_interleave_self_int(group_heads, 2, None::<i64>); // [B, T, HQ]
    o.masked_fill(&off.transpose(1, 2).unsqueeze(-1), 0.0)
}

/// Checks the shapes of a prefill call; returns (B, HQ, HKV, T, D, NG).
fn prefill_shape(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, group_heads: i64) -> Result<(i64, i64, i64, i64, i64, i64)> {
    let (qs, ks) = (q.size(), k.size());
    ensure!(qs.len() == 4 && ks.len() == 4, "attention_prefill: q and k must be [batch, heads, tokens, head_dim], got {qs:?} and {ks:?}");
    ensure!(v.size() == ks, "attention_prefill: v {:?} must match k {ks:?}", v.size());
    ensure!(qs[0] == ks[0] && qs[2] == ks[2] && qs[3] == ks[3], "attention_prefill: q {qs:?} and k {ks:?} disagree");
    ensure!(ks[1] > 0 && qs[1] % ks[1] == 0, "attention_prefill: {} KV heads do not divide {} query heads", ks[1], qs[1]);
    ensure!(group_heads > 0 && qs[1] % group_heads == 0, "attention_prefill: group size {group_heads} does not divide {} heads", qs[1]);
    ensure!(
        mask.size() == [qs[0], qs[2], qs[1] / group_heads],
        "attention_prefill: mask must be [batch, tokens, groups] = [{}, {}, {}], got {:?}",
        qs[0],
        qs[2],
        qs[1] / group_heads,
        mask.size()
    );
    Ok((qs[0], qs[1], ks[1], qs[2], qs[3], qs[1] / group_heads))
}

/// Causal prefill attention with head-group routing (shapes as in
/// [`attention_prefill_reference`]; k/v may be a narrowed KV cache, rows contiguous). With
/// padding, or off CUDA, the reference; on CUDA (bf16/f16, head_dim 64 or 128) the routed kernel
/// where [`prefill_routed_pays`] says so, else dense SDPA (flash, GQA) and a zero pass over the
/// skipped rows. The mask's skip rate is measured here (one device sync) for prompts long enough
/// to consider the routed kernel; [`attention_prefill_with`] takes it from the caller instead.
/// `WIDE_ATTN_PREFILL=routed|dense` forces a path (read once; for benchmarks).
pub fn attention_prefill(q: &Tensor, k: &Tensor, v: &Tensor, key_padding: Option<&Tensor>, mask: &Tensor, group_heads: i64, scale: f64) -> Result<Tensor> {
    attention_prefill_with(q, k, v, key_padding, mask, group_heads, scale, None)
}

/// [`attention_prefill`] with the mask's skip rate given (`sparsity`, e.g. the router's running
/// mean: no device sync); `None` measures it from the mask when the choice depends on it.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_padding: Option<&Tensor>,
    mask: &Tensor,
    group_heads: i64,
    scale: f64,
    sparsity: Option<f64>,
) -> Result<Tensor> {
    let (_, _, _, t, d, _) = prefill_shape(q, k, v, mask, group_heads)?;
    if key_padding.is_some() || !matches!(q.device(), Device::Cuda(_)) {
        return Ok(attention_prefill_reference(q, k, v, key_padding, mask, group_heads, scale));
    }
    let kernel_ok = matches!(q.kind(), Kind::BFloat16 | Kind::Half) && matches!(d, 64 | 128) && q.kind() == k.kind() && k.kind() == v.kind();
    // The skip rate: given, or measured from the mask (a device sync, ~30 us of idle GPU on the
    // H200) only where the attention itself takes about a millisecond or more.
    let measured = || 1.0 - mask.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    let device = match q.device() {
        Device::Cuda(dv) => dv,
        _ => unreachable!("checked above"),
    };
    let wgmma = PREFILL_WGMMA.supports(d, device);
    let (routed, s) = match prefill_override() {
        Some(r) => (r && kernel_ok, sparsity.unwrap_or(0.5)),
        None if !kernel_ok || t < prefill_min_tokens(wgmma) => (false, 0.0),
        // The wgmma kernel wins at every skip rate: no need to know it.
        None if wgmma => (true, sparsity.unwrap_or(0.5)),
        None => match sparsity {
            Some(s) => (prefill_routed_pays(t, s, wgmma), s),
            None if t >= PREFILL_MEASURE_MIN_TOKENS => {
                let s = measured();
                (prefill_routed_pays(t, s, wgmma), s)
            }
            None => (false, 0.0),
        },
    };
    if routed {
        let (b, hq) = (q.size()[0], q.size()[1]);
        attention_prefill_routed(q, k, v, mask, group_heads, scale, PrefillTile::choose_for(device, d, b, hq, t, s))
    } else {
        attention_prefill_dense(q, k, v, mask, group_heads, scale)
    }
}

/// Prompt length from which [`attention_prefill`] considers the `mma.sync` routed kernel.
pub const PREFILL_ROUTED_MIN_TOKENS: i64 = 2048;
/// Prompt length from which it considers the wgmma (Hopper) routed kernel.
pub const PREFILL_WGMMA_MIN_TOKENS: i64 = 1024;

/// Whether [`attention_prefill`] / [`attention_prefill_with`] may take a routed kernel for a
/// `tokens`-token prompt (else they run SDPA and the zero pass, which take q in any layout
/// while the routed kernels copy it head-major): from the smaller of the two kernels' minimum
/// lengths, or at any length under `WIDE_ATTN_PREFILL=routed`.
pub fn prefill_routed_possible(tokens: i64) -> bool {
    prefill_override() == Some(true) || tokens >= PREFILL_WGMMA_MIN_TOKENS.min(PREFILL_ROUTED_MIN_TOKENS)
}

fn prefill_min_tokens(wgmma: bool) -> i64 {
    if wgmma {
        PREFILL_WGMMA_MIN_TOKENS
    } else {
        PREFILL_ROUTED_MIN_TOKENS
    }
}

/// Prompt length from which [`attention_prefill`] without a skip rate measures it from the mask
/// for the `mma.sync` kernel's rule (below, it runs the dense path without a sync; the wgmma
/// kernel needs no skip rate).
pub const PREFILL_MEASURE_MIN_TOKENS: i64 = 8192;

/// Dispatch rule of [`attention_prefill`]: does the routed kernel (layout included) beat SDPA +
/// the zero pass at `tokens` prompt tokens and skip rate `sparsity`, with the wgmma kernel
/// (`wgmma`: a compute capability 9.0 GPU and head_dim 128) or the `mma.sync` one? Fitted to the
/// H200 (bf16, 32/8 heads, head_dim 128, cold L2; benchmarks/RESULTS.md).
/// - wgmma (128-key tiles): from 1024 tokens at every skip rate. It does (1 - s) of the FLOPs at
///   about SDPA's own rate (490-610 TFLOP/s from 8192 tokens), so even with nothing skipped it
///   is level: routed / (SDPA + zero) at s = 0 / 0.125 was 1.02 / 1.04x at 1024 tokens, 1.02 /
///   1.07x at 2048, 1.01 / 1.12x at 4096, 1.02 / 1.15x at 8192, and 1.21-4.14x from s = 0.25.
///   Below 1024 tokens it was not measured.
/// - `mma.sync`: routed / (SDPA + zero) at s = 0.375 / 0.5 / 0.625: 1024 tokens 0.85 / 0.88 /
///   0.90x, 2048 0.79 / 0.98 / 1.20x, 4096 0.76 / 0.93 / 1.14x, 8192 0.75 / 0.90 / 1.14x, 32768
///   0.80 / 1.04 / 1.37x: 180-300 TFLOP/s on (1 - s) of the FLOPs, so the break-even skip rate
///   is a little above 0.5 ([`PREFILL_MIN_SPARSITY`]).
pub fn prefill_routed_pays(tokens: i64, sparsity: f64, wgmma: bool) -> bool {
    tokens >= prefill_min_tokens(wgmma) && (wgmma || sparsity >= PREFILL_MIN_SPARSITY)
}

/// The skip rate from which the `mma.sync` routed kernel wins (see [`prefill_routed_pays`]).
pub const PREFILL_MIN_SPARSITY: f64 = 0.55;

/// `WIDE_ATTN_PREFILL=routed|dense`: force the prefill attention path (read once).
fn prefill_override() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| crate::knobs::choice("WIDE_ATTN_PREFILL", &["routed", "dense"]).map(|c| c == "routed"))
}

/// The dense path: SDPA with GQA (the flash kernel without padding), then the skipped
/// (token, head) rows set to 0 (on CUDA in place by one kernel that writes only those rows; the
/// tch `masked_fill` elsewhere). Shapes as in [`attention_prefill_reference`].
pub fn attention_prefill_dense(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, group_heads: i64, scale: f64) -> Result<Tensor> {
    let (b, hq, _, t, d, ng) = prefill_shape(q, k, v, mask, group_heads)?;
    let o = Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, scale, true);
    let st = o.stride();
    let aligned = st[3] == 1 && st[..3].iter().all(|x| x % 8 == 0) && o.data_ptr() as usize % 16 == 0 && d % 8 == 0;
    match o.device() {
        Device::Cuda(dv) if aligned && matches!(o.kind(), Kind::BFloat16 | Kind::Half) && matches!(mask.kind(), Kind::Bool | Kind::Uint8) => {
            let m = if mask.kind() == Kind::Bool { mask.contiguous().view_dtype(Kind::Uint8) } else { mask.contiguous() };
            let zero = prefill_kernel(o.kind() == Kind::Half, None, "attn_prefill_zero", 0, dv)?;
            // One warp a token, 8 a block.
            let grid = ((b * t + 7) / 8).min(64 * crate::cuda::multiprocessor_count(dv)? as i64).max(1);
            unsafe {
                zero.launch(
                    LaunchConfig { grid: (grid as u32, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 },
                    &[
                        KernelArg::tensor(&o)?,
                        KernelArg::tensor(&m)?,
                        KernelArg::I32(b as i32),
                        KernelArg::I32(hq as i32),
                        KernelArg::I32(t as i32),
                        KernelArg::I32(d as i32),
                        KernelArg::I32(group_heads as i32),
                        KernelArg::I32(ng as i32),
                        KernelArg::I64(st[0]),
                        KernelArg::I64(st[1]),
                        KernelArg::I64(st[2]),
                    ],
                )?;
            }
            Ok(o)
        }
        _ => {
            let off = mask.to_kind(Kind::Bool).logical_not().repeat_interleave_self_int(group_heads, 2, None::<i64>);
            Ok(o.masked_fill(&off.transpose(1, 2).unsqueeze(-1), 0.0))
        }
    }
}

/// Block shape of the routed prefill kernel: `warps` (computing) warps of `mi` x 16 gathered
/// query rows each, key tiles of `bn`; `wgmma`: the Hopper kernel (`attn_wgmma.cu`: two
/// consumer warpgroups of 64 rows and a producer warpgroup), else the `mma.sync` one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillTile {
    pub warps: u32,
    pub mi: u32,
    pub bn: u32,
    pub wgmma: bool,
}

/// The shipped block shapes: the `mma.sync` ones compiled for head_dim 64 and 128, the wgmma
/// ones (last) for head_dim 128 on compute capability 9.0; each for bf16 and f16.
pub const PREFILL_TILES: [PrefillTile; 5] = [
    PrefillTile { warps: 4, mi: 1, bn: 64, wgmma: false },
    PrefillTile { warps: 8, mi: 1, bn: 64, wgmma: false },
    PrefillTile { warps: 4, mi: 2, bn: 32, wgmma: false },
    PrefillTile { warps: 8, mi: 1, bn: 64, wgmma: true },
    PREFILL_WGMMA,
];

/// The Hopper prefill kernel's block, the one [`PrefillTile::choose_for`] takes: 8 consumer
/// warps of 16 rows (128 list entries), 128-key tiles in a ring of
/// [`PrefillTile::wgmma_stages`]. Against the 64-key tile (H200, cold L2, s = 0.5; 2048 / 8192 /
/// 32768 tokens): 0.0580 / 0.483 / 7.24 ms against 0.0606 / 0.543 / 8.32 ms: QK^T on
/// m64n128k16 reads a third fewer shared-memory bytes a FLOP than on m64n64k16, and each tile
/// costs half the barrier round trips.
pub const PREFILL_WGMMA: PrefillTile = PrefillTile { warps: 8, mi: 1, bn: 128, wgmma: true };

impl PrefillTile {
    /// Query rows (list entries) a block.
    pub fn rows(&self) -> i64 {
        (self.warps * self.mi * 16) as i64
    }
    /// Depth of the wgmma kernel's K/V ring: 4 tiles of 64 keys, 3 of 128 (within the 227 KB of
    /// shared memory a block).
    pub fn wgmma_stages(&self) -> u32 {
        if self.bn >= 128 {
            3
        } else {
            4
        }
    }
    /// Threads a block (the wgmma kernel adds its producer warpgroup).
    pub fn threads(&self) -> u32 {
        (self.warps + if self.wgmma { 4 } else { 0 }) * 32
    }
    /// Dynamic shared memory. `mma.sync`: Q tile and two K and V tiles, rows padded by 8
    /// elements. wgmma: 1024 bytes of alignment slack, the Q tile and the K/V ring, unpadded
    /// (swizzled).
    pub fn smem_bytes(&self, d: i64) -> u32 {
        let d = d as u32;
        if self.wgmma {
            1024 + self.rows() as u32 * d * 2 + self.wgmma_stages() * 2 * self.bn * d * 2
        } else {
            (self.rows() as u32 + 4 * self.bn) * (d + 8) * 2
        }
    }
    pub fn name(&self) -> String {
        if self.wgmma {
            format!("wgmma{}n{}", self.rows(), self.bn)
        } else {
            format!("w{}m{}n{}", self.warps, self.mi, self.bn)
        }
    }
    /// Can this block shape run head_dim `d` on `device`? (The wgmma kernel: head_dim 128 on a
    /// compute capability 9.0 GPU.)
    pub fn supports(&self, d: i64, device: usize) -> bool {
        if self.wgmma {
            d == 128 && super::wgmma::supported(device)
        } else {
            matches!(d, 64 | 128)
        }
    }
    /// Parses [`PrefillTile::name`].
    pub fn parse(s: &str) -> Option<Self> {
        PREFILL_TILES.into_iter().find(|t| t.name() == s)
    }
    /// `WIDE_ATTN_PREFILL_TILE` if set to a shipped name (read once), else the measured best for
    /// `batch` x `heads` heads of `tokens` tokens at skip rate `sparsity`: 4 warps of 32 rows
    /// (half the shared-memory reads of K and V per MMA of 16-row warps; 8192 tokens, s = 0.5:
    /// 1.020 ms against 1.116 ms) where its 128-row blocks of active rows number at least 384
    /// (1.45 waves of 2 blocks on 132 multiprocessors), else 64-row blocks (2048 tokens, s = 0.5,
    /// 256 blocks of 128: 0.097 ms against 0.127 ms; 4096 tokens, s = 0.75: 0.181 against 0.240).
    pub fn choose(batch: i64, heads: i64, tokens: i64, sparsity: f64) -> Self {
        let blocks = batch as f64 * heads as f64 * tokens as f64 * (1.0 - sparsity) / 128.0;
        Self::forced().unwrap_or(if blocks >= 384.0 { PREFILL_TILES[2] } else { PREFILL_TILES[0] })
    }
    /// [`PrefillTile::choose`] for head_dim `d` on `device`: the wgmma kernel wherever it can
    /// run (see [`prefill_routed_pays`] for its measured times), else the `mma.sync` choice.
    pub fn choose_for(device: usize, d: i64, batch: i64, heads: i64, tokens: i64, sparsity: f64) -> Self {
        match Self::forced() {
            Some(t) if t.supports(d, device) => t,
            _ if PREFILL_WGMMA.supports(d, device) => PREFILL_WGMMA,
            _ => Self::choose(batch, heads, tokens, sparsity),
        }
    }
    fn forced() -> Option<Self> {
        static V: OnceLock<Option<PrefillTile>> = OnceLock::new();
        *V.get_or_init(|| {
            let v = crate::knobs::value("WIDE_ATTN_PREFILL_TILE")?;
            crate::knobs::report(Self::parse(&v).map(Some).ok_or_else(|| {
                let names: Vec<String> = PREFILL_TILES.iter().map(|t| t.name()).collect();
                format!("WIDE_ATTN_PREFILL_TILE takes one of {}, got '{v}'", names.join(", "))
            }))
        })
    }
    fn entry(&self, d: i64) -> String {
        if self.wgmma {
            format!("attn_prefill_wgmma_{d}")
        } else {
            format!("attn_prefill_{d}_{}_{}_{}", self.warps, self.mi, self.bn)
        }
    }
}

const PREFILL_SOURCE: &str = concat!(include_str!("mma_sync.cuh"), include_str!("partition.cuh"), include_str!("attn_prefill.cu"));

/// The prefill module for a dtype (layout entry and every `mma.sync` block shape).
pub fn prefill_source(f16: bool) -> KernelSource {
    KernelSource::new("attn_prefill", PREFILL_SOURCE).define("WIDE_F16", f16 as u32)
}

const PREFILL_WGMMA_SOURCE: &str = concat!(include_str!("mbarrier.cuh"), include_str!("wgmma_common.cuh"), include_str!("attn_wgmma.cu"));

/// The Hopper prefill module for a dtype and a wgmma block shape (sm_90a; head_dim 128).
pub fn prefill_wgmma_source(f16: bool, tile: PrefillTile) -> KernelSource {
    KernelSource::new("attn_prefill_wgmma", PREFILL_WGMMA_SOURCE)
        .target(super::wgmma::TARGET)
        .define("WIDE_F16", f16 as u32)
        .define("KN", tile.bn)
        .define("STAGES", tile.wgmma_stages())
}

/// The kernel `entry` of the prefill module (`tile`: the wgmma module of that block shape, else
/// the `mma.sync` module), loaded once.
fn prefill_kernel(f16: bool, tile: Option<PrefillTile>, entry: &str, smem: u32, device: usize) -> Result<CudaKernel> {
    type Key = (bool, Option<PrefillTile>, String, usize);
    static K: OnceLock<Mutex<HashMap<Key, CudaKernel>>> = OnceLock::new();
    let key = (f16, tile, entry.to_string(), device);
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(*k);
    }
    let src = match tile {
        Some(t) => prefill_wgmma_source(f16, t),
        None => prefill_source(f16),
    };
    let k = CudaKernel::get(&src, entry, device)?;
    if smem > 0 {
        k.set_max_dynamic_shared_mem(smem)?;
    }
    K.get_or_init(Default::default).lock().unwrap().insert(key, k);
    Ok(k)
}

/// The routed prefill kernel, always (no dispatch): per (batch, head group) a list of the active
/// tokens (one layout launch), then causal attention of the gathered active query rows of each
/// head against dense K/V; skipped (token, head) rows exactly 0. CUDA, bf16/f16, head_dim 64 or
/// 128, no padding; k/v may be narrowed views of a KV cache (rows contiguous). The output is
/// `[B, HQ, T, D]` laid out in memory as `[B, T, HQ, D]` (like SDPA's).
pub fn attention_prefill_routed(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, group_heads: i64, scale: f64, tile: PrefillTile) -> Result<Tensor> {
    let (b, hq, hkv, t, d, ng) = prefill_shape(q, k, v, mask, group_heads)?;
    let device = match q.device() {
        Device::Cuda(dv) => dv,
        dv => bail!("attention_prefill_routed: needs CUDA tensors, got {dv:?}; use attention_prefill for other devices"),
    };
    ensure!(
        matches!(q.kind(), Kind::BFloat16 | Kind::Half) && q.kind() == k.kind() && k.kind() == v.kind(),
        "attention_prefill_routed: q, k, v must all be bf16 or all f16, got {:?}, {:?}, {:?}",
        q.kind(),
        k.kind(),
        v.kind()
    );
    ensure!(matches!(d, 64 | 128), "attention_prefill_routed: the kernel takes head_dim 64 or 128, got {d}; use attention_prefill_dense");
    ensure!(PREFILL_TILES.contains(&tile), "attention_prefill_routed: {tile:?} is not a shipped block shape (PREFILL_TILES)");
    ensure!(
        tile.supports(d, device),
        "attention_prefill_routed: block shape {} needs head_dim 128 on a compute capability 9.0 GPU (head_dim {d}, device {device}); use another of PREFILL_TILES",
        tile.name()
    );
    let bm = tile.rows();
    ensure!(
        t >= 1 && t <= i32::MAX as i64 && (t + bm - 1) / bm <= 65535 && b <= 65535 && hq <= 65535,
        "attention_prefill_routed: {t} tokens, batch {b}, {hq} heads exceed the kernel's grid (at most 65535 x {bm} tokens, 65535 sequences and heads)"
    );
    let f16 = q.kind() == Kind::Half;
    let q = q.contiguous();
    // K/V rows must be contiguous (a narrowed cache is fine); batch and head strides are passed.
    let kv_ok = |x: &Tensor| x.stride()[3] == 1 && x.stride()[2] == d;
    let (k, v) = if kv_ok(k) && kv_ok(v) && k.stride() == v.stride() { (k.shallow_clone(), v.shallow_clone()) } else { (k.contiguous(), v.contiguous()) };
    let (kv_sb, kv_sh) = (k.stride()[0], k.stride()[1]);
    let mask = match mask.kind() {
        Kind::Bool => mask.contiguous().view_dtype(Kind::Uint8),
        Kind::Uint8 => mask.contiguous(),
        kd => bail!("attention_prefill_routed: mask must be bool or u8, got {kd:?}"),
    };
    let perm = Tensor::empty([b, ng, t], (Kind::Int, q.device()));
    let count = Tensor::empty([b, ng], (Kind::Int, q.device()));
    // [B, HQ, T, D] over [B, T, HQ, D] memory, as SDPA returns it: the engine's
    // transpose(1, 2).reshape([B * T, HQ * D]) is then a view.
    let out = Tensor::empty([b, t, hq, d], (q.kind(), q.device())).transpose(1, 2);
    let os = out.stride();
    let layout = prefill_kernel(f16, None, "attn_prefill_layout", 0, device)?;
    let smem = tile.smem_bytes(d);
    let attn = prefill_kernel(f16, tile.wgmma.then_some(tile), &tile.entry(d), smem, device)?;
    let threads = (t.min(1024) as u32).div_ceil(32) * 32;
    unsafe {
        layout.launch(
            LaunchConfig { grid: (ng as u32, b as u32, 1), block: (threads, 1, 1), shared_mem_bytes: 0 },
            &[KernelArg::tensor(&mask)?, KernelArg::I32(t as i32), KernelArg::I32(ng as i32), KernelArg::tensor(&perm)?, KernelArg::tensor(&count)?],
        )?;
        let cfg = LaunchConfig { grid: (hq as u32, ((t + bm - 1) / bm) as u32, b as u32), block: (tile.threads(), 1, 1), shared_mem_bytes: smem };
        let tail = [
            KernelArg::I64(os[0]),
            KernelArg::I64(os[1]),
            KernelArg::I64(os[2]),
            KernelArg::F32((scale * std::f64::consts::LOG2_E) as f32),
        ];
        let dims = [KernelArg::I32(hq as i32), KernelArg::I32(hkv as i32), KernelArg::I32(t as i32), KernelArg::I32(group_heads as i32), KernelArg::I32(ng as i32)];
        if tile.wgmma {
            // K and V through 4-D tensor maps (head dim, token, KV head, batch): boxes of 64 dims
            // x bn keys, the kernel's swizzled tile halves.
            let map = |x: &Tensor| crate::cuda::tensor_map(x, f16, &[d as u64, t as u64, hkv as u64, b as u64], &[d as u64 * 2, kv_sh as u64 * 2, kv_sb as u64 * 2], &[64, tile.bn, 1, 1]);
            let mut args = vec![KernelArg::tensor(&q)?, KernelArg::tensor(&perm)?, KernelArg::tensor(&count)?, KernelArg::tensor(&out)?];
            args.extend(dims);
            args.extend(tail);
            args.push(map(&k)?);
            args.push(map(&v)?);
            attn.launch(cfg, &args)?;
        } else {
            let mut args = vec![
                KernelArg::tensor(&q)?,
                KernelArg::tensor(&k)?,
                KernelArg::tensor(&v)?,
                KernelArg::tensor(&perm)?,
                KernelArg::tensor(&count)?,
                KernelArg::tensor(&out)?,
            ];
            args.extend(dims);
            args.push(KernelArg::I64(kv_sb));
            args.push(KernelArg::I64(kv_sh));
            args.extend(tail);
            attn.launch(cfg, &args)?;
        }
    }
    Ok(out)
}

/// Every prefill kernel variant (for the NVRTC compile test).
pub fn kernel_variants() -> Vec<KernelSource> {
    let mut v = vec![prefill_source(false), prefill_source(true)];
    for t in PREFILL_TILES.into_iter().filter(|t| t.wgmma) {
        v.extend([prefill_wgmma_source(false, t), prefill_wgmma_source(true, t)]);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_step_rope_off_cuda_is_rope_then_attention_and_checks_shapes() {
        tch::manual_seed(5);
        let (b, hq, hkv, cap, d, gh) = (2, 8, 2, 12, 16, 2);
        let opts = (Kind::Float, Device::Cpu);
        let qkv = Tensor::randn([b, (hq + 2 * hkv) * d], opts);
        let (k, v) = (Tensor::randn([b, hkv, cap, d], opts), Tensor::randn([b, hkv, cap, d], opts));
        let inv_freq = (Tensor::arange(d / 2, opts) * -0.5).exp();
        let len = Tensor::from_slice(&[5i32, 12]);
        let mask = Tensor::rand([b, hq / gh], opts).lt(0.5);
        let (k1, v1) = (k.copy(), v.copy());
        let y = attention_decode_step_rope(&qkv, &inv_freq, &k1, &v1, &len, &mask, gh, 0.25).unwrap();
        // By hand: the reference RoPE + cache write at position lengths - 1, then the reference attention.
        let (k2, v2) = (k.copy(), v.copy());
        let shape = crate::ops::fused::QkvShape { batch: b, tokens: 1, q_heads: hq, kv_heads: hkv, head_dim: d };
        let q = crate::ops::fused::rope_qkv_cache_reference(&qkv, &Tensor::from_slice(&[4i32, 11]), &inv_freq, &shape, &k2, &v2);
        let r = attention_decode_reference(&q.view([b, hq, d]), &k2, &v2, &len, &mask, gh, 0.25);
        assert!(y.allclose(&r, 1e-6, 1e-6, false));
        assert!(k1.equal(&k2) && v1.equal(&v2), "the newest cache rows were not written as rope_qkv_cache writes them");
        // The newest row really was written (it differs from the random row it replaced).
        assert!(!k1.get(0).narrow(1, 4, 1).equal(&k.get(0).narrow(1, 4, 1)));
        // Shapes that do not fit: one clear error each.
        let e = attention_decode_step_rope(&qkv.narrow(1, 0, (hq + 2 * hkv) * d - 1), &inv_freq, &k1, &v1, &len, &mask, gh, 0.25).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        let e = attention_decode_step_rope(&qkv, &inv_freq.narrow(0, 0, 4), &k1, &v1, &len, &mask, gh, 0.25).unwrap_err();
        assert!(e.to_string().contains("inv_freq"), "{e}");
    }

    #[test]
    fn decode_reference_matches_prefill_last_row_and_masks_heads() {
        tch::manual_seed(3);
        let (b, hq, hkv, t, d, gh) = (2, 8, 2, 9, 16, 2);
        let opts = (Kind::Double, Device::Cpu);
        let q = Tensor::randn([b, hq, t, d], opts);
        let k = Tensor::randn([b, hkv, t, d], opts);
        let v = Tensor::randn([b, hkv, t, d], opts);
        let mask = Tensor::rand([b, t, hq / gh], (Kind::Float, Device::Cpu)).lt(0.5);
        let full = attention_prefill_reference(&q, &k, &v, None, &mask, gh, 0.25);
        let lengths = Tensor::from_slice(&[t as i32, t as i32]);
        let last_q = q.select(2, t - 1);
        let last_mask = mask.select(1, t - 1);
        let dec = attention_decode(&last_q, &k, &v, &lengths, &last_mask, gh, 0.25).unwrap();
        let want = full.select(2, t - 1);
        assert!((&dec - &want).abs().max().double_value(&[]) < 1e-12);
        // Skipped heads are exactly zero.
        let off = last_mask.logical_not().repeat_interleave_self_int(gh, 1, None::<i64>);
        assert_eq!(dec.abs().sum_dim_intlist(-1, false, Kind::Double).masked_select(&off).sum(Kind::Double).double_value(&[]), 0.0);
    }

    #[test]
    fn decode_reference_ignores_positions_past_the_length() {
        let opts = (Kind::Double, Device::Cpu);
        let q = Tensor::randn([1, 2, 8], opts);
        let k = Tensor::randn([1, 1, 6, 8], opts);
        let v = Tensor::randn([1, 1, 6, 8], opts);
        let mask = Tensor::ones([1, 2], (Kind::Bool, Device::Cpu));
        let a = attention_decode_reference(&q, &k, &v, &Tensor::from_slice(&[4i32]), &mask, 1, 0.3);
        let b = attention_decode_reference(&q, &k.narrow(2, 0, 4), &v.narrow(2, 0, 4), &Tensor::from_slice(&[4i32]), &mask, 1, 0.3);
        assert!((a - b).abs().max().double_value(&[]) < 1e-12);
    }

    #[test]
    fn prefill_checks_shapes_and_routed_needs_cuda() {
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([1, 8, 5, 64], opts);
        let k = Tensor::randn([1, 2, 5, 64], opts);
        let m = Tensor::ones([1, 5, 4], (Kind::Bool, Device::Cpu));
        let e = attention_prefill(&q, &k, &k, None, &m.narrow(2, 0, 3), 2, 1.0).unwrap_err().to_string();
        assert!(e.contains("mask must be [batch, tokens, groups]"), "{e}");
        let e = attention_prefill_routed(&q, &k, &k, &m, 2, 1.0, PREFILL_TILES[0]).unwrap_err().to_string();
        assert!(e.contains("needs CUDA"), "{e}");
        // CPU: the reference, and the dense path agrees with it.
        let a = attention_prefill(&q, &k, &k, None, &m, 2, 0.125).unwrap();
        let b = attention_prefill_dense(&q, &k, &k, &m, 2, 0.125).unwrap();
        assert!((a - b).abs().max().double_value(&[]) < 1e-5);
    }

    #[test]
    fn prefill_wgmma_tile_resources() {
        assert_eq!(PREFILL_WGMMA.rows(), 128);
        assert_eq!(PREFILL_WGMMA.threads(), 384, "two consumer warpgroups and a producer");
        assert_eq!(PREFILL_TILES[0].threads(), 128);
        // Q tile 32 KB, four stages of 64-key K and V tiles (16 KB each), 1 KB of alignment;
        // three stages of 128-key tiles.
        assert_eq!(PREFILL_TILES[3].smem_bytes(128), 1024 + 32768 + 4 * 32768);
        assert_eq!(PREFILL_WGMMA.smem_bytes(128), 1024 + 32768 + 3 * 65536);
        // head_dim 64 has no wgmma kernel, on any device.
        assert!(!PREFILL_WGMMA.supports(64, 0));
        assert!(PREFILL_TILES[0].supports(64, 0) && !PREFILL_TILES[0].supports(96, 0));
    }

    #[test]
    fn prefill_dispatch_rule() {
        // mma.sync kernel.
        assert!(!prefill_routed_pays(1024, 0.9, false));
        assert!(!prefill_routed_pays(2048, 0.5, false) && prefill_routed_pays(2048, 0.625, false));
        assert!(!prefill_routed_pays(8192, 0.5, false) && prefill_routed_pays(8192, 0.625, false));
        // wgmma kernel: from 1024 tokens at any skip rate.
        assert!(!prefill_routed_pays(512, 0.9, true) && prefill_routed_pays(1024, 0.25, true));
        assert!(prefill_routed_pays(8192, 0.5, true) && prefill_routed_pays(8192, 0.0, true));
        // 128-row blocks only with enough of them (Llama-3.1-8B: 32 heads).
        assert_eq!(PrefillTile::choose(1, 32, 2048, 0.5), PREFILL_TILES[0]);
        assert_eq!(PrefillTile::choose(1, 32, 4096, 0.75), PREFILL_TILES[0]);
        assert_eq!(PrefillTile::choose(1, 32, 8192, 0.5), PREFILL_TILES[2]);
    }

    #[test]
    fn prefill_tiles_fit_the_multiprocessor() {
        for t in PREFILL_TILES {
            assert_eq!(PrefillTile::parse(&t.name()), Some(t));
            assert!(t.smem_bytes(128) <= 227 * 1024 && t.bn % 16 == 0);
        }
    }

    #[test]
    fn decode_rejects_bad_shapes() {
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([1, 6, 8], opts);
        let k = Tensor::randn([1, 4, 5, 8], opts);
        let m = Tensor::ones([1, 3], (Kind::Bool, Device::Cpu));
        let e = attention_decode(&q, &k, &k, &Tensor::from_slice(&[5i32]), &m, 2, 1.0).unwrap_err().to_string();
        assert!(e.contains("do not divide"), "{e}");
    }
}
