// Decode attention straight from a paged KV pool, in two halves around torch's softmax:
// scores = q . K^T * scale over each sequence's history (padding past its length = -inf), and
// out = probs . V. No gathered copy of the history and no per-layer view/transpose/mask ops.
// Pool rows hold [K (kv_heads x D) | V (kv_heads x D)] of one token; sequence b's token t sits in
// row tables[b, t / page] * page + t % page. Sums run in a fixed order per (sequence, head), so a
// sequence's result does not depend on the rest of the batch.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline const float* row_of(const float* pool, int64_t row_stride, const int64_t* table, int64_t page,
                                   int64_t t) {
    return pool + (table[t / page] * page + t % page) * row_stride;
}

// q [B, Hq, D]; scores [B, Hq, T] (T >= every length); D a multiple of 8
extern "C" void paged_scores_f32(const float* q, const float* pool, int64_t row_stride, const int64_t* tables,
                                 int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t page, float scale, float* scores, int64_t T) {
    const int64_t G = Hq / Hkv;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* table = tables + b * table_stride;
        const int64_t len = lens[b];
        for (int64_t h = 0; h < Hkv; h++) {
            const float* qh = q + (b * Hq + h * G) * D;
            float* sh = scores + (b * Hq + h * G) * T;
            for (int64_t t = 0; t < len; t++) {
                const float* k = row_of(pool, row_stride, table, page, t) + h * D;
                for (int64_t g = 0; g < G; g++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + d), _mm256_loadu_ps(k + d), acc);
                    sh[g * T + t] = hsum(acc) * scale;
                }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = len; t < T; t++) sh[g * T + t] = -INFINITY;
        }
    }
}

// probs [B, Hq, T]; out [B, Hq, D]
extern "C" void paged_values_f32(const float* probs, const float* pool, int64_t row_stride, const int64_t* tables,
                                 int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t page, int64_t T, float* out) {
    const int64_t G = Hq / Hkv;
    const int64_t v_offset = Hkv * D;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* table = tables + b * table_stride;
        const int64_t len = lens[b];
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t g = 0; g < G; g++) {
                const float* p = probs + (b * Hq + h * G + g) * T;
                float* o = out + (b * Hq + h * G + g) * D;
                for (int64_t d0 = 0; d0 < D; d0 += 64) {      // 8 accumulators of 8 lanes at a time
                    const int64_t width = D - d0 < 64 ? D - d0 : 64;
                    __m256 acc[8];
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                    for (int64_t t = 0; t < len; t++) {
                        const float* v = row_of(pool, row_stride, table, page, t) + v_offset + h * D + d0;
                        const __m256 pt = _mm256_broadcast_ss(p + t);
                        for (int i = 0; i < 8; i++)
                            if (i * 8 < width) acc[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + i * 8), acc[i]);
                    }
                    for (int i = 0; i < 8; i++)
                        if (i * 8 < width) _mm256_storeu_ps(o + d0 + i * 8, acc[i]);
                }
            }
    }
}
