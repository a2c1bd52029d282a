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

#[cfg(test)]
mod tests {
    /// Every shipped kernel variant must compile for the GPUs we target, here on a CPU-only
    /// machine too (NVRTC from the PyPI CUDA runtime). A missing NVRTC fails, never skips.
    #[test]
    fn every_kernel_variant_compiles_with_nvrtc() {
        assert!(
            crate::nvrtc::nvrtc_available(),
            "libnvrtc was not found: put the CUDA runtime's lib directory on LD_LIBRARY_PATH (scripts/setup.sh --print-env)"
        );
        std::env::set_var("WIDE_KERNEL_CACHE", std::env::temp_dir().join(format!("wide-kcache-{}", std::process::id())));
        for arch in ["compute_80", "compute_90"] {
            for k in super::all_kernel_variants() {
                let c = crate::nvrtc::compile(&k, arch).unwrap_or_else(|e| panic!("{e:#}"));
                let text = String::from_utf8_lossy(&c.ptx);
                assert!(text.contains(".entry"), "{}: no kernel entry in PTX", k.name);
            }
        }
    }
}
