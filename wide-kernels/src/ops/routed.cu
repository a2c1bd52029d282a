// Routed kernels: the routing layout, GEMV paths (small M, read the raw mask) and mma.sync
// tiled paths (large M). Compiled by NVRTC with defines:
//   WIDE_F16      1 for f16 operands, 0 for bf16 (fp32 accumulation either way)
//   BM, BN, WM, WN, STAGES, FUSED   tile shape, warps along M/N, pipeline depth, gate+up fusion
//                                   (tiled entries only; the GEMV/layout entries ignore them)
// mma_sync.cuh (storage type, MMA and copy helpers), pdl.cuh, partition.cuh, router_gate.cuh
// (storage conversions, the router gate) and rope.cuh are prepended.
__device__ __forceinline__ float silu(float a) { return a / (1.0f + __expf(-a)); }

// Weights are streamed once: keep them out of L1 so the (re-read) activations stay there.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_keep(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
// What the launch just before wrote (x, q), read after pdl_wait(): a coherent load, kept in L1
// like ld_keep's; ld_keep's read-only load may be scheduled above the wait (pdl.cuh).
__device__ __forceinline__ uint4 ld_fresh(const void* p) { return __ldca(reinterpret_cast<const uint4*>(p)); }

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
// Routing layout. mask: u8 [M][NG], read in place (a group's column at stride NG: no
// transposed copy: M strided byte loads a block, 2 M in the chunked form, from L2).
// perm: i32 [NG][M], per group the active tokens ascending, then the inactive ones ascending.
// count: i32 [NG]. One block of up to 1024 threads per group.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024) route_layout(const unsigned char* __restrict__ mask, int M, int NG, int* __restrict__ perm, int* __restrict__ count) {
    const int g = blockIdx.x;
    block_partition(mask + g, NG, M, perm + (long long)g * M, count + g);
}
// The same with the two-pass chunked partition (`WIDE_LAYOUT=chunked`, for A/B).
extern "C" __global__ void __launch_bounds__(1024) route_layout_chunked(const unsigned char* __restrict__ mask, int M, int NG, int* __restrict__ perm, int* __restrict__ count) {
    const int g = blockIdx.x;
    block_partition_chunked(mask + g, NG, M, perm + (long long)g * M, count + g);
}

// The want-th (from 0) group of [0, FIXED) that is on (used) or, with !used, off, where
// on_at(g0) gives this lane's bit for group g0 + lane; -1 if there are not that many. Every
// lane of the warp calls it (ballots).
template <class OnAt>
__device__ __forceinline__ int gemv_nth_group(int FIXED, bool used, int want, OnAt on_at) {
    int g = -1;
    for (int g0 = 0; g0 < FIXED && g < 0; g0 += 32) {
        const bool on = on_at(g0);
        const unsigned valid = FIXED - g0 >= 32 ? 0xffffffffu : (1u << (FIXED - g0)) - 1u;
        const unsigned ball = __ballot_sync(0xffffffffu, on);
        const unsigned pick = used ? ball : ~ball & valid;
        const int c = __popc(pick);
        if (want < c) g = g0 + __fns(pick, 0, want + 1);
        want -= c;
    }
    return g;
}

// ---------------------------------------------------------------------------------------
// GEMV, output-width routed (small M): out[m, n] = x[m,:] . w[n,:] where mask[m, n/G], else 0.
// A warp owns R consecutive rows of one group (R | G): a group no token uses is never loaded,
// and each x chunk, loaded once per lane, serves all R rows (x traffic / R).
// Groups [FIXED, NG) are on for every token (the caller's promise: 0 for a dense projection, the
// trailing always-on K|V groups of a fused Q|K|V): the first warps take them in order and, since
// that needs no mask, load their first weight chunks before waiting for the launch just before
// (programmatic dependent launch; weights are never written, and nothing is stored before the
// wait). The other warps are dealt to the groups [0, FIXED) some token uses first, in order
// (warp k takes the (k / (G/R))-th such group), then to the unused ones, whose rows they only
// zero: the loading warps are consecutive, so they spread evenly over the multiprocessors
// wherever the used groups fall. The mask is read in one pass (each lane holds the used bits of
// groups lane + 32 j in registers), so a warp finds its group after a single round of loads.
// With EARLY (the caller's promise: the mask was written two or more launches back, so it is
// complete when this grid starts) every warp reads it through L2 and loads its first weight
// chunks before the wait, as the always-on warps do.
// With w2 (fused): out = silu(x . w[n]) * (x . w2[n]).
// ---------------------------------------------------------------------------------------
#define GEMV_MASK_WORDS 16  // groups [0, FIXED) held in registers: up to 32 x 16 = 512
template <int MAXM, int R, bool FUSE>
__device__ __forceinline__ void gemv_mn(const T* x, const T* __restrict__ w, const T* __restrict__ w2,
                                        const unsigned char* mask, T* __restrict__ out,
                                        int M, int N, int K, int G, int NG, int FIXED, int EARLY) {
    const int lane = threadIdx.x & 31;
    const int wi = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int wpg = G / R;  // warps a group
    if (wi >= NG * wpg) return;
    const int nfix = (NG - FIXED) * wpg;  // warps on the always-on groups
    const bool fixed = wi < nfix;
    constexpr int U = R >= 8 ? 1 : 8 / R;  // R * U weight loads in flight per lane
    const int chunks = K >> 3;
    uint4 wv[U][R], wv2[U][FUSE ? R : 1];
    int n0;
    unsigned act;
    if (fixed) {
        const int g = FIXED + wi / wpg;
        n0 = g * G + (wi % wpg) * R;
        act = (1u << M) - 1u;  // every token (M <= MAXM <= 16)
    } else {
        if (!EARLY) {
            pdl_wait();  // x and the mask come from the launches just before
            pdl_trigger();
        }
        // An early mask is read from L2 (__ldcg): no line an earlier launch left in this
        // multiprocessor's L1 is trusted.
        auto mk = [&](long long i) -> bool { return (EARLY ? __ldcg(mask + i) : mask[i]) != 0; };
        const int wd = wi - nfix;
        // Used bits of groups lane + 32 j (j < GEMV_MASK_WORDS), all loads in flight at once.
        unsigned used = 0;
#pragma unroll
        for (int j = 0; j < GEMV_MASK_WORDS; ++j) {
            const int g = 32 * j + lane;
            if (g < FIXED) {
                bool on = false;
#pragma unroll
                for (int m = 0; m < MAXM; ++m) on |= m < M && mk((long long)m * NG + g);
                used |= (unsigned)on << j;
            }
        }
        int n_on = 0;
        for (int g0 = 32 * GEMV_MASK_WORDS; g0 < FIXED; g0 += 32) {  // past the registers (G < 32 / huge N)
            bool on = false;
            if (g0 + lane < FIXED) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m) on |= m < M && mk((long long)m * NG + g0 + lane);
            }
            n_on += __popc(__ballot_sync(0xffffffffu, on));
        }
#pragma unroll
        for (int j = 0; j < GEMV_MASK_WORDS; ++j) n_on += __popc(__ballot_sync(0xffffffffu, (used >> j) & 1u));
        const bool loads = wd < n_on * wpg;
        const int want = loads ? wd / wpg : (wd - n_on * wpg) / wpg;  // rank among the used / unused groups
        const int g = gemv_nth_group(FIXED, loads, want, [&](int g0) {
            bool on = false;
            if (g0 < 32 * GEMV_MASK_WORDS) {
#pragma unroll
                for (int j = 0; j < GEMV_MASK_WORDS; ++j)
                    if (32 * j == g0) on = (used >> j) & 1u;
            } else if (g0 + lane < FIXED) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m) on |= m < M && mk((long long)m * NG + g0 + lane);
            }
            return on;
        });
        if (g < 0) return;  // more warps than groups [0, FIXED) (cannot happen: wi < NG * wpg)
        n0 = g * G + (loads ? wd % wpg : (wd - n_on * wpg) % wpg) * R;
        act = 0;
#pragma unroll
        for (int m = 0; m < MAXM; ++m)
            if (m < M && mk((long long)m * NG + g)) act |= 1u << m;  // lines this warp just read
        if (act == 0) {
            if (EARLY) {  // nothing is stored before the wait
                pdl_wait();
                pdl_trigger();
            }
            for (int i = lane; i < M * R; i += 32) out[(long long)(i / R) * N + n0 + i % R] = (T)0.0f;
            return;
        }
    }
    float acc[R][MAXM], acc2[FUSE ? R : 1][MAXM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            acc[r][m] = 0.f;
            if (FUSE) acc2[FUSE ? r : 0][m] = 0.f;
        }
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
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
        if ((fixed || EARLY) && c0 == lane) {  // the first weight chunks are on their way: now wait for x
            pdl_wait();
            pdl_trigger();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m) {
                    if ((act >> m) & 1u) {
                        const uint4 xv = ld_fresh(x + (long long)m * K + (c << 3));
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
    if ((fixed || EARLY) && chunks == 0) {
        pdl_wait();
        pdl_trigger();
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
// read. A block owns R output rows and all of its warps work on them (split over the used
// chunks, so a block keeps 8 warps of loads in flight on rows of tens of KB); warp 0 lists the
// used groups (its mask loads all in flight at once, then a warp scan), the warps' partial sums
// meet in shared memory. Dynamic shared memory: NG * (4 bytes, 8 with M > 1) for the list, then
// warps * R * MAXM floats.
// ---------------------------------------------------------------------------------------
// Warp 0 of a gemm_k GEMV block lists the groups some token uses: glist[i] (ascending), with
// M > 1 gbits[i] = which tokens use it, *nlist = the count. With `l2`, the mask is read from L2
// (__ldcg: no line an earlier launch left in this multiprocessor's L1 is trusted).
template <int MAXM>
__device__ __forceinline__ void gemv_k_list(const unsigned char* mask, int M, int NG, int* glist, unsigned* gbits,
                                            int* s_nlist, bool l2) {
    const int lane = threadIdx.x & 31;
    // Lane l looks at groups [g0 + 16 l, +16).
    int nlist = 0;
    for (int g0 = 0; g0 < NG; g0 += 512) {
        unsigned tb[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int g = g0 + 16 * lane + i;
            tb[i] = 0;
            if (g < NG) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m)
                    if (m < M && (l2 ? __ldcg(mask + (long long)m * NG + g) : mask[(long long)m * NG + g])) tb[i] |= 1u << m;
            }
        }
        int cnt = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) cnt += tb[i] != 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        int at = nlist + incl - cnt;
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (tb[i]) {
                glist[at] = g0 + 16 * lane + i;
                if (MAXM > 1) gbits[at] = tb[i];
                ++at;
            }
        nlist += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) *s_nlist = nlist;
}

// The next sublayer's router folded into a one-token gemm_k GEMV (decode; see gemv_k_router).
struct RouterFold {
    const T* xres;  // [H] the residual this projection's output is added to
    const T* w1;    // [RR, H] the router's first layer
    const T* b1;    // [RR]
    const T* w2;    // [2 RNG, RR] its second layer
    const T* b2;    // [2 RNG]
    float offset;
    float* hpart;          // [RR] first-layer sums, then one u32 arrival counter (0 between launches)
    unsigned char* rmask;  // [RNG] the decision
    unsigned char* rext;   // [RNG + REXTRA] with REXTRA trailing groups on, or null
    int RR, RNG, REXTRA, H;
    int w2_shared;  // copy w2 and b2 into dynamic shared memory (after the list and partial sums)
    // 0: measurement only (`WIDE_FOLD_TAIL=0`): no arrival count and no gate; block 0 writes a
    // fixed decision (every other group on) instead, so a step can be timed without the tail.
    int tail;
};

// FOLD: this block computes rows bid * R.. of the router's first layer (w = the fold W1 W,
// [RR, K]) instead of output rows, and the last such block to finish gates.
template <int MAXM, int R, bool FOLD = false>
__device__ __forceinline__ void gemv_k(const T* x, const T* __restrict__ w, const unsigned char* mask,
                                       T* __restrict__ out, int M, int N, int K, int G, int NG, int settled, int bid,
                                       const RouterFold* fold = nullptr) {
    extern __shared__ int gemv_k_smem[];
    __shared__ int s_nlist;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwb = blockDim.x >> 5;
    const int n0 = bid * R;
    int* glist = gemv_k_smem;
    unsigned* gbits = reinterpret_cast<unsigned*>(glist + NG);  // tokens using list entry i (M > 1)
    float* red = reinterpret_cast<float*>(glist + NG * (MAXM > 1 ? 2 : 1));
    // Programmatic dependent launch: x comes from the launch just before. A settled mask (written
    // two or more launches back, so complete once this grid runs; read from L2) is listed and the
    // first weight chunks are loaded before the wait, overlapping that launch's tail.
    if (!settled) {
        pdl_wait();
        pdl_trigger();
    }
    // The gate's weights: into this block's shared memory (any fold block may be the last), or
    // into L2 by one block, before the wait.
    T* w2s = reinterpret_cast<T*>(gemv_k_smem + ((NG * (MAXM > 1 ? 2 : 1) + nwb * R * MAXM + 3) & ~3));
    T* b2s = w2s + 2 * (FOLD ? fold->RNG * fold->RR : 0);
    if (FOLD) {
        if (fold->w2_shared) {
            for (int c = threadIdx.x; c < fold->RNG * fold->RR / 4; c += blockDim.x)
                reinterpret_cast<uint4*>(w2s)[c] = __ldg(reinterpret_cast<const uint4*>(fold->w2) + c);
            for (int i = threadIdx.x; i < 2 * fold->RNG; i += blockDim.x) b2s[i] = fold->b2[i];
        } else if (bid == 0) {
            router_gate_prefetch(fold->w2, fold->b2, fold->RNG, fold->RR);
        }
    }
    if (warp == 0) gemv_k_list<MAXM>(mask, M, NG, glist, gbits, &s_nlist, settled != 0);
    __syncthreads();
    const int per = G >> 3;  // 16-byte chunks per group slice
    const bool pow2 = (per & (per - 1)) == 0;
    const int sh = __ffs(per) - 1;
    const int chunks = s_nlist * per;
    float acc[R][MAXM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.f;
    if (FOLD) {
        // W1[r] . xres over the whole residual (a settled launch's residual is complete too: the
        // engine writes it two or more launches back), the warps splitting its 16-byte chunks.
        // Two chunks a lane at a time, all their loads in flight before the first product.
        const int hc = fold->H / 8, st = 32 * nwb;
        for (int c = 32 * warp + lane; c < hc; c += 2 * st) {
            const bool two = c + st < hc;
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 xv = ld_keep(fold->xres + 8 * c), xv2 = two ? ld_keep(fold->xres + 8 * (c + st)) : z;
            uint4 wv1[R], wv2[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const T* row = fold->w1 + (long long)(n0 + r) * fold->H;
                wv1[r] = ld_keep(row + 8 * c);
                wv2[r] = two ? ld_keep(row + 8 * (c + st)) : z;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][0] = dot8(wv2[r], xv2, dot8(wv1[r], xv, acc[r][0]));
        }
    }
    constexpr int U = R >= 8 ? 1 : 8 / R;
    const int stride = 32 * nwb;
    uint4 wv[U][R];
    int col[U];
    unsigned bits[U];
    for (int c0 = 32 * warp + lane;; c0 += stride * U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + stride * u;
            bits[u] = 0;
            col[u] = 0;
            if (c < chunks) {
                const int gi = pow2 ? c >> sh : c / per;
                col[u] = glist[gi] * G + ((c - gi * per) << 3);
                bits[u] = MAXM > 1 ? gbits[gi] : 1u;
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][r] = ld_stream(w + (long long)(n0 + r) * K + col[u]);
            }
        }
        if (settled && c0 == 32 * warp + lane) {
            pdl_wait();
            pdl_trigger();
        }
        if (c0 >= chunks) break;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int m = 0; m < MAXM; ++m)
                if ((bits[u] >> m) & 1u) {
                    const uint4 xv = ld_fresh(x + (long long)m * K + col[u]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][m] = dot8(wv[u][r], xv, acc[r][m]);
                }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            const float v = warp_sum(acc[r][m]);
            if (lane == 0) red[(warp * R + r) * MAXM + m] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < R * MAXM; i += blockDim.x) {
        const int r = i / MAXM, m = i % MAXM;
        if (m < M) {
            float v = 0.f;
            for (int wi = 0; wi < nwb; ++wi) v += red[(wi * R + r) * MAXM + m];
            if (FOLD)
                fold->hpart[n0 + r] = v;
            else
                out[(long long)m * N + n0 + r] = (T)v;
        }
    }
    if (FOLD && !fold->tail) {
        if (bid == 0)
            for (int g = threadIdx.x; g < fold->RNG + fold->REXTRA; g += blockDim.x) {
                const unsigned char on = g >= fold->RNG || (g & 1) == 0;
                if (g < fold->RNG) fold->rmask[g] = on;
                if (fold->rext != nullptr) fold->rext[g] = on;
            }
        return;
    }
    if (FOLD) {
        // Publish, count this block in; the last of the RR / R fold blocks adds b1, rounds to
        // storage like the unfused router's first layer, and gates.
        __threadfence();
        __syncthreads();
        __shared__ int s_last;
        __shared__ float hs[256];
        unsigned* counter = reinterpret_cast<unsigned*>(fold->hpart + fold->RR);
        if (threadIdx.x == 0) {
            const unsigned n = atomicAdd(counter, 1u);
            s_last = n == (unsigned)(fold->RR / R - 1);
            if (s_last) *counter = 0u;
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        for (int i = threadIdx.x; i < fold->RR; i += blockDim.x) hs[i] = rt(__ldcg(fold->hpart + i) + tf(fold->b1[i]));
        __syncthreads();
        if (fold->w2_shared)
            gate_row<true>(hs, w2s, b2s, fold->offset, fold->rmask, fold->rext, fold->RR, fold->RNG, fold->REXTRA, 0);
        else
            gate_row(hs, fold->w2, fold->b2, fold->offset, fold->rmask, fold->rext, fold->RR, fold->RNG, fold->REXTRA, 0);
    }
}

#define GEMV_ENTRIES(MM, R)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) gemv_mn_##MM##_##R(const T* x, const T* w, const unsigned char* mask, \
                                                                         T* out, int M, int N, int K, int G, int NG, int FIXED, \
                                                                         int EARLY) {                                  \
        gemv_mn<MM, R, false>(x, w, nullptr, mask, out, M, N, K, G, NG, FIXED, EARLY);                                \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) gemv_mn_swiglu_##MM##_##R(const T* x, const T* w, const T* w2,  \
                                                                                const unsigned char* mask, T* out, int M, \
                                                                                int N, int K, int G, int NG, int FIXED, \
                                                                                int EARLY) {                           \
        gemv_mn<MM, R, true>(x, w, w2, mask, out, M, N, K, G, NG, FIXED, EARLY);                                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gemv_k_##MM##_##R(const T* x, const T* w, const unsigned char* mask, \
                                                                        T* out, int M, int N, int K, int G, int NG, int settled) { \
        gemv_k<MM, R>(x, w, mask, out, M, N, K, G, NG, settled, blockIdx.x);                                          \
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
// GEMV, output-width routed, one token, a block's 8 warps sharing R rows (the dense one-token
// projections; see gemv_split in gemm.rs): the same contract and placement as gemv_mn with
// MAXM = 1, but the unit dealt to the used groups is a block of R consecutive rows, and warp j
// of it reads the j-th eighth of every row, so all of a block's loads (16 a lane; 8 each matrix
// when fused) go out at once; the warps' partial sums meet in shared memory.
// ---------------------------------------------------------------------------------------
// One row set of the split GEMV: rows n0 .. n0 + R - 1, warp j of the block reading the j-th
// eighth of every row (U chunks a lane in flight), the warps' partial sums meeting in part;
// writes out[n0 ..]. With !waited the first weight loads go out before the programmatic-launch
// wait (and waited is set). All threads of the block take part; part is free again only after
// a __syncthreads.
template <int R, bool FUSE, int U>
__device__ __forceinline__ void gemv_split_rowset(const T* x, const T* __restrict__ w, const T* __restrict__ w2,
                                                  T* __restrict__ out, int n0, int K, bool& waited,
                                                  float (*part)[FUSE ? 2 * R : R]) {
    constexpr int WARPS = 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = K >> 3;
    const int per = (chunks + WARPS - 1) / WARPS;
    const int cb = warp * per, ce = min(chunks, cb + per);
    float acc[R], acc2[FUSE ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.f;
        if (FUSE) acc2[FUSE ? r : 0] = 0.f;
    }
    for (int c0 = cb + lane; c0 < ce || !waited; c0 += 32 * U) {
        uint4 wv[U][R], wv2[U][FUSE ? R : 1];
#pragma unroll
        for (int v = 0; v < U; ++v) {
            const int c = c0 + 32 * v;
            if (c < ce) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    wv[v][r] = ld_stream(w + (long long)(n0 + r) * K + (c << 3));
                    if (FUSE) wv2[v][FUSE ? r : 0] = ld_stream(w2 + (long long)(n0 + r) * K + (c << 3));
                }
            }
        }
        if (!waited) {  // the first weights are on their way: now wait for x
            pdl_wait();
            pdl_trigger();
            waited = true;
        }
#pragma unroll
        for (int v = 0; v < U; ++v) {
            const int c = c0 + 32 * v;
            if (c < ce) {
                const uint4 xv = ld_fresh(x + (c << 3));
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    acc[r] = dot8(wv[v][r], xv, acc[r]);
                    if (FUSE) acc2[FUSE ? r : 0] = dot8(wv2[v][FUSE ? r : 0], xv, acc2[FUSE ? r : 0]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float a = warp_sum(acc[r]);
        const float b = FUSE ? warp_sum(acc2[FUSE ? r : 0]) : 0.f;
        if (lane == 0) {
            part[warp][r] = a;
            if (FUSE) part[warp][FUSE ? R + r : 0] = b;
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int j = 0; j < WARPS; ++j) {
            a += part[j][threadIdx.x];
            if (FUSE) b += part[j][FUSE ? R + threadIdx.x : 0];
        }
        out[n0 + threadIdx.x] = (T)(FUSE ? silu(a) * b : a);
    }
}

template <int R, bool FUSE>
__device__ __forceinline__ void gemv_mn_split(const T* x, const T* __restrict__ w, const T* __restrict__ w2,
                                              const unsigned char* mask, T* __restrict__ out, int N, int K,
                                              int G, int NG, int FIXED, int EARLY) {
    constexpr int WARPS = 8;
    constexpr int U = (FUSE ? 8 : 16) / R > 0 ? (FUSE ? 8 : 16) / R : 1;
    __shared__ float part[WARPS][FUSE ? 2 * R : R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int upg = G / R;  // blocks a group
    const int u = blockIdx.x;
    if (u >= NG * upg) return;
    const int nfix = (NG - FIXED) * upg;
    const bool fixed = u < nfix;
    int n0;
    if (fixed) {
        n0 = (FIXED + u / upg) * G + (u % upg) * R;
    } else {
        if (!EARLY) {
            pdl_wait();
            pdl_trigger();
        }
        auto mk = [&](int g) -> bool { return (EARLY ? __ldcg(mask + g) : mask[g]) != 0; };
        const int ud = u - nfix;
        int n_on = 0;
        for (int g0 = 0; g0 < FIXED; g0 += 32) n_on += __popc(__ballot_sync(0xffffffffu, g0 + lane < FIXED && mk(g0 + lane)));
        const bool loads = ud < n_on * upg;
        const int want = loads ? ud / upg : (ud - n_on * upg) / upg;
        const int g = gemv_nth_group(FIXED, loads, want, [&](int g0) { return g0 + lane < FIXED && mk(g0 + lane); });
        if (g < 0) return;  // uniform over the block
        n0 = g * G + (loads ? ud % upg : (ud - n_on * upg) % upg) * R;
        if (!loads) {
            if (EARLY) {
                pdl_wait();
                pdl_trigger();
            }
            if (warp == 0 && lane < R) out[n0 + lane] = (T)0.0f;
            return;
        }
    }
    bool waited = !(fixed || EARLY);
    gemv_split_rowset<R, FUSE, U>(x, w, w2, out, n0, K, waited, part);
}
// Entries of the split GEMV's two forms (KIND split or ps, FN its device function): plain and
// fused gate+up (SwiGLU epilogue).
#define GEMV_ROWSET_ENTRIES(KIND, FN, R)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gemv_mn_##KIND##_##R(const T* x, const T* w, const unsigned char* mask, \
                                                                           T* out, int M, int N, int K, int G, int NG,   \
                                                                           int FIXED, int EARLY) {                       \
        FN<R, false>(x, w, nullptr, mask, out, N, K, G, NG, FIXED, EARLY);                                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gemv_mn_##KIND##_swiglu_##R(                                   \
        const T* x, const T* w, const T* w2, const unsigned char* mask, T* out, int M, int N, int K, int G, int NG,  \
        int FIXED, int EARLY) {                                                                                      \
        FN<R, true>(x, w, w2, mask, out, N, K, G, NG, FIXED, EARLY);                                                  \
    }
GEMV_ROWSET_ENTRIES(split, gemv_mn_split, 8)

// ---------------------------------------------------------------------------------------
// GEMV, output-width routed, one token, persistent (`gemv_mn_ps`): the split kernel's row sets
// (R consecutive rows, warp j reading the j-th eighth of each, partial sums meeting in shared
// memory), but on a grid of a few blocks a multiprocessor, all resident from the start. Each
// block reads the mask once and lists the groups [0, FIXED) in dynamic shared memory (the used
// ones ascending, then the unused ones), then takes the row sets b, b + grid, ... of the
// always-on groups [FIXED, NG) followed by those of the used groups; the unused groups' outputs
// are written as zeros by all threads of the grid. So no block waits for the mask more than
// once and no block exists only to write zeros. Before the wait (programmatic dependent launch)
// a block issues the loads of its first row set when that set needs no mask (an always-on
// group) or the mask is early (written two or more launches back: EARLY, read through L2).
// ---------------------------------------------------------------------------------------
// The groups [0, FIXED) of the mask (one token) into list: the used ones ascending at [0, n),
// the unused ones ascending at [n, FIXED); returns n (every thread). All 256 threads take part.
__device__ __forceinline__ int gemv_ps_list(const unsigned char* mask, int FIXED, int* list) {
    __shared__ int wc[8], s_base[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Pass 1: every thread's bits (group threadIdx.x + 256 i), all loads in flight, then the total.
    unsigned bits = 0;
    for (int i = 0; 256 * i < FIXED && i < 32; ++i) {
        const int g = threadIdx.x + 256 * i;
        if (g < FIXED && __ldcg(mask + g) != 0) bits |= 1u << i;  // through L2: another launch wrote it
    }
    int c = __popc(bits);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) wc[warp] = c;
    if (threadIdx.x == 0) s_base[0] = s_base[1] = 0;
    __syncthreads();
    int n = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) n += wc[j];
    __syncthreads();
    // Pass 2: chunk by chunk of 256 groups, each group's place by a block-wide prefix.
    for (int i = 0; 256 * i < FIXED && i < 32; ++i) {
        const int g = threadIdx.x + 256 * i;
        const bool valid = g < FIXED, on = valid && ((bits >> i) & 1u);
        const unsigned bon = __ballot_sync(0xffffffffu, on), boff = __ballot_sync(0xffffffffu, valid && !on);
        if (lane == 0) wc[warp] = __popc(bon) | (__popc(boff) << 16);
        __syncthreads();
        int pre_on = 0, pre_off = 0, tot_on = 0, tot_off = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int v = wc[j];
            if (j < warp) { pre_on += v & 0xffff; pre_off += v >> 16; }
            tot_on += v & 0xffff;
            tot_off += v >> 16;
        }
        const unsigned lt = (1u << lane) - 1u;
        if (on) list[s_base[0] + pre_on + __popc(bon & lt)] = g;
        else if (valid) list[n + s_base[1] + pre_off + __popc(boff & lt)] = g;
        __syncthreads();
        if (threadIdx.x == 0) { s_base[0] += tot_on; s_base[1] += tot_off; }
        __syncthreads();
    }
    return n;
}

template <int R, bool FUSE>
__device__ __forceinline__ void gemv_mn_ps(const T* x, const T* __restrict__ w, const T* __restrict__ w2,
                                           const unsigned char* mask, T* __restrict__ out, int N, int K, int G,
                                           int NG, int FIXED, int EARLY) {
    constexpr int WARPS = 8;
    constexpr int U = (FUSE ? 8 : 16) / R > 0 ? (FUSE ? 8 : 16) / R : 1;
    extern __shared__ int gemv_ps_list_smem[];  // FIXED ints
    __shared__ float part[WARPS][FUSE ? 2 * R : R];
    const int upg = G / R;
    const int nfix = (NG - FIXED) * upg;  // row sets of the always-on groups
    bool waited = false;
    // The list is needed for any row set past the always-on ones; it is read before the wait
    // only when the mask is early.
    int n_on = 0;
    if (FIXED > 0 && EARLY) n_on = gemv_ps_list(mask, FIXED, gemv_ps_list_smem);
    bool listed = FIXED == 0 || EARLY;
    for (int rs = blockIdx.x;; rs += gridDim.x) {
        if (!listed && rs >= nfix) {  // the first row set that needs the mask: wait, then list
            if (!waited) {
                pdl_wait();
                pdl_trigger();
                waited = true;
            }
            n_on = gemv_ps_list(mask, FIXED, gemv_ps_list_smem);
            listed = true;
        }
        if (rs >= nfix + n_on * upg) break;  // uniform over the block
        const int n0 = rs < nfix ? (FIXED + rs / upg) * G + (rs % upg) * R
                                 : gemv_ps_list_smem[(rs - nfix) / upg] * G + ((rs - nfix) % upg) * R;
        gemv_split_rowset<R, FUSE, U>(x, w, w2, out, n0, K, waited, part);
        __syncthreads();  // part is reused by the next row set
    }
    if (!waited) {  // no row set for this block: nothing is stored before the wait
        pdl_wait();
        pdl_trigger();
    }
    if (FIXED > 0) {
        if (!listed) n_on = gemv_ps_list(mask, FIXED, gemv_ps_list_smem);
        // The unused groups' outputs: zeros, spread over every thread of the grid.
        const long long nz = (long long)(FIXED - n_on) * G;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nz; i += (long long)gridDim.x * blockDim.x)
            out[(long long)gemv_ps_list_smem[n_on + i / G] * G + i % G] = (T)0.0f;
    }
}
GEMV_ROWSET_ENTRIES(ps, gemv_mn_ps, 8)

// ---------------------------------------------------------------------------------------
// gemm_k GEMV of one token with the next sublayer's router folded in (decode). That router
// reads the residual after this projection, xres + out, and its first layer is linear, so
// W1 (xres + out) = W1 xres + (W1 W) x: its hidden needs x (this launch's input, with the same
// used groups) and xres, not out. The first RR / FOLD_RPR blocks of the grid compute FOLD_RPR
// hidden values each (the fold W1 W [RR, K], precomputed, over the used groups, plus W1 . xres);
// the last to finish gates (gate_row). The next projection's mask then exists two launches
// before it (the norm launch in between), so it can load weights before its wait like a dense
// one. The other blocks are gemv_k's. FOLD_RPR = 2: a fold block reads less than an output
// block of 8 rows (down: 2 x 7168 used + 2 x 4096 against 8 x 7168), so it is not the tail.
// ---------------------------------------------------------------------------------------
#define FOLD_RPR 2
#define GEMV_K_ROUTER_ENTRY(R)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) gemv_k_router_1_##R(                                          \
        const T* x, const T* w, const unsigned char* mask, T* out, int M, int N, int K, int G, int NG, int settled,  \
        const T* wf, const T* xres, const T* w1, const T* b1, const T* w2, const T* b2, float offset, float* hpart,  \
        unsigned char* rmask, unsigned char* rext, int RR, int RNG, int REXTRA, int H, int w2_shared, int tail) {    \
        const RouterFold f{xres, w1, b1, w2, b2, offset, hpart, rmask, rext, RR, RNG, REXTRA, H, w2_shared, tail};   \
        const int fb = RR / FOLD_RPR;                                                                                \
        if ((int)blockIdx.x < fb)                                                                                    \
            gemv_k<1, FOLD_RPR, true>(x, wf, mask, nullptr, M, RR, K, G, NG, settled, blockIdx.x, &f);              \
        else                                                                                                         \
            gemv_k<1, R>(x, w, mask, out, M, N, K, G, NG, settled, blockIdx.x - fb);                                  \
    }
GEMV_K_ROUTER_ENTRY(1)
GEMV_K_ROUTER_ENTRY(2)
GEMV_K_ROUTER_ENTRY(4)
GEMV_K_ROUTER_ENTRY(8)

// ---------------------------------------------------------------------------------------
// Small-M gemm_mn on the tensor cores (2 <= M <= 8 NT): out[m, n] = x[m,:] . w[n,:] where
// mask[m, n/G], else 0 (with w2: silu(x . w[n]) * (x . w2[n])). The GEMV above keeps per-token
// dot products on the CUDA cores and reloads x for every token and row; here a block owns 16
// rows of one group (16 | G), its 8 warps split K (contiguous runs of 32-wide k blocks), and the
// products run as m16n8k16 mma with the weight rows as A and the tokens (8 a tile) as B, so each
// weight byte is loaded once and used for every token. A group no token uses is not read past
// the first U k blocks (its rows get zeros); the tokens that skip a used group are computed and
// written as zeros.
// Loads straight into fragments: lane (g = lane/4, t = lane%4) loads the 16 bytes at k 8t of
// weight rows g and g + 8 and of x row g of each token tile. The first mma takes k 8t+{0,1} as
// its k 2t+{0,1} and 8t+{2,3} as 2t+8+{0,1}, the second k 8t+4..8t+7 likewise, identically in
// A and B (a dot product does not care about the order).
// Pipelining: every warp requests its first U k blocks of weights before it waits for the launch
// just before (programmatic dependent launch) and reads the mask (with several tokens a group
// is almost always used: 94% at 4 tokens and 50% skip), and the next U blocks' before the mma
// of the current ones. The warps' partial sums meet in shared memory.
// ---------------------------------------------------------------------------------------
#define SK_WARPS 8
template <int NT, int U, bool FUSE>
__device__ __forceinline__ void skinny_mn(const T* x, const T* __restrict__ w, const T* __restrict__ w2,
                                          const unsigned char* mask, T* __restrict__ out,
                                          int M, int N, int K, int G, int NG, int FIXED) {
    constexpr int NB = FUSE ? 2 : 1;
    __shared__ float red[SK_WARPS][NB][NT * 128];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const int grp = n0 / G;
    const int nkb = K >> 5, per = (nkb + SK_WARPS - 1) / SK_WARPS;
    const int kb0 = warp * per, kb1 = min(nkb, kb0 + per);
    const long long r0 = (long long)(n0 + g8) * K + 8 * t;
    uint4 a[U][NB][2];
    auto load_w = [&](uint4 (&dst)[U][NB][2], int kb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool ok = kb + u < kb1;
            const long long o = 32LL * (kb + u);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const T* wb = b == 0 ? w : w2;
                dst[u][b][0] = ok ? ld_stream(wb + r0 + o) : make_uint4(0, 0, 0, 0);
                dst[u][b][1] = ok ? ld_stream(wb + r0 + 8LL * K + o) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    load_w(a, kb0);  // weights are never written: before the wait
    // x and the mask come from the launches just before. The wait sits behind a branch (M >= 2
    // in every launch, launch_skinny): straight after the loads, ptxas scheduled it above them
    // (their machine code had all of them after ACQBULK), so they did not overlap the launch before.
    if (M > 0) {
        pdl_wait();
        pdl_trigger();
    }
    unsigned act;
    if (grp >= FIXED) {
        act = M >= 32 ? 0xffffffffu : (1u << M) - 1u;
    } else {
        const bool on = lane < M && mask[(long long)lane * NG + grp] != 0;
        act = __ballot_sync(0xffffffffu, on);
        if (act == 0) {
            for (int i = threadIdx.x; i < M * 16; i += blockDim.x) out[(long long)(i >> 4) * N + n0 + (i & 15)] = (T)0.0f;
            return;
        }
    }
    float acc[NB][NT][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[b][nt][0] = acc[b][nt][1] = acc[b][nt][2] = acc[b][nt][3] = 0.f;
    for (int kb = kb0; kb < kb1; kb += U) {
        uint4 xv[U][NT], an[U][NB][2];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int tok = nt * 8 + g8;
                const bool ok = kb + u < kb1 && tok < M && ((act >> tok) & 1u);
                xv[u][nt] = ok ? ld_fresh(x + (long long)tok * K + 32LL * (kb + u) + 8 * t) : make_uint4(0, 0, 0, 0);
            }
        if (kb + U < kb1) load_w(an, kb + U);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const unsigned A0[4] = {a[u][b][0].x, a[u][b][1].x, a[u][b][0].y, a[u][b][1].y};
                const unsigned A1[4] = {a[u][b][0].z, a[u][b][1].z, a[u][b][0].w, a[u][b][1].w};
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const unsigned B0[2] = {xv[u][nt].x, xv[u][nt].y}, B1[2] = {xv[u][nt].z, xv[u][nt].w};
                    mma16816(acc[b][nt], A0, B0);
                    mma16816(acc[b][nt], A1, B1);
                }
            }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                a[u][b][0] = an[u][b][0];
                a[u][b][1] = an[u][b][1];
            }
    }
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][b][nt * 128 + lane * 4 + e] = acc[b][nt][e];
    __syncthreads();
    // Fragment entry (nt, lane L, e): row L/4 (+8 for e >= 2), token 8 nt + 2 (L%4) + e%2.
    for (int o = threadIdx.x; o < NT * 128; o += blockDim.x) {
        float v = 0.f, v2 = 0.f;
#pragma unroll
        for (int wi = 0; wi < SK_WARPS; ++wi) {
            v += red[wi][0][o];
            if (FUSE) v2 += red[wi][NB - 1][o];
        }
        if (FUSE) v = silu(v) * v2;
        const int L = (o & 127) >> 2, e = o & 3;
        const int row = (L >> 2) + (e >= 2 ? 8 : 0), tok = (o >> 7) * 8 + 2 * (L & 3) + (e & 1);
        if (tok < M) out[(long long)tok * N + n0 + row] = (T)(((act >> tok) & 1u) ? v : 0.0f);
    }
}

// Entries skinny_mn[_swiglu]_<NT>_<U>: NT 8-token tiles, U k blocks of weights a warp requests
// at a time (up to 2 U in flight).
#define SKINNY_ENTRY(NT, U)                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS) skinny_mn_##NT##_##U(const T* x, const T* w, const unsigned char* mask, \
                                                                                     T* out, int M, int N, int K, int G, int NG, int FIXED) { \
        skinny_mn<NT, U, false>(x, w, nullptr, mask, out, M, N, K, G, NG, FIXED);                                      \
    }
#define SKINNY_SWIGLU_ENTRY(NT, U)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS) skinny_mn_swiglu_##NT##_##U(const T* x, const T* w, const T* w2, \
                                                                                            const unsigned char* mask, T* out, int M, \
                                                                                            int N, int K, int G, int NG, int FIXED) { \
        skinny_mn<NT, U, true>(x, w, w2, mask, out, M, N, K, G, NG, FIXED);                                            \
    }
SKINNY_ENTRY(1, 2)
SKINNY_ENTRY(1, 4)
SKINNY_ENTRY(2, 2)
SKINNY_ENTRY(2, 4)
SKINNY_SWIGLU_ENTRY(1, 2)
SKINNY_SWIGLU_ENTRY(2, 2)

// ---------------------------------------------------------------------------------------
// The dense path's mask in one pass, 8 elements (16 bytes) per thread, G % 8 == 0:
//   mode 0: dst[m, n] = 0 where group n/G of token m is off (in place, write-only)
//   mode 1: dst = mask ? a : 0              (masked copy, e.g. a gemm_k input)
//   mode 2: dst = mask ? silu(a) * b : 0    (SwiGLU of two dense products)
// Two entries; the host picks one a launch by the rows a thread takes (`mask_pass` in gemm.rs).
// ---------------------------------------------------------------------------------------
// o = silu(a) * b, 8 elements (16 bytes of each).
__device__ __forceinline__ void swiglu8(uint4& o, const uint4& a, const uint4& b) {
    const unsigned* ap = &a.x;
    const unsigned* bp = &b.x;
    unsigned* op = &o.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 p = to_f2(ap[j]), q = to_f2(bp[j]);
        op[j] = from_f2(silu(p.x) * q.x, silu(p.y) * q.y);
    }
}
// Rows in batches of 4 (each batch's mask loads, then its stores): 30 registers a thread, so the
// grid's ~16 blocks a multiprocessor are all resident. Taken below 16 rows a thread.
extern "C" __global__ void apply_group_mask_rows4(const T* a, const T* b, T* __restrict__ dst,
                                            const unsigned char* mask, long long M, int N, int G, int NG, int mode) {
    pdl_wait();  // the product it masks comes from the launch just before (cuBLAS)
    pdl_trigger();
    // Grid (ceil(N/8/blockDim), rows): blocks loop over rows; no 64-bit division on the hot path.
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) << 3;
    if (n >= N) return;
    const int g = n / G;
    // Rows in batches of 4 whose mask bytes are loaded together (one wait instead of four).
    for (long long m0 = blockIdx.y; m0 < M; m0 += 4LL * gridDim.y) {
        bool on[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long m = m0 + u * (long long)gridDim.y;
            on[u] = m < M && mask[m * NG + g] != 0;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long m = m0 + u * (long long)gridDim.y;
            if (m >= M) break;
            uint4* d = reinterpret_cast<uint4*>(dst + m * N + n);
            if (!on[u]) {
                *d = make_uint4(0, 0, 0, 0);
            } else if (mode == 1) {
                *d = ld_stream(a + m * N + n);
            } else if (mode == 2) {
                const uint4 av = ld_stream(a + m * N + n), bv = ld_stream(b + m * N + n);
                uint4 o;
                swiglu8(o, av, bv);
                *d = o;
            }
        }
    }
}

// Batched, taken from 16 rows a thread. Grid (ceil(N/8/blockDim), rows): a thread takes rows
// y, y + gridDim.y, ... of its 16-byte column, `rb` (1-32) of them at a time: first the mask
// bytes of all rb rows (in chunks of 8, every load issued before any is used: one round trip a
// batch), then the stores. The host makes rb a thread's whole share of the rows (28 rows of up
// at 4096 tokens: one round trip a launch instead of seven). Its 106 registers leave 4 of the
// grid's ~16 blocks a multiprocessor resident, which costs more than the batching saves at a few
// rows a thread (NOTES v51).
#define MASK_RB_MAX 32
#define MASK_CHUNK 8
extern "C" __global__ void apply_group_mask(const T* a, const T* b, T* __restrict__ dst,
                                            const unsigned char* mask, long long M, int N, int G, int NG, int mode, int rb) {
    pdl_wait();  // the product it masks comes from the launch just before (cuBLAS)
    pdl_trigger();
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) << 3;
    if (n >= N) return;
    const int g = n / G;
    const long long step = gridDim.y;
    const long long mstep = step * NG, dstep = step * N;  // a row slot's stride in mask and dst
    for (long long m0 = blockIdx.y; m0 < M; m0 += rb * step) {
        // Rows of this batch: m0 + u * step for u < left (M < 2^31: the layout's token bound);
        // uniform over the block, so a chunk past it is skipped by a uniform branch.
        const int left = min(rb, (int)(((unsigned)(M - m0) + (unsigned)step - 1u) / (unsigned)step));
        unsigned char v[MASK_RB_MAX];
        const unsigned char* mp = mask + m0 * NG + g;
#pragma unroll
        for (int c = 0; c < MASK_RB_MAX; c += MASK_CHUNK) {
            if (c < left) {
                const unsigned char* q = mp + c * mstep;
#pragma unroll
                for (int u = c; u < c + MASK_CHUNK; ++u, q += mstep) v[u] = u < left ? *q : 1;
            }
        }
        // Bit u: row m0 + u * step is on.
        unsigned on = 0;
#pragma unroll
        for (int c = 0; c < MASK_RB_MAX; c += MASK_CHUNK) {
            if (c < left) {
#pragma unroll
                for (int u = c; u < c + MASK_CHUNK; ++u) on |= (unsigned)(v[u] != 0) << u;
            }
        }
        if (mode == 0) {
            T* d = dst + m0 * N + n;
#pragma unroll 4
            for (int u = 0; u < left; ++u, d += dstep)
                if (!((on >> u) & 1u)) *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
            continue;
        }
        // Modes 1 and 2 read rows too: in fours, the loads of four rows before their stores.
        for (int u0 = 0; u0 < left; u0 += 4) {
            uint4 av[4], bv[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const long long off = (m0 + (u0 + u) * step) * N + n;
                if (u0 + u < left && ((on >> (u0 + u)) & 1u)) {
                    av[u] = ld_stream(a + off);
                    if (mode == 2) bv[u] = ld_stream(b + off);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (u0 + u >= left) break;
                uint4 o = make_uint4(0, 0, 0, 0);
                if ((on >> (u0 + u)) & 1u) {
                    if (mode == 1) {
                        o = av[u];
                    } else {
                        swiglu8(o, av[u], bv[u]);
                    }
                }
                *reinterpret_cast<uint4*>(dst + (m0 + (u0 + u) * step) * N + n) = o;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Decode attention, head-group routed (split-K "flash decoding" on the tensor cores).
// q [B, HQ, D]; k, v [B, HKV, TCAP, D]; lengths i32 [B]; mask u8 [B, NG] with GH query heads a
// group. Grid (NB, 1, B). A KV head is active if any of its QPK (<= 8) query heads is; only
// active heads are read. The NB blocks of a sequence are shared out on the device among its n
// active KV heads, NB / n splits each (so every block works whatever the skip rate, which the
// host cannot know without a sync); a split is a run of the sequence rounded up to 64 tokens.
// Each of the 4 warps of a block takes the 16-token tiles w, w + 4, w + 8, ... of its split:
//   S = Q K^T: mma m16n8k16 with the query heads as rows (rows >= QPK are zero) and 8 tokens as
//     columns. K is read straight from global memory into B fragments: lane (g = lane/4,
//     t = lane%4) loads dims [32c + 8t, +8) of token g, and the mma's k index is permuted
//     accordingly (Q is loaded with the same permutation; a dot product does not care).
//   O^T += V^T P^T: rows = dims, columns = the 8 heads, k = the 16 tokens. The P fragments are
//     the S accumulators of this lane (same layout), packed to 16 bits; the V^T fragments are
//     packed from V rows loaded 16 (D = 128) or 8 (D = 64) bytes at a time, row r of mma i
//     being dim CW*r + i (CW = D/16).
// Online softmax per head in the log2 domain; the warps are merged through shared memory and
// the partial results (max, sum, unnormalised output) go to part_* for the combine.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned pack_half(unsigned lo_src, unsigned hi_src, int half) {
    return __byte_perm(lo_src, hi_src, half ? 0x7632 : 0x5410);
}

// W 32-bit words, read once (streamed past L1). FRESH: rows the launch just before may have
// written, read after pdl_wait(): a coherent load, which ptxas keeps below the wait (pdl.cuh).
template <int W, bool FRESH = false>
__device__ __forceinline__ void ld_words(unsigned* dst, const void* p, bool valid) {
    if (W == 4) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid && FRESH)
            asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        else if (valid)
            v = ld_stream(p);
        dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
    } else {
        uint2 v = make_uint2(0, 0);
        if (valid && FRESH)
            asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        else if (valid)
            asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        dst[0] = v.x; dst[1] = v.y;
    }
}

// Bit h set iff KV head h of sequence b has an active query head (HKV <= 64). Each lane tests
// its heads with all of their mask loads in flight, then one ballot per 32 heads; every warp
// computes the same bits on its own (no block barrier).
template <int QPK>
__device__ __forceinline__ unsigned long long active_kv_heads(const unsigned char* mask, int b, int HKV, int GH, int NG, bool l2) {
    const int lane = threadIdx.x & 31;
    unsigned long long bits = 0;
    for (int h0 = 0; h0 < HKV; h0 += 32) {
        const int h = h0 + lane;
        bool on = false;
        if (h < HKV) {
#pragma unroll
            for (int j = 0; j < QPK; ++j) {
                const unsigned char* p = mask + (long long)b * NG + (h * QPK + j) / GH;
                on |= (l2 ? __ldcg(p) : *p) != 0;
            }
        }
        bits |= (unsigned long long)__ballot_sync(0xffffffffu, on) << h0;
    }
    return bits;
}

// Index of the n-th (from 0) set bit of v.
__device__ __forceinline__ int nth_set_bit(unsigned long long v, int n) {
    for (int i = 0; i < n; ++i) v &= v - 1;
    return __ffsll((long long)v) - 1;
}

// Splits a sequence gets per active KV head (NB >= HKV, so every active head gets one; no more
// than there are 64-token chunks, so a short context does not write and merge empty splits),
// and tokens a split.
__device__ __forceinline__ int decode_splits(int NB, int n_active, int len) {
    return max(1, min(NB / max(n_active, 1), (len + 63) / 64));
}
__device__ __forceinline__ int decode_chunk(int len, int splits) { return max(64, ((len + splits - 1) / splits + 63) / 64 * 64); }

// Arrival counters of the split blocks of one (sequence, KV head) when the split kernel merges
// its own splits (out != null): the last block to arrive merges and puts the counter back to 0,
// so the array is all zero between launches (launches on one stream do not overlap).
#define ATTN_TICKETS 65536
__device__ unsigned int attn_tickets[ATTN_TICKETS];

template <int D, int QPK>
__device__ __forceinline__ void attn_decode_merge_head(const float* part_o, const float* part_ml, const unsigned char* __restrict__ mask,
                                                       T* __restrict__ out, int b, int h, int HQ, int NB, int S, int GH, int NG);

// Loads of one 16-token tile at tb for lane (g, t) (tokens at or past t1 read as zeros):
// K: tokens tb + 8j + g, dims 32c + 8t .. +8.   V: tokens tb + {2t, 2t+1, 2t+8, 2t+9}, dims
// [CW g, +CW) and [CW (g+8), +CW). 8 KB a warp at D = 128.
template <int D, bool FRESH = false>
__device__ __forceinline__ void decode_tile_loads(unsigned (&kr)[2][D / 32][4], unsigned (&vr)[4][2][D / 32], const T* kb, const T* vb,
                                                  int tb, int t1, int g, int t) {
    constexpr int DC = D / 32, CW = D / 16, VW = CW / 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int tok = tb + 8 * j + g;
#pragma unroll
        for (int c = 0; c < DC; ++c) ld_words<4, FRESH>(kr[j][c], kb + (long long)tok * D + 32 * c + 8 * t, tok < t1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int tok = tb + 2 * t + (e & 1) + 8 * (e >> 1);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) ld_words<VW, FRESH>(vr[e][hh], vb + (long long)tok * D + CW * (g + 8 * hh), tok < t1);
    }
}

// The cosines and sines of dims [i0, i0 + 8) from the block's RoPE table (rc, rs).
__device__ __forceinline__ void rope_table8(const float* rc, const float* rs, int i0, float (&cs)[8], float (&sn)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) { cs[j] = rc[i0 + j]; sn[j] = rs[i0 + j]; }
}

// The tile of one token whose (rotated) k and v rows the block staged in shared memory (decode
// attention with the RoPE fused in: the new token): as decode_tile_loads with that token first
// in the tile and the other 15 zero.
template <int D>
__device__ __forceinline__ void decode_newest_loads(unsigned (&kr)[2][D / 32][4], unsigned (&vr)[4][2][D / 32], const T* sk, const T* sv, int g, int t) {
    constexpr int DC = D / 32, CW = D / 16, VW = CW / 2;
#pragma unroll
    for (int c = 0; c < DC; ++c) {
        const uint4 w = g == 0 ? *reinterpret_cast<const uint4*>(sk + 32 * c + 8 * t) : make_uint4(0, 0, 0, 0);
        kr[0][c][0] = w.x; kr[0][c][1] = w.y; kr[0][c][2] = w.z; kr[0][c][3] = w.w;
        kr[1][c][0] = kr[1][c][1] = kr[1][c][2] = kr[1][c][3] = 0u;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int w = 0; w < VW; ++w) vr[e][hh][w] = t == 0 && e == 0 ? reinterpret_cast<const unsigned*>(sv + CW * (g + 8 * hh))[w] : 0u;
}

// One tile (tb < t1) into the running softmax state of this lane: m (head g's running max,
// log2 domain), l (this lane's share of head g's sum), o (O^T accumulators).
template <int D>
__device__ __forceinline__ void decode_tile_compute(const unsigned (&qa)[D / 32][4], const unsigned (&kr)[2][D / 32][4], const unsigned (&vr)[4][2][D / 32],
                                                    int tb, int t1, float scale_log2, int t, float (&o)[D / 16][4], float& m, float& l) {
    constexpr int DC = D / 32, CW = D / 16;
    const float NEG_INF = -__int_as_float(0x7f800000);
    float sc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int c = 0; c < DC; ++c)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned a[4] = {qa[c][2 * hh], 0u, qa[c][2 * hh + 1], 0u};
                const unsigned bb[2] = {kr[j][c][2 * hh], kr[j][c][2 * hh + 1]};
                mma16816(sc[j], a, bb);
            }
    }
    // sc[j][e] (e < 2) = score of head g with token tb + 8j + 2t + e.
    float mt = NEG_INF;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            sc[j][e] = tb + 8 * j + 2 * t + e < t1 ? sc[j][e] * scale_log2 : NEG_INF;
            mt = fmaxf(mt, sc[j][e]);
        }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float mn = fmaxf(m, mt);  // finite: token tb is valid
    const float alpha = exp2f(m - mn);
    m = mn;
    float p[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) p[j][e] = exp2f(sc[j][e] - mn);
    l = l * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    // This lane's outputs belong to heads 2t and 2t + 1, whose alphas live in lanes 8t, 8t + 4.
    const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t), al1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
    const unsigned pb[2] = {from_f2(p[0][0], p[0][1]), from_f2(p[1][0], p[1][1])};
#pragma unroll
    for (int i = 0; i < CW; ++i) {
        o[i][0] *= al0; o[i][2] *= al0;
        o[i][1] *= al1; o[i][3] *= al1;
        const int w = i >> 1, hf = i & 1;
        const unsigned a[4] = {pack_half(vr[0][0][w], vr[1][0][w], hf), pack_half(vr[0][1][w], vr[1][1][w], hf),
                               pack_half(vr[2][0][w], vr[3][0][w], hf), pack_half(vr[2][1][w], vr[3][1][w], hf)};
        mma16816(o[i], a, pb);
    }
}

template <int D, int QPK, bool ROPE>
__device__ __forceinline__ void attn_decode_split(const T* q, const T* __restrict__ k, const T* __restrict__ v,
                                                  const int* __restrict__ lengths, const unsigned char* mask,
                                                  float* __restrict__ part_o, float* __restrict__ part_ml, T* __restrict__ out,
                                                  int HQ, int HKV, int TCAP, int NB, int GH, int NG, float scale_log2, int settled,
                                                  int single_max, const T* qkv, const float* __restrict__ inv_freq) {
    static_assert(QPK <= 8 && D % 32 == 0 && (!ROPE || D % 64 == 0), "at most 8 query heads a KV head, head_dim a multiple of 32 (64 with RoPE)");
    constexpr int DC = D / 32;     // 32-dim blocks of K (2 mma k-steps each)
    constexpr int CW = D / 16;     // dims a lane holds per V row chunk = PV mmas
    constexpr int VW = CW / 2;     // 32-bit words per V chunk
    constexpr int NW = 4;          // warps a block
    __shared__ float sm_o[NW][QPK][D];
    __shared__ float sm_m[NW][QPK], sm_l[NW][QPK];
    // q and the cache rows come from the launch just before. `settled` (the caller's promise, a
    // decode step): that launch wrote only q and each sequence's newest cache row (position
    // lengths[b] - 1), and the mask and lengths are two or more launches old. Then the mask,
    // the length and the first tiles of the older rows are loaded before the wait, the newest
    // row after it; nothing is stored before the wait either way.
    // ROPE (attn_decode_rope): q and the new token's k and v are that token's row of the
    // projection's output qkv [B, (HQ + 2 HKV) D], unrotated, at position p = lengths[b] - 1.
    // q and that k are rotated here (rope.cuh, as rope_qkv_cache8 does); block x < HKV writes KV
    // head x's cache row p; the split holding p runs its tiles over the rows before it (all
    // older, loaded before the wait when settled) and the new token as one more tile of its own,
    // from qkv, after the loop. `settled` then promises that the launch just before wrote only qkv.
    if (!settled) {
        pdl_wait();
        pdl_trigger();
    }
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // The length is loaded before the mask bits are reduced, so that both loads are in flight
    // together (after the ballot it cost one more memory round trip before the first K/V load).
    // Through L2 (__ldcg), settled or not: not settled, the launch just before may have written
    // it, and a read-only load may be scheduled above the wait (ptxas did so for the length:
    // LDG.E.CONSTANT ahead of the wait's ACQBULK); settled, a read-only load would be predicated
    // above the unsettled path's wait, which the machine-code audit (pdl_audit.rs) cannot tell
    // from a hoist.
    const int len_b = __ldcg(lengths + b);
    const unsigned long long heads = active_kv_heads<QPK>(mask, b, HKV, GH, NG, !settled);
    const int n_act = __popcll(heads);
    const int len = min(len_b, TCAP);
    // Merged here and short (len <= single_max): one block a KV head, whose 4 warps merge in
    // shared memory and write the output themselves (no partials, no fence, no arrival count).
    const bool single = out != nullptr && len <= single_max;
    const int splits = single ? 1 : decode_splits(NB, n_act, len);
    const bool work = (int)blockIdx.x < n_act * splits;  // else nothing for this block (or no head active)
    const int s = work ? blockIdx.x % splits : 0;
    const int h = work ? nth_set_bit(heads, blockIdx.x / splits) : 0;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int chunk = decode_chunk(len, splits);
    const int t0 = s * chunk, t1 = work ? min(len, t0 + chunk) : 0;
    const long long head = ((long long)b * HKV + h) * TCAP;
    const T* kb = k + head * D;
    const T* vb = v + head * D;
    const long long qkv_row = (long long)b * (HQ + 2 * HKV) * D;
    // ROPE: the cosines and sines of position lengths[b] - 1 (older than the launch before when
    // settled), one dim a thread, before the wait; every rotation below reads them.
    __shared__ float rope_c[ROPE ? D / 2 : 1], rope_s[ROPE ? D / 2 : 1];
    if (ROPE) {
        for (int i = threadIdx.x; i < D / 2; i += blockDim.x) rope_cos_sin(len_b - 1, inv_freq[i], rope_c[i], rope_s[i]);
        __syncthreads();
    }
    // ROPE: the new token's row, when this split holds it, is not read from the cache.
    const bool has_new = ROPE && work && len_b - 1 >= t0 && len_b - 1 < t1;
    const int te = has_new ? len_b - 1 : t1;  // the tiles' end
    // Two register slots of tiles: tile k + 2's loads are issued into the slot of tile k as soon
    // as tile k is consumed (ptxas hoists them above tile k's PV products once its K registers
    // are free), so a warp has one tile in flight while it computes and two while it waits.
    constexpr int ST = 16 * NW;  // tokens between a warp's tiles
    unsigned kr[2][2][DC][4], vr[2][4][2][VW];
    int tb = t0 + 16 * warp;
    const int tp = ROPE ? te : settled ? min(t1, len - 1) : t1;  // settled: the rows written before the last launch
    decode_tile_loads<D>(kr[0], vr[0], kb, vb, tb, tp, g, t);
    decode_tile_loads<D>(kr[1], vr[1], kb, vb, tb + ST, tp, g, t);
    if (settled) {
        pdl_wait();
        pdl_trigger();
        // The newest row, in this split's range when tp < t1: its tile again, now in full (the
        // launch just before wrote that row: coherent loads).
        const int nt = len - 1;
        if (!ROPE && tp < t1 && nt >= tb && nt < tb + 16) decode_tile_loads<D, true>(kr[0], vr[0], kb, vb, tb, t1, g, t);
        if (!ROPE && tp < t1 && nt >= tb + ST && nt < tb + ST + 16) decode_tile_loads<D, true>(kr[1], vr[1], kb, vb, tb + ST, t1, g, t);
    }
    if (out != nullptr) {
        // Merged here: block x writes the zeros of the x-th KV head with no active query head
        // (NB >= HKV blocks, so each such head has one).
        const unsigned long long idle = ~heads & (HKV == 64 ? ~0ull : ((1ull << HKV) - 1));
        if ((int)blockIdx.x < __popcll(idle)) {
            T* o = out + ((long long)b * HQ + nth_set_bit(idle, blockIdx.x) * QPK) * D;
            for (int i = threadIdx.x; i < QPK * D; i += blockDim.x) o[i] = (T)0.0f;
        }
    }
    // Q A-fragments: row g = query head g (zero past QPK); a1, a3 (rows g + 8) stay zero. ROPE:
    // q comes unrotated from qkv, its loads issued before the new token's rows below.
    unsigned qa[DC][4];
    if (ROPE && work) {
#pragma unroll
        for (int c = 0; c < DC; ++c) {
            uint4 w = make_uint4(0, 0, 0, 0);
            if (g < QPK) w = ld_fresh(qkv + qkv_row + (long long)(h * QPK + g) * D + 32 * c + 8 * t);
            qa[c][0] = w.x; qa[c][1] = w.y; qa[c][2] = w.z; qa[c][3] = w.w;
        }
    }
    __shared__ __align__(16) T new_k[ROPE ? D : 8], new_v[ROPE ? D : 8];
    if (ROPE) {
        // The new token's rows at position p: this block's KV head h staged in shared memory for
        // the tile after the loop (has_new), KV head blockIdx.x written to the cache (block x <
        // HKV; every head, active or not); one load when both are the same head. D / 16 threads
        // rotate 8 pairs of k each, D / 8 copy 8 values of v each.
        const int i = threadIdx.x, kh = blockIdx.x, p = len_b - 1;
        const bool wr = kh < HKV && len_b >= 1 && p < TCAP;
        const bool same = has_new && wr && kh == h;
        for (int r = 0; r < 2; ++r) {
            const bool stage = r == 0 && has_new, write = r == 0 ? same : wr && !same;
            if (!stage && !write) continue;  // uniform over the block
            const int hh = r == 0 ? h : kh;
            const T* ks = qkv + qkv_row + (long long)(HQ + hh) * D;
            const T* vs = qkv + qkv_row + (long long)(HQ + HKV + hh) * D;
            const long long dst = (((long long)b * HKV + hh) * TCAP + p) * D;
            if (i < D / 16) {
                float cs[8], sn[8];
                rope_table8(rope_c, rope_s, 8 * i, cs, sn);
                uint4 a = *reinterpret_cast<const uint4*>(ks + 8 * i), bq = *reinterpret_cast<const uint4*>(ks + D / 2 + 8 * i);
                rope_rotate8(a, bq, cs, sn);
                if (stage) {
                    *reinterpret_cast<uint4*>(new_k + 8 * i) = a;
                    *reinterpret_cast<uint4*>(new_k + D / 2 + 8 * i) = bq;
                }
                if (write) {
                    T* kd = const_cast<T*>(k) + dst;
                    *reinterpret_cast<uint4*>(kd + 8 * i) = a;
                    *reinterpret_cast<uint4*>(kd + D / 2 + 8 * i) = bq;
                }
            } else if (i < D / 16 + D / 8) {
                const int j = i - D / 16;
                const uint4 w = *reinterpret_cast<const uint4*>(vs + 8 * j);
                if (stage) *reinterpret_cast<uint4*>(new_v + 8 * j) = w;
                if (write) *reinterpret_cast<uint4*>(const_cast<T*>(v) + dst + 8 * j) = w;
            }
        }
        if (has_new) __syncthreads();  // uniform over the block
    }
    if (!work) return;
    if (!ROPE) {
#pragma unroll
        for (int c = 0; c < DC; ++c) {
            uint4 w = make_uint4(0, 0, 0, 0);
            if (g < QPK) w = ld_fresh(q + ((long long)b * HQ + h * QPK + g) * D + 32 * c + 8 * t);
            qa[c][0] = w.x; qa[c][1] = w.y; qa[c][2] = w.z; qa[c][3] = w.w;
        }
    }
    if (ROPE && g < QPK) {
#pragma unroll
        for (int cc = 0; cc < DC / 2; ++cc) {
            float cs[8], sn[8];
            rope_table8(rope_c, rope_s, 32 * cc + 8 * t, cs, sn);
            uint4 a = make_uint4(qa[cc][0], qa[cc][1], qa[cc][2], qa[cc][3]);
            uint4 bq = make_uint4(qa[cc + DC / 2][0], qa[cc + DC / 2][1], qa[cc + DC / 2][2], qa[cc + DC / 2][3]);
            rope_rotate8(a, bq, cs, sn);
            qa[cc][0] = a.x; qa[cc][1] = a.y; qa[cc][2] = a.z; qa[cc][3] = a.w;
            qa[cc + DC / 2][0] = bq.x; qa[cc + DC / 2][1] = bq.y; qa[cc + DC / 2][2] = bq.z; qa[cc + DC / 2][3] = bq.w;
        }
    }
    float o[CW][4];
#pragma unroll
    for (int i = 0; i < CW; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m = NEG_INF, l = 0.f;  // head g's running max (log2 domain) and this lane's share of the sum
    for (; tb < te; tb += 2 * ST) {  // uniform in the warp
        decode_tile_compute<D>(qa, kr[0], vr[0], tb, te, scale_log2, t, o, m, l);
        decode_tile_loads<D>(kr[0], vr[0], kb, vb, tb + 2 * ST, te, g, t);
        if (tb + ST >= te) break;
        decode_tile_compute<D>(qa, kr[1], vr[1], tb + ST, te, scale_log2, t, o, m, l);
        decode_tile_loads<D>(kr[1], vr[1], kb, vb, tb + 3 * ST, te, g, t);
    }
    if (has_new && warp == NW - 1) {  // ROPE: the new token, one more tile (the loop's registers are free)
        const int p = len_b - 1;
        decode_newest_loads<D>(kr[0], vr[0], new_k, new_v, g, t);
        decode_tile_compute<D>(qa, kr[0], vr[0], p, p + 1, scale_log2, t, o, m, l);
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0 && g < QPK) { sm_m[warp][g] = m; sm_l[warp][g] = l; }
#pragma unroll
    for (int i = 0; i < CW; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int hq = 2 * t + (e & 1), dim = CW * (g + 8 * (e >> 1)) + i;
            if (hq < QPK) sm_o[warp][hq][dim] = o[i][e];
        }
    __syncthreads();
    for (int idx = threadIdx.x; idx < QPK * D; idx += 32 * NW) {
        const int hq = idx / D, d = idx % D;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hq]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float c = exp2f(sm_m[w][hq] - M);
                L += c * sm_l[w][hq];
                O += c * sm_o[w][hq][d];
            }
        }
        if (single) {
            const int qh = h * QPK + hq;
            const bool on = mask[(long long)b * NG + qh / GH] != 0;
            out[((long long)b * HQ + qh) * D + d] = (T)(on && L > 0.f ? O / L : 0.0f);
            continue;
        }
        const long long row = ((long long)b * HQ + h * QPK + hq) * NB + s;
        part_o[row * D + d] = O;
        if (d == 0) { part_ml[row * 2] = M; part_ml[row * 2 + 1] = L; }
    }
    if (out == nullptr || single) return;
    // Publish this block's partials, then count it in; the last split of the head merges them.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    const int ticket = b * HKV + h;
    if (threadIdx.x == 0) {
        const unsigned int n = atomicAdd(&attn_tickets[ticket], 1u);
        last = n == (unsigned int)(splits - 1);
        if (last) attn_tickets[ticket] = 0u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    attn_decode_merge_head<D, QPK>(part_o, part_ml, mask, out, b, h, HQ, NB, splits, GH, NG);
}

// The last split block of KV head h merges the S splits of its QPK query heads into out (an
// inactive query head gets zeros). Each thread owns 4 consecutive dims of one head; the split
// maxima and sums are read twice (maximum, then weights), the partials once, all from L2
// (__ldcg: other blocks wrote them, so no L1 line of this multiprocessor may be trusted).
template <int D, int QPK>
__device__ __forceinline__ void attn_decode_merge_head(const float* part_o, const float* part_ml, const unsigned char* __restrict__ mask,
                                                       T* __restrict__ out, int b, int h, int HQ, int NB, int S, int GH, int NG) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    for (int idx = threadIdx.x; idx < QPK * D / 4; idx += blockDim.x) {
        const int hq = h * QPK + (4 * idx) / D, d0 = (4 * idx) % D;
        T* o = out + ((long long)b * HQ + hq) * D + d0;
        if (!mask[(long long)b * NG + hq / GH]) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = (T)0.0f;
            continue;
        }
        const long long row0 = ((long long)b * HQ + hq) * NB;
        float M = NEG_INF;
#pragma unroll 8
        for (int s = 0; s < S; ++s) M = fmaxf(M, __ldcg(part_ml + (row0 + s) * 2));
        float L = 0.f;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
        if (M != NEG_INF) {
#pragma unroll 4
            for (int s = 0; s < S; ++s) {
                const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml + (row0 + s) * 2));
                const float c = ml.x == NEG_INF ? 0.f : exp2f(ml.x - M);  // a split past the length: weight 0
                const float4 os = __ldcg(reinterpret_cast<const float4*>(part_o + (row0 + s) * D + d0));
                L += c * ml.y;
                O.x += c * os.x;
                O.y += c * os.y;
                O.z += c * os.z;
                O.w += c * os.w;
            }
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        o[0] = (T)(O.x * inv);
        o[1] = (T)(O.y * inv);
        o[2] = (T)(O.z * inv);
        o[3] = (T)(O.w * inv);
    }
}

// out [B, HQ, D]: inactive heads exactly 0, others the merged splits. Grid (HQ, B), 256
// threads. One pass: the thread of slice sl and dims [4 dv, +4) takes splits sl, sl + NSL, ... with U of
// them (their max/sum pairs and outputs) loaded at once, rescaling its running sums by a running
// maximum; the NSL slices are merged through shared memory. The mask and lengths come from
// launches before the split kernel, which had all finished before any split block passed its
// own wait, hence before this grid started: they are read before the wait, so only the
// partials' loads (one round trip for up to NSL * U splits) follow the split kernel's end.
template <int D, int QPK>
__device__ __forceinline__ void attn_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                    const int* __restrict__ lengths, const unsigned char* __restrict__ mask,
                                                    T* __restrict__ out, int HQ, int HKV, int TCAP, int NB, int GH, int NG) {
    constexpr int DV = D / 4, NSL = 256 / DV, U = 8;
    __shared__ float sm_o[NSL][D];
    __shared__ float sm_m[NSL], sm_l[NSL];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, sl = tid / DV, dv = tid % DV;
    const bool on = mask[(long long)b * NG + hq / GH] != 0;  // uniform in the block
    int S = 0;
    if (on) S = decode_splits(NB, __popcll(active_kv_heads<QPK>(mask, b, HKV, GH, NG, false)), min(lengths[b], TCAP));
    pdl_wait();
    pdl_trigger();
    T* o = out + ((long long)b * HQ + hq) * D;
    if (!on) {
        if (tid < D) o[tid] = (T)0.0f;
        return;
    }
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long row0 = ((long long)b * HQ + hq) * NB;
    float m = NEG_INF, l = 0.f;
    float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = sl; s0 < S; s0 += NSL * U) {
        float2 ml[U];
        float4 os[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + NSL * u;
            ml[u] = make_float2(NEG_INF, 0.f);
            os[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (s < S) {
                ml[u] = __ldcg(reinterpret_cast<const float2*>(part_ml + (row0 + s) * 2));
                os[u] = __ldcg(reinterpret_cast<const float4*>(part_o + (row0 + s) * D + 4 * dv));
            }
        }
        float mc = m;
#pragma unroll
        for (int u = 0; u < U; ++u) mc = fmaxf(mc, ml[u].x);
        if (mc == NEG_INF) continue;  // only splits past the length so far
        const float a = exp2f(m - mc);  // 0 while m is -inf (l and O are 0 then)
        l *= a;
        O.x *= a; O.y *= a; O.z *= a; O.w *= a;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float c = ml[u].x == NEG_INF ? 0.f : exp2f(ml[u].x - mc);  // a split past the length: weight 0
            l += c * ml[u].y;
            O.x += c * os[u].x;
            O.y += c * os[u].y;
            O.z += c * os[u].z;
            O.w += c * os[u].w;
        }
        m = mc;
    }
    *reinterpret_cast<float4*>(&sm_o[sl][4 * dv]) = O;
    if (dv == 0) {
        sm_m[sl] = m;
        sm_l[sl] = l;
    }
    __syncthreads();
    if (tid < D) {
        float M = NEG_INF;
#pragma unroll
        for (int i = 0; i < NSL; ++i) M = fmaxf(M, sm_m[i]);
        float L = 0.f, OO = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int i = 0; i < NSL; ++i) {
                const float c = sm_m[i] == NEG_INF ? 0.f : exp2f(sm_m[i] - M);
                L += c * sm_l[i];
                OO += c * sm_o[i][tid];
            }
        }
        o[tid] = (T)(L > 0.f ? OO / L : 0.0f);
    }
}

#define ATTN_DECODE(D, QPK)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_split_##D##_##QPK(                                 \
        const T* q, const T* k, const T* v, const int* lengths, const unsigned char* mask, float* part_o, float* part_ml, \
        T* out, int HQ, int HKV, int TCAP, int NB, int GH, int NG, float scale_log2, int settled, int single_max) {   \
        attn_decode_split<D, QPK, false>(q, k, v, lengths, mask, part_o, part_ml, out, HQ, HKV, TCAP, NB, GH, NG, scale_log2, \
                                         settled, single_max, nullptr, nullptr);                                     \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_rope_##D##_##QPK(                                  \
        const T* qkv, const float* inv_freq, T* k, T* v, const int* lengths, const unsigned char* mask, float* part_o,  \
        float* part_ml, T* out, int HQ, int HKV, int TCAP, int NB, int GH, int NG, float scale_log2, int settled,      \
        int single_max) {                                                                                            \
        attn_decode_split<D, QPK, true>(nullptr, k, v, lengths, mask, part_o, part_ml, out, HQ, HKV, TCAP, NB, GH, NG, scale_log2, \
                                        settled, single_max, qkv, inv_freq);                                         \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) attn_decode_combine_##D##_##QPK(                               \
        const float* part_o, const float* part_ml, const int* lengths, const unsigned char* mask, T* out, int HQ, int HKV,     \
        int TCAP, int NB, int GH, int NG) {                                                                           \
        attn_decode_combine<D, QPK>(part_o, part_ml, lengths, mask, out, HQ, HKV, TCAP, NB, GH, NG);                  \
    }
ATTN_DECODE(64, 1)
ATTN_DECODE(64, 2)
ATTN_DECODE(64, 4)
ATTN_DECODE(64, 8)
ATTN_DECODE(128, 1)
ATTN_DECODE(128, 2)
ATTN_DECODE(128, 4)
ATTN_DECODE(128, 8)

// Keeps the GPU busy for `ns` nanoseconds: queued before a timed region, it lets the host
// enqueue the region's launches ahead of the GPU, so events time device work alone.
extern "C" __global__ void gpu_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}

// Words [i, n) of p, every stride-th (stride = the grid's threads), streamed past L1 with 8 loads
// in flight a thread, folded into acc so that no load is dropped (stream_read, step_read).
__device__ __forceinline__ unsigned read_words(const uint4* p, long long i, long long n, long long stride, unsigned acc) {
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = ld_stream(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return acc;
}

// Reads na 16-byte words at a and nb at b once each, and stores nothing unless an impossible
// value comes out: the time one launch needs to read those bytes, the ceiling of the
// decode-attention benchmark.
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* a, long long na, const uint4* b, long long nb,
                                                              unsigned* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned acc = read_words(b, tid, nb, stride, read_words(a, tid, na, stride, 0u));
    if (acc == 0x9e3779b9u && sink != nullptr) sink[blockIdx.x] = acc;
}

// Measurement only (`WIDE_STEP_READS`, infer.rs): stands in for one projection of the decode
// step. Reads na 16-byte words at a and nb at b (the weight bytes the projection reads) as
// stream_read does and writes nout zero words to out. Launched with programmatic dependent
// launch: the first round of weight loads goes out before the wait, as the projections' own
// weight loads do; out is written after it.
extern "C" __global__ void __launch_bounds__(256) step_read(const uint4* a, long long na, const uint4* b, long long nb,
                                                            uint4* out, long long nout, unsigned* sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4 z = make_uint4(0, 0, 0, 0);
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = tid + u * stride < na ? ld_stream(a + tid + u * stride) : z;
    pdl_wait();
    pdl_trigger();
    unsigned acc = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    acc = read_words(b, tid, nb, stride, read_words(a, tid + 8 * stride, na, stride, acc));
    for (long long j = tid; j < nout; j += stride) out[j] = z;
    if (acc == 0x9e3779b9u && sink != nullptr) sink[blockIdx.x] = acc;
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
