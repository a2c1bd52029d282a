//! Ops on tch tensors. Each op has a tch reference (CPU and GPU) and, where it pays, a CUDA
//! kernel; callers use the op and the op picks the path.
pub mod scale_shift;

use crate::nvrtc::KernelSource;

/// Every kernel source with every specialisation the project ships, so that a CPU-only CI
/// run can compile all of them with NVRTC (a kernel that does not compile fails CI).
pub fn all_kernel_variants() -> Vec<KernelSource> {
    let mut v = Vec::new();
    v.extend(scale_shift::kernel_variants());
    v
}
