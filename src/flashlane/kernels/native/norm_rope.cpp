// The per-token glue of a decoder layer in one call each instead of a handful of torch ops:
// RMSNorm (``w * (x * rsqrt(mean(x^2) + eps))``) and rotate-half RoPE, in float32 or bfloat16,
// rows split over `threads` of torch's OpenMP team (parallel.h); each row is computed on its own
// in a fixed order (batch-invariant, and the same on any number of threads). bf16 rounds
// where torch's bf16 formulas round (kernels/norm.py, kernels/rope.py): the norm in float32,
// rounded, then times the weight, rounded; RoPE's two products and their sum each rounded.
#include "parallel.h"
#include "simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {
template <typename D>
void rms_norm(const typename D::T* x, int64_t rows, int64_t dim, int64_t x_stride, const typename D::T* w, float eps,
              typename D::T* out) {
    for (int64_t r = 0; r < rows; r++) {
        const typename D::T* xr = x + r * x_stride;
        typename D::T* o = out + r * dim;
        const float inv = 1.0f / sqrtf(sum_squares<D>(xr, dim) / (float)dim + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8)
            D::store8(o + d, _mm256_mul_ps(D::load8(w + d), D::round8(_mm256_mul_ps(D::load8(xr + d), vinv))));
        for (; d < dim; d++) D::store1(o + d, D::value1(w[d]) * D::round1(D::value1(xr[d]) * inv));
    }
}

// cos/sin already in x's dtype's values (bf16: rounded by the caller, as torch casts them)
template <typename D>
void rope_half(const typename D::T* x, int64_t n, int64_t heads, int64_t Dim, int64_t row_stride, int64_t head_stride,
               const float* cos_, const float* sin_, typename D::T* out) {
    const int64_t half = Dim / 2;
    for (int64_t i = 0; i < n; i++) {
        const float* c = cos_ + i * Dim;
        const float* s = sin_ + i * Dim;
        for (int64_t h = 0; h < heads; h++) {
            const typename D::T* xh = x + i * row_stride + h * head_stride;
            typename D::T* o = out + (i * heads + h) * Dim;
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 a = D::load8(xh + d), b = D::load8(xh + half + d);
                D::store8(o + d, _mm256_sub_ps(D::round8(_mm256_mul_ps(a, _mm256_loadu_ps(c + d))),
                                               D::round8(_mm256_mul_ps(b, _mm256_loadu_ps(s + d)))));
                D::store8(o + half + d, _mm256_add_ps(D::round8(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + d))),
                                                      D::round8(_mm256_mul_ps(a, _mm256_loadu_ps(s + half + d)))));
            }
            for (; d < half; d++) {
                const float a = D::value1(xh[d]), b = D::value1(xh[half + d]);
                D::store1(o + d, D::round1(a * c[d]) - D::round1(b * s[d]));
                D::store1(o + half + d, D::round1(b * c[half + d]) + D::round1(a * s[half + d]));
            }
        }
    }
}
}  // namespace

// x [rows, dim] (row stride x_stride) -> out [rows, dim] contiguous
extern "C" void rms_norm_f32(const float* x, int64_t rows, int64_t dim, int64_t x_stride, const float* w, float eps,
                             float* out, int64_t threads) {
    parallel_rows(rows, threads, [&](int64_t r, int64_t count) {
        rms_norm<F32>(x + r * x_stride, count, dim, x_stride, w, eps, out + r * dim);
    });
}

extern "C" void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t dim, int64_t x_stride, const uint16_t* w,
                              float eps, uint16_t* out, int64_t threads) {
    parallel_rows(rows, threads, [&](int64_t r, int64_t count) {
        rms_norm<Bf16>(x + r * x_stride, count, dim, x_stride, w, eps, out + r * dim);
    });
}

// x [n, heads, D] (strides row_stride, head_stride; last dim contiguous), cos/sin [n, D] float32
// contiguous -> out [n, heads, D] contiguous: out = x * cos + rotate_half(x) * sin
extern "C" void rope_half_f32(const float* x, int64_t n, int64_t heads, int64_t D, int64_t row_stride,
                              int64_t head_stride, const float* cos_, const float* sin_, float* out, int64_t threads) {
    parallel_rows(n, threads, [&](int64_t r, int64_t count) {
        rope_half<F32>(x + r * row_stride, count, heads, D, row_stride, head_stride, cos_ + r * D, sin_ + r * D,
                       out + r * heads * D);
    });
}

extern "C" void rope_half_bf16(const uint16_t* x, int64_t n, int64_t heads, int64_t D, int64_t row_stride,
                               int64_t head_stride, const float* cos_, const float* sin_, uint16_t* out,
                               int64_t threads) {
    parallel_rows(n, threads, [&](int64_t r, int64_t count) {
        rope_half<Bf16>(x + r * row_stride, count, heads, D, row_stride, head_stride, cos_ + r * D, sin_ + r * D,
                        out + r * heads * D);
    });
}
