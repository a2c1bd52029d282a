// Stable partition of one strided byte column by one block (blockDim.x a multiple of 32, at
// most 1024; every thread of the block calls it): perm[0 .. count) = the indices t < n whose
// byte col[t * stride] is nonzero, ascending, then the others, ascending; *count = how many are
// nonzero. Two passes: count (so the inactive tail starts at the right place), then place
// through warp ballots and per-warp offsets.
__device__ __forceinline__ void block_partition(const unsigned char* __restrict__ col, long long stride, int n,
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
