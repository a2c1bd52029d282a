//! GPU tests (feature `cuda-tests`; run on the GPU machine through the device tool):
//! the libtorch CUDA shim, NVRTC kernels on tch tensors, graph capture, and the backbone on
//! the GPU against the CPU.
#![cfg(feature = "cuda-tests")]

mod common;

use tch::{nn, Device, Kind, Tensor};
use wide_core::decode::StaticDecoder;
use wide_core::{presets, ForwardOptions, LlamaModel, RandomWeights, SamplingConfig};
use wide_kernels::ops::scale_shift::{scale_shift, scale_shift_reference};
use wide_kernels::{current_stream, CudaGraph, MemoryStats};

fn gpu() -> Device {
    common::exclusive_gpu()
}

#[test]
fn shim_reports_stream_and_memory() {
    let dev = gpu();
    // Outside capture libtorch works on the legacy default stream (a null handle); inside a
    // capture the shim has switched libtorch to a side stream, which our kernels must follow.
    assert!(current_stream(0).unwrap().is_null());
    let mut g = CudaGraph::new(0).unwrap();
    let inside = g.capture(|| current_stream(0)).unwrap();
    assert!(!inside.is_null(), "capture must run on a side stream");
    assert!(current_stream(0).unwrap().is_null(), "the stream is restored after capture");
    MemoryStats::reset_peak(0).unwrap();
    let before = MemoryStats::read(0).unwrap();
    let t = Tensor::ones([64, 1024, 1024], (Kind::Float, dev)); // 256 MiB
    let during = MemoryStats::read(0).unwrap();
    assert!(during.allocated_current - before.allocated_current >= 256 << 20, "{before:?} -> {during:?}");
    drop(t);
    let after = MemoryStats::read(0).unwrap();
    assert!(after.allocated_current < during.allocated_current);
    assert!(after.allocated_peak >= during.allocated_current);
}

#[test]
fn nvrtc_kernel_matches_reference_in_f32_and_bf16() {
    let dev = gpu();
    for kind in [Kind::Float, Kind::BFloat16] {
        for n in [1i64, 1000, 1 << 20] {
            let x = Tensor::randn([n], (kind, dev));
            let y = scale_shift(&x, 1.5, -0.25).unwrap();
            let r = scale_shift_reference(&x, 1.5, -0.25);
            let err = (&y.to_kind(Kind::Float) - &r.to_kind(Kind::Float)).abs().max().double_value(&[]);
            let tol = if kind == Kind::Float { 1e-6 } else { 1e-2 };
            assert!(err <= tol, "{kind:?} n={n}: max error {err}");
            assert_eq!(y.isnan().sum(Kind::Int64).int64_value(&[]), 0);
        }
    }
}

#[test]
fn graph_replays_tch_work_and_our_kernel() {
    let dev = gpu();
    let x = Tensor::randn([4096], (Kind::Float, dev));
    // Warm-up outside capture (module load, allocator).
    let _ = scale_shift(&(&x * 2.0), 3.0, 1.0).unwrap();
    let mut g = CudaGraph::new(0).unwrap();
    let y = g.capture(|| scale_shift(&(&x * 2.0), 3.0, 1.0)).unwrap();
    for _ in 0..3 {
        let fresh = Tensor::randn([4096], (Kind::Float, dev));
        x.shallow_clone().copy_(&fresh);
        g.replay().unwrap();
        let want = &fresh * 6.0 + 1.0;
        let err = (&y - want).abs().max().double_value(&[]);
        assert!(err < 1e-5, "replay error {err}");
    }
}

fn tiny(device: Device, kind: Kind) -> (nn::VarStore, LlamaModel) {
    tch::manual_seed(3);
    let cfg = presets::preset("tiny").unwrap();
    // Random weights drawn once on the CPU, so both devices get the same model.
    let vs = nn::VarStore::new(Device::Cpu);
    LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.2 }, Kind::Float, false).unwrap();
    let vs2 = nn::VarStore::new(device);
    let mut src = VarStoreWeights(vs);
    let m = LlamaModel::new(&vs2.root(), &cfg, &mut src, kind, false).unwrap();
    (vs2, m)
}

struct VarStoreWeights(nn::VarStore);
impl wide_core::WeightSource for VarStoreWeights {
    fn get(&mut self, name: &str, _shape: &[i64], kind: Kind, device: Device) -> anyhow::Result<Tensor> {
        Ok(self.0.variables()[name].to_device(device).to_kind(kind))
    }
}

#[test]
fn backbone_on_gpu_matches_cpu() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    let (_a, cpu) = tiny(Device::Cpu, Kind::Float);
    let (_b, cuda) = tiny(dev, Kind::Float);
    let ids = Tensor::randint(250, [3, 40], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([3, 40], (Kind::Int64, Device::Cpu));
    let _ = mask.narrow(1, 0, 7).get(1).fill_(0);
    let lc = cpu.forward(&ids, ForwardOptions { attention_mask: Some(&mask), ..Default::default() }).unwrap();
    let lg = cuda.forward(&ids.to_device(dev), ForwardOptions { attention_mask: Some(&mask.to_device(dev)), ..Default::default() }).unwrap();
    let err = (lc - lg.to_device(Device::Cpu)).abs().max().double_value(&[]);
    assert!(err < 2e-3, "GPU f32 logits differ from CPU by {err}");
}

#[test]
fn graph_decoder_matches_eager_generation() {
    let dev = gpu();
    let (_vs, model) = tiny(dev, Kind::Float);
    let prompt: Vec<i64> = (0..12).map(|i| (i * 17 + 5) % 250).collect();
    let want = model
        .generate(&[prompt.clone()], &SamplingConfig { max_new_tokens: 20, stop_at_eos: false, ..Default::default() }, |_, _| Ok(()))
        .unwrap();
    let ids = Tensor::from_slice(&prompt).view([1, -1]).to_device(dev);
    let mut dec = StaticDecoder::new(&model, &ids, 64, true).unwrap();
    let mut got = vec![dec.tokens.int64_value(&[0, 0])];
    for _ in 0..19 {
        dec.step().unwrap();
        got.push(dec.tokens.int64_value(&[0, 0]));
    }
    assert_eq!(got, want.tokens[0]);
}
