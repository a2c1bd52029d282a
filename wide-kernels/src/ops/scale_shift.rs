//! `y = alpha * x + beta`, elementwise: the smallest real kernel, used to prove the NVRTC
//! path end to end (compile, load into libtorch's context, launch on libtorch's stream, read
//! back through tch) and as a template for the routed ops.
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = r#"
#include <cuda_bf16.h>
template <typename T>
__device__ void scale_shift(const T* __restrict__ x, T* __restrict__ y, float alpha, float beta, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        y[i] = (T)(alpha * (float)x[i] + beta);
    }
}
extern "C" __global__ void scale_shift_f32(const float* x, float* y, float alpha, float beta, long long n) {
    scale_shift<float>(x, y, alpha, beta, n);
}
extern "C" __global__ void scale_shift_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, float alpha, float beta, long long n) {
    scale_shift<__nv_bfloat16>(x, y, alpha, beta, n);
}
"#;

pub fn kernel_variants() -> Vec<KernelSource> {
    vec![KernelSource::new("scale_shift", SOURCE)]
}

/// Reference: `alpha * x + beta` in tch, on any device.
pub fn scale_shift_reference(x: &Tensor, alpha: f64, beta: f64) -> Tensor {
    (x.to_kind(Kind::Float) * alpha + beta).to_kind(x.kind())
}

/// The entry loaded once per (entry, device); later calls look it up instead of hashing the source.
fn kernel(entry: &'static str, device: usize) -> Result<CudaKernel> {
    static K: OnceLock<Mutex<HashMap<(&'static str, usize), CudaKernel>>> = OnceLock::new();
    if let Some(k) = K.get_or_init(Default::default).lock().unwrap().get(&(entry, device)) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&kernel_variants()[0], entry, device)?;
    K.get_or_init(Default::default).lock().unwrap().insert((entry, device), k);
    Ok(k)
}

/// `alpha * x + beta`; the CUDA kernel on CUDA tensors (f32, bf16), the reference elsewhere.
pub fn scale_shift(x: &Tensor, alpha: f64, beta: f64) -> Result<Tensor> {
    let device = match x.device() {
        Device::Cuda(d) => d,
        _ => return Ok(scale_shift_reference(x, alpha, beta)),
    };
    let entry = match x.kind() {
        Kind::Float => "scale_shift_f32",
        Kind::BFloat16 => "scale_shift_bf16",
        k => bail!("scale_shift: unsupported dtype {k:?} (use f32 or bf16)"),
    };
    let x = x.contiguous();
    let y = x.empty_like();
    let n = x.numel();
    let kernel = kernel(entry, device)?;
    let cfg = LaunchConfig::for_elements(n, 256);
    let cfg = LaunchConfig { grid: (cfg.grid.0.min(65535 * 8), 1, 1), ..cfg };
    unsafe {
        kernel.launch(
            cfg,
            &[
                KernelArg::tensor(&x)?,
                KernelArg::tensor(&y)?,
                KernelArg::F32(alpha as f32),
                KernelArg::F32(beta as f32),
                KernelArg::I64(n as i64),
            ],
        )?;
    }
    Ok(y)
}
