// x @ W^T (+ bias) for a few rows of bfloat16 x against bfloat16 W ([N, K] row-major, as
// loaded, so the same weights serve torch's matmul for prefill): the decode case of a bf16
// model, where torch's bf16 linear at one row reads the weights at a fraction of the memory
// bandwidth. AVX512_BF16's dot-product instruction multiplies 32 bf16 pairs into 16 float32
// lanes; each output is accumulated in K order in 16 lanes, summed in one fixed order, has the
// bias (float32) added and is rounded to bf16 as torch rounds: a row's result does not depend on
// which other rows share the call (batch-invariant). Built with -mavx512f -mavx512bw
// -mavx512bf16; the caller checks the CPU flags.
#include "simd.h"

#include <immintrin.h>
#include <stdint.h>

namespace {
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// C[i, j] for MR rows of A and NR rows of W
template <int MR, int NR>
inline void tile(const uint16_t* A, int64_t lda, const uint16_t* W, int64_t ldw, int64_t K, __mmask32 tail,
                 uint16_t* C, int64_t ldc, const float* bias) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i w[NR];
        for (int j = 0; j < NR; j++) w[j] = _mm512_loadu_si512(W + j * ldw + k);
        for (int i = 0; i < MR; i++) {
            const __m512i a = _mm512_loadu_si512(A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(a), as_bh(w[j]));
        }
    }
    if (k < K) {   // zeros past K
        __m512i w[NR];
        for (int j = 0; j < NR; j++) w[j] = _mm512_maskz_loadu_epi16(tail, W + j * ldw + k);
        for (int i = 0; i < MR; i++) {
            const __m512i a = _mm512_maskz_loadu_epi16(tail, A + i * lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(a), as_bh(w[j]));
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            if (bias) s += bias[j];
            C[i * ldc + j] = bf16_bits(s);
        }
}

template <int NR>
inline void rows_of(const uint16_t* A, int64_t M, int64_t lda, const uint16_t* W, int64_t ldw, int64_t K,
                    __mmask32 tail, uint16_t* C, int64_t ldc, const float* bias) {
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) tile<4, NR>(A + i * lda, lda, W, ldw, K, tail, C + i * ldc, ldc, bias);
    for (; i < M; i++) tile<1, NR>(A + i * lda, lda, W, ldw, K, tail, C + i * ldc, ldc, bias);
}
}  // namespace

// C [M, N] (row stride ldc) = A [M, K] (row stride lda) @ W[N, K]^T (row stride ldw) + bias [N]
// (float32, may be null); K even is not required (the tail is masked)
extern "C" void row_gemm_bf16(const uint16_t* A, int64_t M, int64_t lda, const uint16_t* W, int64_t N, int64_t K,
                              int64_t ldw, const float* bias, uint16_t* C, int64_t ldc) {
    const int64_t rest = K % 32;
    const __mmask32 tail = rest ? static_cast<__mmask32>((1ull << rest) - 1) : 0;
    int64_t j = 0;
    for (; j + 4 <= N; j += 4)
        rows_of<4>(A, M, lda, W + j * ldw, ldw, K, tail, C + j, ldc, bias ? bias + j : nullptr);
    for (; j < N; j++) rows_of<1>(A, M, lda, W + j * ldw, ldw, K, tail, C + j, ldc, bias ? bias + j : nullptr);
}
