// Routed causal prefill attention on Hopper wgmma (sm_90a), head_dim 128. wgmma_common.cuh is
// prepended; compiled by NVRTC for compute_90a with
//   WIDE_F16   1 for f16 operands, 0 for bf16 (fp32 accumulation, online softmax in the exp2
//              domain)
//   KN         keys a K/V tile: 64, or 128 (the consumers then take registers from the
//              producer with setmaxnreg)
//   STAGES     depth of the K/V ring (default 4)
//
// Same contract as attn_prefill_* in attn_prefill.cu: q [B, HQ, T, 128] contiguous, k/v through
// 4-D tensor maps (rows contiguous, any 16-byte-multiple batch / head strides: a narrowed KV
// cache needs no copy), out
// with strides o_sb, o_sh, o_st; perm / count from attn_prefill_layout (per (batch, group) the
// active tokens ascending, then the inactive ones). A block takes BM = 128 consecutive list
// entries of one query head: the active ones attend causally to keys 0 ..= their position, the
// inactive ones get exact zeros. Grid (HQ, ceil(T / 128), B); y = 0 is each head's heaviest
// (last) active tile.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer: it gathers the 128 query rows once (16-byte
// cp.async) and one thread streams KN-key K and V tiles through a STAGES-deep ring with the
// tensor copy engine (TMA), all into the 128-byte-swizzled layout, each stage handed over
// through an mbarrier. Warpgroups 1 and 2
// (cw = 0, 1) own the entries [64 cw, 64 cw + 64): per key tile S = Q K^T with m64n64k16 (both
// operands in shared memory, K-major), the causal mask and the online softmax on the
// accumulator registers, and O += P V with m64n128k16 taking P from registers (the accumulator
// layout converted in place) and V from shared memory MN-major. Tile j's P V is issued together
// with tile j + 1's S = Q K^T and runs while the consumer computes tile j + 1's softmax (the
// exponentials cost about half of the tensor-core time at head_dim 128). A consumer skips the
// key tiles past its last row's position but still hands them back.

#ifndef STAGES
#define STAGES 4
#endif
#define HD 128                           // head dim
#define BM 128                           // list entries a block
#ifndef KN
#define KN 64                            // keys a tile (64 or 128)
#endif
#if KN != 64 && KN != 128
#error "KN is 64 or 128"
#endif
#define Q_HALF (BM * 128)                // [128 rows x 64 dims] swizzled block, bytes
#define Q_BYTES (2 * Q_HALF)
#define KV_HALF (KN * 128)               // [KN keys x 64 dims]
#define KV_BYTES (2 * KV_HALF)           // one of K, V
#define STAGE_BYTES (2 * KV_BYTES)       // K then V
#define THREADS 384

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Descriptor of an MN-major operand in the 128-byte swizzle layout: 8-row (key) groups 1024
// bytes apart (stride byte offset), 64-element blocks of the N dimension `lbo` bytes apart
// (leading byte offset).
__device__ __forceinline__ unsigned long long sw128_desc_mn(unsigned addr, unsigned lbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// O[64 x 128] (f32) += P[64 x 16] * V[16 x 128]: P in registers (the m16n8k16 A-fragment layout
// in each warp's 16 rows), V in shared memory MN-major (rows of keys, head dim contiguous:
// transpose flag 1).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
        : WG_ACC64(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

#define NEG_INF (-__int_as_float(0x7f800000))

// Issues S = Q K^T for one consumer warpgroup (sub-tile of Q at `sqw`, K tile at `skt`): zeroes
// the accumulators and queues 8 m64n64k16 (k = 16 head dims each; dims 64-127 are the second
// swizzled block). The caller commits and waits.
__device__ __forceinline__ void issue_qk(float (&sc)[KN / 2], unsigned sqw, unsigned skt) {
#pragma unroll
    for (int i = 0; i < KN / 2; ++i) sc[i] = 0.f;
    fence_acc(sc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#if KN == 64
        wgmma_m64n64k16(sc, sw128_desc(sqw + (kk >> 2) * Q_HALF + (kk & 3) * 32), sw128_desc(skt + (kk >> 2) * KV_HALF + (kk & 3) * 32));
#else
        wgmma_m64n128k16(sc, sw128_desc(sqw + (kk >> 2) * Q_HALF + (kk & 3) * 32), sw128_desc(skt + (kk >> 2) * KV_HALF + (kk & 3) * 32));
#endif
}
// Box {64 dims, KN keys, 1, 1} at (d0, key0, hk, b) of a 4-D tensor map, written
// 128B-swizzled at `dst`, completing its bytes on the barrier at `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDesc* map, int d0, int key0, int hk, int b, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(d0), "r"(key0), "r"(hk), "r"(b), "r"(bar)
        : "memory");
}
template <int NK>
__device__ __forceinline__ void fence_pa(unsigned (&pa)[NK][4]) {
#pragma unroll
    for (int i = 0; i < NK; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[i][e])::"memory");
}
// Queues O += P V over the KN keys of the stage at `st` (V after K; 16 keys = 2048 bytes a step).
__device__ __forceinline__ void issue_pv(float (&o)[64], const unsigned (&pa)[KN / 16][4], unsigned st) {
#pragma unroll
    for (int kc = 0; kc < KN / 16; ++kc) wgmma_m64n128k16_rs(o, pa[kc], sw128_desc_mn(st + KV_BYTES + kc * 16 * 128, KV_HALF));
}
// Causal mask and online softmax for one tile of scores, P left in place in `sc`. Accumulator
// fragment: register 4 jj + e holds row warp * 16 + lane / 4 (+ 8 for e >= 2), key key0 + 8 jj +
// 2 (lane % 4) + (e % 2). `alpha` returns each row's rescaling of the earlier output.
__device__ __forceinline__ void softmax_tile(float (&sc)[KN / 2], float (&alpha)[2], float (&m)[2], float (&l)[2], int key0, int wmin,
                                             const int (&rp)[2], int lane, float sl2) {
    if (key0 + KN - 1 > wmin) {
#pragma unroll
        for (int jj = 0; jj < KN / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (key0 + 8 * jj + 2 * (lane & 3) + (e & 1) > rp[e >> 1]) sc[4 * jj + e] = NEG_INF;
    }
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
        float mx = m[e2];
#pragma unroll
        for (int jj = 0; jj < KN / 8; ++jj) mx = fmaxf(mx, fmaxf(sc[4 * jj + 2 * e2], sc[4 * jj + 2 * e2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[e2] = ex2((m[e2] - mx) * sl2);
        m[e2] = mx;
        const float ms = mx * sl2;
        float sum = 0.f;
#pragma unroll
        for (int jj = 0; jj < KN / 8; ++jj) {
            const float p0 = ex2(fmaf(sc[4 * jj + 2 * e2], sl2, -ms));
            const float p1 = ex2(fmaf(sc[4 * jj + 2 * e2 + 1], sl2, -ms));
            sc[4 * jj + 2 * e2] = p0;
            sc[4 * jj + 2 * e2 + 1] = p1;
            sum += p0 + p1;
        }
        l[e2] = l[e2] * alpha[e2] + sum;
    }
}
// P as the A operand: keys 16 kc .. 16 kc + 15 are accumulator columns 2 kc and 2 kc + 1.
__device__ __forceinline__ void pack_p(const float (&sc)[KN / 2], unsigned (&pa)[KN / 16][4]) {
#pragma unroll
    for (int kc = 0; kc < KN / 16; ++kc) {
        pa[kc][0] = pack2(sc[8 * kc + 0], sc[8 * kc + 1]);
        pa[kc][1] = pack2(sc[8 * kc + 2], sc[8 * kc + 3]);
        pa[kc][2] = pack2(sc[8 * kc + 4], sc[8 * kc + 5]);
        pa[kc][3] = pack2(sc[8 * kc + 6], sc[8 * kc + 7]);
    }
}

// A consumer's key tiles [j0, j1) it does not compute: each stage waited for and handed straight
// back to the producer (ring position s, phase ph advance).
__device__ __forceinline__ void pass_tiles(int j0, int j1, unsigned long long* full_bar, unsigned long long* empty_bar, int& s, unsigned& ph,
                                           int lane) {
    for (int j = j0; j < j1; ++j) {
        mbar_wait(smem_u32(&full_bar[s]), ph);
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s]));
        if (++s == STAGES) {
            s = 0;
            ph ^= 1u;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    attn_prefill_wgmma_128(const T* __restrict__ q, const int* __restrict__ perm,
                           const int* __restrict__ count, T* __restrict__ out, int HQ, int HKV, int Tn, int GH, int NG, long long o_sb,
                           long long o_sh, long long o_st, float sl2,
                           // maps of k and v: dims (head dim, token, KV head, batch), boxes 64 x KN x 1 x 1
                           const __grid_constant__ TmaDesc tmap_k, const __grid_constant__ TmaDesc tmap_v) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ int rows[BM];  // the entries' token positions (-1 past the list)
    __shared__ __align__(8) unsigned long long q_bar, full_bar[STAGES], empty_bar[STAGES];
    // Tiles start 1024-aligned (the swizzle pattern is defined on absolute address bits); the
    // launch asks for 1024 bytes of slack.
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned sq = base, skv = base + Q_BYTES;
    const int tid = threadIdx.x;
    const int h = blockIdx.x, b = blockIdx.z;
    const int hk = h / (HQ / HKV), g = h / GH;
    // Block-uniform values broadcast from lane 0, so that the branches around the wgmma
    // instructions look warp-uniform to the compiler.
    const int c = __shfl_sync(0xffffffffu, count[b * NG + g], 0);
    const int nat = (c + BM - 1) / BM;
    const int tile = (int)blockIdx.y < nat ? nat - 1 - (int)blockIdx.y : (int)blockIdx.y;
    const int row0 = tile * BM;
    const int* list = perm + ((long long)b * NG + g) * Tn;
    T* oh = out + b * o_sb + h * o_sh;
    for (int i = tid; i < BM; i += THREADS) rows[i] = row0 + i < Tn ? list[row0 + i] : -1;
    const int nact = min(BM, c - row0);  // active entries in this tile (<= 0: none)
    if (tid == 0) {
        mbar_init(smem_u32(&q_bar), 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 1);  // the producer's expect_tx
            mbar_init(smem_u32(&empty_bar[s]), 8);   // every consumer warp
        }
        // The initialised barriers visible to the async proxy (the K/V tensor copies complete on them).
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (nact > 0) {
        const int n_kt = __shfl_sync(0xffffffffu, rows[nact - 1], 0) / KN + 1;  // key tiles up to the last position
        if (wg == 0) {
#if KN == 128
            // The producer needs few registers; the consumers' 128-key tiles need more than an
            // even split of the file (168 a thread) gives.
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
#endif
            // Producer. Query rows: thread t copies chunks t + 128 i (row / 16, chunk % 16);
            // rows past the active ones are zero-filled (finite scores, never written).
            const T* qh = q + ((long long)b * HQ + h) * Tn * HD;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int idx = tid + 128 * i, r = idx >> 4, ch = idx & 15;
                const bool ok = r < nact;
                cp_async16(sq + (ch >> 3) * Q_HALF + sw128_off(r, ch & 7), qh + (ok ? (long long)rows[r] * HD + ch * 8 : 0), ok);
            }
            cp_async_arrive(smem_u32(&q_bar));
            // K and V tiles: one thread, four tensor copies a tile (K and V, head dims 0-63 and
            // 64-127, each [KN keys x 64 dims] written 128B-swizzled); keys past the prompt
            // read as zeros (masked anyway).
            if (tid == 0) {
                int s = 0;
                unsigned ph = 0;
                for (int j = 0; j < n_kt; ++j) {
                    if (j >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ph ^ 1u);
                    const unsigned st = skv + s * STAGE_BYTES, fb = smem_u32(&full_bar[s]);
                    mbar_arrive_expect_tx(fb, STAGE_BYTES);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        tma_load_4d(st + half * KV_HALF, &tmap_k, half * 64, j * KN, hk, b, fb);
                        tma_load_4d(st + KV_BYTES + half * KV_HALF, &tmap_v, half * 64, j * KN, hk, b, fb);
                    }
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1u;
                    }
                }
            }
            cp_wait<0>();
        } else {
#if KN == 128
            asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
#endif
            const int cw = wg - 1;
            const int ct = tid & 127, warp = ct >> 5, lane = tid & 31;
            const int r0 = cw * 64;
            const int my_n = min(64, nact - r0);  // this warpgroup's active rows
            int s = 0;
            unsigned ph = 0;
            if (my_n <= 0) {
                pass_tiles(0, n_kt, full_bar, empty_bar, s, ph, lane);
            } else {
                const int wmin = __shfl_sync(0xffffffffu, rows[r0], 0);
                const int wmax = __shfl_sync(0xffffffffu, rows[r0 + my_n - 1], 0);
                const int n_my = wmax / KN + 1;  // key tiles this warpgroup computes (<= n_kt)
                // This thread's rows: warp * 16 + lane / 4 (+ 8); past the active rows, the last
                // active position (finite, never written).
                int rp[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) rp[e] = rows[r0 + min(warp * 16 + (lane >> 2) + 8 * e, my_n - 1)];
                float o[64];
#pragma unroll
                for (int i = 0; i < 64; ++i) o[i] = 0.f;
                float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
                float sc[KN / 2];
                mbar_wait(smem_u32(&q_bar), 0);
                fence_proxy_async();  // Q came through cp.async (generic proxy); K/V by TMA
                // S of tile 0, then per tile j: the softmax of S_j, S_{j + 1} and P_j V_j issued
                // together, and S_{j + 1} awaited while P_j V_j runs, so that the exponentials of
                // the next tile overlap the tensor cores' work on this one.
                mbar_wait(smem_u32(&full_bar[0]), 0);
                issue_qk(sc, sq + cw * 64 * 128, skv);
                wg_commit();
                fence_acc(sc);
                wg_wait<0>();
                fence_acc(sc);
                int s_prev = 0;
                // P in two register sets: tile j packs into one while the other is still read
                // by the asynchronous P_{j-1} V_{j-1}, and each set stays live (fenced) until
                // the wait after which it may be rewritten.
                unsigned pa0[KN / 16][4] = {}, pa1[KN / 16][4] = {};
                auto step = [&](int j, unsigned (&pa)[KN / 16][4], unsigned (&pa_prev)[KN / 16][4]) {
                    float alpha[2];
                    softmax_tile(sc, alpha, m, l, j * KN, wmin, rp, lane, sl2);
                    pack_p(sc, pa);
                    // P_{j-1} V_{j-1} has completed (unconditional: a wait that ptxas cannot
                    // prove on every path to the rescale below serialises the wgmmas); its
                    // stage goes back to the producer.
                    wg_wait<0>();
                    fence_acc(o);
                    fence_pa(pa_prev);
                    if (j > 0) {
                        __syncwarp();
                        if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s_prev]));
                    }
#pragma unroll
                    for (int jj = 0; jj < HD / 8; ++jj) {
                        o[4 * jj] *= alpha[0];
                        o[4 * jj + 1] *= alpha[0];
                        o[4 * jj + 2] *= alpha[1];
                        o[4 * jj + 3] *= alpha[1];
                    }
                    const unsigned st = skv + s * STAGE_BYTES;
                    s_prev = s;
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1u;
                    }
                    // The rescaled output and P must be in their registers before the
                    // wgmma fence that issue_qk starts with.
                    fence_acc(o);
                    fence_pa(pa);
                    if (j + 1 < n_my) {
                        mbar_wait(smem_u32(&full_bar[s]), ph);
                        issue_qk(sc, sq + cw * 64 * 128, skv + s * STAGE_BYTES);
                        wg_commit();
                        issue_pv(o, pa, st);
                        wg_commit();
                        fence_acc(sc);
                        wg_wait<1>();  // S_{j + 1} (the older group) has completed
                        fence_acc(sc);
                    } else {
                        wg_fence();
                        issue_pv(o, pa, st);
                        wg_commit();
                    }
                };
                for (int j = 0; j < n_my; j += 2) {
                    step(j, pa0, pa1);
                    if (j + 1 < n_my) step(j + 1, pa1, pa0);
                }
                wg_wait<0>();
                fence_acc(o);
                fence_pa(pa0);
                fence_pa(pa1);
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s_prev]));
                // Key tiles past this warpgroup's last row: handed straight back.
                pass_tiles(n_my, n_kt, full_bar, empty_bar, s, ph, lane);
                // Normalise and write this thread's active rows (16 4-byte stores a row).
#pragma unroll
                for (int e2 = 0; e2 < 2; ++e2) {
                    float tot = l[e2];
                    tot += __shfl_xor_sync(0xffffffffu, tot, 1);
                    tot += __shfl_xor_sync(0xffffffffu, tot, 2);
                    const int r = warp * 16 + (lane >> 2) + 8 * e2;
                    if (r < my_n) {
                        const float inv = 1.f / tot;
                        T* orow = oh + (long long)rows[r0 + r] * o_st + 2 * (lane & 3);
#pragma unroll
                        for (int jj = 0; jj < HD / 8; ++jj)
                            *reinterpret_cast<unsigned*>(orow + 8 * jj) = pack2(o[4 * jj + 2 * e2] * inv, o[4 * jj + 2 * e2 + 1] * inv);
                    }
                }
            }
        }
    }
    // Zeros for the inactive entries of the tile (all of it when none is active).
    const int first = max(nact, 0);
    for (int i = tid; i < (BM - first) * (HD / 8); i += THREADS) {
        const int r = first + i / (HD / 8), ch = i % (HD / 8);
        if (rows[r] >= 0) *reinterpret_cast<uint4*>(oh + (long long)rows[r] * o_st + ch * 8) = make_uint4(0, 0, 0, 0);
    }
}
