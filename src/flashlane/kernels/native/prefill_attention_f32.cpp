// Causal attention of a float32 prefill chunk over its sequence's paged K|V rows (flash-attention
// style, FMA vectors): each kv head's keys are packed once, transposed into blocks of one vector's
// width of keys ([D][lanes] per block), and its values copied into rows, straight from the pool's
// pages (no gathered copy of the history, one pass over history and chunk: no two-part merge).
// The query rows of a block are the G query heads sharing the kv head times a run of positions,
// so every key and value load serves all of them. Per span of keys: every row's scores by a
// register-blocked micro-kernel (RS rows x NS vectors of keys, the queries pre-scaled into log2
// units), one max, one rescale and one exp2 pass per row, then the span's values by a second
// micro-kernel (RP rows x CP vectors of d) accumulating into the rows' float32 sums. Keys past a
// row's position are masked; spans past a block's last position skipped.
//
// Built twice from this source (simd_variants.py): 16 lanes where __AVX512F__ is on, 8 otherwise.
#include "parallel.h"
#include "simd.h"

#include <math.h>
#include <string.h>

namespace {

// the vector type and its operations from simd.h (F32x16 / F32x8), and the few this kernel adds
#ifdef __AVX512F__
using S = F32x16;
constexpr int RS = 6, NS = 4;     // scores: 24 accumulators, 64 keys a group
constexpr int RP = 6, CP = 4;     // values: 24 accumulators, 64 d a pass
inline float reduce_max(__m512 a) { return _mm512_reduce_max_ps(a); }
inline float reduce_add(__m512 a) { return _mm512_reduce_add_ps(a); }
// lanes [0, n) of x, the rest `fill` (0 <= n <= 16)
inline __m512 first_lanes(__m512 x, int64_t n, __m512 fill) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>((1u << n) - 1), fill, x);
}
inline __m512 round_even(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 pow2i(__m512 n) {   // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
using S = F32x8;
constexpr int RS = 4, NS = 2;     // scores: 8 accumulators of the 16 registers, 16 keys a group
constexpr int RP = 3, CP = 4;     // values: 12 accumulators, 32 d a pass
inline float reduce_max(__m256 a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
inline float reduce_add(__m256 a) { return hsum(a); }
inline __m256 first_lanes(__m256 x, int64_t n, __m256 fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    return _mm256_blendv_ps(fill, x, keep);
}
inline __m256 round_even(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256 pow2i(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif
using V = S::T;
constexpr int kLanes = S::kLanes;

constexpr int kGroup = NS * kLanes;    // keys per scores micro-kernel call
constexpr int kSpan = 256;             // keys per span: one max, rescale and exp2 pass per row
constexpr int kPiece = 64;             // keys per piece of the values pass
constexpr int kRowsMax = 192;          // query rows per block (G heads x positions), before padding:
                                       // 48 or 96 read the keys more often (at 8K, 5% and 3% slower)
constexpr int kRowsPad = kRowsMax + 6; // padded to the micro-kernels' row counts
static_assert(kSpan % kGroup == 0, "a span holds whole key groups");

// 2^x for x <= 0 (clamped at -126): 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error ~3e-8); -inf gives 2^-126 * 2^0, which the caller masks or flushes
inline V exp2v(V x) {
    x = S::max(x, S::set1(-126.0f));
    const V n = round_even(x);
    const V f = S::sub(x, n);
    static const float c[7] = {1.0f, 0.69314718f, 0.24022651f, 0.05550411f, 0.00961813f, 0.00133336f, 0.00015404f};
    V p = S::set1(c[6]);
    for (int i = 5; i >= 0; i--) p = S::fmadd(p, f, S::set1(c[i]));
    return S::mul(p, pow2i(n));
}

inline const float* row_of(const float* pool, int64_t stride, const int64_t* table, int64_t page, int64_t t) {
    return pool + (table[t / page] * page + t % page) * stride;
}

// scores of R query rows (q: R x D, contiguous, pre-scaled) against NS blocks of keys (kt: the
// first block's [D][kLanes], blocks D * kLanes apart) into s (rows s_stride apart)
template <int R>
inline void scores_kernel(const float* q, int64_t D, const float* kt, float* s, int64_t s_stride) {
    V acc[R][NS];
    for (int r = 0; r < R; r++)
        for (int n = 0; n < NS; n++) acc[r][n] = S::zero();
    for (int64_t d = 0; d < D; d++) {
        V k[NS];
        for (int n = 0; n < NS; n++) k[n] = S::load(kt + n * D * kLanes + d * kLanes);
        for (int r = 0; r < R; r++) {
            const V b = S::set1(q[r * D + d]);
            for (int n = 0; n < NS; n++) acc[r][n] = S::fmadd(b, k[n], acc[r][n]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int n = 0; n < NS; n++) S::store(s + r * s_stride + n * kLanes, acc[r][n]);
}

// acc (R rows of CP vectors of d, rows acc_stride apart) = acc * alpha + p . v over `width` keys
// (p: R rows p_stride apart; v: `width` value rows v_stride apart, from this pass's first d)
template <int R>
inline void values_kernel(const float* p, int64_t p_stride, const float* v, int64_t v_stride, int64_t width,
                          float* acc, int64_t acc_stride, const float* alpha) {
    V o[R][CP];
    for (int r = 0; r < R; r++) {
        const V a = S::set1(alpha[r]);
        for (int c = 0; c < CP; c++) o[r][c] = S::mul(S::load(acc + r * acc_stride + c * kLanes), a);
    }
    for (int64_t j = 0; j < width; j++) {
        V x[CP];
        for (int c = 0; c < CP; c++) x[c] = S::load(v + j * v_stride + c * kLanes);
        for (int r = 0; r < R; r++) {
            const V b = S::set1(p[r * p_stride + j]);
            for (int c = 0; c < CP; c++) o[r][c] = S::fmadd(b, x[c], o[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < CP; c++) S::store(acc + r * acc_stride + c * kLanes, o[r][c]);
}

// One block: `rows` query rows (row i at position pos[i], pre-scaled queries qb [rows][D]) of one
// kv head, over its packed keys kt and values vh, keys [0, last) with last = max(pos) + 1; the
// normalised outputs written through out_rows.
void attend_block(const float* qb, const int64_t* pos, int64_t rows, int64_t last, const float* kt,
                  const float* vh, int64_t D, float* const* out_rows) {
    static thread_local float s[kRowsPad * kSpan];
    static thread_local float acc[kRowsPad * 256];
    float m[kRowsPad], l[kRowsPad], alpha[kRowsPad], ones[kRowsPad];
    int64_t vis[kRowsPad];
    const int64_t prow = (rows + 5) / 6 * 6;   // zero rows past `rows` (the caller's qb): whole micro-kernel calls
    for (int64_t r = 0; r < prow; r++) m[r] = -INFINITY, l[r] = 0.0f, ones[r] = 1.0f;
    memset(acc, 0, sizeof(float) * prow * D);
    const V ninf = S::set1(-INFINITY);
    for (int64_t k0 = 0; k0 < last; k0 += kSpan) {
        const int64_t width = last - k0 < kSpan ? last - k0 : kSpan;
        const int64_t groups = (width + kGroup - 1) / kGroup;
        for (int64_t g = 0; g < groups; g++) {          // a group's keys stay in L1 across the rows
            const float* kb = kt + (k0 + g * kGroup) * D;     // blocks of kLanes keys, D * kLanes each
            for (int64_t r0 = 0; r0 < prow; r0 += RS) {
                const int64_t nr = prow - r0 < RS ? prow - r0 : RS;
                float* sb = s + r0 * kSpan + g * kGroup;
                switch (nr) {
                    case RS: scores_kernel<RS>(qb + r0 * D, D, kb, sb, kSpan); break;
                    default:
                        for (int64_t r = 0; r < nr; r++) scores_kernel<1>(qb + (r0 + r) * D, D, kb, sb + r * kSpan, kSpan);
                }
            }
        }
        for (int64_t r = 0; r < prow; r++) {
            const int64_t seen = r < rows ? pos[r] + 1 - k0 : 0;
            vis[r] = seen < 0 ? 0 : seen < width ? seen : width;
            float* sr = s + r * kSpan;
            V top = ninf;
            int64_t j = 0;
            for (; j + kLanes <= vis[r]; j += kLanes) top = S::max(top, S::load(sr + j));
            if (j < vis[r]) top = S::max(top, first_lanes(S::load(sr + j), vis[r] - j, ninf));
            const float mb = vis[r] ? reduce_max(top) : -INFINITY;
            const float mn = mb > m[r] ? mb : m[r];
            alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mn);
            m[r] = mn;
            const V sub = S::set1(mn == -INFINITY ? 0.0f : mn);
            V sum = S::zero();
            for (j = 0; j + kLanes <= vis[r]; j += kLanes) {
                const V e = exp2v(S::sub(S::load(sr + j), sub));
                sum = S::add(sum, e);
                S::store(sr + j, e);
            }
            if (j < vis[r]) {
                const V e = first_lanes(exp2v(S::sub(S::load(sr + j), sub)), vis[r] - j, S::zero());
                sum = S::add(sum, e);
                S::store(sr + j, e);
                j += kLanes;
            }
            for (; j < width; j += kLanes) S::store(sr + j, S::zero());
            l[r] = l[r] * alpha[r] + reduce_add(sum);
        }
        // the span's values in pieces that stay in L1 across the rows; the rows' sums are rescaled
        // by alpha with the first piece
        for (int64_t j0 = 0; j0 < width; j0 += kPiece) {
            const int64_t pw = width - j0 < kPiece ? width - j0 : kPiece;
            const float* scale = j0 == 0 ? alpha : ones;
            for (int64_t d0 = 0; d0 < D; d0 += CP * kLanes) {
                const float* vb = vh + (k0 + j0) * D + d0;
                for (int64_t r0 = 0; r0 < prow; r0 += RP) {
                    const int64_t nr = prow - r0 < RP ? prow - r0 : RP;
                    const float* pb = s + r0 * kSpan + j0;
                    float* ab = acc + r0 * D + d0;
                    switch (nr) {
                        case RP: values_kernel<RP>(pb, kSpan, vb, D, pw, ab, D, scale + r0); break;
                        default:
                            for (int64_t r = 0; r < nr; r++)
                                values_kernel<1>(pb + r * kSpan, kSpan, vb, D, pw, ab + r * D, D, scale + r0 + r);
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        const V vi = S::set1(inv);
        for (int64_t d = 0; d < D; d += kLanes) S::store(out_rows[r] + d, S::mul(S::load(acc + r * D + d), vi));
    }
}
}  // namespace

// Packed sizes per kv head, in floats, for T keys of head dim D (keys padded to a whole group).
extern "C" int64_t prefill_f32_keys_size(int64_t T, int64_t D) { return (T + kGroup - 1) / kGroup * kGroup * D; }
extern "C" int64_t prefill_f32_values_size(int64_t T, int64_t D) { return T * D; }
extern "C" int64_t prefill_f32_lanes() { return kLanes; }
extern "C" int64_t prefill_f32_d_multiple() { return CP * kLanes; }
extern "C" int64_t prefill_f32_max_group() { return kRowsMax; }

// Keys and values of the Hkv kv heads of positions 0 .. T - 1 (pool rows [K (Hkv x D) | V (Hkv x
// D)], row_stride floats, found through table, page size page) packed into kt / vt, one *_size
// block per head; the heads' key ranges split over `threads` of torch's OpenMP team.
extern "C" void prefill_f32_pack(const float* pool, int64_t row_stride, const int64_t* table, int64_t page,
                                 int64_t T, int64_t Hkv, int64_t D, float* kt, float* vt, int64_t threads) {
    const int64_t ks = prefill_f32_keys_size(T, D), blocks = ks / (kLanes * D);
    constexpr int64_t kPart = 64;    // key blocks per work item
    const int64_t parts = (blocks + kPart - 1) / kPart;
    parallel_rows(Hkv * parts, threads, [&](int64_t first, int64_t count) {
        for (int64_t item = first; item < first + count; item++) {
            const int64_t h = item / parts, b0 = (item % parts) * kPart;
            const int64_t b1 = b0 + kPart < blocks ? b0 + kPart : blocks;
            float* kh = kt + h * ks;
            float* vh = vt + h * T * D;
            for (int64_t b = b0; b < b1; b++) {
                float* dst = kh + b * kLanes * D;      // [D][kLanes]
                for (int64_t i = 0; i < kLanes; i++) {
                    const int64_t t = b * kLanes + i;
                    if (t >= T) {
                        for (int64_t d = 0; d < D; d++) dst[d * kLanes + i] = 0.0f;
                        continue;
                    }
                    const float* row = row_of(pool, row_stride, table, page, t);
                    const float* k = row + h * D;
                    for (int64_t d = 0; d < D; d++) dst[d * kLanes + i] = k[d];
                    memcpy(vh + t * D, row + (Hkv + h) * D, D * sizeof(float));
                }
            }
        }
    });
}

// q, out [Q, Hq, D] float32 (token strides q_stride / out_stride), the queries at positions
// start .. start + Q - 1, against the packed keys and values of positions 0 .. start + Q - 1.
// Work items Hkv * parts: item i is kv head i / parts and its blocks i % parts, + parts, ...
// (interleaved, so the parts of a causal chunk cost alike), split over `threads`. A block is
// `positions` consecutive positions times the G = Hq / Hkv query heads of the kv head.
extern "C" void prefill_f32_attend(const float* q, int64_t q_stride, const float* kt, const float* vt, int64_t start,
                                   int64_t Q, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* out,
                                   int64_t out_stride, int64_t parts, int64_t threads) {
    const int64_t T = start + Q, G = Hq / Hkv;
    const int64_t positions = kRowsMax / G > 0 ? kRowsMax / G : 1;
    const int64_t blocks = (Q + positions - 1) / positions;
    const float c = scale * 1.4426950408889634f;     // scores in log2 units
    parallel_rows(Hkv * parts, threads, [&](int64_t first, int64_t count) {
        const FlushDenormals flush;   // the softmax's far tail (simd.h)
        static thread_local float qb[kRowsPad * 256];
        int64_t pos[kRowsPad];
        float* out_rows[kRowsPad];
        for (int64_t item = first; item < first + count; item++) {
            const int64_t h = item / parts;
            const float* kh = kt + h * prefill_f32_keys_size(T, D);
            const float* vh = vt + h * T * D;
            for (int64_t b = item % parts; b < blocks; b += parts) {
                const int64_t p0 = b * positions, np = Q - p0 < positions ? Q - p0 : positions;
                int64_t rows = 0;
                for (int64_t p = 0; p < np; p++)
                    for (int64_t g = 0; g < G; g++, rows++) {
                        const float* src = q + (p0 + p) * q_stride + (h * G + g) * D;
                        for (int64_t d = 0; d < D; d++) qb[rows * D + d] = src[d] * c;
                        pos[rows] = start + p0 + p;
                        out_rows[rows] = out + (p0 + p) * out_stride + (h * G + g) * D;
                    }
                memset(qb + rows * D, 0, sizeof(float) * ((rows + 5) / 6 * 6 - rows) * D);
                attend_block(qb, pos, rows, start + p0 + np, kh, vh, D, out_rows);
            }
        }
    });
}
