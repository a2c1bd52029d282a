// Programmatic dependent launch (compute capability 9.0 and later; before that, and in a launch
// that did not ask for it, both are no-ops). A kernel launched with `CudaKernel::launch_pdl` may
// start while the preceding launch on the stream is still running:
//   pdl_wait():    returns once the preceding launch has finished and its writes are visible;
//                  nothing that launch writes may be read before it (weights may), nor after it
//                  through a read-only load (`const T* __restrict__`, `__ldg`, `ld.global.nc`):
//                  ptxas may schedule those above the wait. Read such data through plain
//                  pointers, `ld_fresh` (routed.cu) or `__ldcg`. The CPU test in pdl_audit.rs
//                  checks every shipped kernel's machine code for loads moved above the wait.
//   pdl_trigger(): lets the next launch start its blocks (they wait in their own pdl_wait).
// Every kernel here triggers only after its own wait, so a launch never overlaps the one two
// places before it.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
