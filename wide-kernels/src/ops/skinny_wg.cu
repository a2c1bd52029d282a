// Hopper (sm_90a) gemm_mn for a few tokens (2-128): the product computed transposed, out^T = W x^T,
// so that the weight rows fill wgmma's 64-row A side and the tokens its narrow N side
// (m64nNTk16, NT = 16 / 32 / 64 / 128). At these sizes a routed product reads nearly every
// weight byte (a group is skipped only where none of the tokens uses it), so the kernel is a
// stream of the weights at the memory's rate with the mask applied as the results are written:
// no second launch writes the zeros (cuBLAS + the zero pass), and x is staged once a block in
// shared memory for all of its rows (the mma.sync small-M kernel reads it again for every
// 16 rows). Compiled with defines:
//   WIDE_F16  1 for f16 operands, 0 for bf16 (fp32 accumulation either way)
//   NT        token tile (wgmma N): 16, 32, 64 or 128; the launch has M <= NT tokens, and the
//             x rows past M come as zeros from the tensor copy
//   R         consumer warpgroups: a block computes 64 R weight rows (output channels)
//   STAGES    shared-memory pipeline depth
//   CLUSTER   1, or 2: clusters of two blocks on neighbouring row blocks; each block loads half
//             of x's rows and multicasts them to both, so x crosses from L2 once for two blocks
//   SPLITK    1, or 2 (with CLUSTER 1): clusters of two blocks on the same rows, each taking half
//             of K; the second hands its f32 partial sums to the first through distributed
//             shared memory, which adds them and writes the tile (twice the blocks for a narrow
//             product such as Q 4096 x 4096, whose 64 row blocks leave half the multiprocessors idle)
//   PUSH      with SPLITK 2: 1 = the second block stores its partial sums into the first's
//             shared memory (16-byte remote stores, not waited for one by one) between two
//             cluster barriers and the first adds them from its own memory; 0 = the first reads
//             them from the second's memory, one f32 remote load at a time
//   MASKPRE   1 = the producer warpgroup's idle warps copy the block's mask bits (one byte a
//             token and 16-byte piece of the tile) into shared memory while the weights
//             stream, so the write-out reads no global memory; 0 = the write-out reads the mask
//
// Block: warpgroup 0 is the producer (one thread issues, for each k step of 64, one tensor copy
// of the block's 64 R x 64 weight box and one of the NT x 64 box of x, both 128-byte swizzled,
// onto the stage's barrier); warpgroups 1..R each multiply their 64 weight rows with x (four
// m64nNTk16 a k step, one wgmma group in flight) and release the stage. Epilogue: once every
// consumer has finished, the results are staged transposed ([token][channel], bf16/f16) in the
// stage memory and all threads write the M x 64 R tile with 16-byte stores, zeros where the
// token skips the channel's group (G a multiple of 8, so a 16-byte piece is in one group).
// The mask is read only there: the weights stream whatever it says (at 2+ tokens and the skip
// rates routed models use, nearly every group is used by some token).

#ifndef NT
#define NT 16
#endif
#ifndef R
#define R 1
#endif
#ifndef STAGES
#define STAGES 8
#endif
#if NT != 16 && NT != 32 && NT != 64 && NT != 128
#error "NT is 16, 32, 64 or 128"
#endif
#if R != 1 && R != 2
#error "R is 1 or 2"
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#if CLUSTER != 1 && CLUSTER != 2
#error "CLUSTER is 1 or 2"
#endif
#ifndef SPLITK
#define SPLITK 1
#endif
#if SPLITK != 1 && (SPLITK != 2 || CLUSTER != 1)
#error "SPLITK is 1, or 2 with CLUSTER 1"
#endif
#ifndef PUSH
#define PUSH 0
#endif
#ifndef MASKPRE
#define MASKPRE 0
#endif
#if PUSH != 0 && SPLITK != 2
#error "PUSH is for the split of K"
#endif
// Blocks a cluster, for either pairing.
#define PAIR (CLUSTER * SPLITK)

#define ROWS (64 * R)
#define W_BYTES (ROWS * 128)
#define X_BYTES (NT * 128)
#define STAGE_BYTES (W_BYTES + X_BYTES)
#define THREADS (128 * (R + 1))
// Row stride (elements) of the staged results: 16 bytes of padding spread a warp's stores over
// the banks.
#define SROW (ROWS + 8)
#define ACC (NT / 2)
#define CH (ROWS / 8)  // 16-byte pieces of a token's row of the tile

#define WG_ACC16(b) WG_ACC8(b), WG_ACC8(b + 8)

// D[64 x NT] (f32) += A[64 x 16] * B[16 x NT], both K-major in shared memory (descriptors).
__device__ __forceinline__ void wgmma_nt(float (&d)[ACC], unsigned long long da, unsigned long long db) {
#if NT == 16
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}"
        : WG_ACC8(0)
        : "l"(da), "l"(db), "r"(1));
#elif NT == 32
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." WG_TYPE "." WG_TYPE " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}"
        : WG_ACC16(0)
        : "l"(da), "l"(db), "r"(1));
#elif NT == 64
    wgmma_m64n64k16(d, da, db);
#else
    wgmma_m64n128k16(d, da, db);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, R == 1 ? 2 : 1)
#if PAIR == 2
__cluster_dims__(2, 1, 1)
#endif
skinny_wg(const __grid_constant__ TmaDesc tmap_w,  // w [N, K]: boxes of 64 k x ROWS rows
          const __grid_constant__ TmaDesc tmap_x,  // x [M, K]: boxes of 64 k x NT / CLUSTER rows
          const unsigned char* __restrict__ mask,  // [M, NG]
          T* __restrict__ out,                     // [M, N]
          int M, int N, int K, int G, int NG) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
#if MASKPRE
    __shared__ unsigned char keep[NT * CH];  // token m, piece c: kept (1) or skipped (0)
#endif
    // Stages start 1024-aligned (the swizzle pattern is defined on absolute address bits); the
    // launch asks for 1024 bytes of slack.
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
#if SPLITK == 2
    // A cluster is one row block; block `rank` takes k steps [rank KT, rank KT + KT).
    const int n0 = (blockIdx.x >> 1) * ROWS;
    const int KT = K / 128;
    const int kt0 = (int)(blockIdx.x & 1) * KT;
#else
    const int n0 = blockIdx.x * ROWS;
    const int KT = K / 64;
    const int kt0 = 0;
#endif
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 1);       // the producer's expect_tx
            mbar_init(smem_u32(&empty_bar[s]), 4 * R * CLUSTER);  // every consumer warp (of the cluster)
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if CLUSTER == 2
    // Both blocks' barriers initialised before either multicasts or arrives remotely.
    cluster_sync();
    const unsigned rank = cluster_rank();
#endif
#if SPLITK == 2
    const unsigned rank = cluster_rank();
#endif
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    float acc[ACC];
#pragma unroll
    for (int e = 0; e < ACC; ++e) acc[e] = 0.f;
    if (wg == 0) {
        if (tid == 0) {
            for (int kt = 0; kt < KT; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), ((kt / STAGES) - 1) & 1);
                const unsigned fb = smem_u32(&full_bar[s]);
                const unsigned sa = base + s * STAGE_BYTES;
                mbar_arrive_expect_tx(fb, STAGE_BYTES);
                tma_load_2d(sa, &tmap_w, (kt0 + kt) * 64, n0, fb);
#if CLUSTER == 2
                // This block's half of x's rows, into both blocks' stage (the stage is free in
                // both: each block's empty barrier counts both blocks' consumer warps).
                tma_load_multicast(sa + W_BYTES + rank * (X_BYTES / 2), &tmap_x, kt * 64, (int)rank * (NT / 2), fb);
#else
                tma_load_2d(sa + W_BYTES, &tmap_x, (kt0 + kt) * 64, 0, fb);
#endif
            }
        }
#if MASKPRE
        else if (tid >= 32) {
            // Warps 1-3 of the producer warpgroup (warp 0 issues the copies): read once, here,
            // while the first stages are in flight; the __syncthreads below publishes them.
            for (int i = tid - 32; i < M * CH; i += 96) {
                const int m = i / CH, c = i - m * CH;
                keep[i] = mask[(long long)m * NG + (n0 + c * 8) / G] != 0;
            }
        }
#endif
    } else {
        const int cw = wg - 1, lane = tid & 31;
        int s = 0, prev = STAGES - 1;
        unsigned ph = 0;
        for (int kt = 0; kt < KT; ++kt) {
            mbar_wait(smem_u32(&full_bar[s]), ph);
            const unsigned sa = base + s * STAGE_BYTES + cw * 64 * 128;
            const unsigned sb = base + s * STAGE_BYTES + W_BYTES;
            fence_acc(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_nt(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32));
            wg_commit();
            fence_acc(acc);
            wg_wait<1>();  // the group of step kt - 1 has completed
            fence_acc(acc);
            __syncwarp();
            if (kt > 0 && lane == 0) {
                mbar_arrive(smem_u32(&empty_bar[prev]));
#if CLUSTER == 2
                mbar_arrive_remote(map_rank(smem_u32(&empty_bar[prev]), rank ^ 1u));
#endif
            }
            prev = s;
            if (++s == STAGES) {
                s = 0;
                ph ^= 1u;
            }
        }
        wg_wait<0>();
        fence_acc(acc);
    }
    // Every copy has landed (the consumers waited for each stage) and every wgmma has read its
    // operands once all threads pass here: the stage memory is free for the staged results.
    __syncthreads();
#if SPLITK == 2
    {
        // The second block's partial sums added by the first (PUSH: stored into the first's
        // shared memory by the second; else read from the second's by the first); the second
        // then leaves.
        float* red = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));
        const int t = tid - 128;
#if PUSH
        // Accumulators 4j .. 4j + 3 of consumer thread t as the 16 bytes at j * 128 R + t (a
        // warp's stores consecutive). The first barrier: both blocks are past their main loops,
        // so the first's stage memory is free; the second's (release / acquire): its stores
        // have landed.
        float4* red4 = reinterpret_cast<float4*>(red);
        cluster_sync();
        if (rank == 1 && wg > 0) {
            const unsigned remote = map_rank(smem_u32(red4), 0u);
#pragma unroll
            for (int j = 0; j < ACC / 4; ++j)
                st_cluster_v4(remote + 16u * (unsigned)(j * (128 * R) + t), acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        }
        cluster_sync();
        if (rank == 1) return;
        if (wg > 0) {
#pragma unroll
            for (int j = 0; j < ACC / 4; ++j) {
                const float4 v = red4[j * (128 * R) + t];
                acc[4 * j] += v.x;
                acc[4 * j + 1] += v.y;
                acc[4 * j + 2] += v.z;
                acc[4 * j + 3] += v.w;
            }
        }
        // The staging below overwrites red4: every consumer has read its sums first.
        __syncthreads();
#else
        // Accumulator e of consumer thread t at e * 128 R + t (a warp's loads consecutive).
        if (rank == 1 && wg > 0) {
#pragma unroll
            for (int e = 0; e < ACC; ++e) red[e * (128 * R) + t] = acc[e];
        }
        cluster_sync();
        if (rank == 0 && wg > 0) {
            const unsigned remote = map_rank(smem_u32(red), 1u);
#pragma unroll
            for (int e = 0; e < ACC; ++e) acc[e] += ld_cluster_f32(remote + 4u * (unsigned)(e * (128 * R) + t));
        }
        // The second block's shared memory stays until the first has read it.
        cluster_sync();
        if (rank == 1) return;
#endif
    }
#endif
    T* st = reinterpret_cast<T*>(smem_raw + (base - smem_u32(smem_raw)));
    if (wg > 0) {
        // Accumulator e of the m64nNT fragment: channel row (warp % 4) * 16 + lane / 4 (+ 8 for
        // e % 4 >= 2), token column 8 (e / 4) + 2 (lane % 4) + e % 2.
        const int lane = tid & 31, w4 = (tid >> 5) & 3;
        const int r0 = (wg - 1) * 64 + w4 * 16 + (lane >> 2);
#pragma unroll
        for (int e = 0; e < ACC; ++e) {
            const int row = r0 + ((e & 2) ? 8 : 0);
            const int col = 8 * (e >> 2) + 2 * (lane & 3) + (e & 1);
            st[col * SROW + row] = (T)acc[e];
        }
    }
    __syncthreads();
    for (int i = tid; i < M * CH; i += THREADS) {
        const int m = i / CH, c = i - m * CH;
        const int ch = n0 + c * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
#if MASKPRE
        if (keep[i])
#else
        if (mask[(long long)m * NG + ch / G] != 0)
#endif
            v = *reinterpret_cast<const uint4*>(st + m * SROW + c * 8);
        *reinterpret_cast<uint4*>(out + (long long)m * N + ch) = v;
    }
#if CLUSTER == 2
    // The other block may still arrive on this block's barriers: neither leaves before both
    // are done.
    cluster_sync();
#endif
}
