// The per-token glue of a decoder layer in one call each instead of a handful of torch ops:
// RMSNorm (``w * (x * rsqrt(mean(x^2) + eps))``) and rotate-half RoPE. float32, one thread; each
// row is computed on its own in a fixed order (batch-invariant).
#include "simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

// x [rows, dim] (row stride x_stride) -> out [rows, dim] contiguous
extern "C" void rms_norm_f32(const float* x, int64_t rows, int64_t dim, int64_t x_stride, const float* w, float eps,
                             float* out) {
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * x_stride;
        float* o = out + r * dim;
        const float inv = 1.0f / sqrtf(sum_squares<F32>(xr, dim) / (float)dim + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(xr + d), vinv)));
        for (; d < dim; d++) o[d] = w[d] * (xr[d] * inv);
    }
}

// x [n, heads, D] (strides row_stride, head_stride; last dim contiguous), cos/sin [n, D]
// contiguous -> out [n, heads, D] contiguous: out = x * cos + rotate_half(x) * sin
extern "C" void rope_half_f32(const float* x, int64_t n, int64_t heads, int64_t D, int64_t row_stride,
                              int64_t head_stride, const float* cos_, const float* sin_, float* out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < n; i++) {
        const float* c = cos_ + i * D;
        const float* s = sin_ + i * D;
        for (int64_t h = 0; h < heads; h++) {
            const float* xh = x + i * row_stride + h * head_stride;
            float* o = out + (i * heads + h) * D;
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 a = _mm256_loadu_ps(xh + d), b = _mm256_loadu_ps(xh + half + d);
                _mm256_storeu_ps(o + d, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + d)),
                                                      _mm256_mul_ps(b, _mm256_loadu_ps(s + d))));
                _mm256_storeu_ps(o + half + d, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + d)),
                                                             _mm256_mul_ps(a, _mm256_loadu_ps(s + half + d))));
            }
            for (; d < half; d++) {
                const float a = xh[d], b = xh[half + d];
                o[d] = a * c[d] - b * s[d];
                o[half + d] = b * c[half + d] + a * s[half + d];
            }
        }
    }
}
