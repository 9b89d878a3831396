// Two attention results over disjoint key sets merged by their log-sum-exps (float32 or
// bfloat16 rows, float32 sums, rounded once): out = (o1 * e^(l1 - m) + o2 * e^(l2 - m)) /
// (e^(l1 - m) + e^(l2 - m)), m = max(l1, l2), for each (b, h, q) row of D values. In one pass
// where torch's ops widen both halves, weigh, add, divide and narrow again in ~8 passes.
#include "simd.h"
#include <math.h>
#include <stdint.h>

namespace {
template <typename E>
void merge(const typename E::T* o1, const typename E::T* o2, const int64_t* so, const float* l1, const float* l2,
           int64_t B, int64_t H, int64_t Q, int64_t D, typename E::T* out, const int64_t* sout) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t q = 0; q < Q; q++) {
                const int64_t r = (b * H + h) * Q + q;
                const float m = l1[r] > l2[r] ? l1[r] : l2[r];
                const float w1 = expf(l1[r] - m), w2 = expf(l2[r] - m), inv = 1.0f / (w1 + w2);
                const float a1 = w1 * inv, a2 = w2 * inv;
                const typename E::T* x1 = o1 + b * so[0] + h * so[1] + q * so[2];
                const typename E::T* x2 = o2 + b * so[0] + h * so[1] + q * so[2];
                typename E::T* y = out + b * sout[0] + h * sout[1] + q * sout[2];
                const __m256 va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2);
                int64_t d = 0;
                for (; d + 8 <= D; d += 8)
                    E::store8(y + d, _mm256_fmadd_ps(E::load8(x1 + d), va1, _mm256_mul_ps(E::load8(x2 + d), va2)));
                for (; d < D; d++) E::store1(y + d, E::value1(x1[d]) * a1 + E::value1(x2[d]) * a2);
            }
}
}  // namespace

// o1, o2 [B, H, Q, D] with element strides so[3] (b, h, q; d contiguous), l1, l2 [B, H, Q]
// contiguous float32, out with strides sout[3]
extern "C" void attention_merge_f32(const float* o1, const float* o2, const int64_t* so, const float* l1,
                                    const float* l2, int64_t B, int64_t H, int64_t Q, int64_t D, float* out,
                                    const int64_t* sout) {
    merge<F32>(o1, o2, so, l1, l2, B, H, Q, D, out, sout);
}

extern "C" void attention_merge_bf16(const uint16_t* o1, const uint16_t* o2, const int64_t* so, const float* l1,
                                     const float* l2, int64_t B, int64_t H, int64_t Q, int64_t D, uint16_t* out,
                                     const int64_t* sout) {
    merge<Bf16>(o1, o2, so, l1, l2, B, H, Q, D, out, sout);
}
