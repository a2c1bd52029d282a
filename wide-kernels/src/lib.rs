//! Routed ops on tch tensors, and the CUDA plumbing under them.
//!
//! - [`shim`]: what tch does not expose from libtorch's CUDA side, through a small C++ shim
//!   compiled against libtorch's own headers: the current CUDA stream, CUDA graph capture and
//!   replay, and the caching allocator's memory statistics.
//! - [`nvrtc`] and [`cuda`]: CUDA C++ sources compiled at run time with NVRTC (through cudarc)
//!   for the device's architecture, cached in process and on disk, and launched on the stream
//!   tch uses.
//! - [`ops`]: each op has a tch reference implementation (CPU and GPU) next to its CUDA kernel:
//!   the routing layout, the routed projections `gemm_mn` (optionally fused gate+up SwiGLU)
//!   and `gemm_k`, and the dispatch policy that picks routed kernel or dense+mask.
//! - [`knobs`]: the one parse of the `WIDE_*` environment knobs (A/B, sweep and measurement
//!   settings) that the kernels, the engine and the trainer read.
pub mod cuda;
pub mod knobs;
pub mod nvrtc;
pub mod ops;
pub mod shim;

pub use cuda::{CudaKernel, GpuTimer, KernelArg, LaunchConfig};
pub use ops::dispatch::{choose, GemmPath, GemmShape, RoutedOp, TileConfig, Tuned};
pub use ops::gemm::{gemm_k, gemm_k_premasked, gemm_k_reference, gemm_mn, gemm_mn_reference, gemm_mn_swiglu, routed_gemm};
pub use ops::attention::{
    attention_decode, attention_decode_reference, attention_decode_step, attention_decode_step_rope, attention_decode_with, attention_prefill, attention_prefill_dense, attention_prefill_reference,
    attention_prefill_routed, attention_prefill_with, DecodeMerge, PrefillTile,
};
pub use ops::layout::{route_layout, route_layout_reference, RouteLayout};
pub use nvrtc::{CompiledKernel, KernelSource};
pub use shim::{cuda_device_count, current_stream, CudaGraph, MemoryStats};
