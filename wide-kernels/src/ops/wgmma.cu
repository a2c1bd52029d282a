// Hopper (sm_90a) routed GEMM for large M: gemm_mn (output-width routed), plain or with the
// fused gate+up SwiGLU epilogue, on the warpgroup tensor-core instruction wgmma.mma_async.
// Compiled by NVRTC for compute_90a only (wgmma exists on sm_90a alone), with defines:
//   WIDE_F16      1 for f16 operands, 0 for bf16 (fp32 accumulation either way)
//   FUSED         1: two weight tiles (gate, up) and out = silu(x.w_gate) * (x.w_up)
//   MI            64-row sub-tiles a consumer warpgroup computes (tile height BM = 128 MI)
//   STAGES        shared-memory pipeline depth
//   ASYNC_ARRIVE  1: each producer thread's copies arrive on the stage's barrier by themselves
//                 (cp.async.mbarrier.arrive.noinc) and the consumers fence the async proxy after
//                 waiting; 0: the producer waits for its copies (cp.async.wait_group, STAGES - 2
//                 stages behind), fences, then arrives
//   CLUSTER       1, or 2: clusters of two blocks on consecutive token tiles of one group; each
//                 block loads half of the weight tile(s) with the tensor copy engine (TMA) and
//                 multicasts it to both, so each weight byte crosses from L2 once for two tiles
//                 (needs ASYNC_ARRIVE 1)
//   TMA_B         1 (with CLUSTER 1 and ASYNC_ARRIVE 1): one producer thread loads the weight
//                 tile(s) with TMA instead of 128 threads' cp.async
//   ROW_TMA       1 (with TMA_B, plain entry): a tile whose listed rows are consecutive tokens
//                 (every row of an always-on group, a mask that keeps a contiguous run) loads
//                 them with TMA too (a tensor map over x), the others keep the cp.async gather
//
// Same contract as gemm_mn_tiled in routed.cu: tile (mt, nt) works on list entries
// [mt*BM, mt*BM+BM) of group g = nt*BN/G (BN | G): entries below count[g] are active tokens,
// gathered through perm and computed; the inactive tokens listed after them get exact zeros, so
// every output element is written once.
//
// Tile order (1-D grid of ceil(M/BM) * N/BN blocks): bands of `band` token tiles (a kernel
// argument, about 2048 list entries; the host picks it so that no group's last, partial tile is
// likely to open a band: see wgmma.rs); inside a band the token tile runs fastest, then the
// channel tile. The blocks in flight then cover one band of a few groups: list entry p of a group is about token
// p / (1 - sparsity) in every group (the active tokens are listed in ascending order), so the
// band's x rows stay in L2 across all groups, and each weight tile is read from DRAM about once
// a band.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer: it gathers the A rows (16-byte cp.async
// chunks, zero-filled past the active rows) and copies the weight tile(s) (cp.async, or TMA with
// TMA_B / CLUSTER 2), both into the
// 128-byte-swizzled K-major layout, and hands each stage to the consumers through an mbarrier.
// Warpgroups 1 and 2 (cw = 0, 1) compute the 64-row sub-tiles cw, cw + 2, ... of the tile with
// wgmma (m64n128k16; m64n256k16 over the adjacent gate and up tiles when fused), both operands
// read from shared memory, keep one wgmma group in flight, and release a stage through a second
// mbarrier when its group has completed.
// A consumer computes only its sub-tiles that hold active rows (a separate instantiation of
// its loop for each count, so no branch around a wgmma looks divergent to the compiler).
// Epilogue: once every wgmma of the block has completed, the consumers stage their results (the
// SwiGLU applied) in the free stage memory, and all 384 threads write the tile's rows out with
// 16-byte stores, a row's 256 contiguous bytes by 16 consecutive threads, zeros for the listed
// inactive tokens included (register-to-global stores of 4 bytes took ~14% of the consumers'
// time in an ncu source profile of up at M = 4096).

#ifndef FUSED
#define FUSED 0
#endif
#ifndef MI
#define MI 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef ASYNC_ARRIVE
#define ASYNC_ARRIVE 1
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#if CLUSTER != 1 && (CLUSTER != 2 || !ASYNC_ARRIVE)
#error "CLUSTER is 1, or 2 with ASYNC_ARRIVE"
#endif
#ifndef TMA_B
#define TMA_B 0
#endif
// PERSIST 1 (with MI 1, CLUSTER 1, TMA_B 1, ASYNC_ARRIVE 1): the entry gemm_mn_wgmma_persist,
// one block a multiprocessor taking tiles from a global counter (see there).
#ifndef PERSIST
#define PERSIST 0
#endif
#if PERSIST && (MI != 1 || CLUSTER != 1 || !TMA_B || !ASYNC_ARRIVE)
#error "PERSIST needs MI 1, CLUSTER 1, TMA_B 1 and ASYNC_ARRIVE 1"
#endif
// STREAMK 1 (with CLUSTER 1, TMA_B 1, ASYNC_ARRIVE 1, no PERSIST, no L2_HINT): the entry
// gemm_mn_wgmma_sk, one block a multiprocessor on a stream-K schedule (see there).
#ifndef STREAMK
#define STREAMK 0
#endif
#if STREAMK && (CLUSTER != 1 || !TMA_B || !ASYNC_ARRIVE || PERSIST)
#error "STREAMK needs CLUSTER 1, TMA_B 1, ASYNC_ARRIVE 1 and no PERSIST"
#endif
// L2_HINT 1: the gathered x rows are copied with an evict-last L2 policy (each row is read by
// about (1 - sparsity) * N / G tiles) and the outputs stored with evict-first (written once).
#ifndef L2_HINT
#define L2_HINT 0
#endif
#if L2_HINT && STREAMK
#error "STREAMK has no L2_HINT"
#endif
#if TMA_B && (CLUSTER != 1 || !ASYNC_ARRIVE)
#error "TMA_B needs CLUSTER 1 and ASYNC_ARRIVE"
#endif
#ifndef ROW_TMA
#define ROW_TMA 0
#endif
#if ROW_TMA && (!TMA_B || PERSIST || STREAMK)
#error "ROW_TMA needs TMA_B and the plain entry"
#endif
// TALL 1 (plain entry, MI 2, no FUSED, TMA_B, no L2_HINT): a group's last computing tile takes
// up to 64 list entries more than BM (a 320-token tile), so a group whose count passes a
// multiple of BM by at most 64 needs no tile of its own for those few rows. Such a tile runs the
// extra 64 rows as one more sub-tile split by columns: each consumer warpgroup multiplies them
// with its half of the weight tile (m64n64k16, 32 more accumulators a thread, 160 in all, which
// setmaxnreg makes room for). The tile after it (a zero tile) writes its zeros from the group's
// count on. At 50% of 4096 tokens every group keeps 2048 +- 32 tokens: the ~56 partial tiles of
// about 32 rows become the last tiles of their groups, 952 computing tiles become ~898 (7.2
// waves of 132 to 6.8); for Q (N = 4096) at 2048 tokens, 144 tiles become 128 (one wave).
#ifndef TALL
#define TALL 0
#endif
#if TALL && (MI != 2 || FUSED || !TMA_B || PERSIST || STREAMK || L2_HINT)
#error "TALL needs MI 2, no FUSED, TMA_B, the plain entry and no L2_HINT"
#endif
// FINE 1 (plain entry): groups narrower than the 128-channel tile. The host passes lists built
// from the 128-channel OR of the mask (a token is listed in a tile's group if it keeps any of
// the tile's fine groups) with G = 128, and the fine mask `fmask` [M, ngf] with its group size
// `fg` (8 | fg, fg | 128): the write-out stores zeros for a listed token's channels whose fine
// group it skips. The tile is computed whole for every listed token; only what is written
// differs.
#ifndef FINE
#define FINE 0
#endif
#if FINE && (PERSIST || STREAMK)
#error "FINE needs the plain entry"
#endif
// The weight tiles come by TMA (one producer thread, an expect_tx arrival on the stage barrier).
#define B_BY_TMA (CLUSTER == 2 || TMA_B)

#define BM (128 * MI)
#define BN 128
#define BK 64  // one 128-byte swizzle row of 2-byte elements
#define NB (FUSED ? 2 : 1)
// Rows of the x stage: a tall tile's 64 extra rows follow the BM rows of every stage.
#define BMA (TALL ? BM + 64 : BM)
#define A_BYTES (BMA * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + NB * B_BYTES)
#define THREADS 384
#define LAG (STAGES - 2)  // ASYNC_ARRIVE 0: stage kt is handed over after issuing stage kt + LAG
#if STAGES < 3
#error "STAGES must be at least 3"
#endif

#if L2_HINT
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
// 16-byte copy of `bytes` (16 or 0: zero fill) source bytes with an L2 policy.
__device__ __forceinline__ void cp_async16_hint(unsigned dst, const void* src, int bytes, unsigned long long pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src), "r"(bytes), "l"(pol) : "memory");
}
#endif
// 16-byte copy of `bytes` (16 or 0: zero fill) source bytes.
__device__ __forceinline__ void cp_async16_sz(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ float silu(float a) { return a / (1.0f + __expf(-a)); }
// True in every producer thread iff `p` holds in all 128 (named barrier 1, the producer
// warpgroup's own).
__device__ __forceinline__ bool producer_all(bool p) {
    unsigned r;
    asm volatile("{\n.reg .pred a, b;\nsetp.ne.u32 a, %1, 0;\nbar.red.and.pred b, 1, 128, a;\nselp.u32 %0, 1, 0, b;\n}" : "=r"(r) : "r"((unsigned)p) : "memory");
    return r != 0;
}
// The weight tile(s) of the stage at `sa` in two boxes of 64 rows each, by one thread, with the
// expect_tx arrival on the stage's barrier.
__device__ __forceinline__ void load_weights_tma(unsigned sa, unsigned fb, const TmaDesc* w, const TmaDesc* w2, int k0, int n0) {
    mbar_arrive_expect_tx(fb, NB * B_BYTES);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        tma_load_2d(sa + A_BYTES + h * (B_BYTES / 2), w, k0, n0 + 64 * h, fb);
        if (FUSED) tma_load_2d(sa + A_BYTES + B_BYTES + h * (B_BYTES / 2), w2, k0, n0 + 64 * h, fb);
    }
}

// A consumer warp's release of a stage: to its own block's producer and, with clusters, to the
// other block's (whose multicast also writes this block's stage).
__device__ __forceinline__ void release_stage(unsigned bar) {
    mbar_arrive(bar);
#if CLUSTER == 2
    mbar_arrive_remote(map_rank(bar, cluster_rank() ^ 1u));
#endif
}

#if FUSED
// D[64 x 256] (f32) += A[64 x 16] * B[16 x 256]: the fused op's gate and up weight tiles lie next
// to each other in shared memory (the same swizzled layout continued over 256 rows), so one
// instruction covers both and reads the A tile once instead of twice. Accumulator columns
// 0-127 (registers 0-63) are the gate tile's, 128-255 (64-127) the up tile's, each in the
// m64n128 register layout.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}"
        : WG_ACC64(0), WG_ACC64(64)
        : "l"(da), "l"(db), "r"(1));
}
#endif

// Row r0 + 16 i of the tile (chunk c a k step): its source (row 0 of x when inactive, a valid
// address that the zero-byte copy does not read) and its copy size (16 or 0 bytes: zero-filled),
// both fixed for the k loop, so each copy is one address add.
__device__ __forceinline__ void row_sources(const T* x, const int* pg, int m0, int nact, int K, int r0, int c, const T* (&asrc)[BMA / 16],
                                            int (&asz)[BMA / 16]) {
#pragma unroll
    for (int i = 0; i < BMA / 16; ++i) {
        const int r = r0 + 16 * i;
        const bool v = r < nact;
        asz[i] = v ? 16 : 0;
        asrc[i] = x + (v ? (long long)pg[m0 + r] * K : 0) + c * 8;
    }
}

// A consumer thread's accumulators of one 64-row sub-tile, NJ 8-column chunks of them from
// chunk `chunk0` of the tile (rows from `row0`; with SWIGLU, silu(gate) * up of registers e and
// 64 + e), into the staging area at `sbase`. Fragment: register 4j + e holds row 16 warp + lane /
// 4 (+8 for e >= 2), column 8 j + 2 (lane % 4) + (e % 2). Staged as [BM rows][BN columns] of T,
// 256 bytes a row, 16-byte chunk j of row r at chunk j ^ (r % 8): a warp's eight rows of one
// chunk then fall on 32 different banks.
template <int NJ, bool SWIGLU, int NA>
__device__ __forceinline__ void stage_frag(unsigned sbase, const float (&acc)[NA], int row0, int chunk0) {
    const int warp = (threadIdx.x & 127) >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + warp * 16 + (lane >> 2) + 8 * h;
        const unsigned srow = sbase + r * (BN * 2) + (lane & 3) * 4;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if constexpr (SWIGLU) {
                v0 = silu(v0) * acc[64 + 4 * j + 2 * h];
                v1 = silu(v1) * acc[64 + 4 * j + 2 * h + 1];
            }
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(srow + (((chunk0 + j) ^ (r & 7)) << 4)), "r"(pack2(v0, v1)) : "memory");
        }
    }
}
// A 64-row sub-tile's results (all BN columns; the SwiGLU applied when fused).
__device__ __forceinline__ void stage_subtile(unsigned sbase, const float (&acc)[NB * 64], int row0) { stage_frag<16, FUSED>(sbase, acc, row0, 0); }

// A tile's rows [rbeg, rend) out (BM rows but for a tall tile's last rows and the zero tile after
// it), 16 bytes a thread (threads `first`, `first + stride`, ...), a row's 256 bytes by 16
// consecutive threads: the results staged at `sbase` for the active rows (r < nact), zeros for
// the inactive tokens listed after them; rows[r] < 0 (past M) are skipped. With FINE, an
// active row's 16-byte chunk is zero where its token skips the chunk's fine group of fg
// channels (bit (c * 8) / fg of fbits[r], the row's bits of the tile's fine groups).
__device__ __forceinline__ void write_rows(T* out, const int* rows, int nact, unsigned sbase, int N, int n0, int first, int stride, int rbeg = 0,
                                           int rend = BM, const unsigned short* fbits = nullptr, int fg = 0) {
#if L2_HINT
    const unsigned long long opol = l2_policy_evict_first();
#endif
    for (int i = rbeg * (BN / 8) + first; i < rend * (BN / 8); i += stride) {
        const int r = i / (BN / 8), c = i % (BN / 8);
        const int tok = rows[r];
        if (tok < 0) continue;
        uint4 v = make_uint4(0, 0, 0, 0);
#if FINE
        const bool keep = r < nact && ((fbits[r] >> ((c * 8) / fg)) & 1u);
#else
        const bool keep = r < nact;
#endif
        if (keep)
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(sbase + r * (BN * 2) + ((c ^ (r & 7)) << 4)));
#if L2_HINT
        asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(out + (long long)tok * N + n0 + c * 8),
                     "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(opol)
                     : "memory");
#else
        *reinterpret_cast<uint4*>(out + (long long)tok * N + n0 + c * 8) = v;
#endif
    }
}

// The two block barriers around the staging of a computing block's results (the consumers
// write the stage memory between them); the producer and a consumer without active rows pass
// them too.
__device__ __forceinline__ void stage_barriers() {
    __syncthreads();
    __syncthreads();
}

// A tall tile's extra sub-tile (rows BM to BM + 63, this warpgroup's 64 columns from `col0`).
__device__ __forceinline__ void stage_extra(unsigned sbase, const float (&acc)[32], int col0) { stage_frag<8, false>(sbase, acc, BM, col0 / 8); }

// One consumer warpgroup's k loop over its first NS sub-tiles (rows (cw + 2 i) * 64, i < NS) and,
// with X (a tall tile), the extra rows BM to BM + 63 times its half cw of the weight tile's
// columns, then its results (with the SwiGLU applied) into the staging area at `base`, between
// the two block barriers every thread of a computing block passes (see `stage_barriers`).
template <int NS, bool X = false>
__device__ __forceinline__ void consume(unsigned base, const unsigned long long* full_bar, const unsigned long long* empty_bar, int cw, int KT) {
    const int lane = threadIdx.x & 31;
    // Sub-tile i's accumulators: the gate (or only) tile in 0-63, the up tile in 64-127.
    float acc[NS][NB * 64];
    float accx[X ? 32 : 1];
#pragma unroll
    for (int i = 0; i < NS; ++i)
#pragma unroll
        for (int e = 0; e < NB * 64; ++e) acc[i][e] = 0.f;
#pragma unroll
    for (int e = 0; e < (X ? 32 : 1); ++e) accx[e] = 0.f;
    int s = 0, prev = STAGES - 1;
    unsigned ph = 0;
    for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(smem_u32(&full_bar[s]), ph);
#if ASYNC_ARRIVE
        fence_proxy_async();
#endif
        const unsigned sa = base + s * STAGE_BYTES + cw * 64 * 128;
        const unsigned sb = base + s * STAGE_BYTES + A_BYTES;
#pragma unroll
        for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
        if constexpr (X) fence_acc(accx);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // k advances 16 elements = 32 bytes inside the swizzle row.
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const unsigned long long da = sw128_desc(sa + i * 128 * 128 + kk * 32);
#if FUSED
                wgmma_m64n256k16(acc[i], da, sw128_desc(sb + kk * 32));
#else
                wgmma_m64n128k16(acc[i], da, sw128_desc(sb + kk * 32));
#endif
            }
            // The extra rows (after the BM rows of the stage) times weight rows 64 cw to 64 cw + 63
            // (8 KiB into the tile: the swizzle pattern repeats every 1 KiB).
            if constexpr (X) wgmma_m64n64k16(accx, sw128_desc(base + s * STAGE_BYTES + BM * 128 + kk * 32), sw128_desc(sb + cw * 64 * 128 + kk * 32));
        }
        wg_commit();
#pragma unroll
        for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
        if constexpr (X) fence_acc(accx);
        wg_wait<1>();  // the group of stage kt - 1 has completed
#pragma unroll
        for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
        if constexpr (X) fence_acc(accx);
        __syncwarp();
        if (kt > 0 && lane == 0) release_stage(smem_u32(&empty_bar[prev]));
        prev = s;
        if (++s == STAGES) {
            s = 0;
            ph ^= 1u;
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
    if constexpr (X) fence_acc(accx);
    // Every wgmma of both consumers has read its operands once all 384 threads pass this
    // barrier (the producer's copies completed before the last stage was consumed), so the
    // stage memory is free for the staged results.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NS; ++i) stage_subtile(base, acc[i], (cw + 2 * i) * 64);
    if constexpr (X) stage_extra(base, accx, cw * 64);
    __syncthreads();
}

// Units of CLUSTER consecutive token tiles (one cluster) in banded order (the tile order above):
// block b's unit mu and N-tile nt; `band_tiles` token tiles a band (a multiple of CLUSTER).
__device__ __forceinline__ void tile_banded(int b, int M, int N, int band_tiles, int& mu, int& nt) {
    const int MU = ((M + BM - 1) / BM + CLUSTER - 1) / CLUSTER;
    const int BU = band_tiles / CLUSTER;
    const int per_band = BU * (N / BN);
    const int unit = b / CLUSTER;
    const int band = unit / per_band, idx = unit % per_band;
    const int bm = min(BU, MU - band * BU);  // units in this band
    mu = band * BU + idx % bm;
    nt = idx / bm;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
#if CLUSTER == 2
__cluster_dims__(2, 1, 1)
#endif
gemm_mn_wgmma(const T* __restrict__ x, const T* __restrict__ w,
                                                                      const T* __restrict__ w2, const int* __restrict__ perm,
                                                                      const int* __restrict__ count, T* __restrict__ out,
                                                                      int M, int N, int K, int G,
                                                                      // CLUSTER 2 or TMA_B: maps of w and w2, boxes of 64 k x 64 rows
                                                                      const __grid_constant__ TmaDesc tmap_w,
                                                                      const __grid_constant__ TmaDesc tmap_w2,
                                                                      // ROW_TMA: the map of x, boxes of 64 k x 64 rows
                                                                      const __grid_constant__ TmaDesc tmap_x,
                                                                      int band,  // token tiles a band of the tile order
                                                                      // FINE: the fine mask [M, ngf] of groups of fg
                                                                      // channels (else unused)
                                                                      const unsigned char* __restrict__ fmask, int fg, int ngf) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ int rows[BMA];
#if FINE
    __shared__ unsigned short fbits[BMA];
#endif
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
    // Stages start 1024-aligned (the swizzle pattern is defined on absolute address bits); the
    // launch asks for 1024 bytes of slack.
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    // Units of CLUSTER consecutive token tiles (one cluster) in banded order; block `rank` of the
    // unit takes its rank-th token tile.
    int mt, nt, mu;
    const int rank = CLUSTER == 1 ? 0 : (int)cluster_rank();
    tile_banded(blockIdx.x, M, N, band, mu, nt);
    mt = mu * CLUSTER + rank;
    const int m0 = mt * BM;
    const int n0 = nt * BN;
    const int g = n0 / G;
    const int* pg = perm + (long long)g * M;
    // Block-uniform values broadcast from lane 0, so that the compiler sees the branches around
    // the wgmma instructions as warp-uniform (in a path it thinks divergent, ptxas serialises
    // every wgmma: warning C7518).
    const int cnt = __shfl_sync(0xffffffffu, count[g], 0);
#if TALL
    // The group's computing tiles: the last one takes up to 64 rows past BM. This tile computes
    // nact rows (up to BMA) and writes rows [rbeg, rend): a zero tile after a tall one starts at
    // the count.
    const int ntc = cnt > 0 ? max(1, (cnt + BM - 65) / BM) : 0;
    const int nact = mt < ntc - 1 ? BM : (mt == ntc - 1 ? cnt - m0 : 0);
    const bool tall = nact > BM;
    const int rbeg = mt >= ntc ? max(0, cnt - m0) : 0;
    const int rend = max(nact, BM);
    const bool run = nact > 0;
#else
    const int nact = min(BM, cnt - m0);
    const int rbeg = 0, rend = BM;
    // The blocks of a cluster run the k loop together (each loads half of the shared weight
    // tiles) if any of them has an active row; a block without one computes nothing.
    const bool run = cnt - mu * CLUSTER * BM > 0;
#endif
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 128 + B_BY_TMA);  // every producer thread (+ the expect_tx)
            mbar_init(smem_u32(&empty_bar[s]), 8 * CLUSTER);          // every consumer warp of the cluster
        }
        // The initialised barriers visible to the async proxy (the tensor copies complete on
        // them, the first ones right after the barrier below) and, with clusters, to the other
        // block.
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if CLUSTER == 2
    cluster_sync();
#endif
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    // The tile's token rows, for the write-out only: filled by the consumer threads (idle until
    // the first stage arrives; BM <= 256), read after the stage barriers (or the barrier of a
    // block that computes nothing). The producer reads its own rows from global memory, so its
    // first copies wait for nothing but those loads.
#if FINE
    // With them, each row's bits of the tile's BN / fg fine groups (bit j: group n0 / fg + j), so
    // that the write-out waits for no global load.
    for (int i = tid - 128; i >= 0 && i < rend; i += THREADS - 128) {
        const int tok = (m0 + i < M) ? pg[m0 + i] : -1;
        rows[i] = tok;
        unsigned b = 0;
        if (tok >= 0) {
            const unsigned char* f = fmask + (long long)tok * ngf + n0 / fg;
            const int per = BN / fg;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
                if (j < per && f[j] != 0) b |= 1u << j;
        }
        fbits[i] = (unsigned short)b;
    }
#else
    for (int i = tid - 128; i >= 0 && i < rend; i += THREADS - 128) rows[i] = (m0 + i < M) ? pg[m0 + i] : -1;
#endif
    if (run) {
        const int KT = K / BK;
        if (wg == 0) {
#if TALL
            // Registers to the consumers (a tall tile's hold 160 accumulators a thread):
            // 384 threads launch with 168 each; 104 + 2 x 200 = 504 = 3 x 168 (no spills at 104).
            asm volatile("setmaxnreg.dec.sync.aligned.u32 104;" ::: "memory");
#endif
            // Producer: thread t copies chunk c = t % 8 of rows t / 8 + 16 i.
            const int c = tid & 7, r0 = tid >> 3;
#if TMA_B
            // The weight tiles of the first stages depend on nothing: requested before the x
            // rows' addresses are known.
            if (tid == 0)
                for (int kt = 0; kt < min(STAGES, KT); ++kt) load_weights_tma(base + kt * STAGE_BYTES, smem_u32(&full_bar[kt]), &tmap_w, &tmap_w2, kt * BK, n0);
#endif
            const T* asrc[BMA / 16];
            int asz[BMA / 16];
            row_sources(x, pg, m0, nact, K, r0, c, asrc, asz);
#if ROW_TMA
#if TALL
            const int nrows = tall ? BMA : BM;  // x rows a stage
#else
            const int nrows = BM;
#endif
            // Consecutive tokens from the tile's first listed one (rows past the active ones
            // then load tokens this group skips, or zeros past M: computed, never written).
            const int row0 = pg[m0];
            bool seq = true;
#pragma unroll
            for (int i = 0; i < BMA / 16; ++i) {
                const int r = r0 + 16 * i;
                if (r < nact) seq &= pg[m0 + r] == row0 + r;
            }
            const bool rowtma = producer_all(seq);
#endif
#if !B_BY_TMA
            const T* bsrc = w + (long long)(n0 + r0) * K + c * 8;
            const T* bsrc2 = w2 + (long long)(n0 + r0) * K + c * 8;
#endif
#if L2_HINT
            const unsigned long long xpol = l2_policy_evict_last();
#endif
            int s = 0;
            unsigned ph = 0;  // (kt / STAGES) & 1
            for (int kt = 0; kt < KT; ++kt) {
                if (kt >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ph ^ 1u);
                const unsigned sa = base + s * STAGE_BYTES;
                const int k0 = kt * BK;
#if ROW_TMA
                if (rowtma) {
                    if (tid == 0) {
                        const unsigned fb = smem_u32(&full_bar[s]);
                        mbar_expect_tx(fb, nrows * BK * 2);  // before this thread's arrival below
                        for (int h = 0; h < nrows / 64; ++h) tma_load_2d(sa + h * 64 * 128, &tmap_x, k0, row0 + 64 * h, fb);
                    }
                } else
#endif
                {
#pragma unroll
                    for (int i = 0; i < BM / 16; ++i) {
#if L2_HINT
                        cp_async16_hint(sa + sw128_off(r0 + 16 * i, c), asrc[i] + k0, asz[i], xpol);
#else
                        cp_async16_sz(sa + sw128_off(r0 + 16 * i, c), asrc[i] + k0, asz[i]);
#endif
                    }
#if TALL
                    if (tall) {
#pragma unroll
                        for (int i = BM / 16; i < BMA / 16; ++i) cp_async16_sz(sa + sw128_off(r0 + 16 * i, c), asrc[i] + k0, asz[i]);
                    }
#endif
                }
#if CLUSTER == 2
                // Rows [64 rank, 64 rank + 64) of each weight tile, to both blocks.
                if (tid == 0) {
                    const unsigned fb = smem_u32(&full_bar[s]);
                    mbar_arrive_expect_tx(fb, NB * B_BYTES);
                    tma_load_multicast(sa + A_BYTES + rank * (B_BYTES / 2), &tmap_w, k0, n0 + 64 * rank, fb);
                    if (FUSED) tma_load_multicast(sa + A_BYTES + B_BYTES + rank * (B_BYTES / 2), &tmap_w2, k0, n0 + 64 * rank, fb);
                }
#elif TMA_B
                if (tid == 0 && kt >= STAGES) load_weights_tma(sa, smem_u32(&full_bar[s]), &tmap_w, &tmap_w2, k0, n0);
#else
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const unsigned off = sw128_off(r0 + 16 * i, c);
                    cp_async16(sa + A_BYTES + off, bsrc + (long long)16 * i * K + k0, true);
                    if (FUSED) cp_async16(sa + A_BYTES + B_BYTES + off, bsrc2 + (long long)16 * i * K + k0, true);
                }
#endif
#if ASYNC_ARRIVE
#if ROW_TMA
                if (rowtma)
                    mbar_arrive(smem_u32(&full_bar[s]));
                else
#endif
                    cp_async_arrive(smem_u32(&full_bar[s]));
#else
                cp_commit();
                if (kt >= LAG) {
                    cp_wait<LAG>();
                    fence_proxy_async();
                    const int done = s >= LAG ? s - LAG : s + STAGES - LAG;  // (kt - LAG) % STAGES
                    mbar_arrive(smem_u32(&full_bar[done]));
                }
#endif
                if (++s == STAGES) {
                    s = 0;
                    ph ^= 1u;
                }
            }
#if ASYNC_ARRIVE
            cp_wait<0>();
#else
            cp_wait<0>();
            fence_proxy_async();
            for (int j = max(KT - LAG, 0); j < KT; ++j) mbar_arrive(smem_u32(&full_bar[j % STAGES]));
#endif
            stage_barriers();
        } else {
#if TALL
            asm volatile("setmaxnreg.inc.sync.aligned.u32 200;" ::: "memory");
#endif
            const int cw = wg - 1;
            const int lane = tid & 31;
            // Sub-tiles of this warpgroup that hold active rows.
            int ns = 0;
#pragma unroll
            for (int i = 0; i < MI; ++i) ns += (cw + 2 * i) * 64 < nact;
            if (ns == 0) {
                // No active row: only pass the stages along.
                int s = 0;
                unsigned ph = 0;
                for (int kt = 0; kt < KT; ++kt) {
                    mbar_wait(smem_u32(&full_bar[s]), ph);
                    __syncwarp();
                    if (lane == 0) release_stage(smem_u32(&empty_bar[s]));
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1u;
                    }
                }
                stage_barriers();
            }
#if TALL
            else if (tall) {
                consume<2, true>(base, full_bar, empty_bar, cw, KT);
            }
#endif
#if MI >= 2
            else if (ns == 2) {
                consume<2>(base, full_bar, empty_bar, cw, KT);
            }
#endif
            else {
                consume<1>(base, full_bar, empty_bar, cw, KT);
            }
        }
    }
    if (!run) __syncthreads();  // the rows filled above
    // All rows when the tile has no active one (nothing was staged then).
#if FINE
    write_rows(out, rows, nact, base, N, n0, tid, THREADS, rbeg, rend, fbits, fg);
#else
    write_rows(out, rows, nact, base, N, n0, tid, THREADS, rbeg, rend);
#endif
#if CLUSTER == 2
    // The other block may still arrive on this block's barriers: leave together.
    cluster_sync();
#endif
}

#if PERSIST || STREAMK
__device__ __forceinline__ void producer_bar() { asm volatile("bar.sync 1, 128;" ::: "memory"); }
__device__ __forceinline__ void consumer_bar() { asm volatile("bar.sync 2, 256;" ::: "memory"); }
// The stage ring's position (stage s, its phase parity ph), run on across tiles; `it` counts the
// stages used so far (the producer waits for a release from the second round on).
__device__ __forceinline__ void ring_next(int& s, unsigned& ph, int& it) {
    ++it;
    if (++s == STAGES) {
        s = 0;
        ph ^= 1u;
    }
}
#endif

#if PERSIST
// Persistent variant: the grid has one block a multiprocessor (at most one a tile); block b takes
// tile b of the banded order first, then the next untaken tile from `sched[0]` (atomicAdd), so a
// block that drew tiles without active rows takes more. The stage ring runs on across tiles:
// while the consumers write one tile out, the producer already fills the next tile's stages.
// Tile hand-over: the producer writes the tile's number, its active row count and its token rows
// into one of two descriptor slots and arrives on the slot's barrier; the consumers release the
// slot after the tile's write-out. After a computing tile's k loop the producer hands over one
// more stage without loading it: the consumers stage the tile's results there (the same swizzled
// layout as the plain kernel) and write them out from it, then release it like any stage.
// The last block to finish resets `sched` to zeros for the next launch on the stream (launches
// sharing `sched` must not overlap).


// One consumer warpgroup's k loop over a tile (its 64-row sub-tile cw), its last stage released,
// then its results (the SwiGLU applied) staged in the hand-over stage that follows. Returns the
// staging stage's index.
__device__ __forceinline__ int consume_tile(unsigned base, unsigned long long* full_bar, unsigned long long* empty_bar, int cw, int KT, int& s,
                                            unsigned& ph, int& it) {
    const int lane = threadIdx.x & 31;
    float acc[NB * 64];
#pragma unroll
    for (int e = 0; e < NB * 64; ++e) acc[e] = 0.f;
    int prev = 0;
    for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(smem_u32(&full_bar[s]), ph);
        fence_proxy_async();
        const unsigned sa = base + s * STAGE_BYTES + cw * 64 * 128;
        const unsigned sb = base + s * STAGE_BYTES + A_BYTES;
        fence_acc(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
#if FUSED
            wgmma_m64n256k16(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32));
#else
            wgmma_m64n128k16(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32));
#endif
        }
        wg_commit();
        fence_acc(acc);
        wg_wait<1>();
        fence_acc(acc);
        __syncwarp();
        if (kt > 0 && lane == 0) mbar_arrive(smem_u32(&empty_bar[prev]));
        prev = s;
        ring_next(s, ph, it);
    }
    wg_wait<0>();
    fence_acc(acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty_bar[prev]));
    // The hand-over stage: free memory once the producer has passed it on.
    const int st = s;
    mbar_wait(smem_u32(&full_bar[s]), ph);
    ring_next(s, ph, it);
    const unsigned sbase = base + st * STAGE_BYTES;
    stage_subtile(sbase, acc, cw * 64);
    return st;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_mn_wgmma_persist(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ w2, const int* __restrict__ perm,
                      const int* __restrict__ count, T* __restrict__ out, int M, int N, int K, int G,
                      const __grid_constant__ TmaDesc tmap_w, const __grid_constant__ TmaDesc tmap_w2,
                      const __grid_constant__ TmaDesc tmap_x,  // unused (the plain entry's ROW_TMA map)
                      // [2], zeros at launch: tiles taken after the first wave, blocks finished
                      int* __restrict__ sched, int tiles, int band) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ int rows[2][BM];
    __shared__ int tile_id[2], tile_nact[2];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES], tile_full[2], tile_empty[2];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 129);  // every producer thread + the expect_tx
            mbar_init(smem_u32(&empty_bar[s]), 8);   // every consumer warp
        }
        for (int i = 0; i < 2; ++i) {
            mbar_init(smem_u32(&tile_full[i]), 128);
            mbar_init(smem_u32(&tile_empty[i]), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int KT = K / BK;
    int s = 0, it = 0;
    unsigned ph = 0;
    if (wg == 0) {
        const int c = tid & 7, r0 = tid >> 3;
        for (int j = 0;; ++j) {
            const int slot = j & 1;
            if (j >= 2) mbar_wait(smem_u32(&tile_empty[slot]), ((j >> 1) & 1) ^ 1u);
            if (tid == 0) tile_id[slot] = j == 0 ? (int)blockIdx.x : atomicAdd(&sched[0], 1) + (int)gridDim.x;
            producer_bar();
            const int t = tile_id[slot];
            if (t >= tiles) {
                mbar_arrive(smem_u32(&tile_full[slot]));
                break;
            }
            int mt, nt;
            tile_banded(t, M, N, band, mt, nt);
            const int m0 = mt * BM, n0 = nt * BN;
            const int* pg = perm + (long long)(n0 / G) * M;
            const int nact = min(BM, count[n0 / G] - m0);
            if (c == 0)
#pragma unroll
                for (int i = 0; i < BM / 16; ++i) {
                    const int r = r0 + 16 * i;
                    rows[slot][r] = m0 + r < M ? pg[m0 + r] : -1;
                }
            if (tid == 0) tile_nact[slot] = nact;
            mbar_arrive(smem_u32(&tile_full[slot]));
            if (nact <= 0) continue;
            const T* asrc[BM / 16];
            int asz[BM / 16];
            row_sources(x, pg, m0, nact, K, r0, c, asrc, asz);
            for (int kt = 0; kt < KT; ++kt) {
                if (it >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ph ^ 1u);
                const unsigned sa = base + s * STAGE_BYTES;
                const int k0 = kt * BK;
                if (tid == 0) load_weights_tma(sa, smem_u32(&full_bar[s]), &tmap_w, &tmap_w2, k0, n0);
#pragma unroll
                for (int i = 0; i < BM / 16; ++i) cp_async16_sz(sa + sw128_off(r0 + 16 * i, c), asrc[i] + k0, asz[i]);
                cp_async_arrive(smem_u32(&full_bar[s]));
                ring_next(s, ph, it);
            }
            // The hand-over stage for the write-out: no copies, every arrival at once.
            if (it >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ph ^ 1u);
            mbar_arrive(smem_u32(&full_bar[s]));
            if (tid == 0) mbar_arrive(smem_u32(&full_bar[s]));
            ring_next(s, ph, it);
        }
        cp_wait<0>();
        if (tid == 0) {
            __threadfence();
            if (atomicAdd(&sched[1], 1) == (int)gridDim.x - 1) {
                atomicExch(&sched[0], 0);
                atomicExch(&sched[1], 0);
            }
        }
    } else {
        const int cw = wg - 1, ct = tid - 128, lane = tid & 31;
        for (int j = 0;; ++j) {
            const int slot = j & 1;
            mbar_wait(smem_u32(&tile_full[slot]), (j >> 1) & 1);
            // Block-uniform (broadcast) so that the branches around wgmma look uniform.
            const int t = __shfl_sync(0xffffffffu, tile_id[slot], 0);
            if (t >= tiles) break;
            const int nact = __shfl_sync(0xffffffffu, tile_nact[slot], 0);
            int mt, nt;
            tile_banded(t, M, N, band, mt, nt);
            const int n0 = nt * BN;
            int st = -1;
            if (nact > 0) {
                if (cw * 64 < nact) {
                    st = consume_tile(base, full_bar, empty_bar, cw, KT, s, ph, it);
                } else {
                    // No active row in this sub-tile: pass the stages along.
                    for (int kt = 0; kt < KT; ++kt) {
                        mbar_wait(smem_u32(&full_bar[s]), ph);
                        __syncwarp();
                        if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s]));
                        ring_next(s, ph, it);
                    }
                    st = s;
                    mbar_wait(smem_u32(&full_bar[s]), ph);
                    ring_next(s, ph, it);
                }
                consumer_bar();  // both sub-tiles staged
            }
            write_rows(out, rows[slot], nact, base + (st < 0 ? 0 : st) * STAGE_BYTES, N, n0, ct, 256);
            // Release the staging stage (the producer refills it with TMA: order these generic
            // reads before its async-proxy writes) and the descriptor slot.
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) {
                if (st >= 0) mbar_arrive(smem_u32(&empty_bar[st]));
                mbar_arrive(smem_u32(&tile_empty[slot]));
            }
        }
    }
}
#endif

#if STREAMK
// Stream-K entry: the grid has one block a multiprocessor (P blocks) and ends them together.
// The grid's tail is what random masks cost the plain grid: at 50% about half the groups have
// a partial last tile, so up at 4096 tokens has ~952 computing 256-token tiles, 7.2 waves of
// 132, run as 8 (NOTES v20, v21). Here the C computing tiles (banded order, zero-only tiles left
// out) are dealt as:
// - whole tiles: the first (C / P - 1) * P (none when C < 2P), block b taking b, b + P, ...,
//   so the blocks in flight cover P consecutive tiles of the order (its L2 reuse stays);
// - the rest (P to 2P - 1 tiles, or all C when C < 2P): their k steps, tile after tile, split
//   into P equal ranges, one a block; a range cuts tiles at any k step. A segment that is not
//   its tile's whole k loop adds its f32 sums into the tile's slot (red.global.add), then its k
//   steps into the tile's flag; the segment that brings the flag to the tile's k steps is its
//   last: it reads the slot (every segment's sums, its own included), applies the epilogue,
//   writes the tile and leaves slot and flag zeroed for the next launch. No block waits for
//   another (each segment adds and goes on), so no order of the blocks can deadlock.
// - the zero-only tiles (listed inactive tokens past a group's computing tiles): block b takes
//   tiles b, b + P, ... of all ceil(M / BM) * N / BN, and its consumer threads write their
//   zeros, one 16-byte store a thread a k step between their wgmma issue and wait (the token
//   rows loaded a step ahead), the rest after its last item: the writes overlap the product
//   instead of taking blocks of their own.
// Every block derives the same schedule at its start from the counts: per (band, N-tile) cell
// of the banded order its computing tiles, and their exclusive prefix (a block-wide scan; the
// dynamic shared memory holds it after the stages). A computing tile's place in the order is a
// binary search in it. Inside an item the block works as the plain kernel's (the stage ring
// runs on across items; the epilogue stages the results in the stage memory between block
// barriers; the consumers fill the tile's token rows before their k loop).

// Largest cell e < cells with pre[e] <= ci (a cell with computing tiles, since pre[cells] > ci).
__device__ __forceinline__ int find_cell(const int* pre, int cells, int ci) {
    int lo = 0, hi = cells;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (pre[mid] <= ci)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

struct SkGrid {
    int MT, NT, BU, cells;  // token tiles, N-tiles, token tiles a band, bands x N-tiles
    int C, dp, KT;          // computing tiles, whole tiles a block, k steps a tile
    long long lo, mid, hi;  // this block's range of the split tiles' k steps, run as [lo, mid)
                            // before its whole tiles and [mid, hi) after them
    int nhead;              // items of [lo, mid)
};
struct SkItem {
    int m0, n0, nact, kt0, kn, slot;  // slot: the split tile's index, -1 for a whole tile
};

// A measurement stamp: thread 0 or 128 (the first producer or consumer thread) stores the
// multiprocessor's clock at tr[i], with no branch (the other threads pass the same pointer).
__device__ __forceinline__ void stamp(unsigned long long* tr, int i) {
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %0, 0;\n@p st.global.u64 [%1], %2;\n}" ::"r"(threadIdx.x & 127), "l"(tr + i), "l"(clock64()) : "memory");
}

// Items of the k-step range [a, b) of the split tiles: one a tile it touches.
__device__ __forceinline__ int sk_segments(long long a, long long b, int KT) { return a < b ? (int)((b - 1) / KT - a / KT + 1) : 0; }
// Segment idx of [a, b): its tile j, first k step and k steps.
__device__ __forceinline__ void sk_segment(long long a, long long b, int KT, int idx, int& j, int& kt0, int& kn) {
    const long long start = idx == 0 ? a : (a / KT + idx) * KT;
    j = (int)(start / KT);
    const long long end = min(b, (long long)(j + 1) * KT);
    kt0 = (int)(start - (long long)j * KT);
    kn = (int)(end - start);
}

// Item n of this block; false past its last.
__device__ __forceinline__ bool sk_item(const SkGrid& gr, const int* pre, const int* cnt, int n, SkItem& it) {
    int ci;
    if (n >= gr.nhead && n < gr.nhead + gr.dp) {
        ci = (int)blockIdx.x + (n - gr.nhead) * (int)gridDim.x;
        if (ci >= gr.C) return false;
        it.kt0 = 0;
        it.kn = gr.KT;
        it.slot = -1;
    } else {
        int j;
        if (n < gr.nhead) {
            sk_segment(gr.lo, gr.mid, gr.KT, n, j, it.kt0, it.kn);
        } else {
            const int idx = n - gr.nhead - gr.dp;
            if (idx >= sk_segments(gr.mid, gr.hi, gr.KT)) return false;
            sk_segment(gr.mid, gr.hi, gr.KT, idx, j, it.kt0, it.kn);
        }
        it.slot = it.kn == gr.KT ? -1 : j;
        ci = gr.dp * (int)gridDim.x + j;
    }
    const int e = find_cell(pre, gr.cells, ci);
    const int band = e / gr.NT, nt = e % gr.NT;
    const int mt = band * gr.BU + (ci - pre[e]);
    it.m0 = mt * BM;
    it.n0 = nt * BN;
    it.nact = min(BM, cnt[nt] - it.m0);
    return true;
}

// The zero-only tiles, written by the consumer threads between their wgmma issue and wait:
// tile t (N-tile t / MT, token tile t % MT) of the block's t = b, b + P, ...; round i of
// BM / 16 a tile writes row (thread / 16) + 16 i, 16-byte chunk thread % 16 (consumer thread
// 0-255); `tok` is that row's token (-1 past M), loaded one k step ahead. (In the producer,
// such a load waited behind the stage's 16 gathered copies, and each k step waited for it: up
// at 16384 tokens 2.08 against 1.58 ms, each producer k step twice as long in clock stamps.
// Here the consumers' proxy fence after each stage wait waits for them instead: up at 16384
// tokens 1.90-1.92 ms, against 1.70-1.73 with `mode` bit 0, all zeros after the last item;
// NOTES v22.)
#define ZROWS 16
struct ZeroCursor {
    int t, i, tok;
};
__device__ __forceinline__ void zero_seek(ZeroCursor& z, const SkGrid& gr, const int* cnt) {
    const int T = gr.MT * gr.NT;
    while (z.t < T && (z.t % gr.MT) * BM < cnt[z.t / gr.MT]) z.t += gridDim.x;
}
__device__ __forceinline__ int zero_token(int t, int i, const SkGrid& gr, const int* perm, int M, int G) {
    const int nt = t / gr.MT, m = (t % gr.MT) * BM + ((threadIdx.x & 255) >> 4) + ZROWS * i;
    return m < M ? perm[(long long)(nt * BN / G) * M + m] : -1;
}
// A 16-byte zero store where tok >= 0, with no branch (it sits beside wgmma code).
__device__ __forceinline__ void zero_store(int t, int tok, const SkGrid& gr, T* out, int N) {
    T* p = out + (long long)max(tok, 0) * N + (t / gr.MT) * BN + (threadIdx.x & 15) * 8;
    asm volatile("{\n.reg .pred p;\nsetp.ge.s32 p, %0, 0;\n@p st.global.v4.u32 [%1], {%2, %2, %2, %2};\n}" ::"r"(tok), "l"(p), "r"(0) : "memory");
}
__device__ __forceinline__ void zero_start(ZeroCursor& z, const SkGrid& gr, const int* cnt, const int* perm, int M, int G) {
    z.t = blockIdx.x;
    z.i = 0;
    zero_seek(z, gr, cnt);
    z.tok = z.t < gr.MT * gr.NT ? zero_token(z.t, 0, gr, perm, M, G) : -1;
}
// One round (a k step's share): the loaded row's zeros, then the next row's token.
__device__ __forceinline__ void zero_step(ZeroCursor& z, const SkGrid& gr, const int* cnt, const int* perm, T* out, int M, int N, int G) {
    if (z.t >= gr.MT * gr.NT) return;
    zero_store(z.t, z.tok, gr, out, N);
    if (++z.i == BM / ZROWS) {
        z.i = 0;
        z.t += gridDim.x;
        zero_seek(z, gr, cnt);
    }
    if (z.t < gr.MT * gr.NT) z.tok = zero_token(z.t, z.i, gr, perm, M, G);
}
// What is left after the block's last item: the loaded round, then eight rounds at a time
// with their loads issued together.
__device__ __forceinline__ void zero_rest(ZeroCursor& z, const SkGrid& gr, const int* cnt, const int* perm, T* out, int M, int N, int G) {
    const int T = gr.MT * gr.NT;
    if (z.t >= T) return;
    zero_store(z.t, z.tok, gr, out, N);
    int i = z.i + 1;
    while (z.t < T) {
        if (i >= BM / ZROWS) {
            i = 0;
            z.t += gridDim.x;
            zero_seek(z, gr, cnt);
            if (z.t >= T) break;
        }
        int tok[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) tok[u] = i + u < BM / ZROWS ? zero_token(z.t, i + u, gr, perm, M, G) : -1;
#pragma unroll
        for (int u = 0; u < 8; ++u) zero_store(z.t, tok[u], gr, out, N);
        i += 8;
    }
}

// A split segment's sums into its tile's slot (layout by consumer thread: float4 v of sub-tile
// q = cw + 2 i at (q * NB * 16 + v) * 128 + thread, so a warp's reductions are 512 contiguous
// bytes), or, in the last segment, the slot's sums (every segment's) back into acc, the slot
// zeroed behind them.
template <int NS, int NA>
__device__ __forceinline__ void slot_add(float* slot, const float (&acc)[NA][NB * 64], int cw) {
    const int lt = threadIdx.x & 127;
#pragma unroll
    for (int i = 0; i < NS; ++i)
#pragma unroll
        for (int v = 0; v < NB * 16; ++v) {
            float* p = slot + ((long long)((cw + 2 * i) * NB * 16 + v) * 128 + lt) * 4;
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(acc[i][4 * v]), "f"(acc[i][4 * v + 1]), "f"(acc[i][4 * v + 2]),
                         "f"(acc[i][4 * v + 3])
                         : "memory");
        }
}
template <int NS, int NA>
__device__ __forceinline__ void slot_take(float* slot, float (&acc)[NA][NB * 64], int cw) {
    const int lt = threadIdx.x & 127;
#pragma unroll
    for (int i = 0; i < NS; ++i)
#pragma unroll
        for (int v = 0; v < NB * 16; ++v) {
            float4* p = reinterpret_cast<float4*>(slot + ((long long)((cw + 2 * i) * NB * 16 + v) * 128 + lt) * 4);
            const float4 a = __ldcg(p);
            acc[i][4 * v] = a.x;
            acc[i][4 * v + 1] = a.y;
            acc[i][4 * v + 2] = a.z;
            acc[i][4 * v + 3] = a.w;
            __stcg(p, make_float4(0.f, 0.f, 0.f, 0.f));
        }
}

// One consumer warpgroup's item: the k loop over its first NS sub-tiles (NS = 0: it passes the
// stages along), every stage released; a split segment's sums into the slot and its k steps
// into the flag (the last segment learns it is the last); then, where the tile is written, the
// results staged and the tile's rows written out with the other threads. The block barriers
// (one, or three when the tile is written) match the producer's.
template <int NS>
__device__ __forceinline__ void sk_consume(unsigned base, unsigned long long* full_bar, unsigned long long* empty_bar, int cw, const SkItem& it,
                                           const SkGrid& gr, float* slots, int* flags, volatile int* last_flag, const int* rows, T* out, int N, int& s,
                                           unsigned& ph, int& cnt_it, unsigned long long* tr, ZeroCursor& z, bool zk, const int* cnt,
                                           const int* perm, int M, int G) {
    const int KT = gr.KT;
    const int lane = threadIdx.x & 31;
    float acc[NS > 0 ? NS : 1][NB * 64];
#pragma unroll
    for (int i = 0; i < NS; ++i)
#pragma unroll
        for (int e = 0; e < NB * 64; ++e) acc[i][e] = 0.f;
    int prev = 0;
    for (int kt = 0; kt < it.kn; ++kt) {
        mbar_wait(smem_u32(&full_bar[s]), ph);
        if (tr && kt == 0) stamp(tr, 1);
        if (NS > 0) {
            fence_proxy_async();
            const unsigned sa = base + s * STAGE_BYTES + cw * 64 * 128;
            const unsigned sb = base + s * STAGE_BYTES + A_BYTES;
#pragma unroll
            for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
                for (int i = 0; i < NS; ++i) {
                    const unsigned long long da = sw128_desc(sa + i * 128 * 128 + kk * 32);
#if FUSED
                    wgmma_m64n256k16(acc[i], da, sw128_desc(sb + kk * 32));
#else
                    wgmma_m64n128k16(acc[i], da, sw128_desc(sb + kk * 32));
#endif
                }
            }
            wg_commit();
#pragma unroll
            for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
            if (zk) zero_step(z, gr, cnt, perm, out, M, N, G);
            wg_wait<1>();
#pragma unroll
            for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
            __syncwarp();
            if (kt > 0 && lane == 0) mbar_arrive(smem_u32(&empty_bar[prev]));
        } else {
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s]));
            if (zk) zero_step(z, gr, cnt, perm, out, M, N, G);
        }
        prev = s;
        ring_next(s, ph, cnt_it);
    }
    if (NS > 0) {
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < NS; ++i) fence_acc(acc[i]);
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&empty_bar[prev]));
    }
    if (tr) stamp(tr, 2);
    bool write = it.slot < 0;
    float* slot = slots + (long long)(it.slot < 0 ? 0 : it.slot) * (BM * BN * NB);
    if (!write) {
        if (NS > 0) slot_add<NS>(slot, acc, cw);
        __threadfence();
        consumer_bar();
        if (threadIdx.x == 128) {
            const int before = atomicAdd(&flags[it.slot], it.kn);
            const bool last = before + it.kn == KT;
            if (last) {
                flags[it.slot] = 0;
                __threadfence();
            }
            *last_flag = last;
        }
    }
    __syncthreads();  // A: every wgmma of the item has read its operands; the last flag set
    if (tr) stamp(tr, 3);
    if (!write) write = *last_flag;
    if (!write) return;
    if (it.slot >= 0 && NS > 0) slot_take<NS>(slot, acc, cw);
#pragma unroll
    for (int i = 0; i < NS; ++i) stage_subtile(base, acc[i], (cw + 2 * i) * 64);
    __syncthreads();  // B
    write_rows(out, rows, it.nact, base, N, it.n0, threadIdx.x, THREADS);
    fence_proxy_async();  // these reads before the producer's next tensor copies into the stages
    __syncthreads();      // C
    if (tr) stamp(tr, 4);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_mn_wgmma_sk(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ w2, const int* __restrict__ perm,
                 const int* __restrict__ count, T* __restrict__ out, int M, int N, int K, int G,
                 const __grid_constant__ TmaDesc tmap_w, const __grid_constant__ TmaDesc tmap_w2,
                 const __grid_constant__ TmaDesc tmap_x,  // unused (the plain entry's ROW_TMA map)
                 // [2 P][BM * BN * NB] f32 and [2 P] flags, zeros at launch (each launch leaves
                 // them zeroed; launches sharing them must not overlap)
                 float* __restrict__ slots, int* __restrict__ flags, int band,
                 // measurement knobs: bit 0 writes the zero-only tiles after the last item, bit 1
                 // runs whole tiles only (no split: a persistent data-parallel grid), bit 2
                 // staggers the blocks' whole tiles (see below)
                 int mode,
                 // null, or [P][64 items][8] clock64 stamps (a measurement knob): 0 the
                 // consumers' item start, 1 their first stage, 2 their k loop's end, 3 barrier A,
                 // 4 barrier C; 5 the producer's item start, 6 its last copies issued
                 unsigned long long* __restrict__ trace) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ int rows[BM];
    __shared__ int wsum[THREADS / 32];
    __shared__ int last_flag;
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    SkGrid gr;
    gr.MT = (M + BM - 1) / BM;
    gr.NT = N / BN;
    gr.BU = band;
    gr.cells = (gr.MT + band - 1) / band * gr.NT;
    gr.KT = K / BK;
    // After the stages: the cells' exclusive prefix [cells + 1], then each N-tile's count [NT].
    int* pre = reinterpret_cast<int*>(smem_raw + (base - smem_u32(smem_raw)) + STAGES * STAGE_BYTES);
    int* cnt = pre + gr.cells + 1;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 129);  // every producer thread + the expect_tx
            mbar_init(smem_u32(&empty_bar[s]), 8);   // every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (int nt = tid; nt < gr.NT; nt += THREADS) cnt[nt] = min(count[nt * BN / G], M);
    __syncthreads();
    // The schedule: computing tiles of cell e = band * NT + nt, their exclusive prefix.
    {
        const int per = (gr.cells + THREADS - 1) / THREADS, e0 = min(tid * per, gr.cells), e1 = min(e0 + per, gr.cells);
        auto comp = [&](int e) {
            const int b = e / gr.NT, nt = e % gr.NT;
            const int inband = min(gr.BU, gr.MT - b * gr.BU);
            return max(0, min((cnt[nt] + BM - 1) / BM - b * gr.BU, inband));
        };
        int local = 0;
        for (int e = e0; e < e1; ++e) local += comp(e);
        int v = local;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += y;
        }
        if (lane == 31) wsum[warp] = v;
        __syncthreads();
        int run = v - local, total = 0;
        for (int i = 0; i < THREADS / 32; ++i) {
            if (i < warp) run += wsum[i];
            total += wsum[i];
        }
        for (int e = e0; e < e1; ++e) {
            pre[e] = run;
            run += comp(e);
        }
        if (tid == 0) pre[gr.cells] = total;
        __syncthreads();
    }
    gr.C = pre[gr.cells];
    const int P = gridDim.x;
    gr.dp = (mode & 2) ? (gr.C + P - 1) / P : gr.C >= 2 * P ? gr.C / P - 1 : 0;
    {
        const long long L = (mode & 2) ? 0 : (long long)(gr.C - gr.dp * P) * gr.KT;
        gr.lo = L * blockIdx.x / P;
        gr.hi = L * (blockIdx.x + 1) / P;
        // Bit 2: block b runs the first b / P of a tile's k steps of its split range before
        // its whole tiles, so that the blocks' tile boundaries are spread over a tile's time.
        gr.mid = (mode & 4) ? min(gr.hi, gr.lo + (long long)blockIdx.x * gr.KT / P) : gr.lo;
        gr.nhead = sk_segments(gr.lo, gr.mid, gr.KT);
    }
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    int s = 0, cnt_it = 0;
    unsigned ph = 0;
    SkItem it;
    if (wg == 0) {
        const int c = tid & 7, r0 = tid >> 3;
        for (int n = 0; sk_item(gr, pre, cnt, n, it); ++n) {
            unsigned long long* tr = trace && n < 64 ? trace + ((long long)blockIdx.x * 64 + n) * 8 : nullptr;
            if (tr) stamp(tr, 5);
            const int* pg = perm + (long long)(it.n0 / G) * M;
            const T* asrc[BM / 16];
            int asz[BM / 16];
            row_sources(x, pg, it.m0, it.nact, K, r0, c, asrc, asz);
            for (int kt = it.kt0; kt < it.kt0 + it.kn; ++kt) {
                if (cnt_it >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ph ^ 1u);
                const unsigned sa = base + s * STAGE_BYTES;
                const int k0 = kt * BK;
                if (tid == 0) load_weights_tma(sa, smem_u32(&full_bar[s]), &tmap_w, &tmap_w2, k0, it.n0);
#pragma unroll
                for (int i = 0; i < BM / 16; ++i) cp_async16_sz(sa + sw128_off(r0 + 16 * i, c), asrc[i] + k0, asz[i]);
                cp_async_arrive(smem_u32(&full_bar[s]));
                ring_next(s, ph, cnt_it);
            }
            if (tr) stamp(tr, 6);
            __syncthreads();  // A
            const bool write = it.slot < 0 || last_flag;
            if (write) {
                __syncthreads();  // B
                write_rows(out, rows, it.nact, base, N, it.n0, tid, THREADS);
                fence_proxy_async();
                __syncthreads();  // C
            }
        }
    } else {
        const int cw = wg - 1, ct = tid - 128;
        ZeroCursor z;
        zero_start(z, gr, cnt, perm, M, G);
        const bool zk = !(mode & 1);  // the zeros between k steps (else all after the last item)
        for (int n = 0; sk_item(gr, pre, cnt, n, it); ++n) {
            unsigned long long* tr = trace && n < 64 ? trace + ((long long)blockIdx.x * 64 + n) * 8 : nullptr;
            if (tr) stamp(tr, 0);
            // The tile's token rows for the write-out (the last item's write-out is done).
            const int* pg = perm + (long long)(it.n0 / G) * M;
            for (int i = ct; i < BM; i += THREADS - 128) rows[i] = it.m0 + i < M ? pg[it.m0 + i] : -1;
            // Block-uniform: the number of this warpgroup's sub-tiles with active rows.
            const int nact = __shfl_sync(0xffffffffu, it.nact, 0);
            int ns = 0;
#pragma unroll
            for (int i = 0; i < MI; ++i) ns += (cw + 2 * i) * 64 < nact;
            if (ns == 0)
                sk_consume<0>(base, full_bar, empty_bar, cw, it, gr, slots, flags, &last_flag, rows, out, N, s, ph, cnt_it, tr, z, zk, cnt, perm, M, G);
#if MI >= 2
            else if (ns == 2)
                sk_consume<2>(base, full_bar, empty_bar, cw, it, gr, slots, flags, &last_flag, rows, out, N, s, ph, cnt_it, tr, z, zk, cnt, perm, M, G);
#endif
            else
                sk_consume<1>(base, full_bar, empty_bar, cw, it, gr, slots, flags, &last_flag, rows, out, N, s, ph, cnt_it, tr, z, zk, cnt, perm, M, G);
        }
        zero_rest(z, gr, cnt, perm, out, M, N, G);
    }
}
#endif
