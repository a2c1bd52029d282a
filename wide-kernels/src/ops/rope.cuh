// Rotary position embedding (rotate_half) of one token's head, shared by the RoPE + cache-write
// kernel (infer.cu) and decode attention with the RoPE fused in (routed.cu). Prepended after
// router_gate.cuh (the storage conversions).
// cos and sin of position p times frequency f, computed in f32 then rounded to storage (as the
// reference's tables are).
__device__ __forceinline__ void rope_cos_sin(int p, float f, float& c, float& s) {
    sincosf((float)p * f, &s, &c);
    c = rt(c);
    s = rt(s);
}
// rope_cos_sin of inv_freq[i0 .. i0 + 8).
__device__ __forceinline__ void rope_cos_sin8(int p, const float* __restrict__ inv_freq, int i0, float (&c)[8], float (&s)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) rope_cos_sin(p, inv_freq[i0 + j], c[j], s[j]);
}
// Rotates in place the 8 pairs held as two 16-byte words, a = dims i0 .. i0 + 8 and b = the same
// dims + D / 2: a' = a c - b s, b' = b c + a s, each product rounded to storage and the sum
// rounded again (the reference's arithmetic in the storage dtype).
__device__ __forceinline__ void rope_rotate8(uint4& a, uint4& b, const float (&c)[8], const float (&s)[8]) {
    const T* x1 = reinterpret_cast<const T*>(&a);
    const T* x2 = reinterpret_cast<const T*>(&b);
    uint4 r1, r2;
    T* y1 = reinterpret_cast<T*>(&r1);
    T* y2 = reinterpret_cast<T*>(&r2);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float u = tf(x1[j]), v = tf(x2[j]);
        y1[j] = ft(rt(u * c[j]) + rt(-v * s[j]));
        y2[j] = ft(rt(v * c[j]) + rt(u * s[j]));
    }
    a = r1;
    b = r2;
}
