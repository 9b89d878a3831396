// x @ W^T (+ bias) with W in a GGUF file's own blocks of 32 weights (the quants and fp16 scales as
// the file stores them, regrouped by 8 output rows, see below):
//   Q4_1: fp16 d, fp16 m, 32 nibbles; w = d * q + m
//   Q8_0: fp16 d, 32 int8;            w = d * q
// Each block of 32 activations is quantised to int8 first (scale amax / 127, divide, round half
// to even; its sum s = scale * sum(q)), the block products are summed exactly in integers by AVX2
// byte products, and one block contributes d_w * d_x * isum (+ m_w * s_x for Q4_1): the arithmetic
// of llama.cpp's CPU dot products, not its code. Q8_0 signs go through maddubs(|w|, sign(w) * x)
// (no saturation: 2 * 127 * 127 < 32767); Q4_1 nibbles are unsigned already. Every row is computed
// in the same order whatever other rows share the call (batch-invariant). Rows: any number
// (decode and prefill).
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>

#include <vector>

enum BlockKind : int { Q4_1 = 0, Q8_0 = 1 };
static inline float hmax(__m256 v) {
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

// one row of K activations -> K int8 (q), per-block scales d and sums s = d * sum(q)
static void quantize_blocks(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * 32;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(xb + 8 * t);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
        }
        const float scale = hmax(amax) / 127.0f;
        __m256i total = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i i32 = _mm256_setzero_si256();
            if (scale > 0.0f) {
                __m256 r = _mm256_round_ps(_mm256_div_ps(v[t], _mm256_set1_ps(scale)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            }
            total = _mm256_add_epi32(total, i32);
            __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i*)(q + b * 32 + 8 * t), _mm_packs_epi16(i16, i16));
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        d[b] = scale;
        s[b] = scale * (float)_mm_cvtsi128_si32(t);
    }
}

// Weights come repacked by groups of 8 output rows (kernels.gguf_blocks.repack): per group, per
// block of 32 inputs, the 8 rows' fp16 d (and m), then the quants laid out so that one 32-byte
// vector holds 4 consecutive inputs of each of the 8 rows. One broadcast quad of activations then
// meets all 8 rows in one byte-product instruction, and a vector lane is an output row: no
// horizontal sums, and the scales of 8 rows convert and apply as one vector.
//   Q4_1 (160 bytes): d[8], m[8], 4 x 32 bytes; byte 4r+i of vector t holds row r's inputs 4t+i
//                     (low nibble) and 16+4t+i (high nibble), as the file's own byte 4t+i does
//   Q8_0 (272 bytes): d[8], 8 x 32 int8; byte 4r+i of vector t is row r's input 4t+i
template <int KIND>
struct Packed;
template <>
struct Packed<Q4_1> { static constexpr int64_t bytes = 160; };
template <>
struct Packed<Q8_0> { static constexpr int64_t bytes = 272; };

static inline __m256i quad(const int8_t* q) { return _mm256_set1_epi32(*(const int32_t*)q); }

// out[i, 0..7] = MR quantised rows (Q, block scales xd, sums xs; nb blocks) x one group of 8 rows
template <int KIND, int MR>
static inline void group_tile(const int8_t* Q, const float* xd, const float* xs, int64_t nb, const uint8_t* G,
                              __m256 out[MR]) {
    constexpr int64_t BYTES = Packed<KIND>::bytes;
    __m256 acc[MR];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = G + b * BYTES;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        if constexpr (KIND == Q4_1) {
            const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
            __m256i w[8];
            for (int t = 0; t < 4; t++) {
                const __m256i p = _mm256_loadu_si256((const __m256i*)(blk + 32 + 32 * t));
                w[t] = _mm256_and_si256(p, low);
                w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            }
            for (int i = 0; i < MR; i++) {
                const int8_t* q = Q + i * nb * 32 + b * 32;
                // nibbles (<= 15) x int8 (|x| <= 127): eight pair sums stay below 32767 in int16
                __m256i s = _mm256_maddubs_epi16(w[0], quad(q));
                for (int t = 1; t < 8; t++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[t], quad(q + 4 * t)));
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
                acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d8, _mm256_set1_ps(xd[i * nb + b])), acc[i]);
                acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xs[i * nb + b]), acc[i]);
            }
        } else {
            for (int i = 0; i < MR; i++) {
                const int8_t* q = Q + i * nb * 32 + b * 32;
                __m256i s = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * t));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(quad(q + 4 * t), w));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d8, _mm256_set1_ps(xd[i * nb + b])),
                                         acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; i++) out[i] = acc[i];
}

template <int KIND, int MR>
static inline void store_tile(const int8_t* Q, const float* xd, const float* xs, int64_t nb, const uint8_t* G,
                              int64_t rows, const float* bias, float* C, int64_t ldc) {
    __m256 out[MR];
    group_tile<KIND, MR>(Q, xd, xs, nb, G, out);
    for (int i = 0; i < MR; i++) {
        float v[8];
        _mm256_storeu_ps(v, out[i]);
        for (int64_t r = 0; r < rows; r++) C[i * ldc + r] = bias ? v[r] + bias[r] : v[r];
    }
}

template <int KIND>
static void block_gemm(const float* A, int64_t M, int64_t lda, const uint8_t* W, int64_t N, int64_t K,
                       const float* bias, float* C, int64_t ldc) {
    // the quantised rows, their block scales and sums: scratch of the calling thread, kept
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> scales;
    const int64_t nb = K / 32, ldg = nb * Packed<KIND>::bytes, groups = (N + 7) / 8;
    q.resize(M * K);
    scales.resize(2 * M * nb);
    int8_t* Q = q.data();
    float* xd = scales.data();
    float* xs = xd + M * nb;
    for (int64_t m = 0; m < M; m++) quantize_blocks(A + m * lda, nb, Q + m * K, xd + m * nb, xs + m * nb);
    // rows in chunks that stay in L2 while every group of weights passes them
    constexpr int64_t CHUNK = 64;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        const int64_t m1 = m0 + CHUNK < M ? m0 + CHUNK : M;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t* G = W + g * ldg;
            const int64_t rows = N - 8 * g < 8 ? N - 8 * g : 8;
            const float* b = bias ? bias + 8 * g : nullptr;
            int64_t m = m0;
            for (; m + 4 <= m1; m += 4)
                store_tile<KIND, 4>(Q + m * K, xd + m * nb, xs + m * nb, nb, G, rows, b, C + m * ldc + 8 * g, ldc);
            for (; m < m1; m++)
                store_tile<KIND, 1>(Q + m * K, xd + m * nb, xs + m * nb, nb, G, rows, b, C + m * ldc + 8 * g, ldc);
        }
    }
}

// W: repacked groups [ceil(N / 8), K / 32 * Packed bytes]; K a multiple of 32
extern "C" void block_gemm_q4_1(const float* A, int64_t M, int64_t lda, const uint8_t* W, int64_t N, int64_t K,
                                const float* bias, float* C, int64_t ldc) {
    block_gemm<Q4_1>(A, M, lda, W, N, K, bias, C, ldc);
}

extern "C" void block_gemm_q8_0(const float* A, int64_t M, int64_t lda, const uint8_t* W, int64_t N, int64_t K,
                                const float* bias, float* C, int64_t ldc) {
    block_gemm<Q8_0>(A, M, lda, W, N, K, bias, C, ldc);
}
