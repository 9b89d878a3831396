// Decode attention straight from a paged KV pool (float32 or bfloat16), one call per step: for
// each sequence (or the run of its kv heads a thread's share holds), the scores q . K^T * scale of
// those heads' query heads over the sequence's history in one pass over its rows, their softmax,
// and probs . V while the rows are in cache, with the scores kept in a per-thread buffer. No gathered copy of the history and no per-layer view/transpose/mask ops.
// Pool rows hold [K (kv_heads x D) | V (kv_heads x D)] of one token; sequence b's token t sits in
// row tables[b, t / page] * page + t % page. Every sum runs in a fixed order per (sequence, head)
// and position, so a sequence's result does not depend on the rest of the batch or on the split.
// Built with AVX-512 (paged_attention.py's avx512 variant, and the bf16 decode layer), bf16 pools
// with a head dim that is a multiple of 16 run sixteen lanes (simd.h's F32x16): 30-35 against
// 39-44 us per sequence and layer for 8 x 576 tokens, 3 of 9 heads, D 64 (Sapphire Rapids). Its
// sums run in another order than the eight-lane build's, so the two builds differ in the last
// bits; float32 pools run eight lanes in every build, so the float32 decode layer (either build)
// and this kernel stay equal.
#include "parallel.h"
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>
#include <math.h>

#include <type_traits>
#include <vector>

// The history rows of one sequence in order, page by page (no division per row).
template <typename P>
struct RowWalk {
    const P* pool;
    int64_t stride, page;
    const int64_t* table;
    int64_t p = 0, i = 0;
    const P* next() {
        const P* row = pool + (table[p] * page + i) * stride;
        if (++i == page) i = 0, p++;
        return row;
    }
};

// the passes of one sequence's heads over vectors V
template <class V>
struct Lanes {
    using T = typename V::T;
    static constexpr int W = V::kLanes;
    // pool values as float32: float32 pools as they are, bf16 pools widened exactly
    static T pool(const float* p) { return V::load(p); }
    static T pool(const uint16_t* p) { return V::load_bf16(p); }

    // eight lanes summed pairs-quads-halves (a row scored alone equals it scored in a block)
    static float sum_lanes1(__m256 a) {
        const __m256 s = _mm256_hadd_ps(a, a), q = _mm256_hadd_ps(s, s);
        return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
    }

    // s[g * len + j] = q[g] . k[j] * scale for GB query heads and four rows (each a chain over d in
    // steps of W, folded, then the lanes summed pairs-quads-halves): each key vector is widened
    // once for GB heads
    template <int GB, typename P>
    static void dots4(const float* q, int64_t D, const P* const* k, float scale, float* s, int64_t len) {
        T a[GB][4];
        for (int g = 0; g < GB; g++)
            for (int j = 0; j < 4; j++) a[g][j] = V::zero();
        for (int64_t d = 0; d < D; d += W) {
            T qv[GB];
            for (int g = 0; g < GB; g++) qv[g] = V::load(q + g * D + d);
            for (int j = 0; j < 4; j++) {
                const T kv = pool(k[j] + d);
                for (int g = 0; g < GB; g++) a[g][j] = V::fmadd(qv[g], kv, a[g][j]);
            }
        }
        for (int g = 0; g < GB; g++) {
            const __m256 q4 = _mm256_hadd_ps(_mm256_hadd_ps(V::fold(a[g][0]), V::fold(a[g][1])),
                                             _mm256_hadd_ps(V::fold(a[g][2]), V::fold(a[g][3])));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(q4), _mm256_extractf128_ps(q4, 1));
            _mm_storeu_ps(s + g * len, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }

    template <typename P>
    static float dot1(const float* q, const P* k, int64_t D, float scale) {
        T a = V::zero();
        for (int64_t d = 0; d < D; d += W) a = V::fmadd(V::load(q + d), pool(k + d), a);
        return sum_lanes1(V::fold(a)) * scale;
    }

    // p[0 : n] = softmax(s[0 : n]) in place (simd.h's exp)
    static void softmax_row(float* s, int64_t n) {
        T vmax = V::set1(-INFINITY);   // the max is exact in any order
        int64_t i = 0;
        for (; i + W <= n; i += W) vmax = V::max(vmax, V::load(s + i));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, V::fold_max(vmax));
        float m = -INFINITY;
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        for (; i < n; i++) m = s[i] > m ? s[i] : m;
        const T vm = V::set1(m);
        T acc = V::zero();
        int64_t t = 0;
        for (; t + W <= n; t += W) {
            const T e = V::exp(V::sub(V::load(s + t), vm));
            V::store(s + t, e);
            acc = V::add(acc, e);
        }
        float sum = hsum(V::fold(acc));
        for (; t < n; t++) {
            s[t] = exp1(s[t] - m);
            sum += s[t];
        }
        const T inv = V::set1(1.0f / sum);
        for (t = 0; t + W <= n; t += W) V::store(s + t, V::mul(V::load(s + t), inv));
        for (; t < n; t++) s[t] *= 1.0f / sum;
    }

    // o[g, d0 : d0 + W * NV] = sum_t p[g, t] * V[t, d0 : ...] for GB query heads at once (p rows
    // len apart, o rows D apart): each V row is read once per GB heads; every lane sums over t in
    // order
    template <int GB, int NV, typename P>
    static void weighted_rows(const float* p, int64_t len, RowWalk<P> rows, int64_t v_off, float* o, int64_t D) {
        T acc[GB][NV];
        for (int g = 0; g < GB; g++)
            for (int i = 0; i < NV; i++) acc[g][i] = V::zero();
        for (int64_t t = 0; t < len; t++) {
            const P* v = rows.next() + v_off;
            T vv[NV];
            for (int i = 0; i < NV; i++) vv[i] = pool(v + i * W);
            for (int g = 0; g < GB; g++) {
                const T pt = V::set1(p[g * len + t]);
                for (int i = 0; i < NV; i++) acc[g][i] = V::fmadd(pt, vv[i], acc[g][i]);
            }
        }
        for (int g = 0; g < GB; g++)
            for (int i = 0; i < NV; i++) V::store(o + g * D + i * W, acc[g][i]);
    }

    // four vectors of the head per pass over the rows (eight lanes: 32 values; sixteen: a head of 64)
    template <int GB, typename P>
    static void heads(const float* p, int64_t len, const RowWalk<P>& rows, int64_t v_off, float* o, int64_t D) {
        int64_t d0 = 0;
        for (; d0 + 4 * W <= D; d0 += 4 * W) weighted_rows<GB, 4>(p, len, rows, v_off + d0, o + d0, D);
        for (; d0 < D; d0 += W) weighted_rows<GB, 1>(p, len, rows, v_off + d0, o + d0, D);
    }
};

// The kv heads [h0, h1) of one sequence: their query heads q [Hq, D] -> o [Hq, D] (rows of the
// heads outside untouched); s: scratch [(h1 - h0) * G, len]. The scores pass reads every row once
// for all these heads and prefetches the row a few steps ahead, V included, so the values pass
// (one head at a time) finds its rows in cache.
template <class L, typename P>
static void attend_heads(const float* q, const RowWalk<P>& start, int64_t len, int64_t h0, int64_t h1,
                         int64_t Hkv, int64_t D, int64_t G, int64_t row_bytes, float scale, float* s, float* o) {
    constexpr int64_t ahead = 16;   // rows
    RowWalk<P> rows = start, next = start;
    for (int64_t t = 0; t < len && t < ahead; t++) next.next();
    const P* k[4];
    int64_t t = 0;
    for (; t < len; t += 4) {
        const int64_t n = len - t < 4 ? len - t : 4;
        for (int j = 0; j < n; j++) {
            k[j] = rows.next();
            if (t + j + ahead < len) {
                const char* r = reinterpret_cast<const char*>(next.next());
                for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
            }
        }
        for (int64_t h = h0; h < h1; h++) {
            float* sh = s + (h - h0) * G * len + t;
            const float* qh = q + h * G * D;
            if (n < 4) {
                for (int j = 0; j < n; j++)
                    for (int64_t g = 0; g < G; g++) sh[g * len + j] = L::dot1(qh + g * D, k[j] + h * D, D, scale);
                continue;
            }
            const P* kh[4] = {k[0] + h * D, k[1] + h * D, k[2] + h * D, k[3] + h * D};
            int64_t g = 0;
            for (; g + 3 <= G; g += 3) L::template dots4<3>(qh + g * D, D, kh, scale, sh + g * len, len);
            for (; g + 2 <= G; g += 2) L::template dots4<2>(qh + g * D, D, kh, scale, sh + g * len, len);
            for (; g < G; g++) L::template dots4<1>(qh + g * D, D, kh, scale, sh + g * len, len);
        }
    }
    for (int64_t i = 0; i < (h1 - h0) * G; i++) L::softmax_row(s + i * len, len);
    for (int64_t h = h0; h < h1; h++) {
        const int64_t v_off = Hkv * D + h * D;
        const float* sh = s + (h - h0) * G * len;
        float* oh = o + h * G * D;
        int64_t g = 0;
        for (; g + 3 <= G; g += 3) L::template heads<3>(sh + g * len, len, start, v_off, oh + g * D, D);
        for (; g < G; g++) L::template heads<1>(sh + g * len, len, start, v_off, oh + g * D, D);
    }
}

// q, out [B, Hq, D] float32; items [first, first + count) of the B * Hkv (sequence, kv head)
// pairs, each sequence's run of them attended together; D a multiple of 8. A sequence of length
// 0 gets zeros.
template <typename P>
static void paged_decode(const float* q, const P* pool, int64_t row_stride, const int64_t* tables,
                         int64_t table_stride, const int64_t* lens, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t page, float scale, float* out, int64_t first, int64_t count) {
    const int64_t G = Hq / Hkv, row_bytes = 2 * Hkv * D * (int64_t)sizeof(P);
    const FlushDenormals flush;
    thread_local std::vector<float> scratch;
    for (int64_t item = first; item < first + count;) {
        const int64_t b = item / Hkv, h0 = item % Hkv;
        const int64_t h1 = (first + count - b * Hkv) < Hkv ? first + count - b * Hkv : Hkv;
        const int64_t len = lens[b];
        item = b * Hkv + h1;
        if (len <= 0) {
            for (int64_t i = h0 * G * D; i < h1 * G * D; i++) out[b * Hq * D + i] = 0.0f;
            continue;
        }
        if ((int64_t)scratch.size() < (h1 - h0) * G * len) scratch.resize((h1 - h0) * G * len);
        const RowWalk<P> rows{pool, row_stride, page, tables + b * table_stride};
#ifdef __AVX512F__
        if constexpr (std::is_same<P, uint16_t>::value)
            if (D % 16 == 0) {
                attend_heads<Lanes<F32x16>>(q + b * Hq * D, rows, len, h0, h1, Hkv, D, G, row_bytes, scale,
                                         scratch.data(), out + b * Hq * D);
                continue;
            }
#endif
        attend_heads<Lanes<F32x8>>(q + b * Hq * D, rows, len, h0, h1, Hkv, D, G, row_bytes, scale,
                                scratch.data(), out + b * Hq * D);
    }
}

// float32 and bfloat16 pools (bf16 values widened exactly; the sums run in float32 either way); the
// items (sequence, kv head) split over `threads` of torch's OpenMP team (parallel.h)
extern "C" void paged_decode_f32(const float* q, const float* pool, int64_t row_stride, const int64_t* tables,
                                 int64_t table_stride, const int64_t* lens, int64_t Hq, int64_t Hkv, int64_t D,
                                 int64_t page, float scale, float* out, int64_t items, int64_t threads) {
    parallel_rows(items, threads, [&](int64_t first, int64_t count) {
        paged_decode(q, pool, row_stride, tables, table_stride, lens, Hq, Hkv, D, page, scale, out, first, count);
    });
}

extern "C" void paged_decode_bf16(const float* q, const uint16_t* pool, int64_t row_stride, const int64_t* tables,
                                  int64_t table_stride, const int64_t* lens, int64_t Hq, int64_t Hkv, int64_t D,
                                  int64_t page, float scale, float* out, int64_t items, int64_t threads) {
    parallel_rows(items, threads, [&](int64_t first, int64_t count) {
        paged_decode(q, pool, row_stride, tables, table_stride, lens, Hq, Hkv, D, page, scale, out, first, count);
    });
}
