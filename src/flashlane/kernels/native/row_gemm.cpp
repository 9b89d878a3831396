// x @ W^T (+ bias) for a few rows of x: the decode case, where MKL's small-M sgemm on AVX2 runs
// at a fraction of the memory bandwidth. W stays as loaded ([N, K] row-major), so the same
// weights serve torch's matmul for prefill. W is float32 (row_gemm_f32) or int8 with one float32
// scale per output row (row_gemm_i8w, weight-only int8: a quarter of the bytes to read; each
// int8 weight is widened to float32 exactly, so only the weight's own rounding differs). Each
// output is one dot product along K, accumulated in 8 lanes in K order then summed the same way
// for every row count: a row's result does not depend on which other rows share the call
// (batch-invariant).
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>

#include <vector>

// eight weights as float32: loaded (float), or widened exactly (int8)
static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
static inline __m256 load8(const int8_t* w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
}
// the last K % 8 weights, zeros past K (int8: copied out, a masked load has no byte form)
static inline __m256 load_tail(const float* w, __m256i tail, int64_t) { return _mm256_maskload_ps(w, tail); }
static inline __m256 load_tail(const int8_t* w, __m256i, int64_t n) {
    int8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) buf[i] = w[i];
    return load8(buf);
}

// one output from its dot product: scaled (int8 weights), then the bias added; every tile of
// both builds stores through this, so they round alike
static inline void store_dot(float dot, float* c, int64_t j, const float* bias, const float* scale) {
    if (scale) dot *= scale[j];
    c[j] = dot + (bias ? bias[j] : 0.0f);
}

// C[i, j] = (A[i, :] . W[j, :]) * scale[j] (+ bias[j]) for MR rows of A and NR rows of W
// (scale: int8 weights' per-row scales, null for float32)
template <int MR, int NR, typename WT>
static inline void tile(const float* A, int64_t lda, const WT* W, int64_t ldw, int64_t K, __m256i tail,
                        float* C, int64_t ldc, const float* bias, const float* scale) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    // int8 rows: the next NR rows fetched meanwhile, as in tile_i8 below (float32 rows are long
    // enough for the hardware prefetcher; measured slower with this)
    const int8_t* next = (const int8_t*)(W + NR * ldw);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if constexpr (sizeof(WT) == 1)
            if (k % 32 == 0)
                for (int l = 0; l < NR * 32; l += 64) _mm_prefetch((const char*)next + k * NR + l, _MM_HINT_T0);
        __m256 w[NR];
        for (int j = 0; j < NR; j++) w[j] = load8(W + j * ldw + k);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_loadu_ps(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, w[j], acc[i][j]);
        }
    }
    if (k < K) {  // masked loads read zeros past K
        __m256 w[NR];
        for (int j = 0; j < NR; j++) w[j] = load_tail(W + j * ldw + k, tail, K - k);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_maskload_ps(A + i * lda + k, tail);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) store_dot(hsum(acc[i][j]), C + i * ldc, j, bias, scale);
}

// all M rows against NR rows of W: the NR weight rows stay in L1 while the row pairs pass
template <int NR, typename WT>
static inline void rows(const float* A, int64_t M, int64_t lda, const WT* W, int64_t ldw, int64_t K,
                        __m256i tail, float* C, int64_t ldc, const float* bias, const float* scale) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) tile<2, NR>(A + m * lda, lda, W, ldw, K, tail, C + m * ldc, ldc, bias, scale);
    if (m < M) tile<1, NR>(A + m * lda, lda, W, ldw, K, tail, C + m * ldc, ldc, bias, scale);
}

#ifdef __AVX512F__
// The AVX-512 build (row_gemm.py builds this file twice, simd_variants.py): two weight rows' eight
// values side by side in one 16-lane vector (row j low, row j + 1 high) against A's eight values
// in both halves. Each half accumulates exactly as tile's 8-lane vector does and is summed by the
// same hsum, so this build rounds as the AVX2 build, bit for bit, with twice the multiply-adds per
// instruction and the 32 registers to hold up to 8 rows of A at once: at decode batch sizes every
// weight is read from memory once per call (the AVX2 tiles pass over it once per 2 rows, from
// cache after the first pass, which left the 8-row case compute-bound at a third of the 1-row
// bandwidth).
static inline __m512 halves(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m512 both_halves(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }
static inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// tile's C for MR rows of A and 2 * NP rows of W
template <int MR, int NP, typename WT>
static inline void tile_pairs(const float* A, int64_t lda, const WT* W, int64_t ldw, int64_t K, __m256i tail,
                              float* C, int64_t ldc, const float* bias, const float* scale) {
    __m512 acc[MR][NP];
    for (int i = 0; i < MR; i++)
        for (int p = 0; p < NP; p++) acc[i][p] = _mm512_setzero_ps();
    // the next 2 * NP weight rows fetched meanwhile: int8 as tile does; float32 too, a cache line
    // of each next row per line of these (with up to 8 rows of A a line takes long enough to use
    // that the hardware prefetcher fell behind: SmolLM2's linears at 8 rows, from memory, 8 against
    // 12 GB/s, where 1 row reads 14)
    const WT* next = W + 2 * NP * ldw;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if constexpr (sizeof(WT) == 1) {
            if (k % 32 == 0)
                for (int l = 0; l < 2 * NP * 32; l += 64) _mm_prefetch((const char*)next + k * 2 * NP + l, _MM_HINT_T0);
        } else if (k % 16 == 0) {
            for (int j = 0; j < 2 * NP; j++) _mm_prefetch((const char*)(next + j * ldw + k), _MM_HINT_T0);
        }
        __m512 w[NP];
        for (int p = 0; p < NP; p++) w[p] = halves(load8(W + 2 * p * ldw + k), load8(W + (2 * p + 1) * ldw + k));
        for (int i = 0; i < MR; i++) {
            const __m512 a = both_halves(_mm256_loadu_ps(A + i * lda + k));
            for (int p = 0; p < NP; p++) acc[i][p] = _mm512_fmadd_ps(a, w[p], acc[i][p]);
        }
    }
    if (k < K) {
        __m512 w[NP];
        for (int p = 0; p < NP; p++)
            w[p] = halves(load_tail(W + 2 * p * ldw + k, tail, K - k), load_tail(W + (2 * p + 1) * ldw + k, tail, K - k));
        for (int i = 0; i < MR; i++) {
            const __m512 a = both_halves(_mm256_maskload_ps(A + i * lda + k, tail));
            for (int p = 0; p < NP; p++) acc[i][p] = _mm512_fmadd_ps(a, w[p], acc[i][p]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int p = 0; p < NP; p++) {
            store_dot(hsum(_mm512_castps512_ps256(acc[i][p])), C + i * ldc, 2 * p, bias, scale);
            store_dot(hsum(high_half(acc[i][p])), C + i * ldc, 2 * p + 1, bias, scale);
        }
}

// all M rows against 2 * NP rows of W, 8 rows of A at a time
template <int NP, typename WT>
static inline void row_pairs(const float* A, int64_t M, int64_t lda, const WT* W, int64_t ldw, int64_t K,
                             __m256i tail, float* C, int64_t ldc, const float* bias, const float* scale) {
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) tile_pairs<8, NP>(A + m * lda, lda, W, ldw, K, tail, C + m * ldc, ldc, bias, scale);
    const float* a = A + m * lda;
    float* c = C + m * ldc;
    switch (M - m) {
        case 1: tile_pairs<1, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 2: tile_pairs<2, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 3: tile_pairs<3, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 4: tile_pairs<4, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 5: tile_pairs<5, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 6: tile_pairs<6, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        case 7: tile_pairs<7, NP>(a, lda, W, ldw, K, tail, c, ldc, bias, scale); break;
        default: break;
    }
}
#endif

template <typename WT>
static void row_gemm(const float* A, int64_t M, int64_t lda, const WT* W, int64_t N, int64_t K, int64_t ldw,
                     const float* bias, const float* scale, float* C, int64_t ldc) {
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = i < K % 8 ? -1 : 0;
    const __m256i tail = _mm256_loadu_si256((const __m256i*)lanes);
    int64_t n = 0;
#define AT(p, n) ((p) ? (p) + (n) : nullptr)
#ifdef __AVX512F__
    if (M > 1) {
        for (; n + 4 <= N; n += 4)
            row_pairs<2>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, AT(bias, n), AT(scale, n));
        for (; n + 2 <= N; n += 2)
            row_pairs<1>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, AT(bias, n), AT(scale, n));
    }
#endif
    if (M == 1)  // one row: eight weight streams keep more loads in flight (bandwidth-bound)
        for (; n + 8 <= N; n += 8)
            rows<8>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, AT(bias, n), AT(scale, n));
    for (; n + 4 <= N; n += 4)
        rows<4>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, AT(bias, n), AT(scale, n));
    for (; n < N; n++)
        rows<1>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, AT(bias, n), AT(scale, n));
#undef AT
}

extern "C" void row_gemm_f32(const float* A, int64_t M, int64_t lda, const float* W, int64_t N, int64_t K,
                             int64_t ldw, const float* bias, float* C, int64_t ldc) {
    row_gemm(A, M, lda, W, N, K, ldw, bias, (const float*)nullptr, C, ldc);
}

extern "C" void row_gemm_i8w(const float* A, int64_t M, int64_t lda, const int8_t* W, const float* scale,
                             int64_t N, int64_t K, int64_t ldw, const float* bias, float* C, int64_t ldc) {
    row_gemm(A, M, lda, W, N, K, ldw, bias, scale, C, ldc);
}

// ---- dynamic W8A8: int8 activations (symmetric, one scale per row) x int8 weights --------------
// Each row of A is quantised as quant_matmul.quantize_per_token does (amax / 127, divide, round
// half to even, clamp to +-127); the products are summed exactly in int32, so the result equals
// torch._int_mm's, and the scales are applied in w8a8_linear's order: (acc * x_scale) * w_scale
// (+ bias). AVX2 has no int8 dot instruction: |w| (unsigned, <= 127) times sign(w) * x (signed)
// through maddubs cannot saturate its int16 pair sums (2 * 127 * 127 < 32767).

static void quantize_row(const float* x, int64_t K, int8_t* q, float* scale) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, amax);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; k < K; k++) m = __builtin_fabsf(x[k]) > m ? __builtin_fabsf(x[k]) : m;
    float s = m / 127.0f;
    if (!(s >= 1e-12f)) s = 1e-12f;
    *scale = s;
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(i16, i16));
    }
    for (; k < K; k++) {
        float v = __builtin_nearbyintf(x[k] / s);
        q[k] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
    }
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// acc[i][j] = Q[i, :] . W[j, :] exactly, for MR quantised rows and NR weight rows
template <int MR, int NR>
static inline void tile_i8(const int8_t* Q, int64_t ldq, const int8_t* W, int64_t ldw, int64_t K,
                           int32_t acc_out[MR][NR]) {
    __m256i acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    // the next NR weight rows, fetched while these are summed: int8 rows are short (a few cache
    // lines), too short for the hardware prefetcher to pick up each as a stream in time
    const char* next = (const char*)(W + NR * ldw);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int l = 0; l < NR * 32; l += 64) _mm_prefetch(next + k * NR + l, _MM_HINT_T0);
        __m256i w[NR], wabs[NR];
        for (int j = 0; j < NR; j++) {
            w[j] = _mm256_loadu_si256((const __m256i*)(W + j * ldw + k));
            wabs[j] = _mm256_sign_epi8(w[j], w[j]);
        }
        for (int i = 0; i < MR; i++) {
            __m256i a = _mm256_loadu_si256((const __m256i*)(Q + i * ldq + k));
            for (int j = 0; j < NR; j++) {
                __m256i pairs = _mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(a, w[j]));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            int32_t s = hsum_i32(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += (int32_t)Q[i * ldq + t] * (int32_t)W[j * ldw + t];
            acc_out[i][j] = s;
        }
}

template <int NR>
static inline void rows_w8a8(const int8_t* Q, int64_t M, int64_t ldq, const float* xs, const int8_t* W,
                             int64_t ldw, int64_t K, const float* ws, const float* bias, float* C, int64_t ldc) {
    int32_t acc[2][NR];
    int64_t m = 0;
    auto store = [&](int rows, int64_t m0) {
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < NR; j++) {
                float v = (float)acc[i][j] * xs[m0 + i];
                v = v * ws[j];
                C[(m0 + i) * ldc + j] = bias ? v + bias[j] : v;
            }
    };
    for (; m + 2 <= M; m += 2) {
        tile_i8<2, NR>(Q + m * ldq, ldq, W, ldw, K, acc);
        store(2, m);
    }
    if (m < M) {
        tile_i8<1, NR>(Q + m * ldq, ldq, W, ldw, K, (int32_t(*)[NR])acc);
        store(1, m);
    }
}

extern "C" void row_gemm_w8a8(const float* A, int64_t M, int64_t lda, const int8_t* W, const float* wscale,
                              int64_t N, int64_t K, int64_t ldw, const float* bias, float* C, int64_t ldc) {
    // the quantised rows and their scales: scratch of the calling thread, kept between calls
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> xs;
    q.resize(M * K);
    xs.resize(M);
    int8_t* qbuf = q.data();
    float* xscale = xs.data();
    for (int64_t m = 0; m < M; m++) quantize_row(A + m * lda, K, qbuf + m * K, xscale + m);
    int64_t n = 0;
#define AT(p, n) ((p) ? (p) + (n) : nullptr)
    if (M == 1)
        for (; n + 8 <= N; n += 8)
            rows_w8a8<8>(qbuf, M, K, xscale, W + n * ldw, ldw, K, wscale + n, AT(bias, n), C + n, ldc);
    for (; n + 4 <= N; n += 4)
        rows_w8a8<4>(qbuf, M, K, xscale, W + n * ldw, ldw, K, wscale + n, AT(bias, n), C + n, ldc);
    for (; n < N; n++)
        rows_w8a8<1>(qbuf, M, K, xscale, W + n * ldw, ldw, K, wscale + n, AT(bias, n), C + n, ldc);
#undef AT
}
