// Routed causal prefill attention (FlashAttention-2 style on mma.sync m16n8k16, fp32
// accumulation, online softmax in the exp2 domain). Compiled by NVRTC with
//   WIDE_F16   1 for f16 operands, 0 for bf16
//
// q [B, HQ, T, D] (contiguous), k/v [B, HKV, T, D] (rows contiguous; batch and head strides
// kv_sb, kv_sh in elements, so a narrowed KV cache needs no copy; out likewise with o_sb, o_sh,
// o_st, written as [B, T, HQ, D] memory like SDPA's output), mask u8 [B, T, NG] (group of query head h:
// h / GH). Per (batch, group) `attn_prefill_layout` lists the active tokens ascending, then the
// inactive ones ascending (perm [B, NG, T], count [B, NG]). A block of `attn_prefill_*` takes BM
// consecutive list entries of one query head: for active entries it gathers those query rows and
// runs causal attention over the keys 0 ..= the tile's last position (K/V dense, cp.async double
// buffer); inactive entries get exact zeros. Grid (HQ, ceil(T / BM), B): y = 0 is each head's
// heaviest (last) active tile, so the longest tiles start first; tiles past the active ones only
// write zeros. mma_sync.cuh (storage type, MMA and copy helpers) and partition.cuh are prepended.

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------
// Layout: one block per (group, batch). perm[b][g]: active tokens ascending, then inactive.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024) attn_prefill_layout(const unsigned char* __restrict__ mask, int Tn, int NG,
                                                                       int* __restrict__ perm, int* __restrict__ count) {
    const int g = blockIdx.x, b = blockIdx.y;
    block_partition(mask + (long long)b * Tn * NG + g, NG, Tn, perm + ((long long)b * NG + g) * Tn, count + b * NG + g);
}

// ---------------------------------------------------------------------------------------
// Attention. NW warps, each MI x 16 gathered query rows (BM = NW * MI * 16 a block), key
// tiles of BN. Shared memory (dynamic): Q [BM][LD], K [2][BN][LD], V [2][BN][LD], LD = D + 8
// (padded rows: the 8 rows of an ldmatrix land in distinct banks). With MI = 1 the Q fragments
// stay in registers; with MI = 2 they are re-read from shared memory each key tile.
// ---------------------------------------------------------------------------------------
template <int D, int NW, int MI, int BN>
__device__ __forceinline__ void attn_prefill(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             const int* __restrict__ perm, const int* __restrict__ count, T* __restrict__ out,
                                             int HQ, int HKV, int Tn, int GH, int NG, long long kv_sb, long long kv_sh,
                                             long long o_sb, long long o_sh, long long o_st, float sl2) {
    constexpr int LD = D + 8;
    constexpr int RW = MI * 16;       // rows a warp
    constexpr int BM = NW * RW;       // rows a block
    constexpr int NT = NW * 32;       // threads
    constexpr int DC = D / 8;         // 16-byte chunks a row
    constexpr int KS = D / 16;        // mma k-steps over the head dim
    constexpr int NN = BN / 8;        // score n-tiles
    constexpr int DN = D / 8;         // output n-tiles
    constexpr bool QREG = MI == 1;
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BM * LD;
    T* sV = sK + 2 * BN * LD;

    const int h = blockIdx.x, b = blockIdx.z;
    const int hk = h / (HQ / HKV), g = h / GH;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gr = lane >> 2, t4 = lane & 3;
    const int c = count[b * NG + g];
    const int nat = (c + BM - 1) / BM;
    const int tile = (int)blockIdx.y < nat ? nat - 1 - (int)blockIdx.y : (int)blockIdx.y;
    const int row0 = tile * BM;
    const int* list = perm + ((long long)b * NG + g) * Tn;
    T* oh = out + b * o_sb + h * o_sh;

    if (row0 >= c) {  // only inactive entries: zeros
        const uint4 z = make_uint4(0, 0, 0, 0);
        for (int i = tid; i < BM * DC; i += NT) {
            const int idx = row0 + i / DC;
            if (idx < Tn) *reinterpret_cast<uint4*>(oh + (long long)list[idx] * o_st + (i % DC) * 8) = z;
        }
        return;
    }
    const T* qh = q + ((long long)b * HQ + h) * Tn * D;
    const T* kh = k + b * kv_sb + hk * kv_sh;
    const T* vh = v + b * kv_sb + hk * kv_sh;
    const int last = min(row0 + BM, c) - 1;  // last active entry of the tile
    const int max_pos = list[last];

    // Q rows (an inactive entry of the tile loads the last active row: finite, never written).
    for (int i = tid; i < BM * DC; i += NT) {
        const int r = i / DC, ch = i % DC;
        const int pos = list[min(row0 + r, last)];
        cp_async16(sQ + r * LD + ch * 8, qh + (long long)pos * D + ch * 8, true);
    }
    auto load_kv = [&](int j, int buf) {
        const int key0 = j * BN;
        T* dk = sK + buf * BN * LD;
        T* dv = sV + buf * BN * LD;
        for (int i = tid; i < BN * DC; i += NT) {
            const int r = i / DC, ch = i % DC;
            const bool ok = key0 + r < Tn;
            const long long off = ok ? (long long)(key0 + r) * D + ch * 8 : 0;
            cp_async16(dk + r * LD + ch * 8, kh + off, ok);
            cp_async16(dv + r * LD + ch * 8, vh + off, ok);
        }
    };
    const int n_kt = max_pos / BN + 1;
    load_kv(0, 0);
    cp_commit();

    // This thread's rows: positions of rows gr and gr + 8 of each m-tile.
    const int wrow0 = row0 + warp * RW;
    const bool warp_active = wrow0 < c;
    const int wmin = list[min(wrow0, last)];
    const int wmax = list[min(wrow0 + RW - 1, last)];
    int rpos[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int e = 0; e < 2; ++e) rpos[mi][e] = list[min(wrow0 + mi * 16 + gr + e * 8, last)];

    float o[MI][DN][4];
    float m[MI][2], l[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int n = 0; n < DN; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.f;
        m[mi][0] = m[mi][1] = NEG_INF;
        l[mi][0] = l[mi][1] = 0.f;
    }
    unsigned qf[QREG ? KS : 1][4];
    const T* sQw = sQ + warp * RW * LD;

    for (int j = 0; j < n_kt; ++j) {
        if (j + 1 < n_kt) {
            load_kv(j + 1, (j + 1) & 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (QREG && j == 0) {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) ldsm_x4(qf[QREG ? kk : 0], sQw + (lane & 15) * LD + kk * 16 + ((lane >> 4) << 3));
        }
        const int key0 = j * BN;
        if (warp_active && key0 <= wmax) {
            const T* cK = sK + (j & 1) * BN * LD;
            const T* cV = sV + (j & 1) * BN * LD;
            float s[MI][NN][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int n = 0; n < NN; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned qa[MI][4];
                if (QREG) {
#pragma unroll
                    for (int x = 0; x < 4; ++x) qa[0][x] = qf[QREG ? kk : 0][x];
                } else {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) ldsm_x4(qa[mi], sQw + (mi * 16 + (lane & 15)) * LD + kk * 16 + ((lane >> 4) << 3));
                }
#pragma unroll
                for (int np = 0; np < NN / 2; ++np) {
                    unsigned kb[4];
                    ldsm_x4(kb, cK + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + (((lane >> 3) & 1) << 3));
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        mma16816(s[mi][2 * np], qa[mi], kb);
                        mma16816(s[mi][2 * np + 1], qa[mi], kb + 2);
                    }
                }
            }
            // Causal mask, only where a key of this tile can pass a row of this warp.
            if (key0 + BN - 1 > wmin) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int n = 0; n < NN; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = key0 + n * 8 + 2 * t4 + (e & 1);
                            if (key > rpos[mi][e >> 1]) s[mi][n][e] = NEG_INF;
                        }
            }
            // Online softmax (row max in raw scores; exponent (s - m) * scale * log2 e).
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float mx = m[mi][e];
#pragma unroll
                    for (int n = 0; n < NN; ++n) mx = fmaxf(mx, fmaxf(s[mi][n][2 * e], s[mi][n][2 * e + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float alpha = ex2((m[mi][e] - mx) * sl2);
                    m[mi][e] = mx;
                    const float ms = mx * sl2;
                    float sum = 0.f;
#pragma unroll
                    for (int n = 0; n < NN; ++n) {
                        const float p0 = ex2(fmaf(s[mi][n][2 * e], sl2, -ms));
                        const float p1 = ex2(fmaf(s[mi][n][2 * e + 1], sl2, -ms));
                        s[mi][n][2 * e] = p0;
                        s[mi][n][2 * e + 1] = p1;
                        sum += p0 + p1;
                    }
                    l[mi][e] = l[mi][e] * alpha + sum;
#pragma unroll
                    for (int n = 0; n < DN; ++n) {
                        o[mi][n][2 * e] *= alpha;
                        o[mi][n][2 * e + 1] *= alpha;
                    }
                }
            }
            // O += P V.
#pragma unroll
            for (int kc = 0; kc < BN / 16; ++kc) {
                unsigned pa[MI][4];
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    pa[mi][0] = from_f2(s[mi][2 * kc][0], s[mi][2 * kc][1]);
                    pa[mi][1] = from_f2(s[mi][2 * kc][2], s[mi][2 * kc][3]);
                    pa[mi][2] = from_f2(s[mi][2 * kc + 1][0], s[mi][2 * kc + 1][1]);
                    pa[mi][3] = from_f2(s[mi][2 * kc + 1][2], s[mi][2 * kc + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    unsigned vb[4];
                    ldsm_x4_t(vb, cV + (kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * LD + dp * 16 + ((lane >> 4) << 3));
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        mma16816(o[mi][2 * dp], pa[mi], vb);
                        mma16816(o[mi][2 * dp + 1], pa[mi], vb + 2);
                    }
                }
            }
        }
        __syncthreads();  // this buffer is refilled by the next iteration's load
    }

    // Normalise and stage this warp's rows in its own Q rows (zeros for inactive entries), then
    // write them out 16 bytes a lane.
    T* st = sQ + warp * RW * LD;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int r = mi * 16 + gr + e * 8;
            const bool act = wrow0 + r < c;
            float tot = l[mi][e];
            tot += __shfl_xor_sync(0xffffffffu, tot, 1);
            tot += __shfl_xor_sync(0xffffffffu, tot, 2);
            const float inv = act ? 1.f / tot : 0.f;
#pragma unroll
            for (int n = 0; n < DN; ++n) {
                const unsigned w = act ? from_f2(o[mi][n][2 * e] * inv, o[mi][n][2 * e + 1] * inv) : 0u;
                *reinterpret_cast<unsigned*>(st + r * LD + n * 8 + 2 * t4) = w;
            }
        }
    __syncwarp();
    for (int i = lane; i < RW * DC; i += 32) {
        const int r = i / DC, ch = i % DC;
        const int idx = wrow0 + r;
        if (idx < Tn) *reinterpret_cast<uint4*>(oh + (long long)list[idx] * o_st + ch * 8) = *reinterpret_cast<const uint4*>(st + r * LD + ch * 8);
    }
}

#define ATTN_PREFILL(D, NW, MI, BN, MINB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB) attn_prefill_##D##_##NW##_##MI##_##BN(                    \
        const T* q, const T* k, const T* v, const int* perm, const int* count, T* out, int HQ, int HKV, int Tn, int GH, int NG, \
        long long kv_sb, long long kv_sh, long long o_sb, long long o_sh, long long o_st, float sl2) {                   \
        attn_prefill<D, NW, MI, BN>(q, k, v, perm, count, out, HQ, HKV, Tn, GH, NG, kv_sb, kv_sh, o_sb, o_sh, o_st, sl2); \
    }
ATTN_PREFILL(128, 4, 1, 64, 2)
ATTN_PREFILL(128, 8, 1, 64, 1)
ATTN_PREFILL(128, 4, 2, 32, 2)
ATTN_PREFILL(64, 4, 1, 64, 2)
ATTN_PREFILL(64, 8, 1, 64, 1)
ATTN_PREFILL(64, 4, 2, 32, 2)

// ---------------------------------------------------------------------------------------
// The dense path's zero pass, in place: one warp a (batch, token) of o (any strides in elements,
// rows of D contiguous and 16-byte aligned); the rows of the token's skipped heads become 0,
// others are not touched. Only the mask and the skipped rows move. A lane takes the 16-byte
// chunks lane, lane + 32, ... of the token's HQ rows: its mask reads are independent of its
// stores (one warp a row made each store wait for that row's mask byte, ~15 times a warp).
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256) attn_prefill_zero(T* __restrict__ o, const unsigned char* __restrict__ mask, int B, int HQ,
                                                                    int Tn, int D, int GH, int NG, long long sb, long long sh, long long st) {
    const long long tokens = (long long)B * Tn;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const int cpr = D >> 3, chunks = HQ * cpr;
    for (long long bt = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); bt < tokens; bt += warps) {
        const long long b = bt / Tn, t = bt - b * Tn;
        const unsigned char* mrow = mask + bt * NG;
        T* base = o + b * sb + t * st;
        for (int c = lane; c < chunks; c += 32) {
            const int h = c / cpr;
            if (!mrow[h / GH]) reinterpret_cast<uint4*>(base + h * sh)[c - h * cpr] = make_uint4(0, 0, 0, 0);
        }
    }
}
