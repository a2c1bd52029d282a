// Fused element-wise kernels of the inference path (prefill and decode): residual add +
// RMSNorm, RoPE + KV-cache write, SwiGLU with the FFN routing mask, and the two-layer token
// router with its deterministic gate. bf16 (WIDE_F16=0) or f16 (1) storage, f32 arithmetic,
// rounding to the storage type where the tch reference rounds. mma_sync.cuh (storage type T),
// pdl.cuh, router_gate.cuh (conversions, the gate), mbarrier.cuh and rope.cuh are prepended.
__device__ __forceinline__ float block_sum(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; ++i) s += sh[i];
    return s;
}

// res[m] = x[m] (+ delta[m]); out[m] = w * rms_normalise(res[m]) for row m, by one block, which
// writes elements [i0, i1) (the whole row's statistics either way, so blocks that split a row's
// writes agree bit for bit). x may alias res (in-place residual update) only when one block
// writes the whole row. H <= 16 * blockDim.x.
constexpr int NORM_PER = 16;  // elements of a row a thread holds
// Row m of x as floats: element threadIdx.x + j * blockDim.x in v[j] (0 past H).
__device__ __forceinline__ void norm_load_row(const T* x, long long m, int H, float (&v)[NORM_PER]) {
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < H ? tf(x[m * H + i]) : 0.f;
    }
}
// The norm weights a thread writes with (elements of [i0, i1)).
__device__ __forceinline__ void norm_load_weights(const T* __restrict__ w, int i0, int i1, float (&wv)[NORM_PER]) {
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        wv[j] = i >= i0 && i < i1 ? tf(w[i]) : 0.f;
    }
}
// The rest of add_rmsnorm_row on x's row in v (see norm_load_row); the weights from wv (WV,
// loaded before) or from w as they are written (the router launches: no registers to spare).
template <bool WV>
__device__ __forceinline__ void add_rmsnorm_row_loaded(float (&v)[NORM_PER], const float (&wv)[NORM_PER], const T* __restrict__ w, const T* delta, T* res,
                                                       T* __restrict__ out, int H, float eps, int has_delta, long long m, int i0, int i1) {
    __shared__ float sh[32];
    const long long row = m * H;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < H) {
            if (has_delta) v[j] = rt(v[j] + tf(delta[row + i]));
            ss += v[j] * v[j];
        }
    }
    const float var = block_sum(ss, sh) / (float)H;
    const float inv = rsqrtf(var + eps);
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= i0 && i < i1) {
            if (has_delta) res[row + i] = ft(v[j]);
            out[row + i] = ft((WV ? wv[j] : tf(w[i])) * rt(v[j] * inv));
        }
    }
}
__device__ __forceinline__ void add_rmsnorm_row(const T* x, const T* delta, const T* __restrict__ w, T* res,
                                                T* __restrict__ out, int H, float eps, int has_delta, long long m,
                                                int i0, int i1) {
    float v[NORM_PER];
    norm_load_row(x, m, H, v);
    add_rmsnorm_row_loaded<false>(v, v, w, delta, res, out, H, eps, has_delta, m, i0, i1);
}

// Grid (M, S): block (m, y) writes slice y of S of row m (S > 1 at decode sizes: the row's
// writes spread over S multiprocessors; x must not alias res then). With `pre` (the caller's
// promise: the launch just before wrote neither x nor w, e.g. x is a residual two or more
// launches old) x's row and the weights are loaded before the programmatic-launch wait, so
// only delta's loads follow the launch before; else everything after it.
extern "C" __global__ void __launch_bounds__(512) add_rmsnorm(const T* x, const T* delta, const T* __restrict__ w,
                                                              T* res, T* __restrict__ out, int H, float eps, int has_delta, int pre) {
    const int per = (H + gridDim.y - 1) / gridDim.y, i0 = blockIdx.y * per, i1 = min(H, i0 + per);
    float v[NORM_PER], wv[NORM_PER];
    if (pre) {
        norm_load_row(x, blockIdx.x, H, v);
        norm_load_weights(w, i0, i1, wv);
    }
    pdl_wait();
    pdl_trigger();
    if (!pre) {
        norm_load_row(x, blockIdx.x, H, v);
        norm_load_weights(w, i0, i1, wv);
    }
    add_rmsnorm_row_loaded<true>(v, wv, w, delta, res, out, H, eps, has_delta, blockIdx.x, i0, i1);
}

// The router's first layer in the norm launches: a block's RPB outputs, each over WPR warps
// that split the row's 16-byte chunks (chunk c = piece * 32 + lane + k * 32 * WPR). W1 is a
// weight, so the first ROUTER_PRE chunks of a lane are loaded before the programmatic-launch wait.
#define ROUTER_PRE 4
__device__ __forceinline__ void router_w1_preload(const T* __restrict__ wr, bool mine, int piece, int lane, int wpr, int H,
                                                  uint4 (&pre)[ROUTER_PRE]) {
#pragma unroll
    for (int u = 0; u < ROUTER_PRE; ++u) {
        const int c = piece * 32 + lane + u * 32 * wpr;
        pre[u] = mine && c < H / 8 ? __ldg(reinterpret_cast<const uint4*>(wr + 8 * c)) : make_uint4(0, 0, 0, 0);
    }
}

// This warp's share of row . w1[r] over the residual row xs (shared memory), summed over the warp.
__device__ __forceinline__ float router_w1_dot(const T* __restrict__ wr, const uint4 (&pre)[ROUTER_PRE], const float* xs, int piece,
                                               int lane, int wpr, int H) {
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < ROUTER_PRE; ++u) {
        const int c = piece * 32 + lane + u * 32 * wpr;
        if (c < H / 8) {
            const T* we = reinterpret_cast<const T*>(&pre[u]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(tf(we[e]), xs[8 * c + e], acc);
        }
    }
#pragma unroll 4
    for (int c = piece * 32 + lane + ROUTER_PRE * 32 * wpr; c < H / 8; c += 32 * wpr) {
        const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wr + 8 * c));
        const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(tf(we[e]), xs[8 * c + e], acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// xs[i] = x[row + i] (+ delta[row + i], rounded to storage like the residual), then a barrier.
// 16-byte loads, all of a thread's in flight at once (H % 8 == 0, H <= 16 * blockDim.x; the
// callers' conditions): one round trip to L2, where a loop of 2-byte loads took one a pass.
__device__ __forceinline__ void residual_row_to_shared(const T* x, const T* delta, int has_delta, long long row, int H,
                                                       float* xs) {
    uint4 xv[2], dv[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (8 * c < H) {
            xv[j] = *reinterpret_cast<const uint4*>(x + row + 8 * c);
            dv[j] = has_delta ? *reinterpret_cast<const uint4*>(delta + row + 8 * c) : make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (8 * c < H) {
            const T* xe = reinterpret_cast<const T*>(&xv[j]);
            const T* de = reinterpret_cast<const T*>(&dv[j]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float a = tf(xe[e]);
                if (has_delta) a = rt(a + tf(de[e]));
                xs[8 * c + e] = a;
            }
        }
    }
    __syncthreads();
}

// Arrival counters of the blocks computing one row's router hidden (add_rmsnorm_router with the
// gate): the last block to arrive runs the gate and puts its counter back to 0, so the array
// is all zero between launches (launches on one stream do not overlap).
#define ROUTER_TICKETS 65536
__device__ unsigned int router_tickets[ROUTER_TICKETS];

// The parameters of both norm + router kernels (the host builds one argument list for either).
#define NORM_ROUTER_PARAMS                                                                                        \
    const T *x, const T *delta, const T *__restrict__ w, T *res, T *__restrict__ out, int H, float eps,               \
        int has_delta, const T *__restrict__ w1, const T *__restrict__ b1, T *__restrict__ h1, int R, int RPB,       \
        const T *__restrict__ w2, const T *__restrict__ b2, float offset, unsigned char *__restrict__ mask,          \
        unsigned char *__restrict__ ext, int NG, int EXTRA, int w2_shared

// add_rmsnorm and the first layer of the router that reads the same residual, in one launch
// (decode: saves a GEMV launch per router). Grid (M, 1 + ceil(R / RPB)): block (m, 0) is
// add_rmsnorm of row m; block (m, y > 0) rebuilds the residual row in shared memory (H floats
// of dynamic shared memory) and computes RPB outputs r = (y - 1) * RPB + j, each by
// WPR = warps / RPB warps that split the row's 16-byte chunks (so the 2 x R x H bytes of W1
// are pulled by many multiprocessors, a few loads in flight a lane):
// h1[m, r] = res[m] . w1[r] + b1[r], the WPR partial sums added in a fixed order and rounded once
// like cuBLAS's linear with bias. H % 8 == 0.
// With w2 != null (M <= ROUTER_TICKETS, R <= min(256, H)) the last of row m's y > 0 blocks to
// finish also runs the second layer and the gate on h1[m] (gate_row): the router costs no
// launch of its own. w2_shared is read by add_rmsnorm_router_cluster only (one argument list).
extern "C" __global__ void __launch_bounds__(512) add_rmsnorm_router(NORM_ROUTER_PARAMS) {
    if (blockIdx.y == 0) {
        pdl_wait();
        pdl_trigger();
        add_rmsnorm_row(x, delta, w, res, out, H, eps, has_delta, blockIdx.x, 0, H);
        return;
    }
    extern __shared__ float xs[];
    __shared__ float part[16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int wpr = warps / RPB, j = warp / wpr, piece = warp % wpr;
    const int r = (blockIdx.y - 1) * RPB + j;
    const bool mine = j < RPB && r < R;
    const T* wr = w1 + (long long)(mine ? r : 0) * H;
    // W1's first chunks before the wait, while the launch that writes x and delta finishes; the
    // gate's weights (read by whichever block arrives last) into L2 by one block.
    uint4 pre[ROUTER_PRE];
    router_w1_preload(wr, mine, piece, lane, wpr, H, pre);
    if (w2 != nullptr && blockIdx.y == 1) router_gate_prefetch(w2, b2, NG, R);
    pdl_wait();
    pdl_trigger();
    const long long row = (long long)blockIdx.x * H;
    residual_row_to_shared(x, delta, has_delta, row, H, xs);
    if (mine) {
        const float acc = router_w1_dot(wr, pre, xs, piece, lane, wpr, H);
        if (lane == 0) part[warp] = acc;
    }
    __syncthreads();
    if (threadIdx.x < RPB) {
        const int rr = (blockIdx.y - 1) * RPB + threadIdx.x;
        if (rr < R) {
            float acc = 0.f;
            for (int p = 0; p < wpr; ++p) acc += part[threadIdx.x * wpr + p];
            h1[(long long)blockIdx.x * R + rr] = ft(acc + tf(b1[rr]));
        }
    }
    if (w2 == nullptr) return;
    // Publish this block's outputs, then count the block in; the last one gates the row.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        const unsigned int n = atomicAdd(&router_tickets[blockIdx.x], 1u);
        last = n == gridDim.y - 2;
        if (last) router_tickets[blockIdx.x] = 0u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // h1 was written by other blocks: read it from L2 (__ldcg), not a stale L1 line.
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(h1 + (long long)blockIdx.x * R + i));
        xs[i] = tf(*reinterpret_cast<const T*>(&bits));
    }
    __syncthreads();
    gate_row(xs, w2, b2, offset, mask, ext, R, NG, EXTRA, blockIdx.x);
}

// add_rmsnorm_router with the gate as one thread-block cluster per token (compute capability
// 9.0; the host launches it with cluster dimensions (1, NB, 1), grid (M, NB), NB <= 8, 512
// threads, H floats of dynamic shared memory). Every block of the cluster rebuilds the residual
// row in shared memory, computes the row's RMS (each the same way, so all agree) and writes its
// 1/NB slice of res and out; its RPB first-layer outputs (W1 rows loaded before the wait, as in
// add_rmsnorm_router) go straight into block 0's shared memory (distributed shared memory), so
// the gate needs no global round trip, fence or arrival counter, only one cluster barrier; then
// block 0 gates the row. h1 is still written to global memory for the caller.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

extern "C" __global__ void __launch_bounds__(512) add_rmsnorm_router_cluster(NORM_ROUTER_PARAMS) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ float xs[];  // H floats, then (w2_shared) block 0's copies of w2 and b2
    __shared__ float part[16];
    __shared__ float sh[32];
    __shared__ float hs[256];  // in block 0: the token's first-layer outputs, written by the whole cluster
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int wpr = warps / RPB, j = warp / wpr, piece = warp % wpr;
    const int y = blockIdx.y, nb = gridDim.y;
    const int r = y * RPB + j;
    const bool mine = j < RPB && r < R;
    const T* wr = w1 + (long long)(mine ? r : 0) * H;
    // Block 0 must be running before others write its shared memory: every block arrives now
    // and waits just before those writes.
    cluster_arrive_relaxed();
    uint4 pre[ROUTER_PRE];
    router_w1_preload(wr, mine, piece, lane, wpr, H, pre);
    // Block 0 gates: its weights into its shared memory (w2_shared; 16-byte rows, R % 8 == 0)
    // or into L2, before the wait.
    T* w2s = reinterpret_cast<T*>(xs + H);
    T* b2s = w2s + 2 * NG * R;
    if (y == 0) {
        if (w2_shared) {
            for (int c = threadIdx.x; c < NG * R / 4; c += blockDim.x)
                reinterpret_cast<uint4*>(w2s)[c] = __ldg(reinterpret_cast<const uint4*>(w2) + c);
            for (int i = threadIdx.x; i < 2 * NG; i += blockDim.x) b2s[i] = b2[i];
        } else {
            router_gate_prefetch(w2, b2, NG, R);
        }
    }
    pdl_wait();
    pdl_trigger();
    const long long row = (long long)blockIdx.x * H;
    residual_row_to_shared(x, delta, has_delta, row, H, xs);
    // The sum of squares in add_rmsnorm's order (its NT threads, each over i = t + j NT; the
    // other threads add exact zeros), so the outputs are bit for bit those of add_rmsnorm.
    const int NT = (min(512, max(32, (H + 15) / 16)) + 31) / 32 * 32;
    float ss = 0.f;
    if ((int)threadIdx.x < NT)
        for (int i = threadIdx.x; i < H; i += NT) ss += xs[i] * xs[i];
    const float inv = rsqrtf(block_sum(ss, sh) / (float)H + eps);
    const int per = (H + nb - 1) / nb, i0 = y * per, i1 = min(H, i0 + per);
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        if (has_delta) res[row + i] = ft(xs[i]);
        out[row + i] = ft(tf(w[i]) * rt(xs[i] * inv));
    }
    if (mine) {
        const float acc = router_w1_dot(wr, pre, xs, piece, lane, wpr, H);
        if (lane == 0) part[warp] = acc;
    }
    __syncthreads();
    cluster_wait();  // every block of the cluster has started
    if (threadIdx.x < RPB) {
        const int rr = y * RPB + threadIdx.x;
        if (rr < R) {
            float acc = 0.f;
            for (int p = 0; p < wpr; ++p) acc += part[threadIdx.x * wpr + p];
            const T hv = ft(acc + tf(b1[rr]));
            h1[(long long)blockIdx.x * R + rr] = hv;
            const unsigned local = (unsigned)__cvta_generic_to_shared(&hs[rr]);
            unsigned remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(0));
            asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(tf(hv)) : "memory");
        }
    }
    cluster_arrive_release();  // publishes this block's outputs to block 0
    cluster_wait();
    if (y != 0) return;
    if (w2_shared)
        gate_row<true>(hs, w2s, b2s, offset, mask, ext, R, NG, EXTRA, blockIdx.x);
    else
        gate_row(hs, w2, b2, offset, mask, ext, R, NG, EXTRA, blockIdx.x);
#endif
}

// qkv [M, (HQ + 2 HKV) D] (one row per token; token m = b * T + t). Rotates q and k by the
// token's position pos[m] + pos_add, writes q to q_out [B, HQ, T, D] (or [B, T, HQ, D] with
// q_token_major, the layout SDPA's output then follows), k and v to the caches
// [B, HKV, CAP, D] at slot = that position. Block (D / 2, heads a block), grid (M, ceil((HQ + HKV)
// / heads a block)): one block per head would be hundreds of thousands of tiny blocks at
// prefill sizes, bound by the rate blocks are scheduled, not by the bytes.
extern "C" __global__ void rope_qkv_cache(const T* qkv, const int* pos, int pos_add,
                                          const float* __restrict__ inv_freq, T* __restrict__ q_out, T* __restrict__ kc,
                                          T* __restrict__ vc, long long M, int T_, int HQ, int HKV, int D, int CAP,
                                          int q_token_major, int pre) {
    (void)M;    // the grid covers the tokens (the argument list is rope_qkv_cache8's)
    (void)pre;  // (rope_qkv_cache8's)
    pdl_wait();
    pdl_trigger();
    const int m = blockIdx.x, h = blockIdx.y * blockDim.y + threadIdx.y, i = threadIdx.x, half = D >> 1;
    if (h >= HQ + HKV) return;
    const int b = m / T_, t = m - b * T_;
    const int p = pos[m] + pos_add;
    const long long src = (long long)m * (HQ + 2 * HKV) * D;
    float s, c;
    rope_cos_sin(p, inv_freq[i], c, s);
    if (h < HQ) {
        const T* q = qkv + src + (long long)h * D;
        const float x1 = tf(q[i]), x2 = tf(q[i + half]);
        // q out [B, HQ, T, D], or [B, T, HQ, D] (= [M, HQ, D]) when token-major.
        T* o = q_out + (q_token_major ? ((long long)m * HQ + h) * D : (((long long)b * HQ + h) * T_ + t) * D);
        o[i] = ft(rt(x1 * c) + rt(-x2 * s));
        o[i + half] = ft(rt(x2 * c) + rt(x1 * s));
    } else {
        const int kh = h - HQ;
        const T* k = qkv + src + (long long)(HQ + kh) * D;
        const T* v = qkv + src + (long long)(HQ + HKV + kh) * D;
        if (p < 0 || p >= CAP) return;
        const long long dst = (((long long)b * HKV + kh) * CAP + p) * D;
        const float x1 = tf(k[i]), x2 = tf(k[i + half]);
        kc[dst + i] = ft(rt(x1 * c) + rt(-x2 * s));
        kc[dst + i + half] = ft(rt(x2 * c) + rt(x1 * s));
        vc[dst + i] = v[i];
        vc[dst + i + half] = v[i + half];
    }
}

// rope_qkv_cache with 16-byte accesses (D % 16 == 0, qkv, q_out and the caches 16-byte aligned):
// a thread rotates 8 consecutive pairs (i, i + D/2) of one head of one token (rope.cuh);
// consecutive threads take consecutive pieces of a head, then heads, then tokens, so a warp
// reads whole head rows. The same arithmetic and rounding as rope_qkv_cache, element for
// element. Grid ceil(M (HQ + HKV) D / 16 / 256), 256 threads.
__device__ __forceinline__ void rope8(const T* x1p, const T* x2p, const float (&c)[8], const float (&s)[8], T* o1, T* o2) {
    uint4 a = *reinterpret_cast<const uint4*>(x1p), bq = *reinterpret_cast<const uint4*>(x2p);
    rope_rotate8(a, bq, c, s);
    *reinterpret_cast<uint4*>(o1) = a;
    *reinterpret_cast<uint4*>(o2) = bq;
}

extern "C" __global__ void __launch_bounds__(256) rope_qkv_cache8(const T* qkv, const int* pos, int pos_add,
                                                                  const float* __restrict__ inv_freq, T* __restrict__ q_out,
                                                                  T* __restrict__ kc, T* __restrict__ vc, long long M, int T_, int HQ,
                                                                  int HKV, int D, int CAP, int q_token_major, int pre) {
    // pre (the caller's promise): the launch just before did not write the positions, so they
    // and the rotation are computed before the programmatic-launch wait (only qkv follows it).
    if (!pre) {
        pdl_wait();
        pdl_trigger();
    }
    const int half = D >> 1, per_head = half >> 3, heads = HQ + HKV;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = idx < M * heads * per_head;
    const int i0 = live ? (int)(idx % per_head) * 8 : 0;
    const long long mh = idx / per_head;
    const int h = (int)(mh % heads);
    const long long m = live ? mh / heads : 0;
    const int b = (int)(m / T_), t = (int)(m - (long long)b * T_);
    const int p = pos[m] + pos_add;
    float c[8], s[8];
    rope_cos_sin8(p, inv_freq, i0, c, s);
    if (pre) {
        pdl_wait();
        pdl_trigger();
    }
    if (!live || (h >= HQ && (p < 0 || p >= CAP))) return;
    const long long src = m * (HQ + 2 * HKV) * D;
    if (h < HQ) {
        const T* q = qkv + src + (long long)h * D + i0;
        T* o = q_out + (q_token_major ? (m * HQ + h) * D : (((long long)b * HQ + h) * T_ + t) * D) + i0;
        rope8(q, q + half, c, s, o, o + half);
    } else {
        const int kh = h - HQ;
        const T* k = qkv + src + (long long)(HQ + kh) * D + i0;
        const T* v = qkv + src + (long long)(HQ + HKV + kh) * D + i0;
        const long long dst = (((long long)b * HKV + kh) * CAP + p) * D + i0;
        rope8(k, k + half, c, s, kc + dst, kc + dst + half);
        *reinterpret_cast<uint4*>(vc + dst) = *reinterpret_cast<const uint4*>(v);
        *reinterpret_cast<uint4*>(vc + dst + half) = *reinterpret_cast<const uint4*>(v + half);
    }
}

// gu [M, 2I] (gate | up); out [M, I] = silu(gate) * up, zero where the token's group is off
// (mask u8 [M, NG], group G channels; mask null = dense). 8 elements a thread.
extern "C" __global__ void swiglu_masked(const T* gu, const unsigned char* mask, T* __restrict__ out,
                                         long long M, int I, int G, int NG) {
    pdl_wait();
    pdl_trigger();
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (n >= I) return;
    for (long long m = blockIdx.y; m < M; m += gridDim.y) {
        T* o = out + m * I + n;
        if (mask != nullptr && !mask[m * NG + n / G]) {
            *reinterpret_cast<uint4*>(o) = make_uint4(0, 0, 0, 0);
            continue;
        }
        const uint4 gv = *reinterpret_cast<const uint4*>(gu + m * 2 * I + n);
        const uint4 uv = *reinterpret_cast<const uint4*>(gu + m * 2 * I + I + n);
        const T* g = reinterpret_cast<const T*>(&gv);
        const T* u = reinterpret_cast<const T*>(&uv);
        uint4 r;
        T* rp = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float a = tf(g[j]);
            rp[j] = ft(rt(a / (1.0f + __expf(-a))) * tf(u[j]));
        }
        *reinterpret_cast<uint4*>(o) = r;
    }
}

// Second router layer and deterministic gate for a few tokens (decode): h [M, R] is the first
// layer's output (x W1^T + b1, from cuBLAS or add_rmsnorm_router); see gate_row. Grid (M), 128
// threads.
extern "C" __global__ void __launch_bounds__(128) router_gate(const T* h, const T* __restrict__ w2, const T* __restrict__ b2,
                                                              float offset, unsigned char* __restrict__ mask,
                                                              unsigned char* __restrict__ ext, int R, int NG, int EXTRA) {
    pdl_wait();
    pdl_trigger();
    __shared__ float hs[256];
    const int m = blockIdx.x;
    for (int r = threadIdx.x; r < R; r += blockDim.x) hs[r] = tf(h[(long long)m * R + r]);
    __syncthreads();
    gate_row(hs, w2, b2, offset, mask, ext, R, NG, EXTRA, m);
}

// The whole router of a prefill (first layer x W1^T + b1 rounded to storage, then gate_one) in
// one launch. Grid (RS, ceil(M / 128)), clusters of the RS blocks of a token tile (RS = H / 512,
// 1..8): block (r, t) multiplies the tile's 128 rows of x with W1 over k in [512 r, 512 r + 512)
// on mma.sync, one warp a 16-token row of the tile. Thread 0 requests the operands with the
// tensor copy engine (TMA, 128-byte swizzle), 8 chunks of 64 k each completing on its own
// mbarrier: all of W1's slice before the programmatic-launch wait (the weights are settled), x's
// chunks after it through a ring of S 16 KB stages, the next chunk requested once every warp is
// done with the stage (S = 3, `router_prefill_R`; S = 8, every chunk resident with one request
// each, `router_prefill_resident_R`, for grids that fit one wave at one block a multiprocessor); the warps compute each chunk as it lands. Each x byte is read once
// and W1 once a tile. Shared memory (~97 KB at rank 32, the gate's weights included) lets two
// blocks share a multiprocessor: with every chunk resident (180 KB) at most 15 clusters of 8 ran
// at once (ncu), so a 2048-token router (16 clusters) took two waves. Each block leaves its f32
// partial [128 x R] in shared memory; after a cluster barrier block r sums the RS partials of the
// tile's tokens r, r + RS, ... in rank order (a fixed order), adds b1, rounds, and gates them
// (the gate's weights copied into shared memory, each group's pair of rows padded by 16 bytes so
// that a quarter warp's 16-byte loads of 8 groups fall on distinct banks). h1 (optional)
// receives the rounded first layer. The cuBLAS path it replaces is a split-K GEMM, its reduction
// and the gate kernel (three launches; ~100 us of host time a call in `at::linear`'s cuBLASLt
// path on the H200 machine).
#define RP_BM 128
#define RP_KB 512
#define RP_CH 64
#define RP_NCH (RP_KB / RP_CH)
#define RP_THREADS (RP_BM * 2)  // one warp a 16-token row
template <int R, int S>
__device__ __forceinline__ void router_prefill_body(const TmaDesc* map_x, const TmaDesc* map_w, const T* __restrict__ b1,
                                                    const T* __restrict__ w2, const T* __restrict__ b2, float offset,
                                                    unsigned char* __restrict__ mask, unsigned char* __restrict__ ext, T* __restrict__ h1,
                                                    int M, int NG, int EXTRA, int w2_shared) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) unsigned char rp_smem[];
    __shared__ __align__(8) unsigned long long bar[RP_NCH];
    // Stages start 1024-aligned (the swizzle pattern follows absolute address bits); the launch
    // asks for 1024 bytes of slack.
    const unsigned raw = smem_u32(rp_smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* gbase = rp_smem + (base - raw);
    constexpr int XB = RP_BM * 128;                  // bytes of an x chunk
    constexpr int PS = 2 * R + 8;                    // elements of a padded pair of gate rows
    const unsigned xs = base;                         // S x [128 rows x 128 bytes]
    const unsigned ws = base + S * XB;        // RP_NCH x [R rows x 128 bytes]
    T* w2s = reinterpret_cast<T*>(gbase + S * XB + RP_NCH * R * 128);  // w2_shared: NG pairs of PS, then b2 [2 NG]
    T* b2s = w2s + NG * PS;
    // After the product: the partials [RP_BM][R], then hs [tokens of this block][R], over the x
    // ring and (at rank 64) the start of W1's chunks, all consumed by then.
    float* part = reinterpret_cast<float*>(gbase);
    float* hs = part + RP_BM * R;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int RS = gridDim.x;
    const int m0 = blockIdx.y * RP_BM, k0 = (int)rank * RP_KB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        for (int ch = 0; ch < RP_NCH; ++ch) mbar_init(smem_u32(&bar[ch]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Settled weights first: all of W1's slice; b1 of this thread's outputs (its j is fixed:
    // RP_THREADS % R == 0).
    if (tid == 0)
        for (int ch = 0; ch < RP_NCH; ++ch) {
            mbar_arrive_expect_tx(smem_u32(&bar[ch]), (RP_BM + R) * 128);
            tma_load_2d(ws + ch * R * 128, map_w, k0 + ch * RP_CH, 0, smem_u32(&bar[ch]));
        }
    const float b1v = tf(b1[tid % R]);
    pdl_wait();
    pdl_trigger();
    // x: rows past M are zero-filled by the copy engine (and still counted in the bytes).
    if (tid == 0)
        for (int ch = 0; ch < S; ++ch) tma_load_2d(xs + ch * XB, map_x, k0 + ch * RP_CH, m0, smem_u32(&bar[ch]));
    // The gate's weights in flight meanwhile (needed only at the end).
    if (w2_shared) {
        for (int c = tid; c < NG * (R / 4); c += RP_THREADS) {
            const int g = c / (R / 4), j = c % (R / 4);
            cp_async16(w2s + g * PS + j * 8, w2 + (long long)g * 2 * R + j * 8, true);
        }
        for (int i = tid; i < NG / 4; i += RP_THREADS) cp_async16(b2s + i * 8, b2 + i * 8, true);
        for (int i = (NG / 4) * 8 + tid; i < 2 * NG; i += RP_THREADS) b2s[i] = b2[i];
        cp_commit();
    }
    // Warp w: tokens [16 w, 16 w + 16) of the tile, all R outputs (R / 8 tiles of m16n8k16).
    // 16-byte chunk c of row r of a 128-byte-swizzled block sits at chunk c ^ (r % 8).
    float acc[R / 8][4];
#pragma unroll
    for (int n = 0; n < R / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const int ar = warp * 16 + (lane & 15), ac = lane >> 4;
    const int br = (lane & 7) + ((lane >> 4) << 3), bc = (lane >> 3) & 1;
#pragma unroll 1
    for (int ch = 0; ch < RP_NCH; ++ch) {
        mbar_wait(smem_u32(&bar[ch]), 0);
        const unsigned xa = xs + (ch % S) * XB + ar * 128;
        const unsigned wb = ws + ch * R * 128;
#pragma unroll
        for (int kk = 0; kk < RP_CH / 16; ++kk) {
            unsigned a[4];
            ldsm_x4_at(a, xa + (((2 * kk + ac) ^ (ar & 7)) << 4));
#pragma unroll
            for (int nj = 0; nj < R / 16; ++nj) {
                const int row = nj * 16 + br;
                unsigned r4[4];
                ldsm_x4_at(r4, wb + row * 128 + (((2 * kk + bc) ^ (row & 7)) << 4));
                const unsigned bb0[2] = {r4[0], r4[1]}, bb1[2] = {r4[2], r4[3]};
                mma16816(acc[2 * nj], a, bb0);
                mma16816(acc[2 * nj + 1], a, bb1);
            }
        }
        // Every warp is done with this stage: refill it with chunk ch + S.
        if (ch + S < RP_NCH) {
            __syncthreads();
            if (tid == 0) tma_load_2d(xs + (ch % S) * XB, map_x, k0 + (ch + S) * RP_CH, m0, smem_u32(&bar[ch + S]));
        }
    }
    __syncthreads();  // every warp is done with x: its memory takes the partial sums
    {
        float* pw = part + (warp * 16 + (lane >> 2)) * R + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < R / 8; ++n) {
            *reinterpret_cast<float2*>(pw + n * 8) = make_float2(acc[n][0], acc[n][1]);
            *reinterpret_cast<float2*>(pw + 8 * R + n * 8) = make_float2(acc[n][2], acc[n][3]);
        }
    }
    cluster_arrive_release();  // publishes the partials to the cluster
    cluster_wait();
    // This block's tokens: r, r + RS, ... of the tile; the RS partials summed in rank order
    // (all RS loads issued before the first add).
    const int ntok = (RP_BM - (int)rank + RS - 1) / RS;
    const unsigned part_base = smem_u32(part);
    for (int p = tid; p < ntok * R; p += RP_THREADS) {
        const int i = p / R, j = p % R, t = (int)rank + RS * i;
        const unsigned off = part_base + (unsigned)((t * R + j) * 4);
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            v[q] = 0.f;
            if (q < RS) {
                unsigned remote;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(off), "r"(q));
                asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v[q]) : "r"(remote));
            }
        }
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < 8; ++q)
            if (q < RS) s += v[q];
        const T hv = ft(s + b1v);
        hs[i * R + j] = tf(hv);
        if (h1 != nullptr && m0 + t < M) h1[(long long)(m0 + t) * R + j] = hv;
    }
    cluster_arrive_relaxed();  // done reading the other blocks' partials
    if (w2_shared) cp_wait<0>();
    __syncthreads();
    const int NE = NG + EXTRA;
    for (int p = tid; p < ntok * NE; p += RP_THREADS) {
        const int i = p / NE, g = p % NE;
        const long long m = m0 + (int)rank + RS * i;
        if (m >= M) continue;
        unsigned char on = 1;
        if (g < NG) {
            on = w2_shared ? gate_one<true>(hs + i * R, w2s, b2s, offset, R, g, PS) : gate_one(hs + i * R, w2, b2, offset, R, g);
            mask[m * NG + g] = on;
        }
        if (ext != nullptr) ext[m * NE + g] = on;
    }
    cluster_wait();  // no block leaves while another may still read its partials
#endif
}
#define ROUTER_PREFILL_ENTRY(NAME, R, S, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(RP_THREADS, MINB) NAME(                                                   \
        const __grid_constant__ TmaDesc map_x, const __grid_constant__ TmaDesc map_w, const T* __restrict__ b1,             \
        const T* __restrict__ w2, const T* __restrict__ b2, float offset, unsigned char* __restrict__ mask,                 \
        unsigned char* __restrict__ ext, T* __restrict__ h1, int M, int NG, int EXTRA, int w2_shared) {                     \
        router_prefill_body<R, S>(&map_x, &map_w, b1, w2, b2, offset, mask, ext, h1, M, NG, EXTRA, w2_shared);              \
    }
#define ROUTER_PREFILL(R)                                      \
    ROUTER_PREFILL_ENTRY(router_prefill_##R, R, 3, 2)          \
    ROUTER_PREFILL_ENTRY(router_prefill_resident_##R, R, RP_NCH, 1)
ROUTER_PREFILL(16)
ROUTER_PREFILL(32)
ROUTER_PREFILL(64)
