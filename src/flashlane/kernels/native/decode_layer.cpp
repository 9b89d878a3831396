// One llama decoder layer for a batch of decode rows (one new token per sequence) in a single
// call: RMSNorm, q/k/v, RoPE, the new K|V written to the paged pool, attention over the pool,
// o_proj + residual, RMSNorm, gate/up, SiLU * up, down + residual. The same kernels as the
// separate calls (row_gemm, norm_rope, paged_attention), so the layer differs from them only in
// SiLU, whose exp is simd.h's; what it saves is the ~13 Python-level calls and
// their allocations per layer, which cost as much as the weights' reads at batch 1.
#include "block_gemm.cpp"
#include "decode_layer.h"
#include "norm_rope.cpp"
#include "paged_attention.cpp"
#include "row_gemm.cpp"

#include <math.h>

#include <vector>

// a = silu(g) * u = g / (1 + e^-g) * u
static void silu_mul(const float* g, const float* u, float* a, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) a[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
}

static void add(const float* a, const float* b, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; i++) out[i] = a[i] + b[i];
}

static void linear(const Linear& L, const float* x, int64_t M, int64_t K, int64_t N, float* out) {
    if (L.kind == LIN_F32)
        row_gemm_f32(x, M, K, (const float*)L.w, N, K, K, L.bias, out, N);
    else if (L.kind == LIN_I8W)
        row_gemm_i8w(x, M, K, (const int8_t*)L.w, L.scale, N, K, K, L.bias, out, N);
    else if (L.kind == LIN_W8A8)
        row_gemm_w8a8(x, M, K, (const int8_t*)L.w, L.scale, N, K, K, L.bias, out, N);
    else if (L.kind == LIN_Q4_1)
        block_gemm_q4_1(x, M, K, (const uint8_t*)L.w, N, K, L.bias, out, N);
    else
        block_gemm_q8_0(x, M, K, (const uint8_t*)L.w, N, K, L.bias, out, N);
}

// h, out [M, D]; cos/sin [M, hd]; pool rows [K (Hkv x hd) | V (Hkv x hd)] (row_stride floats);
// slots [M] pool rows of the new tokens; tables [M, table_stride], lens [M] (the new token
// included)
extern "C" void llama_decode_layer_f32(const float* h, int64_t M, int64_t D, int64_t I, const LayerWeights* w,
                                       float eps, int64_t Hq, int64_t Hkv, int64_t hd, const float* cos_,
                                       const float* sin_, float* pool, int64_t row_stride, const int64_t* slots,
                                       const int64_t* tables, int64_t table_stride, const int64_t* lens,
                                       int64_t page, float scale, float* out) {
    const int64_t nq = Hq * hd, nkv = Hkv * hd;
    thread_local std::vector<float> buf;
    const LayerScratch<float> s(buf, M, D, nq, nkv, I);
    float *x = s.x, *h1 = s.h1, *o = s.o, *q = s.q, *qr = s.qr, *att = s.att, *k = s.k, *kr = s.kr, *v = s.v,
          *g = s.g, *u = s.u, *a = s.a;

    rms_norm_f32(h, M, D, D, (const float*)w->ln1, eps, x, 1);
    linear(w->q, x, M, D, nq, q);
    linear(w->k, x, M, D, nkv, k);
    linear(w->v, x, M, D, nkv, v);
    rope_half_f32(q, M, Hq, hd, nq, hd, cos_, sin_, qr, 1);
    rope_half_f32(k, M, Hkv, hd, nkv, hd, cos_, sin_, kr, 1);
    for (int64_t m = 0; m < M; m++) {
        float* row = pool + slots[m] * row_stride;
        for (int64_t i = 0; i < nkv; i++) row[i] = kr[m * nkv + i];
        for (int64_t i = 0; i < nkv; i++) row[nkv + i] = v[m * nkv + i];
    }
    paged_decode_f32(qr, pool, row_stride, tables, table_stride, lens, Hq, Hkv, hd, page, scale, att, M * Hkv, 1);
    linear(w->o, att, M, nq, D, o);
    add(h, o, h1, M * D);
    rms_norm_f32(h1, M, D, D, (const float*)w->ln2, eps, x, 1);
    linear(w->gate, x, M, D, I, g);
    linear(w->up, x, M, D, I, u);
    silu_mul(g, u, a, M * I);
    linear(w->down, a, M, I, D, o);
    add(h1, o, out, M * D);
}
