// x @ W^T (+ bias) for a few rows of x: the decode case, where MKL's small-M sgemm on AVX2 runs
// at a fraction of the memory bandwidth. W stays as loaded ([N, K] row-major), so the same
// weights serve torch's matmul for prefill. Each output is one dot product along K, accumulated
// in 8 lanes in K order then summed the same way for every row count: a row's result does not
// depend on which other rows share the call (batch-invariant).
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// C[i, j] = A[i, :] . W[j, :] (+ bias[j]) for MR rows of A and NR rows of W
template <int MR, int NR>
static inline void tile(const float* A, int64_t lda, const float* W, int64_t ldw, int64_t K, __m256i tail,
                        float* C, int64_t ldc, const float* bias) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 w[NR];
        for (int j = 0; j < NR; j++) w[j] = _mm256_loadu_ps(W + j * ldw + k);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_loadu_ps(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, w[j], acc[i][j]);
        }
    }
    if (k < K) {  // masked loads read zeros past K
        __m256 w[NR];
        for (int j = 0; j < NR; j++) w[j] = _mm256_maskload_ps(W + j * ldw + k, tail);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_maskload_ps(A + i * lda + k, tail);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) C[i * ldc + j] = hsum(acc[i][j]) + (bias ? bias[j] : 0.0f);
}

// all M rows against NR rows of W: the NR weight rows stay in L1 while the row pairs pass
template <int NR>
static inline void rows(const float* A, int64_t M, int64_t lda, const float* W, int64_t ldw, int64_t K,
                        __m256i tail, float* C, int64_t ldc, const float* bias) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) tile<2, NR>(A + m * lda, lda, W, ldw, K, tail, C + m * ldc, ldc, bias);
    if (m < M) tile<1, NR>(A + m * lda, lda, W, ldw, K, tail, C + m * ldc, ldc, bias);
}

extern "C" void row_gemm_f32(const float* A, int64_t M, int64_t lda, const float* W, int64_t N, int64_t K,
                             int64_t ldw, const float* bias, float* C, int64_t ldc) {
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = i < K % 8 ? -1 : 0;
    const __m256i tail = _mm256_loadu_si256((const __m256i*)lanes);
    int64_t n = 0;
    if (M == 1)  // one row: eight weight streams keep more loads in flight (bandwidth-bound)
        for (; n + 8 <= N; n += 8)
            rows<8>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, bias ? bias + n : nullptr);
    for (; n + 4 <= N; n += 4)
        rows<4>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, bias ? bias + n : nullptr);
    for (; n < N; n++)
        rows<1>(A, M, lda, W + n * ldw, ldw, K, tail, C + n, ldc, bias ? bias + n : nullptr);
}
