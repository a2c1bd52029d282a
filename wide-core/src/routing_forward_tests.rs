//! The routed forward against explicit slow forms.
use crate::model::{ForwardOptions, LlamaModel};
use crate::routing::{GateMode, Routing, RoutingConfig, RoutingRun, Variant};
use crate::{presets, rope, RandomWeights};
use tch::{nn, Device, Kind, Tensor};

fn model(seed: i64) -> (nn::VarStore, LlamaModel) {
    tch::manual_seed(seed);
    let cfg = presets::preset("tiny").unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let m = LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.1 }, Kind::Float, false).unwrap();
    (vs, m)
}

fn routing(m: &LlamaModel, variant: Variant) -> (nn::VarStore, Routing) {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut c = RoutingConfig::new(variant);
    c.attn_group_size = 2;
    c.ffn_group_size = 64;
    c.target_sparsity = Some(0.5);
    let r = Routing::new(&vs.root(), &m.config, &c, Kind::Float).unwrap();
    (vs, r)
}

/// The wide forward computed token by token with inactive Q heads and FFN channels physically
/// left out: only the active rows of q_proj/gate/up and columns of o_proj/down are used.
fn slow_wide(m: &LlamaModel, ids: &Tensor, attn_masks: &[Tensor], ffn_masks: &[Tensor]) -> Tensor {
    let c = &m.config;
    let (b, t) = ids.size2().unwrap();
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let g = nh / nkv;
    let mut x = Tensor::embedding(&m.embed_tokens, ids, -1, false, false);
    let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0).expand([b, t], false);
    let (cos, sin) = m.rope.cos_sin(&pos, Kind::Float);
    for (li, layer) in m.layers.iter().enumerate() {
        let a = &layer.self_attn;
        let h = layer.input_layernorm.forward(&x);
        let k = rope::apply(&a.k_proj.forward(&h).view([b, t, nkv, hd]).transpose(1, 2), &cos, &sin);
        let v = a.v_proj.forward(&h).view([b, t, nkv, hd]).transpose(1, 2);
        let heads_per_group = nh / attn_masks[li].size()[2];
        let mut attn_rows = vec![];
        for bi in 0..b {
            let mut row = vec![];
            for ti in 0..t {
                let hv = h.get(bi).get(ti);
                let mut out = Tensor::zeros([c.hidden_size], (Kind::Float, Device::Cpu));
                for head in 0..nh {
                    if attn_masks[li].double_value(&[bi, ti, head / heads_per_group]) == 0.0 {
                        continue;
                    }
                    let wq = a.q_proj.weight.narrow(0, head * hd, hd);
                    let q = hv.matmul(&wq.tr()).view([1, 1, 1, hd]);
                    let q = rope::apply(&q, &cos.get(bi).unsqueeze(0).narrow(2, ti, 1), &sin.get(bi).unsqueeze(0).narrow(2, ti, 1)).view([hd]);
                    let kh = k.get(bi).get(head / g).narrow(0, 0, ti + 1);
                    let vh = v.get(bi).get(head / g).narrow(0, 0, ti + 1);
                    let w = (kh.matmul(&q) / (hd as f64).sqrt()).softmax(0, Kind::Float);
                    let o = w.matmul(&vh);
                    out += o.matmul(&a.o_proj.weight.narrow(1, head * hd, hd).tr());
                }
                row.push(out);
            }
            attn_rows.push(Tensor::stack(&row, 0));
        }
        let x1 = &x + Tensor::stack(&attn_rows, 0);
        let h2 = layer.post_attention_layernorm.forward(&x1);
        let gs = c.intermediate_size / ffn_masks[li].size()[2];
        let mut ffn_rows = vec![];
        for bi in 0..b {
            let mut row = vec![];
            for ti in 0..t {
                let hv = h2.get(bi).get(ti);
                let mut out = Tensor::zeros([c.hidden_size], (Kind::Float, Device::Cpu));
                for grp in 0..ffn_masks[li].size()[2] {
                    if ffn_masks[li].double_value(&[bi, ti, grp]) == 0.0 {
                        continue;
                    }
                    let gw = layer.mlp.gate_proj.weight.narrow(0, grp * gs, gs);
                    let uw = layer.mlp.up_proj.weight.narrow(0, grp * gs, gs);
                    let dw = layer.mlp.down_proj.weight.narrow(1, grp * gs, gs);
                    let hid = hv.matmul(&gw.tr()).silu() * hv.matmul(&uw.tr());
                    out += hid.matmul(&dw.tr());
                }
                row.push(out);
            }
            ffn_rows.push(Tensor::stack(&row, 0));
        }
        x = &x1 + Tensor::stack(&ffn_rows, 0);
    }
    m.logits(&m.norm.forward(&x), crate::Logits::All)
}

#[test]
fn wide_masked_forward_equals_the_physically_pruned_slow_form() {
    let _g = tch::no_grad_guard();
    let (_vs, m) = model(1);
    let (_rvs, r) = routing(&m, Variant::Wide);
    let (b, t) = (2, 7);
    let ids = Tensor::randint(250, [b, t], (Kind::Int64, Device::Cpu));
    for trial in 0..3 {
        let p = [0.0, 0.5, 1.0][trial];
        let mut forced = vec![];
        let (mut am, mut fm) = (vec![], vec![]);
        for _ in 0..m.layers.len() {
            let a = Tensor::rand([b, t, 2], (Kind::Float, Device::Cpu)).ge(p * 0.6 + 0.2).to_kind(Kind::Float);
            let f = Tensor::rand([b, t, 6], (Kind::Float, Device::Cpu)).ge(0.5).to_kind(Kind::Float);
            forced.push(a.shallow_clone());
            forced.push(f.shallow_clone());
            am.push(a);
            fm.push(f);
        }
        let mut run = RoutingRun::new(&r, GateMode::Forced(forced), Tensor::ones([b, t], (Kind::Float, Device::Cpu)));
        let fast = m.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
        let slow = slow_wide(&m, &ids, &am, &fm);
        let err = (&fast - &slow).abs().max().double_value(&[]);
        assert!(err < 1e-4, "trial {trial}: masked forward differs from the slow form by {err}");
    }
}

#[test]
fn layer_skip_with_everything_skipped_is_the_identity() {
    let _g = tch::no_grad_guard();
    let (_vs, m) = model(2);
    let (_rvs, r) = routing(&m, Variant::LayerSkip);
    let ids = Tensor::randint(250, [2, 9], (Kind::Int64, Device::Cpu));
    let forced = (0..m.layers.len()).map(|_| Tensor::zeros([2, 9, 1], (Kind::Float, Device::Cpu))).collect();
    let mut run = RoutingRun::new(&r, GateMode::Forced(forced), Tensor::ones([2, 9], (Kind::Float, Device::Cpu)));
    let got = m.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
    let emb = Tensor::embedding(&m.embed_tokens, &ids, -1, false, false);
    let want = m.logits(&m.norm.forward(&emb), crate::Logits::All);
    assert!(got.equal(&want), "skipping every layer must leave the residual untouched");
    let rate = run.stats.skip_rate(crate::routing::RouterKind::Layer).unwrap().double_value(&[]);
    assert_eq!(rate, 1.0);
}

#[test]
fn dense_routing_equals_the_plain_backbone_bit_for_bit() {
    let _g = tch::no_grad_guard();
    let (_vs, m) = model(3);
    let (_rvs, r) = routing(&m, Variant::Dense);
    let ids = Tensor::randint(250, [3, 11], (Kind::Int64, Device::Cpu));
    let mut run = RoutingRun::new(&r, GateMode::Inference, Tensor::ones([3, 11], (Kind::Float, Device::Cpu)));
    let a = m.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
    let b = m.forward(&ids, ForwardOptions::default()).unwrap();
    assert!(a.equal(&b));
    assert!(run.stats.routers.is_empty());
}

#[test]
fn sublayer_skip_all_active_equals_dense_and_padding_is_not_counted() {
    let _g = tch::no_grad_guard();
    let (_vs, m) = model(4);
    let (_rvs, r) = routing(&m, Variant::SublayerSkip);
    let ids = Tensor::randint(250, [2, 5], (Kind::Int64, Device::Cpu));
    let mut forced = vec![];
    for _ in 0..m.layers.len() {
        forced.push(Tensor::ones([2, 5, 1], (Kind::Float, Device::Cpu)));
        // Skip the FFN of the padded tokens only: they must not count.
        let f = Tensor::ones([2, 5, 1], (Kind::Float, Device::Cpu));
        let _ = f.get(1).narrow(0, 0, 2).fill_(0.0);
        forced.push(f);
    }
    let valid = Tensor::ones([2, 5], (Kind::Float, Device::Cpu));
    let _ = valid.get(1).narrow(0, 0, 2).fill_(0.0);
    let mut run = RoutingRun::new(&r, GateMode::Forced(forced), valid);
    let got = m.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
    assert_eq!(run.stats.skip_rate(crate::routing::RouterKind::Ffn).unwrap().double_value(&[]), 0.0);
    assert_eq!(run.stats.skip_rate(crate::routing::RouterKind::Attention).unwrap().double_value(&[]), 0.0);
    // 8 valid tokens x 1 group per router call.
    assert!(run.stats.routers.iter().all(|s| s.total == 8.0), "{:?}", run.stats.routers.iter().map(|s| s.total).collect::<Vec<_>>());
    let dense = m.forward(&ids, ForwardOptions::default()).unwrap();
    // Row 0 has every sublayer active: exactly the dense model's output.
    assert!(got.get(0).equal(&dense.get(0)), "an all-active row must equal the dense model");
    // Every sublayer of every token active: the dense model's output.
    let ones = (0..2 * m.layers.len()).map(|_| Tensor::ones([2, 5, 1], (Kind::Float, Device::Cpu))).collect();
    let mut run = RoutingRun::new(&r, GateMode::Forced(ones), Tensor::ones([2, 5], (Kind::Float, Device::Cpu)));
    let all = m.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
    assert!(all.equal(&dense), "all-active sublayer_skip must equal the dense model");
}
