// The DSA indexer's prefill scores (kernels/indexer.py, ``_score_pools``) without the [S, H, M]
// per-head products in memory: score[s, m] = sum_h w[s, h] * ReLU(scale * (q[s, h] . k[m])), the
// dot product summed in d order with FMAs, eight pools per vector and four queries per key load.
// torch's path writes, rescales and re-reads every per-head product (H x the scores' size), which
// at long contexts is most of a prefill chunk's indexer time. The keys come in blocks of eight
// pools, [ceil(M / 8), D, 8] (a block's D x 8 values contiguous: rows of a [D, M] transpose lie
// M floats apart and, at long contexts, on one cache set). The sums run in one fixed order
// whatever the batch (its rounding is not torch's GEMM's).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {
// NQ queries (a compile-time count, so their sums stay in registers) against every block of pools
template <int NQ>
void tile(const float* qs, const float* ws, const float* kb, int64_t H, int64_t D, int64_t M, float scale,
          float* out) {
    const __m256 vscale = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
    const int64_t blocks = (M + 7) / 8;
    for (int64_t mb = 0; mb < blocks; mb++) {
        const float* kv = kb + mb * D * 8;
        __m256 total[NQ];
        for (int i = 0; i < NQ; i++) total[i] = zero;
        for (int64_t h = 0; h < H; h++) {
            __m256 acc[NQ];
            for (int i = 0; i < NQ; i++) acc[i] = zero;
            for (int64_t d = 0; d < D; d++) {
                const __m256 k = _mm256_loadu_ps(kv + d * 8);
                for (int i = 0; i < NQ; i++)
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(qs[(i * H + h) * D + d]), k, acc[i]);
            }
            for (int i = 0; i < NQ; i++) {
                const __m256 r = _mm256_max_ps(_mm256_mul_ps(acc[i], vscale), zero);
                total[i] = _mm256_fmadd_ps(_mm256_set1_ps(ws[i * H + h]), r, total[i]);
            }
        }
        const int64_t m = mb * 8, valid = M - m < 8 ? M - m : 8;
        for (int i = 0; i < NQ; i++) {
            float* o = out + i * M + m;
            if (valid == 8) {
                _mm256_storeu_ps(o, total[i]);
            } else {
                alignas(32) float lanes[8];
                _mm256_store_ps(lanes, total[i]);
                memcpy(o, lanes, valid * sizeof(float));
            }
        }
    }
}
}  // namespace

// rows of [rows, H, D] queries q and [rows, H] weights w, all of one sequence whose keys are kb
// [ceil(M / 8), D, 8] (zero-padded past M); out [rows, M]
extern "C" void index_scores_f32(const float* q, const float* w, const float* kb, int64_t rows, int64_t H, int64_t D,
                                 int64_t M, float scale, float* out) {
    int64_t s = 0;
    for (; s + 4 <= rows; s += 4) tile<4>(q + s * H * D, w + s * H, kb, H, D, M, scale, out + s * M);
    for (; s < rows; s++) tile<1>(q + s * H * D, w + s * H, kb, H, D, M, scale, out + s * M);
}
