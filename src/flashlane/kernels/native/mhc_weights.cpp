// Manifold-constrained hyper-connections (kernels/mhc.py) where torch spends its time in op
// dispatch rather than arithmetic:
// - mhc_weights_f32: hc_pre's per-token weights from the mixed projection of the normed streams:
//   pre = sigmoid(a s + b) + eps, post = 2 sigmoid(.), comb = softmax over each row of an n x n
//   block + eps, then Sinkhorn (a column step, then iters - 1 row and column rounds): ~120 torch
//   ops on [N, n, n] tensors of a few floats each. Eight tokens per vector (a short last group is
//   padded, so a token's numbers do not depend on its neighbours), the torch formulas' order of
//   operations (multiply, then add; divisions as divisions).
// - mhc_post_f32: hc_post, X'[j] = post[j] y + sum_i comb[i, j] X[i], in one pass per token
//   instead of an outer product, a batched matmul of 4 x 4 blocks and an add over [N, n, H].
// - mhc_norm_*: hc_pre's RMS-normed flat streams (float32 rows for the mixed projection), one pass
//   per token over float32 or bfloat16 streams instead of a copy, a square, a mean and a multiply.
// - mhc_collapse_*: hc_pre's collapse sum_i pre[i] X[i], summed in float32 in stream order and
//   rounded once to the streams' dtype, as the formula's promotion to float32 does.
// - mhc_post_bf16: the same for bfloat16 y, X and out, rounded where torch's bf16 formula rounds
//   (post y and comb^T X each to bf16, then their sum), with post and comb given already rounded
//   to bf16 values (as the formula's casts make them).
#include "simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// mixed [N, (2 + n) n] (a_pre | a_post | a_comb row-major); base [(2 + n) n]; scale = (pre, post,
// comb); outputs pre [N, n], post [N, n], comb [N, n, n]
extern "C" void mhc_weights_f32(const float* mixed, int64_t N, int64_t n, const float* base, const float* scale,
                                float hc_eps, int64_t iters, float* pre, float* post, float* comb) {
    const int64_t width = (2 + n) * n;
    thread_local std::vector<float> lanes;          // [width][8]: one token per lane
    lanes.resize(width * 8);
    float* v = lanes.data();
    const __m256 eps = _mm256_set1_ps(hc_eps), two = _mm256_set1_ps(2.0f);
    const __m256 s_pre = _mm256_set1_ps(scale[0]), s_post = _mm256_set1_ps(scale[1]), s_comb = _mm256_set1_ps(scale[2]);
    auto at = [&](int64_t e) { return _mm256_loadu_ps(v + e * 8); };
    auto put = [&](int64_t e, __m256 x) { _mm256_storeu_ps(v + e * 8, x); };
    for (int64_t t0 = 0; t0 < N; t0 += 8) {
        const int64_t count = N - t0 < 8 ? N - t0 : 8;
        for (int64_t e = 0; e < width; e++)
            for (int64_t l = 0; l < 8; l++) v[e * 8 + l] = l < count ? mixed[(t0 + l) * width + e] : 0.0f;
        for (int64_t i = 0; i < n; i++) {
            put(i, _mm256_add_ps(sigmoid8(_mm256_add_ps(_mm256_mul_ps(at(i), s_pre), _mm256_set1_ps(base[i]))), eps));
            put(n + i, _mm256_mul_ps(two, sigmoid8(_mm256_add_ps(_mm256_mul_ps(at(n + i), s_post),
                                                                 _mm256_set1_ps(base[n + i])))));
        }
        const int64_t c0 = 2 * n;                    // comb element (i, j) is entry c0 + i n + j
        for (int64_t i = 0; i < n; i++) {
            __m256 m = _mm256_set1_ps(-INFINITY);
            for (int64_t j = 0; j < n; j++) {
                const int64_t e = c0 + i * n + j;
                const __m256 z = _mm256_add_ps(_mm256_mul_ps(at(e), s_comb), _mm256_set1_ps(base[e]));
                put(e, z);
                m = _mm256_max_ps(m, z);
            }
            __m256 s = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const __m256 z = exp256(_mm256_sub_ps(at(c0 + i * n + j), m));
                put(c0 + i * n + j, z);
                s = _mm256_add_ps(s, z);
            }
            for (int64_t j = 0; j < n; j++) put(c0 + i * n + j, _mm256_add_ps(_mm256_div_ps(at(c0 + i * n + j), s), eps));
        }
        for (int64_t round = 0; round < iters; round++) {
            if (round > 0)
                for (int64_t i = 0; i < n; i++) {
                    __m256 s = _mm256_setzero_ps();
                    for (int64_t j = 0; j < n; j++) s = _mm256_add_ps(s, at(c0 + i * n + j));
                    s = _mm256_add_ps(s, eps);
                    for (int64_t j = 0; j < n; j++) put(c0 + i * n + j, _mm256_div_ps(at(c0 + i * n + j), s));
                }
            for (int64_t j = 0; j < n; j++) {
                __m256 s = _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++) s = _mm256_add_ps(s, at(c0 + i * n + j));
                s = _mm256_add_ps(s, eps);
                for (int64_t i = 0; i < n; i++) put(c0 + i * n + j, _mm256_div_ps(at(c0 + i * n + j), s));
            }
        }
        for (int64_t l = 0; l < count; l++) {
            const int64_t t = t0 + l;
            for (int64_t i = 0; i < n; i++) {
                pre[t * n + i] = v[i * 8 + l];
                post[t * n + i] = v[(n + i) * 8 + l];
            }
            for (int64_t e = 0; e < n * n; e++) comb[t * n * n + e] = v[(c0 + e) * 8 + l];
        }
    }
}

// y [N, H], streams X [N, n, H], post [N, n], comb [N, n, n] -> out [N, n, H]
extern "C" void mhc_post_f32(const float* y, const float* X, const float* post, const float* comb, int64_t N,
                             int64_t n, int64_t H, float* out) {
    for (int64_t t = 0; t < N; t++) {
        const float* yt = y + t * H;
        const float* xt = X + t * n * H;
        const float* ct = comb + t * n * n;
        for (int64_t j = 0; j < n; j++) {
            float* o = out + (t * n + j) * H;
            const __m256 p = _mm256_set1_ps(post[t * n + j]);
            int64_t h = 0;
            for (; h + 8 <= H; h += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(ct[i * n + j]), _mm256_loadu_ps(xt + i * H + h), acc);
                _mm256_storeu_ps(o + h, _mm256_add_ps(_mm256_mul_ps(p, _mm256_loadu_ps(yt + h)), acc));
            }
            for (; h < H; h++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < n; i++) acc += ct[i * n + j] * xt[i * H + h];
                o[h] = post[t * n + j] * yt[h] + acc;
            }
        }
    }
}

// bf16 y [N, H], X [N, n, H], out [N, n, H]; post [N, n], comb [N, n, n] float32 holding bf16 values
extern "C" void mhc_post_bf16(const uint16_t* y, const uint16_t* X, const float* post, const float* comb, int64_t N,
                              int64_t n, int64_t H, uint16_t* out) {
    for (int64_t t = 0; t < N; t++) {
        const uint16_t* yt = y + t * H;
        const uint16_t* xt = X + t * n * H;
        const float* ct = comb + t * n * n;
        for (int64_t j = 0; j < n; j++) {
            uint16_t* o = out + (t * n + j) * H;
            const float pj = post[t * n + j];
            const __m256 p = _mm256_set1_ps(pj);
            int64_t h = 0;
            for (; h + 8 <= H; h += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(ct[i * n + j]), bf16_load8(xt + i * H + h), acc);
                const __m256 a = bf16_rounded8(_mm256_mul_ps(p, bf16_load8(yt + h)));
                bf16_store8(o + h, _mm256_add_ps(a, bf16_rounded8(acc)));
            }
            for (; h < H; h++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < n; i++) acc = fmaf(ct[i * n + j], bf16_value(xt[i * H + h]), acc);
                const float a = bf16_round1(pj * bf16_value(yt[h]));
                o[h] = bf16_bits(a + bf16_round1(acc));
            }
        }
    }
}

// x [N, W] (float32 or bf16 via load8 / value1) -> out [N, W] float32: x rsqrt(mean(x^2) + eps)
template <typename T, typename Load8, typename Value1>
static void norm_rows(const T* x, int64_t N, int64_t W, float eps, float* out, Load8 load8, Value1 value1) {
    for (int64_t t = 0; t < N; t++) {
        const T* r = x + t * W;
        float* o = out + t * W;
        __m256 acc = _mm256_setzero_ps();
        int64_t w = 0;
        for (; w + 8 <= W; w += 8) {
            const __m256 v = load8(r + w);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sq = hsum(acc);
        for (; w < W; w++) sq += value1(r[w]) * value1(r[w]);
        const float inv = 1.0f / sqrtf(sq / static_cast<float>(W) + eps);
        const __m256 s = _mm256_set1_ps(inv);
        for (w = 0; w + 8 <= W; w += 8) _mm256_storeu_ps(o + w, _mm256_mul_ps(load8(r + w), s));
        for (; w < W; w++) o[w] = value1(r[w]) * inv;
    }
}

// X [N, n, H], pre [N, n] float32 -> out [N, H]: sum_i pre[i] X[i] in float32, stored by store8 / store1
template <typename T, typename Load8, typename Value1, typename Store8, typename Store1>
static void collapse(const T* X, const float* pre, int64_t N, int64_t n, int64_t H, T* out, Load8 load8,
                     Value1 value1, Store8 store8, Store1 store1) {
    for (int64_t t = 0; t < N; t++) {
        const T* xt = X + t * n * H;
        const float* pt = pre + t * n;
        T* o = out + t * H;
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_set1_ps(pt[0]), load8(xt + h));
            for (int64_t i = 1; i < n; i++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(pt[i]), load8(xt + i * H + h)));
            store8(o + h, acc);
        }
        for (; h < H; h++) {
            float acc = pt[0] * value1(xt[h]);
            for (int64_t i = 1; i < n; i++) acc = acc + pt[i] * value1(xt[i * H + h]);
            store1(o + h, acc);
        }
    }
}

static inline __m256 f32_load8(const float* p) { return _mm256_loadu_ps(p); }
static inline float f32_value(float v) { return v; }
static inline void f32_store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void f32_store1(float* p, float v) { *p = v; }
static inline void bf16_store1(uint16_t* p, float v) { *p = bf16_bits(v); }

extern "C" void mhc_norm_f32(const float* x, int64_t N, int64_t W, float eps, float* out) {
    norm_rows(x, N, W, eps, out, f32_load8, f32_value);
}

extern "C" void mhc_norm_bf16(const uint16_t* x, int64_t N, int64_t W, float eps, float* out) {
    norm_rows(x, N, W, eps, out, bf16_load8, bf16_value);
}

extern "C" void mhc_collapse_f32(const float* X, const float* pre, int64_t N, int64_t n, int64_t H, float* out) {
    collapse(X, pre, N, n, H, out, f32_load8, f32_value, f32_store8, f32_store1);
}

extern "C" void mhc_collapse_bf16(const uint16_t* X, const float* pre, int64_t N, int64_t n, int64_t H,
                                  uint16_t* out) {
    collapse(X, pre, N, n, H, out, bf16_load8, bf16_value, bf16_store8, bf16_store1);
}
