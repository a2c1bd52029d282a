// Routed kernels: the routing layout, GEMV paths (small M, read the raw mask) and mma.sync
// tiled paths (large M). Compiled by NVRTC with defines:
//   WIDE_F16      1 for f16 operands, 0 for bf16 (fp32 accumulation either way)
//   BM, BN, WM, WN, STAGES, FUSED   tile shape, warps along M/N, pipeline depth, gate+up fusion
//                                   (tiled entries only; the GEMV/layout entries ignore them)
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

__device__ __forceinline__ float silu(float a) { return a / (1.0f + __expf(-a)); }

// Weights are streamed once: keep them out of L1 so the (re-read) activations stay there.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_keep(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    float2 a0 = to_f2(a.x), b0 = to_f2(b.x);
    float2 a1 = to_f2(a.y), b1 = to_f2(b.y);
    float2 a2 = to_f2(a.z), b2 = to_f2(b.z);
    float2 a3 = to_f2(a.w), b3 = to_f2(b.w);
    acc = fmaf(a0.x, b0.x, acc); acc = fmaf(a0.y, b0.y, acc);
    acc = fmaf(a1.x, b1.x, acc); acc = fmaf(a1.y, b1.y, acc);
    acc = fmaf(a2.x, b2.x, acc); acc = fmaf(a2.y, b2.y, acc);
    acc = fmaf(a3.x, b3.x, acc); acc = fmaf(a3.y, b3.y, acc);
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#ifndef BM  // the layout and GEMV entries live in the one untiled module
// ---------------------------------------------------------------------------------------
// Routing layout. mask_t: u8 [NG][M] (the transposed mask, so reads are coalesced).
// perm: i32 [NG][M], per group the active tokens ascending, then the inactive ones ascending.
// count: i32 [NG]. One block of 1024 threads per group.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024) route_layout(const unsigned char* __restrict__ mask_t, int M, int* __restrict__ perm, int* __restrict__ count) {
    const int g = blockIdx.x;
    const unsigned char* mg = mask_t + (long long)g * M;
    int* pg = perm + (long long)g * M;
    __shared__ int wa[32], wi[32], tot_a;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // Pass 1: how many are active, so the inactive tail starts at the right place.
    int local = 0;
    for (int t = threadIdx.x; t < M; t += blockDim.x) local += mg[t] != 0;
    local = __reduce_add_sync(0xffffffffu, local);
    if (lane == 0) wa[warp] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int i = 0; i < nw; ++i) s += wa[i];
        tot_a = s;
        count[g] = s;
    }
    __syncthreads();
    int base_a = 0, base_i = tot_a;
    const unsigned lt = (1u << lane) - 1u;
    for (int t0 = 0; t0 < M; t0 += blockDim.x) {
        const int t = t0 + threadIdx.x;
        const bool valid = t < M;
        const bool on = valid && mg[t] != 0;
        const unsigned ba = __ballot_sync(0xffffffffu, on);
        const unsigned bi = __ballot_sync(0xffffffffu, valid && !on);
        __syncthreads();  // wa/wi of the previous chunk are consumed
        if (lane == 0) { wa[warp] = __popc(ba); wi[warp] = __popc(bi); }
        __syncthreads();
        int off_a = 0, off_i = 0, all_a = 0, all_i = 0;
        for (int i = 0; i < nw; ++i) {
            if (i < warp) { off_a += wa[i]; off_i += wi[i]; }
            all_a += wa[i]; all_i += wi[i];
        }
        if (on) pg[base_a + off_a + __popc(ba & lt)] = t;
        else if (valid) pg[base_i + off_i + __popc(bi & lt)] = t;
        base_a += all_a;
        base_i += all_i;
    }
}

// ---------------------------------------------------------------------------------------
// GEMV, output-width routed (small M): out[m, n] = x[m,:] . w[n,:] where mask[m, n/G], else 0.
// A warp owns R consecutive rows of one group (R | G): a group no token uses is never loaded,
// and each x chunk, loaded once per lane, serves all R rows (x traffic / R).
// With w2 (fused): out = silu(x . w[n]) * (x . w2[n]).
// ---------------------------------------------------------------------------------------
template <int MAXM, int R, bool FUSE>
__device__ __forceinline__ void gemv_mn(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ w2,
                                        const unsigned char* __restrict__ mask, T* __restrict__ out,
                                        int M, int N, int K, int G, int NG) {
    const int lane = threadIdx.x & 31;
    const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (n0 >= N) return;
    const int g = n0 / G;
    unsigned act = 0;
#pragma unroll
    for (int m = 0; m < MAXM; ++m)
        if (m < M && mask[(long long)m * NG + g]) act |= 1u << m;
    if (act == 0) {
        for (int i = lane; i < M * R; i += 32) out[(long long)(i / R) * N + n0 + i % R] = (T)0.0f;
        return;
    }
    float acc[R][MAXM], acc2[FUSE ? R : 1][MAXM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            acc[r][m] = 0.f;
            if (FUSE) acc2[FUSE ? r : 0][m] = 0.f;
        }
    const int chunks = K >> 3;
    constexpr int U = R >= 8 ? 1 : 8 / R;  // R * U weight loads in flight per lane
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 wv[U][R], wv2[U][FUSE ? R : 1];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    wv[u][r] = ld_stream(w + (long long)(n0 + r) * K + (c << 3));
                    if (FUSE) wv2[u][FUSE ? r : 0] = ld_stream(w2 + (long long)(n0 + r) * K + (c << 3));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m) {
                    if ((act >> m) & 1u) {
                        const uint4 xv = ld_keep(x + (long long)m * K + (c << 3));
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            acc[r][m] = dot8(wv[u][r], xv, acc[r][m]);
                            if (FUSE) acc2[FUSE ? r : 0][m] = dot8(wv2[u][FUSE ? r : 0], xv, acc2[FUSE ? r : 0][m]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                float v = warp_sum(acc[r][m]);
                if (FUSE) v = silu(v) * warp_sum(acc2[FUSE ? r : 0][m]);
                if (lane == 0) out[(long long)m * N + n0 + r] = (T)(((act >> m) & 1u) ? v : 0.0f);
            }
        }
}

// ---------------------------------------------------------------------------------------
// GEMV, reduction-width routed (small M): out[m, :] = sum over groups g active for token m of
// x[m, gG:(g+1)G] . w[:, gG:(g+1)G]^T. Only the column slices of w that some token uses are
// read. A warp owns R output rows; the block first lists the groups any token uses.
// ---------------------------------------------------------------------------------------
template <int MAXM, int R>
__device__ __forceinline__ void gemv_k(const T* __restrict__ x, const T* __restrict__ w, const unsigned char* __restrict__ mask,
                                       T* __restrict__ out, int M, int N, int K, int G, int NG) {
    __shared__ int glist[2048];
    __shared__ unsigned gbits[2048];
    __shared__ int nlist;
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x; g < NG; g += blockDim.x) {
        unsigned b = 0;
#pragma unroll
        for (int m = 0; m < MAXM; ++m)
            if (m < M && mask[(long long)m * NG + g]) b |= 1u << m;
        gbits[g] = b;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // ascending list of used groups: keeps the weight reads in order
        int base = 0;
        for (int g0 = 0; g0 < NG; g0 += 32) {
            const int g = g0 + lane;
            const bool on = g < NG && gbits[g] != 0;
            const unsigned b = __ballot_sync(0xffffffffu, on);
            if (on) glist[base + __popc(b & ((1u << lane) - 1u))] = g;
            base += __popc(b);
        }
        if (lane == 0) nlist = base;
    }
    __syncthreads();
    const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (n0 >= N) return;
    const int per = G >> 3;  // 16-byte chunks per group slice
    const int chunks = nlist * per;
    float acc[R][MAXM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.f;
    // One chunk a lane per step: measured faster here than unrolling (the block's group list
    // and the per-chunk group lookup cost more than the extra loads in flight gain).
    constexpr int U = 1;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        uint4 wv[U][R];
        int col[U];
        unsigned bits[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            bits[u] = 0;
            if (c < chunks) {
                const int gi = c / per;
                const int g = glist[gi];
                col[u] = g * G + ((c - gi * per) << 3);
                bits[u] = gbits[g];
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][r] = ld_stream(w + (long long)(n0 + r) * K + col[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int m = 0; m < MAXM; ++m)
                if ((bits[u] >> m) & 1u) {
                    const uint4 xv = ld_keep(x + (long long)m * K + col[u]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][m] = dot8(wv[u][r], xv, acc[r][m]);
                }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                const float v = warp_sum(acc[r][m]);
                if (lane == 0) out[(long long)m * N + n0 + r] = (T)v;
            }
        }
}

#define GEMV_ENTRIES(MM, R)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) gemv_mn_##MM##_##R(const T* x, const T* w, const unsigned char* mask, \
                                                                         T* out, int M, int N, int K, int G, int NG) { \
        gemv_mn<MM, R, false>(x, w, nullptr, mask, out, M, N, K, G, NG);                                              \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) gemv_mn_swiglu_##MM##_##R(const T* x, const T* w, const T* w2,  \
                                                                                const unsigned char* mask, T* out, int M, \
                                                                                int N, int K, int G, int NG) {       \
        gemv_mn<MM, R, true>(x, w, w2, mask, out, M, N, K, G, NG);                                                    \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) gemv_k_##MM##_##R(const T* x, const T* w, const unsigned char* mask, \
                                                                        T* out, int M, int N, int K, int G, int NG) {  \
        gemv_k<MM, R>(x, w, mask, out, M, N, K, G, NG);                                                               \
    }
GEMV_ENTRIES(1, 1)
GEMV_ENTRIES(1, 2)
GEMV_ENTRIES(1, 4)
GEMV_ENTRIES(1, 8)
GEMV_ENTRIES(2, 1)
GEMV_ENTRIES(2, 2)
GEMV_ENTRIES(2, 4)
GEMV_ENTRIES(2, 8)
GEMV_ENTRIES(4, 1)
GEMV_ENTRIES(4, 2)
GEMV_ENTRIES(4, 4)
GEMV_ENTRIES(8, 1)
GEMV_ENTRIES(8, 2)
GEMV_ENTRIES(16, 1)

// ---------------------------------------------------------------------------------------
// The dense path's mask in one pass, 8 elements (16 bytes) per thread, G % 8 == 0:
//   mode 0: dst[m, n] = 0 where group n/G of token m is off (in place, write-only)
//   mode 1: dst = mask ? a : 0              (masked copy, e.g. a gemm_k input)
//   mode 2: dst = mask ? silu(a) * b : 0    (SwiGLU of two dense products)
// ---------------------------------------------------------------------------------------
extern "C" __global__ void apply_group_mask(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ dst,
                                            const unsigned char* __restrict__ mask, long long M, int N, int G, int NG, int mode) {
    // Grid (ceil(N/8/blockDim), min(M, 65535)): no 64-bit division on the hot path.
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) << 3;
    if (n >= N) return;
    const int g = n / G;
    for (long long m = blockIdx.y; m < M; m += gridDim.y) {
        const bool on = mask[m * NG + g] != 0;
        uint4* d = reinterpret_cast<uint4*>(dst + m * N + n);
        if (!on) {
            *d = make_uint4(0, 0, 0, 0);
        } else if (mode == 1) {
            *d = ld_stream(a + m * N + n);
        } else if (mode == 2) {
            const uint4 av = ld_stream(a + m * N + n), bv = ld_stream(b + m * N + n);
            const unsigned* ap = &av.x;
            const unsigned* bp = &bv.x;
            uint4 o;
            unsigned* op = &o.x;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 p = to_f2(ap[j]), q = to_f2(bp[j]);
                op[j] = from_f2(silu(p.x) * q.x, silu(p.y) * q.y);
            }
            *d = o;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Decode attention, head-group routed (split-K "flash decoding").
// q [B, HQ, D]; k, v [B, HKV, TCAP, D]; lengths i32 [B]; mask u8 [B, NG] with GH query heads a
// group. Block (split s, KV head h, batch b) covers tokens [s*chunk, (s+1)*chunk) of one KV head
// for its QPK query heads; if none of them is active the block returns before reading K/V.
// Groups of 8 lanes each own one token at a time (D/8 dims a lane); 16 such groups a block.
// Partial results (log2-domain max, sum, unnormalised output) go to part_* for the combine.
// ---------------------------------------------------------------------------------------
template <int D, int QPK>
__device__ __forceinline__ void attn_decode_split(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                                  const int* __restrict__ lengths, const unsigned char* __restrict__ mask,
                                                  float* __restrict__ part_o, float* __restrict__ part_ml, int HQ, int HKV,
                                                  int TCAP, int S, int chunk, int GH, int NG, float scale_log2) {
    constexpr int DPL = D / 8;   // dims a lane
    constexpr int NV = DPL / 8;  // 16-byte loads a lane per row
    constexpr int NTG = 16;      // token groups a block (128 threads)
    __shared__ float sm_acc[NTG][D];
    __shared__ float sm_m[NTG], sm_l[NTG];
    const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, sub = lane & 7, tg = tid >> 3;
    const unsigned gmask = 0xffu << (lane & 24);  // the 8 lanes of this token group
    unsigned act = 0;
#pragma unroll
    for (int j = 0; j < QPK; ++j)
        if (mask[(long long)b * NG + (h * QPK + j) / GH]) act |= 1u << j;
    if (act == 0) return;  // every query head of this KV head is off: its K/V are not read
    const int len = min(lengths[b], TCAP);
    const int t0 = s * chunk, t1 = min(len, t0 + chunk);
    float qr[QPK][DPL];
#pragma unroll
    for (int j = 0; j < QPK; ++j) {
        const T* qp = q + ((long long)b * HQ + h * QPK + j) * D + sub * DPL;
#pragma unroll
        for (int u = 0; u < NV; ++u) {
            const uint4 w = ld_keep(qp + u * 8);
            const unsigned* wp = &w.x;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = to_f2(wp[e]);
                qr[j][u * 8 + 2 * e] = f.x * scale_log2;
                qr[j][u * 8 + 2 * e + 1] = f.y * scale_log2;
            }
        }
    }
    float mx[QPK], l[QPK], acc[QPK][DPL];
#pragma unroll
    for (int j = 0; j < QPK; ++j) {
        mx[j] = -__int_as_float(0x7f800000);
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[j][i] = 0.f;
    }
    const long long head = ((long long)b * HKV + h) * TCAP;
    const T* kb = k + head * D + sub * DPL;
    const T* vb = v + head * D + sub * DPL;
    constexpr int UT = 2;  // tokens in flight per lane group
    for (int tb = t0 + tg; tb < t1; tb += NTG * UT) {
        uint4 kv[UT][NV], vv[UT][NV];
#pragma unroll
        for (int u = 0; u < UT; ++u) {
            const int t = tb + u * NTG;
            if (t < t1) {
#pragma unroll
                for (int e = 0; e < NV; ++e) {
                    kv[u][e] = ld_stream(kb + (long long)t * D + e * 8);
                    vv[u][e] = ld_stream(vb + (long long)t * D + e * 8);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UT; ++u) {
            const int t = tb + u * NTG;
            if (t >= t1) break;  // uniform within the 8-lane group
            float kf[DPL], vf[DPL];
#pragma unroll
            for (int e = 0; e < NV; ++e) {
                const unsigned* kp = &kv[u][e].x;
                const unsigned* vp = &vv[u][e].x;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float2 a = to_f2(kp[c]), bb = to_f2(vp[c]);
                    kf[e * 8 + 2 * c] = a.x;
                    kf[e * 8 + 2 * c + 1] = a.y;
                    vf[e * 8 + 2 * c] = bb.x;
                    vf[e * 8 + 2 * c + 1] = bb.y;
                }
            }
#pragma unroll
            for (int j = 0; j < QPK; ++j) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < DPL; ++i) d = fmaf(qr[j][i], kf[i], d);
                // Only this token's 8 lanes take part: the 4 groups of a warp may run
                // different numbers of tokens (ragged lengths), so a full-warp mask would hang.
                d += __shfl_xor_sync(gmask, d, 4);
                d += __shfl_xor_sync(gmask, d, 2);
                d += __shfl_xor_sync(gmask, d, 1);
                const float mn = fmaxf(mx[j], d);
                const float alpha = exp2f(mx[j] - mn), p = exp2f(d - mn);
                l[j] = l[j] * alpha + p;
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[j][i] = fmaf(acc[j][i], alpha, p * vf[i]);
                mx[j] = mn;
            }
        }
    }
    // Merge the 16 token groups, one query head at a time (keeps shared memory small).
#pragma unroll
    for (int j = 0; j < QPK; ++j) {
        __syncthreads();
        if (sub == 0) { sm_m[tg] = mx[j]; sm_l[tg] = l[j]; }
#pragma unroll
        for (int i = 0; i < DPL; ++i) sm_acc[tg][sub * DPL + i] = acc[j][i];
        __syncthreads();
        const long long row = ((long long)b * HQ + h * QPK + j) * S + s;
        if (tid < D) {
            float M = -__int_as_float(0x7f800000);
            for (int g = 0; g < NTG; ++g) M = fmaxf(M, sm_m[g]);
            float L = 0.f, O = 0.f;
            if (M != -__int_as_float(0x7f800000)) {
                for (int g = 0; g < NTG; ++g) {
                    const float c = exp2f(sm_m[g] - M);
                    L += c * sm_l[g];
                    O += c * sm_acc[g][tid];
                }
            }
            part_o[row * D + tid] = O;
            if (tid == 0) { part_ml[row * 2] = M; part_ml[row * 2 + 1] = L; }
        }
    }
}

// out [B, HQ, D]: inactive heads exactly 0, others the merged splits. Grid (HQ, B), D threads.
template <int D>
__device__ __forceinline__ void attn_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                    const unsigned char* __restrict__ mask, T* __restrict__ out, int HQ, int S,
                                                    int GH, int NG) {
    const int hq = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    T* o = out + ((long long)b * HQ + hq) * D + d;
    if (!mask[(long long)b * NG + hq / GH]) { *o = (T)0.0f; return; }
    const long long row0 = ((long long)b * HQ + hq) * S;
    float M = -__int_as_float(0x7f800000);
    for (int s = 0; s < S; ++s) M = fmaxf(M, part_ml[(row0 + s) * 2]);
    float L = 0.f, O = 0.f;
    if (M != -__int_as_float(0x7f800000)) {
        for (int s = 0; s < S; ++s) {
            const float c = exp2f(part_ml[(row0 + s) * 2] - M);
            L += c * part_ml[(row0 + s) * 2 + 1];
            O += c * part_o[(row0 + s) * D + d];
        }
    }
    *o = (T)(L > 0.f ? O / L : 0.0f);
}

#define ATTN_SPLIT(D, QPK)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_split_##D##_##QPK(                                 \
        const T* q, const T* k, const T* v, const int* lengths, const unsigned char* mask, float* part_o, float* part_ml, \
        int HQ, int HKV, int TCAP, int S, int chunk, int GH, int NG, float scale_log2) {                             \
        attn_decode_split<D, QPK>(q, k, v, lengths, mask, part_o, part_ml, HQ, HKV, TCAP, S, chunk, GH, NG, scale_log2); \
    }
ATTN_SPLIT(64, 1)
ATTN_SPLIT(64, 2)
ATTN_SPLIT(64, 4)
ATTN_SPLIT(64, 8)
ATTN_SPLIT(128, 1)
ATTN_SPLIT(128, 2)
ATTN_SPLIT(128, 4)
#define ATTN_COMBINE(D)                                                                                             \
    extern "C" __global__ void attn_decode_combine_##D(const float* part_o, const float* part_ml, const unsigned char* mask, \
                                                       T* out, int HQ, int S, int GH, int NG) {                      \
        attn_decode_combine<D>(part_o, part_ml, mask, out, HQ, S, GH, NG);                                           \
    }
ATTN_COMBINE(64)
ATTN_COMBINE(128)

// Keeps the GPU busy for `ns` nanoseconds: queued before a timed region, it lets the host
// enqueue the region's launches ahead of the GPU, so events time device work alone.
extern "C" __global__ void gpu_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}
#endif

// ---------------------------------------------------------------------------------------
// Tiled mma.sync paths (large M).
// ---------------------------------------------------------------------------------------
#ifdef BM
#ifndef BK
#define BK 32
#endif
#define LDS (BK + 8)  // padded smem row (80 or 144 bytes): ldmatrix rows land in distinct banks
#define THREADS (WM * WN * 32)
#define WTM (BM / WM)
#define WTN (BN / WN)
#define MI (WTM / 16)
#define NI (WTN / 8)
#if (NI % 2) != 0
#error "warp tile N must be a multiple of 16"
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N_)); }
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(MMA_OP " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One BK slice of the block tile: A [BM][LDS], B [BN][LDS] (n-major, k contiguous).
template <int NB>
__device__ __forceinline__ void mma_slice(const T* sA, const T* const* sB, float (*acc)[MI][NI][4], int wm, int wn, int lane) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        unsigned a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
            ldsm_x4(a[mi], sA + (wm * WTM + mi * 16 + (lane & 15)) * LDS + kk * 16 + ((lane >> 4) << 3));
#pragma unroll
        for (int b = 0; b < NB; ++b) {
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                unsigned r[4];
                ldsm_x4(r, sB[b] + (wn * WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + (((lane >> 3) & 1) << 3));
                const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma16816(acc[b][mi][2 * nj], a[mi], b0);
                    mma16816(acc[b][mi][2 * nj + 1], a[mi], b1);
                }
            }
        }
    }
}

#define NB_MN (FUSED ? 2 : 1)

// Output-width routed GEMM. Grid (N/BN, ceil(M/BM)); block (nt, mt) works on list entries
// [mt*BM, mt*BM+BM) of group g = nt*BN/G: rows below count[g] are computed (gathered through
// perm), the inactive tokens listed after them get zeros, so every output is written once.
// Requires BN | G, K % BK == 0.
extern "C" __global__ void __launch_bounds__(THREADS) gemm_mn_tiled(const T* __restrict__ x, const T* __restrict__ w,
                                                                    const T* __restrict__ w2, const int* __restrict__ perm,
                                                                    const int* __restrict__ count, T* __restrict__ out,
                                                                    int M, int N, int K, int G) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int rows[BM];
    T* sA = reinterpret_cast<T*>(smem_raw);
    T* sB0 = sA + STAGES * BM * LDS;
    T* sB1 = sB0 + STAGES * BN * LDS;  // only with FUSED
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int n0 = blockIdx.x * BN;
    const int g = n0 / G;
    const int m0 = blockIdx.y * BM;
    const int* pg = perm + (long long)g * M;
    for (int i = tid; i < BM; i += THREADS) rows[i] = (m0 + i < M) ? pg[m0 + i] : -1;
    const int nact = min(BM, count[g] - m0);
    __syncthreads();
    if (nact > 0) {
        float acc[NB_MN][MI][NI][4];
#pragma unroll
        for (int b = 0; b < NB_MN; ++b)
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[b][mi][ni][e] = 0.f;
        const bool warp_busy = wm * WTM < nact;  // a warp whose rows are all inactive issues no MMA
        const int KT = K / BK;
        auto load = [&](int stage, int k0) {
            T* a = sA + stage * BM * LDS;
            for (int i = tid; i < BM * (BK / 8); i += THREADS) {
                const int r = i / (BK / 8), c = i % (BK / 8);
                const bool v = r < nact;
                cp_async16(a + r * LDS + c * 8, v ? x + (long long)rows[r] * K + k0 + c * 8 : x, v);
            }
            for (int i = tid; i < BN * (BK / 8); i += THREADS) {
                const int r = i / (BK / 8), c = i % (BK / 8);
                cp_async16(sB0 + stage * BN * LDS + r * LDS + c * 8, w + (long long)(n0 + r) * K + k0 + c * 8, true);
                if (FUSED) cp_async16(sB1 + stage * BN * LDS + r * LDS + c * 8, w2 + (long long)(n0 + r) * K + k0 + c * 8, true);
            }
        };
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < KT) load(s, s * BK);
            cp_commit();
        }
        for (int kt = 0; kt < KT; ++kt) {
            cp_wait<STAGES - 2>();
            __syncthreads();
            const int nk = kt + STAGES - 1;
            if (nk < KT) load(nk % STAGES, nk * BK);
            cp_commit();
            const int st = kt % STAGES;
            if (warp_busy) {
                const T* sb[2] = {sB0 + st * BN * LDS, sB1 + st * BN * LDS};
                mma_slice<NB_MN>(sA + st * BM * LDS, sb, acc, wm, wn, lane);
            }
        }
        cp_wait<0>();
        if (warp_busy) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = wm * WTM + mi * 16 + (lane >> 2) + h * 8;
                    if (r < nact) {
                        T* orow = out + (long long)rows[r] * N + n0 + wn * WTN + (lane & 3) * 2;
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni) {
                            float v0 = acc[0][mi][ni][2 * h], v1 = acc[0][mi][ni][2 * h + 1];
#if FUSED
                            v0 = silu(v0) * acc[NB_MN - 1][mi][ni][2 * h];
                            v1 = silu(v1) * acc[NB_MN - 1][mi][ni][2 * h + 1];
#endif
                            *reinterpret_cast<unsigned*>(orow + ni * 8) = from_f2(v0, v1);
                        }
                    }
                }
        }
    }
    // Zeros for the inactive tokens listed in this tile (all of it when the tile is empty).
    const int first = max(nact, 0);
    for (int i = tid; i < (BM - first) * (BN / 8); i += THREADS) {
        const int r = first + i / (BN / 8), c = i % (BN / 8);
        if (rows[r] >= 0) *reinterpret_cast<uint4*>(out + (long long)rows[r] * N + n0 + c * 8) = make_uint4(0, 0, 0, 0);
    }
}

// Reduction-width routed GEMM. Grid (N/BN, ceil(M/BM)) over tokens in their own order; the
// block lists the groups that any of its BM tokens uses and runs the K loop over those only;
// rows of tokens inactive for a group are zero-filled in shared memory (predicated loads), so
// their contribution is exactly zero. Requires G % BK == 0, N % BN == 0.
extern "C" __global__ void __launch_bounds__(THREADS) gemm_k_tiled(const T* __restrict__ x, const T* __restrict__ w,
                                                                   const unsigned char* __restrict__ mask, T* __restrict__ out,
                                                                   int M, int N, int K, int G) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int glist[2048];
    __shared__ int nlist;
    T* sA = reinterpret_cast<T*>(smem_raw);
    T* sB0 = sA + STAGES * BM * LDS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int n0 = blockIdx.x * BN;
    const int m0 = blockIdx.y * BM;
    const int NG = K / G;
    const int mrows = min(BM, M - m0);
    if (tid == 0) nlist = 0;
    __syncthreads();
    if (warp == 0) {
        int base = 0;
        for (int g0 = 0; g0 < NG; g0 += 32) {
            const int g = g0 + lane;
            bool on = false;
            if (g < NG)
                for (int r = 0; r < mrows && !on; ++r) on = mask[(long long)(m0 + r) * NG + g] != 0;
            const unsigned b = __ballot_sync(0xffffffffu, on);
            if (on) glist[base + __popc(b & ((1u << lane) - 1u))] = g;
            base += __popc(b);
        }
        if (lane == 0) nlist = base;
    }
    __syncthreads();
    float acc[1][MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][mi][ni][e] = 0.f;
    const int per = G / BK;
    const int KT = nlist * per;
    const bool warp_busy = wm * WTM < mrows;
    auto load = [&](int stage, int s) {
        const int g = glist[s / per];
        const int k0 = g * G + (s % per) * BK;
        T* a = sA + stage * BM * LDS;
        for (int i = tid; i < BM * (BK / 8); i += THREADS) {
            const int r = i / (BK / 8), c = i % (BK / 8);
            const bool v = r < mrows && mask[(long long)(m0 + r) * NG + g] != 0;
            cp_async16(a + r * LDS + c * 8, v ? x + (long long)(m0 + r) * K + k0 + c * 8 : x, v);
        }
        for (int i = tid; i < BN * (BK / 8); i += THREADS) {
            const int r = i / (BK / 8), c = i % (BK / 8);
            cp_async16(sB0 + stage * BN * LDS + r * LDS + c * 8, w + (long long)(n0 + r) * K + k0 + c * 8, true);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        cp_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) load(nk % STAGES, nk);
        cp_commit();
        const int st = kt % STAGES;
        if (warp_busy) {
            const T* sb[1] = {sB0 + st * BN * LDS};
            mma_slice<1>(sA + st * BM * LDS, sb, acc, wm, wn, lane);
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WTM + mi * 16 + (lane >> 2) + h * 8;
            if (r < mrows) {
                T* orow = out + (long long)(m0 + r) * N + n0 + wn * WTN + (lane & 3) * 2;
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
                    *reinterpret_cast<unsigned*>(orow + ni * 8) = from_f2(acc[0][mi][ni][2 * h], acc[0][mi][ni][2 * h + 1]);
            }
        }
}
#endif
