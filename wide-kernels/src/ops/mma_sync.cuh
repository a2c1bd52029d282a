// Storage type, mma.sync, cp.async and ldmatrix helpers shared by the modules that run
// mma.sync (routed.cu, attn_prefill.cu); prepended to their source. WIDE_F16: 1 for f16
// operands, 0 for bf16 (fp32 accumulation either way).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef WIDE_F16
#define WIDE_F16 0
#endif
#if WIDE_F16
typedef __half T;
typedef __half2 T2;
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
__device__ __forceinline__ float2 to_f2(unsigned v) { return __half22float2(*reinterpret_cast<T2*>(&v)); }
__device__ __forceinline__ unsigned from_f2(float a, float b) { T2 h = __floats2half2_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }
#else
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
__device__ __forceinline__ float2 to_f2(unsigned v) { return __bfloat1622float2(*reinterpret_cast<T2*>(&v)); }
__device__ __forceinline__ unsigned from_f2(float a, float b) { T2 h = __floats2bfloat162_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }
#endif

// D (f32, 16x8) += A (16x16, row) * B (16x8, col) on the tensor cores.
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(MMA_OP " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared memory, asynchronous copies and matrix loads.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N_)); }
// At a shared-memory address (ldsm_x4_at) or a generic pointer into shared memory (ldsm_x4).
__device__ __forceinline__ void ldsm_x4_at(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) { ldsm_x4_at(r, smem_u32(p)); }
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
