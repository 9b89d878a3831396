// SwiGLU of a bfloat16 model, SiLU(gate) * up, rounded where torch's bf16 ops round: SiLU's result
// (g / (1 + e^-g), simd.h's exp), then the product. torch's bf16 silu and mul run at about 1 ns an
// element on one core, which made them a sixth of a llama prefill; this is one pass. Built twice
// (swiglu.py): with AVX-512 where the CPU has it (sixteen lanes), else AVX2; the two round alike.
#include "parallel.h"
#include "simd.h"

#include <math.h>

// a = bf16(bf16(silu(g)) * u) over n values
static void silu_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = bf16_load16(g + i);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one16, exp512(_mm512_sub_ps(zero16, gv))));
        const __m512 sig = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(silu), 16));
        const __m512i bits = bf16_bits16(_mm512_mul_ps(sig, bf16_load16(u + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i), _mm512_cvtepi32_epi16(bits));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = Bf16::load8(g + i);
        const __m256 sig = Bf16::round8(_mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv)))));
        Bf16::store8(a + i, _mm256_mul_ps(sig, Bf16::load8(u + i)));
    }
    for (; i < n; i++) {
        const float gv = bf16_value(g[i]);
        a[i] = bf16_bits(Bf16::round1(gv / (1.0f + exp1(-gv))) * bf16_value(u[i]));
    }
}

// The clamped variant's inputs (glm5_next): gate clamped from above, up to [-limit, limit], each
// rounded to bf16 as torch's clamp returns them.
static void clamp_bf16(const uint16_t* g, const uint16_t* u, uint16_t* gc, uint16_t* uc, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float gv = bf16_value(g[i]), uv = bf16_value(u[i]);
        gc[i] = bf16_bits(gv > limit ? limit : gv);
        uc[i] = bf16_bits(uv > limit ? limit : (uv < -limit ? -limit : uv));
    }
}

// gate / up [rows, n] (row strides ldg / ldu) -> out [rows, n], the rows split over `threads` of
// torch's OpenMP team (parallel.h); limit: the clamp, or a negative value for none
extern "C" void swiglu_bf16(const uint16_t* g, int64_t ldg, const uint16_t* u, int64_t ldu, uint16_t* out, int64_t n,
                            float limit, int64_t rows, int64_t threads) {
    parallel_rows(rows, threads, [&](int64_t first, int64_t count) {
        uint16_t* gc = nullptr;
        if (limit >= 0.0f) gc = new uint16_t[2 * n];
        for (int64_t r = first; r < first + count; r++) {
            const uint16_t *gr = g + r * ldg, *ur = u + r * ldu;
            if (gc) {
                clamp_bf16(gr, ur, gc, gc + n, n, limit);
                gr = gc, ur = gc + n;
            }
            silu_mul_bf16(gr, ur, out + r * n, n);
        }
        delete[] gc;
    });
}
