// Thread-block cluster helpers shared by the wgmma gemm_mn kernels (wgmma.cu, skinny_wg.cu):
// the block's rank, a cluster-wide barrier, another block's shared-memory address and an f32
// load from it, a remote mbarrier arrival and a multicast tensor copy. Prepended after
// mbarrier.cuh (TmaDesc).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same shared-memory offset in block `rank` of the cluster.
__device__ __forceinline__ unsigned map_rank(unsigned addr, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// An f32 of another block's shared memory (an address from map_rank).
__device__ __forceinline__ float ld_cluster_f32(unsigned cluster_addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr) : "memory");
    return v;
}
// Four f32 into another block's shared memory (an address from map_rank, 16-byte aligned): a
// store the thread does not wait for; a release (cluster_sync) makes it visible there.
__device__ __forceinline__ void st_cluster_v4(unsigned cluster_addr, float a, float b, float c, float d) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(cluster_addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// Arrival on a barrier of another block of the cluster. Default semantics: the stage's readers
// were wgmma, complete (wgmma.wait_group) before this in program order; no data written here
// needs a cluster-scope release.
__device__ __forceinline__ void mbar_arrive_remote(unsigned cluster_addr) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}
// Box {64 k, rows} at (k0, row0) of the 2-D tensor map, written 128B-swizzled at `dst` in both
// blocks of the cluster, completing its bytes on the barrier at `bar` in each.
__device__ __forceinline__ void tma_load_multicast(unsigned dst, const TmaDesc* map, int k0, int row0, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(k0), "r"(row0), "r"(bar), "h"((unsigned short)3)
        : "memory");
}
