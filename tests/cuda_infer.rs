//! GPU tests of the inference engine (feature `cuda-tests`): the fused kernels against their
//! tch references, the engine's prefill against the training path for the same masks (bf16),
//! and graph-captured batched decode against eager decode and full forwards.
#![cfg(feature = "cuda-tests")]

mod common;

use std::path::Path;
use tch::{nn, Device, Kind, Tensor};
use wide_core::infer::{Decoder, Engine, EngineCache, MaskSource};
use wide_core::routing::{GateMode, Routing, RoutingConfig, RoutingRun, Variant};
use wide_core::{ForwardOptions, Logits, Pretrained};
use wide_kernels::ops::fused::{self, QkvShape, RouterWeights};

fn gpu() -> Device {
    common::exclusive_gpu()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    assert_eq!(a.isnan().sum(Kind::Int64).int64_value(&[]), 0, "NaN in output");
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

#[test]
fn fused_kernels_match_their_references() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    tch::manual_seed(1);
    let bf = (Kind::BFloat16, dev);
    for (m, h) in [(1i64, 4096i64), (37, 512), (5, 8192), (64, 4096)] {
        let x = Tensor::randn([m, h], bf);
        let d = Tensor::randn([m, h], bf);
        let w = Tensor::randn([h], bf);
        let (r, o) = fused::add_rmsnorm(&x, Some(&d), &w, 1e-5).unwrap();
        let rr = &x + &d;
        assert!(rel(&r, &rr) < 1e-2, "residual");
        assert!(rel(&o, &fused::rmsnorm_reference(&rr, &w, 1e-5)) < 1e-2, "rmsnorm m={m} h={h}");
        let (_, o2) = fused::add_rmsnorm(&x, None, &w, 1e-5).unwrap();
        assert!(rel(&o2, &fused::rmsnorm_reference(&x, &w, 1e-5)) < 1e-2);
        // x and w loaded before the wait (the delta written by the launch just before): the same
        // bits. x and w were written long before; d is rewritten right before the call.
        let d2 = d.copy();
        let (rs, os) = fused::add_rmsnorm_settled(&x, Some(&d2), &w, 1e-5).unwrap();
        assert!(rs.equal(&r) && os.equal(&o), "add_rmsnorm_settled m={m} h={h} differs from add_rmsnorm");
        // The same launch with a router's first layer (rank 32: several router blocks a row).
        let (w1, b1) = (Tensor::randn([32, h], bf) * 0.03, Tensor::randn([32], bf) * 0.1);
        for delta in [Some(&d), None] {
            let (r3, o3, h1) = fused::add_rmsnorm_router(&x, delta, &w, 1e-5, &w1, &b1).unwrap();
            let (r2, o2) = fused::add_rmsnorm(&x, delta, &w, 1e-5).unwrap();
            assert!(r3.equal(&r2) && o3.equal(&o2), "norm outputs change with the router fused in (m={m} h={h})");
            assert!(rel(&h1, &r2.linear(&w1, Some(&b1))) < 1e-2, "router first layer m={m} h={h}");
            // And the whole router with its gate in the same launch: the decisions are those of
            // the separate gate kernel on the same hidden, bit for bit, for one router block a
            // row (rank 8), several (32) and many (200).
            for rank in [8i64, 32, 200] {
                let (w1, b1) = (Tensor::randn([rank, h], bf) * 0.03, Tensor::randn([rank], bf) * 0.1);
                let (w2, b2) = (Tensor::randn([2 * 112, rank], bf) * 0.2, Tensor::randn([2 * 112], bf) * 0.1);
                let rw = RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
                for extra in [0i64, 4] {
                    poison_bool(m, 112);
                    let g = fused::add_rmsnorm_router_gate(&x, delta, &w, 1e-5, &rw, 0.05, extra).unwrap();
                    assert!(g.res.equal(&r2) && g.norm.equal(&o2), "norm outputs change with the gate fused in (m={m} h={h} rank {rank})");
                    // The hidden the gate read is the router's first layer (checked on its own,
                    // so a wrong hidden cannot hide behind a gate computed from the same value).
                    assert!(rel(&g.hidden, &r2.linear(&w1, Some(&b1))) < 1e-2, "router first layer with the gate fused (m={m} h={h} rank {rank})");
                    let (want, want_ext) = fused::router_gate_from_hidden(&g.hidden, &rw, 0.05, extra).unwrap();
                    assert!(g.mask.equal(&want), "fused gate differs from the gate kernel (m={m} h={h} rank {rank} extra {extra})");
                    assert_eq!(g.ext.is_some(), extra > 0);
                    if let (Some(e), Some(we)) = (&g.ext, &want_ext) {
                        assert!(e.equal(we), "fused extended mask differs (m={m} h={h} rank {rank})");
                    }
                    let on = g.mask.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
                    assert!(on > 0.0 && on < 1.0 || m == 1, "degenerate gate test: {on} of the pairs on");
                }
            }
        }
    }
    // (1, 3, 6, 3, 128): 9 heads, so the second block of 8 heads is partial. head_dim 40 is not a
    // multiple of 16: the scalar kernel (the others take the 16-byte one).
    for (b, t, hq, hkv, d) in [(1i64, 1i64, 32i64, 8i64, 128i64), (3, 17, 8, 2, 64), (1, 3, 6, 3, 128), (2, 5, 4, 2, 40), (2, 300, 32, 8, 128)] {
        let s = QkvShape { batch: b, tokens: t, q_heads: hq, kv_heads: hkv, head_dim: d };
        let qkv = Tensor::randn([b * t, (hq + 2 * hkv) * d], bf);
        // Distinct positions within a row (a slot is written once).
        let pos = (Tensor::arange(t, (Kind::Int, dev)).repeat([b]) * 2 + 3).to_kind(Kind::Int);
        let inv = Tensor::rand([d / 2], (Kind::Float, dev));
        let cap = 2 * t + 8;
        let (kc, vc) = (Tensor::randn([b, hkv, cap, d], bf), Tensor::randn([b, hkv, cap, d], bf));
        let (kr, vr) = (kc.copy(), vc.copy());
        let q = fused::rope_qkv_cache(&qkv, &pos, &inv, &s, &kc, &vc).unwrap();
        let qr = fused::rope_qkv_cache_reference(&qkv, &pos, &inv, &s, &kr, &vr);
        assert!(rel(&q, &qr) < 1e-2, "rope q");
        // Token-major q: the same values as the kernel's head-major q, in [B, T, HQ, D] storage.
        let qt = fused::rope_qkv_cache_with(&qkv, &pos, &inv, &s, &kc.zeros_like(), &vc.zeros_like(), true).unwrap();
        assert_eq!(qt.transpose(1, 2).stride(), [t * hq * d, hq * d, d, 1]);
        assert!(qt.equal(&q), "token-major q");
        assert!(rel(&kc, &kr) < 1e-2 && rel(&vc, &vr) < 1e-3, "cache writes");
        // The rotation computed before the wait (qkv rewritten right before the call): same bits.
        let (ks, vs) = (kc.zeros_like(), vc.zeros_like());
        let qkv2 = qkv.copy();
        let qs = fused::rope_qkv_cache_settled(&qkv2, &pos, &inv, &s, &ks, &vs, false).unwrap();
        let (kz, vz) = (kc.zeros_like(), vc.zeros_like());
        let _ = fused::rope_qkv_cache(&qkv, &pos, &inv, &s, &kz, &vz).unwrap();
        assert!(qs.equal(&q) && ks.equal(&kz) && vs.equal(&vz), "rope_qkv_cache_settled differs");
    }
    let gu = Tensor::randn([9, 2 * 1024], bf);
    let mask = Tensor::rand([9, 8], (Kind::Float, dev)).lt(0.5);
    assert!(rel(&fused::swiglu(&gu, Some(&mask), 128).unwrap(), &fused::swiglu_reference(&gu, Some(&mask), 128)) < 1e-2);
    assert!(rel(&fused::swiglu(&gu, None, 128).unwrap(), &fused::swiglu_reference(&gu, None, 128)) < 1e-2);
    // The dense engine's call (no mask, group 1) runs the kernel too: bit for bit the masked
    // kernel with every group on (the tch fallback rounds its exponentials differently).
    let ones = Tensor::ones([9, 8], (Kind::Bool, dev));
    assert!(fused::swiglu(&gu, None, 1).unwrap().equal(&fused::swiglu(&gu, Some(&ones), 128).unwrap()), "dense swiglu on the kernel");
    let x = Tensor::randn([7, 4096], bf);
    let (w1, b1) = (Tensor::randn([32, 4096], bf) * 0.03, Tensor::randn([32], bf) * 0.1);
    let (w2, b2) = (Tensor::randn([2 * 112, 32], bf) * 0.2, Tensor::randn([2 * 112], bf) * 0.1);
    let r = RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
    let (m, ext) = fused::router_gate(&x, &r, 0.05, 4).unwrap();
    let want = fused::router_gate_reference(&x, &r, 0.05);
    let agree = m.eq_tensor(&want).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    assert!(agree > 0.98, "router decisions agree on {agree} of the pairs (bf16 rounding may flip near-ties)");
    let ext = ext.unwrap();
    assert!(ext.narrow(1, 0, 112).equal(&m) && ext.narrow(1, 112, 4).all().int64_value(&[]) == 1);
}

/// The one-launch prefill router (`fused::router_prefill`, clusters of hidden / 512 blocks
/// splitting the first layer's k): its rounded hidden against the f64 first layer, its decision
/// bit for bit the gate kernel's on that hidden, every mask byte written, the same bits on a
/// second call (a fixed summation order), and the decision of cuBLAS's first layer + the gate
/// wherever the logit margin exceeds the rounding. Token counts off the 128-token tile, cluster
/// sizes 1, 3, 4 and 8, ranks 16 / 32 / 64 on both variants (every x chunk resident for grids
/// of one wave, the 3-stage ring from 2048 tokens at hidden 4096), the gate's weights in shared
/// memory and (many groups at rank 64) read from global memory.
#[test]
fn router_prefill_matches_the_unfused_router() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    tch::manual_seed(5);
    for kind in [Kind::BFloat16, Kind::Half] {
        let o = (kind, dev);
        for (m, h, rank, ng, extra) in [(1i64, 4096i64, 32i64, 112i64, 0i64), (7, 4096, 32, 8, 4), (129, 2048, 16, 28, 0), (300, 512, 64, 112, 4), (2048, 4096, 32, 112, 0), (2051, 1536, 32, 8, 4), (64, 1024, 64, 1024, 0), (2100, 4096, 64, 112, 4), (15000, 512, 16, 8, 0)] {
            let what = format!("{kind:?} M={m} H={h} rank={rank} groups={ng}+{extra}");
            let x = Tensor::randn([m, h], o);
            let w1 = Tensor::randn([rank, h], o) * (1.0 / (h as f64).sqrt());
            let b1 = Tensor::randn([rank], o) * 0.1;
            let w2 = Tensor::randn([2 * ng, rank], o) * (1.0 / (rank as f64).sqrt());
            let b2 = Tensor::randn([2 * ng], o) * 0.1;
            let rw = RouterWeights { w1: &w1, b1: &b1, w2: &w2, b2: &b2 };
            let offset = 0.05;
            poison_bool(m, ng);
            let (mask, ext, hid) = fused::router_prefill(&x, &rw, offset, extra, true).unwrap().unwrap_or_else(|| panic!("{what}: the kernel does not apply"));
            for (t, which) in [(Some(&mask), "mask"), (ext.as_ref(), "extended mask")] {
                if let Some(t) = t {
                    assert!(t.view_dtype(Kind::Uint8).max().int64_value(&[]) <= 1, "{what}: {which} has unwritten bytes");
                }
            }
            let hid = hid.unwrap();
            let d = |t: &Tensor| t.to_kind(Kind::Double);
            let want = d(&x).matmul(&d(&w1).tr()) + d(&b1);
            let scale = d(&x).abs().matmul(&d(&w1).abs().tr()) + d(&b1).abs();
            let ulp = if kind == Kind::Half { 1.0 / 1024.0 } else { 1.0 / 128.0 };
            let bad = ((d(&hid) - &want).abs() - want.abs() * ulp - &scale * 1e-5).gt(0.0).sum(Kind::Int64).int64_value(&[]);
            assert_eq!(bad, 0, "{what}: {bad} hidden values off the f64 first layer by more than a rounding");
            let (gm, ge) = fused::router_gate_from_hidden(&hid, &rw, offset, extra).unwrap();
            assert!(mask.equal(&gm), "{what}: decision differs from the gate kernel's on the same hidden");
            assert_eq!(ext.is_some(), extra > 0, "{what}: extended mask iff extra groups");
            if let (Some(a), Some(b)) = (&ext, &ge) {
                assert!(a.equal(b), "{what}: extended mask differs");
            }
            let (again, _, hid2) = fused::router_prefill(&x, &rw, offset, extra, true).unwrap().unwrap();
            assert!(again.equal(&mask) && hid2.unwrap().equal(&hid), "{what}: a second call differs");
            let (public, _) = fused::router_gate(&x, &rw, offset, extra).unwrap();
            assert!(public.equal(&mask), "{what}: router_gate does not take the one-launch router");
            // cuBLAS's first layer + the gate kernel, where the f64 logits are not near a tie.
            let (old, _) = fused::router_gate_from_hidden(&x.linear(&w1, Some(&b1)), &rw, offset, 0).unwrap();
            let logits = want.matmul(&d(&w2).tr()) + d(&b2);
            let logits = logits.view([m, ng, 2]);
            let sure = (logits.select(2, 1) - logits.select(2, 0) + offset).abs().gt(0.05);
            let differ = mask.ne_tensor(&old).logical_and(&sure).sum(Kind::Int64).int64_value(&[]);
            assert_eq!(differ, 0, "{what}: {differ} decisions with margin > 0.05 differ from cuBLAS + the gate kernel");
        }
    }
}

/// Leaves garbage in the allocator's free bool blocks of this size, so a kernel that skips
/// writing part of its mask output is caught.
fn poison_bool(m: i64, ng: i64) {
    let _ = Tensor::full([m, ng], 7, (Kind::Uint8, gpu()));
    let _ = Tensor::full([m, ng + 4], 7, (Kind::Uint8, gpu()));
}

fn small() -> Pretrained {
    // The checkout the binary was built in, or (staged on the GPU machine) the current folder.
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("testbed/testbed-small");
    let dir = if built.exists() { built } else { Path::new("testbed/testbed-small").to_path_buf() };
    Pretrained::load(&dir, gpu(), Kind::BFloat16).unwrap()
}

fn wide_routing(p: &Pretrained, vs: &nn::VarStore, fixed: bool) -> Routing {
    let mut c = RoutingConfig::new(Variant::Wide);
    c.attn_group_size = 1;
    c.ffn_group_size = 64;
    c.target_sparsity = Some(0.5);
    let r = Routing::new(&vs.root(), &p.model.config, &c, Kind::BFloat16).unwrap();
    if fixed {
        // Decisions far from the threshold (router weights 0, biases +-3): both paths decide the
        // same whatever their rounding, and about half of the groups run.
        let _g = tch::no_grad_guard();
        for l in &r.layers {
            for rt in [&l.attention, &l.ffn].into_iter().flatten() {
                let _ = rt.router_w.shallow_clone().zero_();
                let signs = Tensor::rand([rt.groups, 2], (Kind::Float, Device::Cpu)).lt(0.5).to_kind(Kind::Float) * 6.0 - 3.0;
                rt.router_b.shallow_clone().copy_(&signs.view([-1]).to_kind(Kind::BFloat16).to_device(rt.router_b.device()));
            }
        }
    }
    r
}

#[test]
fn engine_prefill_matches_training_path_on_gpu() {
    let _ = gpu(); // the device first (one GPU test at a time)
    let _g = tch::no_grad_guard();
    tch::manual_seed(2);
    let p = small();
    let vs = nn::VarStore::new(gpu());
    let r = wide_routing(&p, &vs, false);
    let (b, t) = (2, 300);
    let ids = Tensor::randint(p.model.config.vocab_size, [b, t], (Kind::Int64, gpu()));
    let mut masks = vec![];
    for l in &r.layers {
        for rt in [&l.attention, &l.ffn].into_iter().flatten() {
            masks.push(Tensor::rand([b, t, rt.groups], (Kind::Float, gpu())).lt(0.5).to_kind(Kind::Float));
        }
    }
    let mut run = RoutingRun::new(&r, GateMode::Forced(masks.iter().map(|m| m.shallow_clone()).collect()), Tensor::ones([b, t], (Kind::Float, gpu())));
    let want = p.model.forward_routed(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap();
    let engine = Engine::new(&p.model, Some(&r)).unwrap();
    let cache = EngineCache::new(&p.model, b, t);
    let got = engine.prefill(&ids, &[t, t], &cache, &mut MaskSource::Forced(masks), None, true).unwrap();
    let e = rel(&got, &want);
    assert!(e < 2e-2, "engine vs training path (bf16): rel {e}");
    let dense_engine = Engine::new(&p.model, None).unwrap();
    let got = dense_engine.prefill(&ids, &[t, t], &cache, &mut MaskSource::Routers, None, true).unwrap();
    let want = p.model.forward(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }).unwrap();
    let e = rel(&got, &want);
    assert!(e < 2e-2, "dense engine vs backbone (bf16): rel {e}");
}

/// Prefill long enough for the fused gate+up and the fused Q|K|V (K|V groups always on) to take
/// a routed large-M kernel when the autotuner measures it faster (with `WIDE_ROUTED=wgmma`:
/// always the Hopper kernel, so run it that way too), on a random model whose FFN groups (128
/// channels) and head groups (2 x 128) fit the wgmma tiles; the engine must still equal the
/// training path for the same masks.
#[test]
fn engine_prefill_with_large_m_routed_gate_up_matches_training_path() {
    let _ = gpu(); // the device first (one GPU test at a time)
    let _g = tch::no_grad_guard();
    tch::manual_seed(5);
    let mut mc = wide_core::presets::preset("tiny").unwrap();
    mc.hidden_size = 1024;
    mc.intermediate_size = 4096;
    mc.num_attention_heads = 8;
    mc.num_key_value_heads = 2;
    mc.head_dim = 128;
    mc.num_hidden_layers = 2;
    mc.max_position_embeddings = 2048;
    let mvs = nn::VarStore::new(gpu());
    let model = wide_core::LlamaModel::new(&mvs.root(), &mc, &mut wide_core::RandomWeights { std: 0.02 }, Kind::BFloat16, false).unwrap();
    let vs = nn::VarStore::new(gpu());
    let mut c = RoutingConfig::new(Variant::Wide);
    c.attn_group_size = 2;
    c.ffn_group_size = 128;
    c.target_sparsity = Some(0.5);
    let r = Routing::new(&vs.root(), &mc, &c, Kind::BFloat16).unwrap();
    let t = 1024;
    let ids = Tensor::randint(mc.vocab_size, [1, t], (Kind::Int64, gpu()));
    let mut masks = vec![];
    for l in &r.layers {
        for rt in [&l.attention, &l.ffn].into_iter().flatten() {
            masks.push(Tensor::rand([1, t, rt.groups], (Kind::Float, gpu())).lt(0.5).to_kind(Kind::Float));
        }
    }
    let mut run = RoutingRun::new(&r, GateMode::Forced(masks.iter().map(|m| m.shallow_clone()).collect()), Tensor::ones([1, t], (Kind::Float, gpu())));
    let want = model.forward_routed(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap();
    let mut engine = Engine::new(&model, Some(&r)).unwrap();
    engine.sparsity_hint = [0.5, 0.5];
    let cache = EngineCache::new(&model, 1, t);
    let got = engine.prefill(&ids, &[t], &cache, &mut MaskSource::Forced(masks), None, true).unwrap();
    let e = rel(&got, &want);
    eprintln!("tuned large-M records: {:?}", wide_kernels::ops::gemm::tuned_records());
    assert!(e < 2e-2, "engine (large-M routed gate+up) vs training path (bf16): rel {e}");
}

#[test]
fn graph_decode_matches_eager_decode_and_full_forwards() {
    let _ = gpu(); // the device first (one GPU test at a time)
    let _g = tch::no_grad_guard();
    tch::manual_seed(3);
    let p = small();
    let vs = nn::VarStore::new(gpu());
    let r = wide_routing(&p, &vs, true);
    let v = p.model.config.vocab_size;
    // Routed with both routers folded at one-token decode, with the default (the FFN router
    // only), and dense.
    for (routed, folds) in [(true, [true, true]), (true, wide_core::infer::DEFAULT_ROUTER_FOLDS), (false, [true, true])] {
        let engine = Engine::with_router_folds(&p.model, routed.then_some(&r), folds).unwrap();
        for lens in [vec![17i64], vec![17, 5, 11]] {
            let prompts: Vec<Vec<i64>> = lens.iter().map(|&n| Vec::<i64>::try_from(Tensor::randint(v, [n], (Kind::Int64, Device::Cpu))).unwrap()).collect();
            let steps = 12;
            let run = |graph: bool| -> (Vec<Tensor>, Vec<Vec<i64>>) {
                let (mut dec, first) = Decoder::new(&engine, &prompts, 17 + steps + 1, true, false, None).unwrap();
                let mut seqs = prompts.clone();
                let mut logits = vec![first.to_kind(Kind::Float)];
                if graph {
                    dec.capture().unwrap();
                }
                for _ in 0..steps {
                    let next = Vec::<i64>::try_from(logits.last().unwrap().argmax(-1, false).to_device(Device::Cpu)).unwrap();
                    for (s, n) in seqs.iter_mut().zip(&next) {
                        s.push(*n);
                    }
                    dec.set_tokens(&next).unwrap();
                    logits.push(dec.step().unwrap().to_kind(Kind::Float));
                }
                (logits, seqs)
            };
            let folded = engine.folded_router_calls();
            let (eager, seqs) = run(false);
            if routed && lens.len() == 1 {
                // One sequence: every router of a folded kind (after the first layer's attention
                // router) is folded into the projection before it.
                let n = p.model.config.num_hidden_layers as u64;
                let per_step = folds[0] as u64 * (n - 1) + folds[1] as u64 * n;
                assert_eq!(engine.folded_router_calls() - folded, steps as u64 * per_step, "folded routers in eager decode ({folds:?})");
            }
            let (graph, seqs_g) = run(true);
            assert_eq!(seqs, seqs_g, "graph decode chose other tokens (routed {routed})");
            for (a, b) in eager.iter().zip(&graph) {
                assert!(rel(a, b) < 1e-3, "graph vs eager step logits differ");
            }
            for (row, s) in seqs.iter().enumerate() {
                let ids = Tensor::from_slice(s).view([1, -1]).to_device(gpu());
                let n = s.len() as i64;
                let full = if routed {
                    let mut run = RoutingRun::new(&r, GateMode::Inference, Tensor::ones([1, n], (Kind::Float, gpu())));
                    p.model.forward_routed(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap()
                } else {
                    p.model.forward(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }).unwrap()
                };
                for (k, l) in graph.iter().enumerate() {
                    let pos = lens[row] - 1 + k as i64;
                    let e = rel(&l.get(row as i64), &full.get(0).get(pos));
                    assert!(e < 3e-2, "routed {routed} lens {lens:?} row {row} step {k}: rel {e}");
                }
            }
        }
    }
}

/// The decode-step measurement `WIDE_STEP_READS` (here through `Engine::set_step_reads`): every
/// one-token projection is a pure read that outputs zeros, so the residual stream stays the
/// token's embedding and each step's logits are the LM head of its normalised embedding, eager
/// and replayed in a CUDA graph, dense and routed (routers then in the norm launches).
#[test]
fn step_reads_leave_the_embedding_through_every_layer() {
    let _ = gpu(); // the device first (one GPU test at a time)
    let _g = tch::no_grad_guard();
    tch::manual_seed(4);
    let p = small();
    let vs = nn::VarStore::new(gpu());
    let r = wide_routing(&p, &vs, true);
    let v = p.model.config.vocab_size;
    for routed in [false, true] {
        let mut engine = Engine::new(&p.model, routed.then_some(&r)).unwrap();
        engine.set_step_reads(Some(2)).unwrap();
        assert!(engine.set_step_reads(Some(9)).is_err());
        for graph in [false, true] {
            let prompt = Vec::<i64>::try_from(Tensor::randint(v, [9], (Kind::Int64, Device::Cpu))).unwrap();
            let (mut dec, _) = Decoder::new(&engine, &[prompt], 9 + 6, true, false, None).unwrap();
            if graph {
                dec.capture().unwrap();
            }
            for step in 0..5 {
                let tok = (step * 37 + 11) % v;
                dec.set_tokens(&[tok]).unwrap();
                let got = dec.step().unwrap().to_kind(Kind::Float).view([-1]);
                let emb = p.model.embed_tokens.get(tok).view([1, -1]);
                let want = p.model.norm.forward(&emb).linear::<Tensor>(&p.model.lm_head, None).to_kind(Kind::Float).view([-1]);
                let e = rel(&got, &want);
                assert!(e < 2e-2, "routed {routed} graph {graph} step {step}: logits vs the LM head of the token's embedding: rel {e}");
            }
        }
    }
}

/// `WIDE_FIXED_MASKS`'s engine setting on the GPU: the fixed decisions skip exactly the expected
/// share of groups at every step, and the step replayed in a CUDA graph (masks made in the
/// warm-up step, outside the capture) gives the eager step's logits.
#[test]
fn fixed_masks_decode_replays_in_a_graph_like_eager() {
    let _ = gpu(); // the device first (one GPU test at a time)
    let _g = tch::no_grad_guard();
    tch::manual_seed(6);
    let p = small();
    let vs = nn::VarStore::new(gpu());
    let r = wide_routing(&p, &vs, false);
    let mut engine = Engine::new(&p.model, Some(&r)).unwrap();
    engine.set_fixed_masks(true);
    let v = p.model.config.vocab_size;
    let prompt = Vec::<i64>::try_from(Tensor::randint(v, [9], (Kind::Int64, Device::Cpu))).unwrap();
    let steps = 5;
    let mut runs = vec![];
    for graph in [false, true] {
        let (mut dec, _) = Decoder::new(&engine, std::slice::from_ref(&prompt), 9 + steps + 1, true, true, None).unwrap();
        if graph {
            dec.capture().unwrap();
        }
        let mut logits = vec![];
        for step in 0..steps {
            dec.set_tokens(&[(step * 37 + 11) % v]).unwrap();
            logits.push(dec.step().unwrap().to_kind(Kind::Float).view([-1]));
        }
        let c = dec.skip_counts();
        for kind in ["attention", "ffn"] {
            let (skipped, total) = c.per_kind[kind];
            assert!(total > 0.0 && skipped * 2.0 == total, "graph {graph} {kind}: {skipped} of {total} skipped, want exactly half");
        }
        runs.push(logits);
    }
    for (step, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        let e = rel(b, a);
        assert!(e < 1e-2, "step {step}: graph vs eager logits rel {e}");
    }
}
