// Manifold-constrained hyper-connections (kernels/mhc.py) where torch spends its time in op
// dispatch rather than arithmetic:
// - mhc_weights_f32: hc_pre's per-token weights from the mixed projection of the normed streams:
//   pre = sigmoid(a s + b) + eps, post = 2 sigmoid(.), comb = softmax over each row of an n x n
//   block + eps, then Sinkhorn (a column step, then iters - 1 row and column rounds): ~120 torch
//   ops on [N, n, n] tensors of a few floats each. Eight tokens per vector (a short last group is
//   padded, so a token's numbers do not depend on its neighbours), the torch formulas' order of
//   operations (multiply, then add; divisions as divisions).
// - mhc_post_*: hc_post, X'[j] = post[j] y + sum_i comb[i, j] X[i], in one pass per token
//   instead of an outer product, a batched matmul of 4 x 4 blocks and an add over [N, n, H];
//   in bf16 rounded where torch's bf16 formula rounds.
// - mhc_norm_*: hc_pre's RMS-normed flat streams (float32 rows for the mixed projection), one pass
//   per token over float32 or bfloat16 streams instead of a copy, a square, a mean and a multiply.
// - mhc_collapse_*: hc_pre's collapse sum_i pre[i] X[i], summed in float32 in stream order and
//   rounded once to the streams' dtype, as the formula's promotion to float32 does.
// (_f32 / _bf16: the streams' dtype, through simd.h's F32 / Bf16 element access.)
// Every token is computed on its own, so each entry splits its tokens over `threads` of torch's
// OpenMP team (parallel.h) with the same numbers as one thread.
#include "parallel.h"
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
static void weights_rows(const float* mixed, int64_t N, int64_t n, const float* base, const float* scale,
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

// y [N, H], streams X [N, n, H], post [N, n], comb [N, n, n] -> out [N, n, H]. In bf16, post y and
// comb^T X are each rounded, then their sum, as torch's bf16 formula rounds (post and comb given
// already rounded to bf16 values, as the formula's casts make them).
// NS streams known at compile time: each 8-wide column block of the n stream rows is loaded once
// for all n outputs (the general loop below loads it n times); the same sums in the same order.
template <typename D, int NS>
static void post_mix_fixed(const typename D::T* y, const typename D::T* X, const float* post, const float* comb,
                           int64_t N, int64_t H, typename D::T* out) {
    for (int64_t t = 0; t < N; t++) {
        const typename D::T* yt = y + t * H;
        const typename D::T* xt = X + t * NS * H;
        const float* ct = comb + t * NS * NS;
        __m256 c[NS][NS], p[NS];
        for (int i = 0; i < NS; i++)
            for (int j = 0; j < NS; j++) c[i][j] = _mm256_set1_ps(ct[i * NS + j]);
        for (int j = 0; j < NS; j++) p[j] = _mm256_set1_ps(post[t * NS + j]);
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
            __m256 acc[NS];
            for (int j = 0; j < NS; j++) acc[j] = _mm256_setzero_ps();
            for (int i = 0; i < NS; i++) {
                const __m256 x = D::load8(xt + i * H + h);
                for (int j = 0; j < NS; j++) acc[j] = _mm256_fmadd_ps(c[i][j], x, acc[j]);
            }
            const __m256 yv = D::load8(yt + h);
            for (int j = 0; j < NS; j++)
                D::store8(out + (t * NS + j) * H + h,
                          _mm256_add_ps(D::round8(_mm256_mul_ps(p[j], yv)), D::round8(acc[j])));
        }
        for (; h < H; h++)
            for (int j = 0; j < NS; j++) {
                float acc = 0.0f;
                for (int i = 0; i < NS; i++) acc = fmaf(ct[i * NS + j], D::value1(xt[i * H + h]), acc);
                D::store1(out + (t * NS + j) * H + h, D::round1(post[t * NS + j] * D::value1(yt[h])) + D::round1(acc));
            }
    }
}

template <typename D>
static void post_mix(const typename D::T* y, const typename D::T* X, const float* post, const float* comb, int64_t N,
                     int64_t n, int64_t H, typename D::T* out) {
    if (n == 4) return post_mix_fixed<D, 4>(y, X, post, comb, N, H, out);
    if (n == 2) return post_mix_fixed<D, 2>(y, X, post, comb, N, H, out);
    for (int64_t t = 0; t < N; t++) {
        const typename D::T* yt = y + t * H;
        const typename D::T* xt = X + t * n * H;
        const float* ct = comb + t * n * n;
        for (int64_t j = 0; j < n; j++) {
            typename D::T* o = out + (t * n + j) * H;
            const float pj = post[t * n + j];
            const __m256 p = _mm256_set1_ps(pj);
            int64_t h = 0;
            for (; h + 8 <= H; h += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < n; i++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(ct[i * n + j]), D::load8(xt + i * H + h), acc);
                D::store8(o + h, _mm256_add_ps(D::round8(_mm256_mul_ps(p, D::load8(yt + h))), D::round8(acc)));
            }
            for (; h < H; h++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < n; i++) acc = fmaf(ct[i * n + j], D::value1(xt[i * H + h]), acc);
                D::store1(o + h, D::round1(pj * D::value1(yt[h])) + D::round1(acc));
            }
        }
    }
}

// x [N, W] -> out [N, W] float32: x rsqrt(mean(x^2) + eps)
template <typename D>
static void norm_rows(const typename D::T* x, int64_t N, int64_t W, float eps, float* out) {
    for (int64_t t = 0; t < N; t++) {
        const typename D::T* r = x + t * W;
        float* o = out + t * W;
        const float inv = 1.0f / sqrtf(sum_squares<D>(r, W) / static_cast<float>(W) + eps);
        const __m256 s = _mm256_set1_ps(inv);
        int64_t w = 0;
        for (; w + 8 <= W; w += 8) _mm256_storeu_ps(o + w, _mm256_mul_ps(D::load8(r + w), s));
        for (; w < W; w++) o[w] = D::value1(r[w]) * inv;
    }
}

// X [N, n, H], pre [N, n] float32 -> out [N, H]: sum_i pre[i] X[i] in float32, rounded once on store
template <typename D>
static void collapse(const typename D::T* X, const float* pre, int64_t N, int64_t n, int64_t H, typename D::T* out) {
    for (int64_t t = 0; t < N; t++) {
        const typename D::T* xt = X + t * n * H;
        const float* pt = pre + t * n;
        typename D::T* o = out + t * H;
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_set1_ps(pt[0]), D::load8(xt + h));
            for (int64_t i = 1; i < n; i++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(pt[i]), D::load8(xt + i * H + h)));
            D::store8(o + h, acc);
        }
        for (; h < H; h++) {
            float acc = pt[0] * D::value1(xt[h]);
            for (int64_t i = 1; i < n; i++) acc = acc + pt[i] * D::value1(xt[i * H + h]);
            D::store1(o + h, acc);
        }
    }
}

extern "C" void mhc_weights_f32(const float* mixed, int64_t N, int64_t n, const float* base, const float* scale,
                                float hc_eps, int64_t iters, float* pre, float* post, float* comb, int64_t threads) {
    const int64_t width = (2 + n) * n;
    parallel_rows(N, threads, [&](int64_t t, int64_t count) {
        weights_rows(mixed + t * width, count, n, base, scale, hc_eps, iters, pre + t * n, post + t * n,
                     comb + t * n * n);
    });
}

template <typename D>
static void post_split(const typename D::T* y, const typename D::T* X, const float* post, const float* comb, int64_t N,
                       int64_t n, int64_t H, typename D::T* out, int64_t threads) {
    parallel_rows(N, threads, [&](int64_t t, int64_t count) {
        post_mix<D>(y + t * H, X + t * n * H, post + t * n, comb + t * n * n, count, n, H, out + t * n * H);
    });
}

template <typename D>
static void norm_split(const typename D::T* x, int64_t N, int64_t W, float eps, float* out, int64_t threads) {
    parallel_rows(N, threads, [&](int64_t t, int64_t count) { norm_rows<D>(x + t * W, count, W, eps, out + t * W); });
}

template <typename D>
static void collapse_split(const typename D::T* X, const float* pre, int64_t N, int64_t n, int64_t H,
                           typename D::T* out, int64_t threads) {
    parallel_rows(N, threads, [&](int64_t t, int64_t count) {
        collapse<D>(X + t * n * H, pre + t * n, count, n, H, out + t * H);
    });
}

extern "C" void mhc_post_f32(const float* y, const float* X, const float* post, const float* comb, int64_t N,
                             int64_t n, int64_t H, float* out, int64_t threads) {
    post_split<F32>(y, X, post, comb, N, n, H, out, threads);
}

extern "C" void mhc_post_bf16(const uint16_t* y, const uint16_t* X, const float* post, const float* comb, int64_t N,
                              int64_t n, int64_t H, uint16_t* out, int64_t threads) {
    post_split<Bf16>(y, X, post, comb, N, n, H, out, threads);
}

extern "C" void mhc_norm_f32(const float* x, int64_t N, int64_t W, float eps, float* out, int64_t threads) {
    norm_split<F32>(x, N, W, eps, out, threads);
}

extern "C" void mhc_norm_bf16(const uint16_t* x, int64_t N, int64_t W, float eps, float* out, int64_t threads) {
    norm_split<Bf16>(x, N, W, eps, out, threads);
}

extern "C" void mhc_collapse_f32(const float* X, const float* pre, int64_t N, int64_t n, int64_t H, float* out,
                                 int64_t threads) {
    collapse_split<F32>(X, pre, N, n, H, out, threads);
}

extern "C" void mhc_collapse_bf16(const uint16_t* X, const float* pre, int64_t N, int64_t n, int64_t H,
                                  uint16_t* out, int64_t threads) {
    collapse_split<Bf16>(X, pre, N, n, H, out, threads);
}
