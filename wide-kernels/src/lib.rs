//! Routed ops on tch tensors, and the CUDA plumbing under them.
//!
//! - [`shim`]: what tch does not expose from libtorch's CUDA side, through a small C++ shim
//!   compiled against libtorch's own headers: the current CUDA stream, CUDA graph capture and
//!   replay, and the caching allocator's memory statistics.
//! - [`nvrtc`] and [`cuda`]: CUDA C++ sources compiled at run time with NVRTC (through cudarc)
//!   for the device's architecture, cached in process and on disk, and launched on the stream
//!   tch uses.
//! - [`ops`]: each op has a tch reference implementation (CPU and GPU) next to its CUDA kernel.
pub mod cuda;
pub mod nvrtc;
pub mod ops;
pub mod shim;

pub use cuda::{CudaKernel, KernelArg, LaunchConfig};
pub use nvrtc::{CompiledKernel, KernelSource};
pub use shim::{cuda_device_count, current_stream, CudaGraph, MemoryStats};
