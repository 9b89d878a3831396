// Decode attention straight from a paged KV pool (float32 or bfloat16), in two halves around torch's softmax:
// scores = q . K^T * scale over each sequence's history (padding past its length = -inf), and
// out = probs . V. No gathered copy of the history and no per-layer view/transpose/mask ops.
// Pool rows hold [K (kv_heads x D) | V (kv_heads x D)] of one token; sequence b's token t sits in
// row tables[b, t / page] * page + t % page. Sums run in a fixed order per (sequence, head), so a
// sequence's result does not depend on the rest of the batch.
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>
#include <math.h>

template <typename T>
static inline const T* row_of(const T* pool, int64_t row_stride, const int64_t* table, int64_t page, int64_t t) {
    return pool + (table[t / page] * page + t % page) * row_stride;
}

// eight pool values as float32: float32 pools as they are, bf16 pools widened exactly
static inline __m256 pool8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 pool8(const uint16_t* p) { return bf16_load8(p); }

// q . k * scale for one query head and TB history rows (TB independent FMA chains keep the
// FMA units busy; each score is one chain over d in order, whatever TB)
template <int TB, typename T>
static inline void dots(const float* qg, const T* const* k, int64_t D, float scale, float* out) {
    __m256 acc[TB];
    for (int j = 0; j < TB; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int j = 0; j < TB; j++) acc[j] = _mm256_fmadd_ps(qv, pool8(k[j] + d), acc[j]);
    }
    for (int j = 0; j < TB; j++) out[j] = hsum(acc[j]) * scale;
}

// q [B, Hq, D] float32; scores [B, Hq, T] (T >= every length); D a multiple of 8
template <typename P>
static void paged_scores(const float* q, const P* pool, int64_t row_stride, const int64_t* tables,
                         int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t page, float scale, float* scores, int64_t T) {
    const int64_t G = Hq / Hkv;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* table = tables + b * table_stride;
        const int64_t len = lens[b];
        for (int64_t h = 0; h < Hkv; h++) {
            const float* qh = q + (b * Hq + h * G) * D;
            float* sh = scores + (b * Hq + h * G) * T;
            int64_t t = 0;
            for (; t + 4 <= len; t += 4) {
                const P* k[4];
                for (int j = 0; j < 4; j++) k[j] = row_of(pool, row_stride, table, page, t + j) + h * D;
                for (int64_t g = 0; g < G; g++) dots<4>(qh + g * D, k, D, scale, sh + g * T + t);
            }
            for (; t < len; t++) {
                const P* k[1] = {row_of(pool, row_stride, table, page, t) + h * D};
                for (int64_t g = 0; g < G; g++) dots<1>(qh + g * D, k, D, scale, sh + g * T + t);
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t t2 = len; t2 < T; t2++) sh[g * T + t2] = -INFINITY;
        }
    }
}

// out[g, d0 : d0 + 8 * NV] = sum_t probs[g, t] * V[t, d0 : ...] for GB query heads at once: each
// V row is read once per GB heads; every output lane sums over t in order, whatever GB and NV
template <int GB, int NV, typename P>
static inline void weighted_rows(const float* p, int64_t T, const P* pool, int64_t row_stride, const int64_t* table,
                                 int64_t page, int64_t len, int64_t v_off, float* o, int64_t D) {
    __m256 acc[GB][NV];
    for (int g = 0; g < GB; g++)
        for (int i = 0; i < NV; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const P* v = row_of(pool, row_stride, table, page, t) + v_off;
        __m256 vv[NV];
        for (int i = 0; i < NV; i++) vv[i] = pool8(v + i * 8);
        for (int g = 0; g < GB; g++) {
            const __m256 pt = _mm256_broadcast_ss(p + g * T + t);
            for (int i = 0; i < NV; i++) acc[g][i] = _mm256_fmadd_ps(pt, vv[i], acc[g][i]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + g * D + i * 8, acc[g][i]);
}

template <int GB, typename P>
static inline void heads(const float* p, int64_t T, const P* pool, int64_t row_stride, const int64_t* table,
                         int64_t page, int64_t len, int64_t v_off, float* o, int64_t D) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) weighted_rows<GB, 4>(p, T, pool, row_stride, table, page, len, v_off + d0, o + d0, D);
    for (; d0 < D; d0 += 8) weighted_rows<GB, 1>(p, T, pool, row_stride, table, page, len, v_off + d0, o + d0, D);
}

// probs [B, Hq, T]; out [B, Hq, D] float32
template <typename P>
static void paged_values(const float* probs, const P* pool, int64_t row_stride, const int64_t* tables,
                         int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t page, int64_t T, float* out) {
    const int64_t G = Hq / Hkv;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* table = tables + b * table_stride;
        const int64_t len = lens[b];
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t v_off = Hkv * D + h * D;
            int64_t g = 0;
            for (; g + 3 <= G; g += 3) {
                const int64_t head = b * Hq + h * G + g;
                heads<3>(probs + head * T, T, pool, row_stride, table, page, len, v_off, out + head * D, D);
            }
            for (; g < G; g++) {
                const int64_t head = b * Hq + h * G + g;
                heads<1>(probs + head * T, T, pool, row_stride, table, page, len, v_off, out + head * D, D);
            }
        }
    }
}

// float32 and bfloat16 pools (bf16 values widened exactly; the sums run in float32 either way)
extern "C" void paged_scores_f32(const float* q, const float* pool, int64_t row_stride, const int64_t* tables,
                                 int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t page, float scale, float* scores, int64_t T) {
    paged_scores(q, pool, row_stride, tables, table_stride, lens, B, Hq, Hkv, D, page, scale, scores, T);
}

extern "C" void paged_scores_bf16(const float* q, const uint16_t* pool, int64_t row_stride, const int64_t* tables,
                                  int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                  int64_t D, int64_t page, float scale, float* scores, int64_t T) {
    paged_scores(q, pool, row_stride, tables, table_stride, lens, B, Hq, Hkv, D, page, scale, scores, T);
}

extern "C" void paged_values_f32(const float* probs, const float* pool, int64_t row_stride, const int64_t* tables,
                                 int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t page, int64_t T, float* out) {
    paged_values(probs, pool, row_stride, tables, table_stride, lens, B, Hq, Hkv, D, page, T, out);
}

extern "C" void paged_values_bf16(const float* probs, const uint16_t* pool, int64_t row_stride, const int64_t* tables,
                                  int64_t table_stride, const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv,
                                  int64_t D, int64_t page, int64_t T, float* out) {
    paged_values(probs, pool, row_stride, tables, table_stride, lens, B, Hq, Hkv, D, page, T, out);
}
