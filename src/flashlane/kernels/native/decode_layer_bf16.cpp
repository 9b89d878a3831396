// One llama decoder layer of a bfloat16 model for a batch of decode rows (up to 16: one AMX tile
// of rows) in a single call: decode_layer.cpp's steps with bf16 activations, weights and pool,
// each rounded to bf16 where torch's bf16 ops round (every linear's output, RMSNorm and RoPE as
// norm_rope.cpp rounds, the attention output, SiLU, its product with up, each residual sum). Its
// linears are row_gemm_amx.cpp's and its attention paged_attention.cpp's, as the separate calls'
// are, so the layer differs from them only in SiLU, whose exp is simd.h's. What it saves is the
// ~15 Python-level calls and their allocations per layer. Built with the AMX kernel's flags.
#include "decode_layer.h"
#include "norm_rope.cpp"
#include "paged_attention.cpp"
#include "row_gemm_amx.cpp"
#include "swiglu.cpp"

#include <vector>

static void linear_bf16(const Linear& L, const uint16_t* x, int64_t M, int64_t K, int64_t N, uint16_t* out) {
    row_gemm_amx_bf16(x, M, K, static_cast<const uint16_t*>(L.w), N, K, K, L.bias, out, N, 0, N);
}

// out = bf16(a + b)
static void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) Bf16::store8(out + i, _mm256_add_ps(Bf16::load8(a + i), Bf16::load8(b + i)));
    for (; i < n; i++) out[i] = bf16_bits(bf16_value(a[i]) + bf16_value(b[i]));
}

// h, out [M, D] bf16; cos/sin [M, hd] float32 (bf16 values); pool rows [K (Hkv x hd) | V (Hkv x hd)]
// bf16 (row_stride elements); slots [M] pool rows of the new tokens; tables [M, table_stride],
// lens [M] (the new token included); every linear of kind LIN_BF16_AMX, K a multiple of 32
extern "C" void llama_decode_layer_bf16(const uint16_t* h, int64_t M, int64_t D, int64_t I, const LayerWeights* w,
                                        float eps, int64_t Hq, int64_t Hkv, int64_t hd, const float* cos_,
                                        const float* sin_, uint16_t* pool, int64_t row_stride, const int64_t* slots,
                                        const int64_t* tables, int64_t table_stride, const int64_t* lens,
                                        int64_t page, float scale, uint16_t* out) {
    const int64_t nq = Hq * hd, nkv = Hkv * hd;
    thread_local std::vector<uint16_t> buf;
    thread_local std::vector<float> wide;
    const LayerScratch<uint16_t> s(buf, M, D, nq, nkv, I);
    uint16_t *x = s.x, *h1 = s.h1, *o = s.o, *q = s.q, *qr = s.qr, *att = s.att, *k = s.k, *kr = s.kr, *v = s.v,
             *g = s.g, *u = s.u, *a = s.a;
    wide.resize(2 * M * nq);
    float* qf = wide.data();               // qr widened, [M, nq]
    float* attf = qf + M * nq;             // attention out in float32, [M, nq]

    rms_norm<Bf16>(h, M, D, D, static_cast<const uint16_t*>(w->ln1), eps, x);
    linear_bf16(w->q, x, M, D, nq, q);
    linear_bf16(w->k, x, M, D, nkv, k);
    linear_bf16(w->v, x, M, D, nkv, v);
    rope_half<Bf16>(q, M, Hq, hd, nq, hd, cos_, sin_, qr);
    rope_half<Bf16>(k, M, Hkv, hd, nkv, hd, cos_, sin_, kr);
    for (int64_t m = 0; m < M; m++) {
        uint16_t* row = pool + slots[m] * row_stride;
        for (int64_t i = 0; i < nkv; i++) row[i] = kr[m * nkv + i];
        for (int64_t i = 0; i < nkv; i++) row[nkv + i] = v[m * nkv + i];
    }
    for (int64_t i = 0; i < M * nq; i++) qf[i] = bf16_value(qr[i]);
    paged_decode(qf, static_cast<const uint16_t*>(pool), row_stride, tables, table_stride, lens, Hq, Hkv, hd, page,
                 scale, attf, 0, M * Hkv);
    for (int64_t i = 0; i < M * nq; i++) att[i] = bf16_bits(attf[i]);
    linear_bf16(w->o, att, M, nq, D, o);
    add_bf16(h, o, h1, M * D);
    rms_norm<Bf16>(h1, M, D, D, static_cast<const uint16_t*>(w->ln2), eps, x);
    linear_bf16(w->gate, x, M, D, I, g);
    linear_bf16(w->up, x, M, D, I, u);
    silu_mul_bf16(g, u, a, M * I);
    linear_bf16(w->down, a, M, I, D, o);
    add_bf16(h1, o, out, M * D);
}
