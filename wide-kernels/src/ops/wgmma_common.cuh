// Hopper (sm_90a) helpers shared by the wgmma kernels (wgmma.cu, attn_wgmma.cu): element type,
// cp.async and mbarrier-arrival wrappers (mbarrier.cuh, prepended first, has the waits and the
// tensor copies), the 128-byte-swizzle shared-memory layout and its matrix
// descriptor, wgmma fences and the m64n128k16 / m64n64k16 instructions with both operands in shared memory.
// Prepended to each of those sources. Defines:
//   WIDE_F16      1 for f16 operands, 0 for bf16 (fp32 accumulation either way)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef WIDE_F16
#define WIDE_F16 0
#endif
#if WIDE_F16
typedef __half T;
typedef __half2 T2;
#define WG_TYPE "f16"
__device__ __forceinline__ unsigned pack2(float a, float b) { T2 h = __floats2half2_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }
#else
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define WG_TYPE "bf16"
__device__ __forceinline__ unsigned pack2(float a, float b) { T2 h = __floats2bfloat162_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N_) : "memory"); }
// One arrival on the barrier once all of this thread's earlier cp.async copies have completed
// (counted in the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Orders shared-memory data written through the generic proxy (cp.async) and observed by this
// thread before its later async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: start
// address >> 4 (bits 0-13), leading byte offset >> 4 (bits 16-29; unused for swizzled K-major
// operands whose k extent fits the swizzle row, set to 1), stride byte offset >> 4 (bits 32-45:
// 1024 bytes between 8-row groups), base offset 0 (bits 49-51; the pattern starts 1024-aligned),
// swizzle mode 1 = 128B (bits 62-63).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// Byte offset of 16-byte chunk c (k / 8) of row r inside a [rows x 64] 2-byte block whose base is
// 1024-aligned: the chunk index is XORed with r % 8.
__device__ __forceinline__ unsigned sw128_off(int r, int c) { return (unsigned)(r * 128 + ((c ^ (r & 7)) << 4)); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N_>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N_) : "memory"); }
// Keeps the compiler from touching accumulator registers while a wgmma may still write them.
template <int NN>
__device__ __forceinline__ void fence_acc(float (&d)[NN]) {
#pragma unroll
    for (int i = 0; i < NN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator operand lists of the wgmma wrappers: "+f"(d[b]) ... "+f"(d[b + 7]) and so on.
#define WG_ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define WG_ACC32(b) WG_ACC8(b), WG_ACC8(b + 8), WG_ACC8(b + 16), WG_ACC8(b + 24)
#define WG_ACC64(b) WG_ACC32(b), WG_ACC32(b + 32)

// D[64 x 128] (f32) += A[64 x 16] * B[16 x 128], A and B K-major in shared memory (descriptors).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}"
        : WG_ACC64(0)
        : "l"(da), "l"(db), "r"(1));
}
// D[64 x 64] (f32) += A[64 x 16] * B[16 x 64], A and B K-major in shared memory (descriptors).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
        : WG_ACC32(0)
        : "l"(da), "l"(db), "r"(1));
}
