// Stable partition of one strided byte column by one block (blockDim.x a multiple of 32, at
// most 1024; every thread of the block calls it): perm[0 .. count) = the indices t < n whose
// byte col[t * stride] is nonzero, ascending, then the others, ascending; *count = how many are
// nonzero.
//
// `block_partition_chunked`: two passes over blockDim-wide chunks: count (so the inactive tail
// starts at the right place), then place through warp ballots and per-warp offsets, two block
// barriers and a walk over the warps' counts a chunk.
__device__ __forceinline__ void block_partition_chunked(const unsigned char* __restrict__ col, long long stride, int n,
                                                int* __restrict__ perm, int* __restrict__ count) {
    __shared__ int wa[32], wi[32], tot_a;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int local = 0;
    for (int t = threadIdx.x; t < n; t += blockDim.x) local += col[(long long)t * stride] != 0;
    local = __reduce_add_sync(0xffffffffu, local);
    if (lane == 0) wa[warp] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int i = 0; i < nw; ++i) s += wa[i];
        tot_a = s;
        *count = s;
    }
    __syncthreads();
    int base_a = 0, base_i = tot_a;
    const unsigned lt = (1u << lane) - 1u;
    for (int t0 = 0; t0 < n; t0 += blockDim.x) {
        const int t = t0 + threadIdx.x;
        const bool valid = t < n;
        const bool on = valid && col[(long long)t * stride] != 0;
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
        if (on) perm[base_a + off_a + __popc(ba & lt)] = t;
        else if (valid) perm[base_i + off_i + __popc(bi & lt)] = t;
        base_a += all_a;
        base_i += all_i;
    }
}

// `block_partition`: one pass. Warp w owns the contiguous indices [32 p w, 32 p (w + 1)), p =
// ceil(n / blockDim) <= 32, and walks them 32 at a time: round k reads the bytes of 32 p w + 32 k
// + lane (p rounds of independent loads, each byte read once) and keeps the round's ballot in
// lane k. One block-wide exclusive scan of the warps' counts gives each warp its offsets in both
// parts (the runs are in index order, so both stay ascending); the placement then replays the
// ballots (a shuffle each), so a warp's stores of a round are consecutive. Two block barriers
// in all. Columns longer than 32 x blockDim take the chunked form.
__device__ __forceinline__ void block_partition(const unsigned char* __restrict__ col, long long stride, int n,
                                                int* __restrict__ perm, int* __restrict__ count) {
    const int nt = blockDim.x;
    const int per = (n + nt - 1) / nt;
    if (per > 32) {
        block_partition_chunked(col, stride, n, perm, count);
        return;
    }
    __shared__ int ws[32], tot;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = nt >> 5;
    const int base = warp * 32 * per;
    unsigned myb = 0;
    int c = 0;
#pragma unroll 8
    for (int k = 0; k < per; ++k) {
        const int t = base + 32 * k + lane;
        const bool on = t < n && col[(long long)t * stride] != 0;
        const unsigned b = __ballot_sync(0xffffffffu, on);
        if (lane == k) myb = b;
        c += __popc(b);
    }
    if (lane == 0) ws[warp] = c;
    __syncthreads();
    if (warp == 0) {
        const int v = lane < nw ? ws[lane] : 0;
        int s = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += u;
        }
        if (lane < nw) ws[lane] = s - v;  // the warps' exclusive offsets
        if (lane == 31) {
            tot = s;
            *count = s;
        }
    }
    __syncthreads();
    int a = ws[warp];                    // active indices before base
    int in = tot + min(base, n) - a;     // the inactive tail's start plus the inactive ones before base
    const unsigned lt = (1u << lane) - 1u;
    for (int k = 0; k < per; ++k) {
        const int t = base + 32 * k + lane;
        const unsigned b = __shfl_sync(0xffffffffu, myb, k);
        const int left = n - (base + 32 * k);  // valid indices in this round
        const unsigned valid = left >= 32 ? 0xffffffffu : left > 0 ? (1u << left) - 1u : 0u;
        const unsigned off = ~b & valid;
        if ((b >> lane) & 1u) perm[a + __popc(b & lt)] = t;
        else if ((valid >> lane) & 1u) perm[in + __popc(off & lt)] = t;
        a += __popc(b);
        in += __popc(off);
    }
}
