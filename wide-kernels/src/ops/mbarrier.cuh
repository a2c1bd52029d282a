// mbarrier and tensor-copy (TMA) helpers shared by the modules that wait on transaction
// barriers (wgmma.cu, attn_wgmma.cu through wgmma_common.cuh; infer.cu's prefill router).
// Prepended to each of those sources; needs nothing before it.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` of transactions (tensor copies) this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(bar), "r"(bytes) : "memory");
}
// Expects `bytes` more of transactions (tensor copies) this phase, without arriving.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// A tensor map (CUtensorMap) passed by value as a __grid_constant__ kernel parameter.
struct __align__(128) TmaDesc {
    unsigned long long v[16];
};
// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWIDE_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WIDE_WAIT;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Box {64 inner elements, rows} at (c0, row0) of a 2-D tensor map, written 128B-swizzled at
// `dst`, completing its bytes on the barrier at `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, int c0, int row0, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(row0), "r"(bar)
                 : "memory");
}
