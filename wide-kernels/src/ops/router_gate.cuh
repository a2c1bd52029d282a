// The storage type's conversions and the router gate shared by the modules that gate
// (infer.cu: the norm launches; routed.cu: the gemm_k GEMV that folds in the next router).
// Prepended after mma_sync.cuh (storage type T).
#if WIDE_F16
__device__ __forceinline__ float tf(T v) { return __half2float(v); }
__device__ __forceinline__ T ft(float v) { return __float2half_rn(v); }
#else
__device__ __forceinline__ float tf(T v) { return __bfloat162float(v); }
__device__ __forceinline__ T ft(float v) { return __float2bfloat16_rn(v); }
#endif
// Round to storage precision and back (what a tch op in the storage dtype does).
__device__ __forceinline__ float rt(float v) { return tf(ft(v)); }

// Second router layer and deterministic gate of one token for group g < NG, on its first
// layer's output hs[R] (f32 values of the stored h1): logits = h W2^T + b2 viewed [NG, 2] =
// (execute, skip); the group runs iff skip - execute + offset <= 0. With SH, w2 and b2 are
// copies in shared memory (plain loads) instead of global memory (__ldg). PS: elements from
// group g's execute row to group g + 1's (2 R unpadded; a shared copy may pad the pairs).
template <bool SH = false>
__device__ __forceinline__ unsigned char gate_one(const float* hs, const T* __restrict__ w2, const T* __restrict__ b2, float offset, int R, int g,
                                                  int PS = 0) {
    float e = 0.f, s = 0.f;
    const T* we = w2 + (long long)g * (PS > 0 ? PS : 2 * R);
    const T* wsk = we + R;
    if ((R & 7) == 0) {
        // 16-byte loads (the two rows are contiguous), a few in flight; the same sequential
        // accumulation order as the scalar loop.
#pragma unroll 4
        for (int c = 0; c < R; c += 8) {
            const uint4 ev = SH ? *reinterpret_cast<const uint4*>(we + c) : __ldg(reinterpret_cast<const uint4*>(we + c));
            const uint4 sv = SH ? *reinterpret_cast<const uint4*>(wsk + c) : __ldg(reinterpret_cast<const uint4*>(wsk + c));
            const T* ee = reinterpret_cast<const T*>(&ev);
            const T* ss = reinterpret_cast<const T*>(&sv);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                e = fmaf(tf(ee[u]), hs[c + u], e);
                s = fmaf(tf(ss[u]), hs[c + u], s);
            }
        }
    } else {
        for (int r = 0; r < R; ++r) {
            e = fmaf(tf(we[r]), hs[r], e);
            s = fmaf(tf(wsk[r]), hs[r], s);
        }
    }
    e = rt(rt(e) + tf(b2[2 * g]));
    s = rt(rt(s) + tf(b2[2 * g + 1]));
    return (s - e + offset) <= 0.f;
}

// The gate of token m (gate_one for every group): writes mask u8 [M, NG] and, when ext !=
// null, ext [M, NG + EXTRA] with the EXTRA trailing groups on. Threads of the block share the
// groups.
template <bool SH = false>
__device__ __forceinline__ void gate_row(const float* hs, const T* __restrict__ w2, const T* __restrict__ b2, float offset,
                                         unsigned char* __restrict__ mask, unsigned char* __restrict__ ext, int R, int NG,
                                         int EXTRA, long long m) {
    for (int g = threadIdx.x; g < NG + EXTRA; g += blockDim.x) {
        unsigned char on = 1;
        if (g < NG) {
            on = gate_one<SH>(hs, w2, b2, offset, R, g);
            mask[m * NG + g] = on;
        }
        if (ext != nullptr) ext[m * (NG + EXTRA) + g] = on;
    }
}

// The gate's weights (second layer [2 NG, R] and its bias), pulled into L2 by one block before the
// wait, so the gate does not wait on memory after the first layer.
__device__ __forceinline__ void router_gate_prefetch(const T* __restrict__ w2, const T* __restrict__ b2, int NG, int R) {
    const long long n2 = 2LL * NG * R * (long long)sizeof(T);
    for (long long off = 128LL * threadIdx.x; off < n2; off += 128LL * blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(w2) + off));
    if (threadIdx.x == 0)
        for (long long off = 0; off < 2LL * NG * (long long)sizeof(T); off += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(b2) + off));
}

