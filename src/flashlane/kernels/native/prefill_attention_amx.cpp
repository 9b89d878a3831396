// Causal attention of a bf16 prefill chunk over its sequence's paged K|V rows on AMX tiles
// (flash-attention style): each kv head's keys and values are packed once into AMX's
// pair-interleaved layout straight from the pool's pages (no gathered copy of the history);
// then each block of 16 query rows of each of its query heads runs over the keys in spans of up
// to 512: a span's scores on tiles, an online softmax in float32 (AVX-512) with one max and one
// rescale per span, probabilities rounded to bf16, the span's values summed on tiles, float32
// accumulation; keys past a row's position are masked, spans past the block's last row skipped.
// (Spans of 512 instead of blocks of 64 keys: 2.5-4% less time. Four heads sharing each key and
// value tile load changed nothing measurable: the softmax's vector work bounds this kernel.) The
// chunk's own K|V are in the pool already. Built with -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16.
#include "amx.h"
#include "parallel.h"

#include <math.h>

namespace {
constexpr int kT = 16;       // tile rows: query rows per block, keys per score tile
constexpr int kKv = 64;      // keys per block: four score tiles
constexpr int kSpan = 512;   // keys per span: one max, rescale and exp pass (kKv blocks)
constexpr int kPair = 32;    // bf16 values of k per tile row

// tiles 0-3: four 16 x 16 float32 blocks (scores, then values); 4: queries or probabilities; 5: keys or values
void configure() { configure_tiles(6); }

inline void zero4() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

// 2^x for x <= 0 (x >= -126 after the clamp): 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6
// polynomial (relative error ~3e-8)
inline __m512 exp2_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    static const float c[7] = {1.0f, 0.69314718f, 0.24022651f, 0.05550411f, 0.00961813f, 0.00133336f, 0.00015404f};
    __m512 p = _mm512_set1_ps(c[6]);
    for (int i = 5; i >= 0; i--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

const uint16_t* row_of(const uint16_t* pool, int64_t stride, const int64_t* table, int64_t page, int64_t t) {
    return pool + (table[t / page] * page + t % page) * stride;
}

// keys of one kv head for the score tiles' right operand: per block of 16 keys and 32 d, 16
// pair-rows of 16 keys x 2 values (keys past T zero)
void pack_keys(const uint16_t* pool, int64_t stride, const int64_t* table, int64_t page, int64_t off, int64_t T,
               int64_t D, uint32_t* kp) {
    const int64_t blocks = (T + kT - 1) / kT, steps = D / kPair;
    memset(kp, 0, blocks * steps * 256 * sizeof(uint32_t));
    for (int64_t t = 0; t < T; t++) {
        const uint32_t* k = reinterpret_cast<const uint32_t*>(row_of(pool, stride, table, page, t) + off);
        uint32_t* dst = kp + (t / kT) * steps * 256 + t % kT;
        for (int64_t s = 0; s < steps; s++)
            for (int kk = 0; kk < 16; kk++) dst[s * 256 + kk * kT] = k[s * 16 + kk];
    }
}

// values of one kv head for the value tiles' right operand: per block of 32 keys and 16 d, 16
// pair-rows (keys 2kk, 2kk + 1) of 16 d x 2 values (keys past T zero)
void pack_values(const uint16_t* pool, int64_t stride, const int64_t* table, int64_t page, int64_t off, int64_t T,
                 int64_t D, uint16_t* vp) {
    const int64_t groups = (T + 2 * kT - 1) / (2 * kT), cols = D / kT;
    memset(vp, 0, groups * cols * 512 * sizeof(uint16_t));
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* v = row_of(pool, stride, table, page, t) + off;
        uint16_t* dst = vp + (t / (2 * kT)) * cols * 512 + ((t % (2 * kT)) / 2) * 32 + (t % 2);
        for (int64_t c = 0; c < cols; c++)
            for (int n = 0; n < kT; n++) dst[c * 512 + n * 2] = v[c * kT + n];
    }
}

// one block of up to 16 query rows (positions pos0 .. pos0 + rows - 1) of one query head against
// keys [0, pos0 + rows), in spans of up to kSpan keys: a span's scores all on tiles first, then per
// row one max, one rescale of the running sums and one exp pass over the span (vectorised along
// the keys), and its values accumulated on tiles across the whole span; q rows q_stride apart,
// out likewise
void attend_block(const uint16_t* q, int64_t q_stride, int64_t rows, int64_t pos0, const uint32_t* kp,
                  const uint16_t* vp, int64_t D, float scale, uint16_t* out, int64_t out_stride) {
    const int64_t steps = D / kPair, cols = D / kT, last = pos0 + rows;   // keys [0, last)
    alignas(64) uint16_t qb[kT * 128];        // the rows, zero-padded to 16 (D <= 128)
    alignas(64) static thread_local float s[kT * kSpan];
    alignas(64) static thread_local uint16_t p[kT * kSpan];
    alignas(64) float ob[kT * kT * 4];
    alignas(64) float acc[kT * 128];
    alignas(64) float m[kT], l[kT];
    memset(qb, 0, sizeof(qb));
    for (int64_t r = 0; r < rows; r++) memcpy(qb + r * D, q + r * q_stride, D * 2);
    for (int r = 0; r < kT; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, sizeof(float) * kT * D);
    const float c = scale * 1.4426950408889634f;     // scores in log2 units
    const __m512 vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t k0 = 0; k0 < last; k0 += kSpan) {
        const int64_t width = last - k0 < kSpan ? last - k0 : kSpan;     // keys of this span
        for (int64_t g0 = 0; g0 < width; g0 += kKv) {                    // scores, 64 keys at a time
            const int nt = static_cast<int>((width - g0 + kT - 1) / kT < 4 ? (width - g0 + kT - 1) / kT : 4);
            zero4();
            for (int64_t st = 0; st < steps; st++) {
                _tile_loadd(4, qb + st * kPair, D * 2);
                const uint32_t* kb = kp + (((k0 + g0) / kT) * steps + st) * 256;
                _tile_loadd(5, kb, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nt > 1) { _tile_loadd(5, kb + steps * 256, 64); _tile_dpbf16ps(1, 4, 5); }
                if (nt > 2) { _tile_loadd(5, kb + 2 * steps * 256, 64); _tile_dpbf16ps(2, 4, 5); }
                if (nt > 3) { _tile_loadd(5, kb + 3 * steps * 256, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, s + g0, kSpan * 4);
            if (nt > 1) _tile_stored(1, s + g0 + 16, kSpan * 4);
            if (nt > 2) _tile_stored(2, s + g0 + 32, kSpan * 4);
            if (nt > 3) _tile_stored(3, s + g0 + 48, kSpan * 4);
        }
        // row r sees the span's keys [k0, k0 + vis[r]): causal, and none for the padding rows
        int64_t vis[kT];
        alignas(64) float mb[kT], rs[kT];
        for (int64_t r = 0; r < kT; r++) {
            const int64_t seen = r < rows ? pos0 + r + 1 - k0 : 0;
            vis[r] = seen < 0 ? 0 : seen < width ? seen : width;
            __m512 top = ninf;
            int64_t j = 0;
            for (; j + 16 <= vis[r]; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + r * kSpan + j));
            if (j < vis[r])
                top = _mm512_mask_max_ps(top, static_cast<__mmask16>((1u << (vis[r] - j)) - 1), top,
                                         _mm512_loadu_ps(s + r * kSpan + j));
            mb[r] = _mm512_reduce_max_ps(top);
        }
        // per row: the new running max (scaled to log2 units), the old sums' factor alpha
        const __m512 mo = _mm512_loadu_ps(m);
        const __m512 mbs = _mm512_mask_mul_ps(ninf, _mm512_cmp_ps_mask(_mm512_loadu_ps(mb), ninf, _CMP_NEQ_OQ),
                                              _mm512_loadu_ps(mb), vc);
        const __m512 mn = _mm512_max_ps(mo, mbs);
        const __mmask16 had = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ), has = _mm512_cmp_ps_mask(mn, ninf, _CMP_NEQ_OQ);
        const __m512 alpha = _mm512_maskz_mov_ps(had, exp2_512(_mm512_sub_ps(mo, _mm512_mask_mov_ps(mo, has, mn))));
        _mm512_storeu_ps(m, mn);
        alignas(64) float al[kT];
        _mm512_store_ps(al, alpha);
        const int64_t padded = (width + 2 * kT - 1) / (2 * kT) * (2 * kT);   // the values tiles' 32 keys
        for (int64_t r = 0; r < kT; r++) {
            const __m512 sub = _mm512_set1_ps(m[r] == -INFINITY ? 0.0f : m[r]);
            const float* sr = s + r * kSpan;
            uint16_t* pr = p + r * kSpan;
            __m512 sum = _mm512_setzero_ps();
            int64_t j = 0;
            for (; j + 16 <= vis[r]; j += 16) {
                const __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vc, sub));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (j < vis[r]) {
                const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << (vis[r] - j)) - 1),
                                                     exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vc, sub)));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
                j += 16;
            }
            for (; j < padded; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
            rs[r] = _mm512_reduce_add_ps(sum);
        }
        _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, _mm512_load_ps(rs)));
        for (int64_t c0 = 0; c0 < cols; c0 += 4) {   // 64 columns of d at a time, over the whole span
            const int nc = cols - c0 < 4 ? static_cast<int>(cols - c0) : 4;
            zero4();
            for (int64_t h0 = 0; h0 < padded; h0 += 2 * kT) {
                _tile_loadd(4, p + h0, kSpan * 2);
                const uint16_t* vb = vp + (((k0 + h0) / (2 * kT)) * cols + c0) * 512;
                _tile_loadd(5, vb, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nc > 1) { _tile_loadd(5, vb + 512, 64); _tile_dpbf16ps(1, 4, 5); }
                if (nc > 2) { _tile_loadd(5, vb + 1024, 64); _tile_dpbf16ps(2, 4, 5); }
                if (nc > 3) { _tile_loadd(5, vb + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, ob, 64 * 4);
            _tile_stored(1, ob + 16, 64 * 4);
            _tile_stored(2, ob + 32, 64 * 4);
            _tile_stored(3, ob + 48, 64 * 4);
            for (int64_t r = 0; r < rows; r++)
                for (int i = 0; i < nc; i++) {   // acc = acc * alpha + this span's values
                    float* a = acc + r * D + (c0 + i) * 16;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(al[r]),
                                                        _mm512_loadu_ps(ob + r * 64 + 16 * i)));
                }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) out[r * out_stride + d] = bf16_bits(acc[r * D + d] * inv);
    }
}
}  // namespace

// Packed sizes per kv head (elements of uint32 keys / uint16 values) for T keys of head dim D.
extern "C" int64_t prefill_keys_size(int64_t T, int64_t D) { return ((T + kKv - 1) / kKv) * 4 * (D / kPair) * 256; }
extern "C" int64_t prefill_values_size(int64_t T, int64_t D) { return ((T + kKv - 1) / kKv) * 2 * (D / kT) * 512; }

// Keys and values of the Hkv kv heads of a sequence's positions 0 .. T - 1 (pool rows
// [K (Hkv x D) | V (Hkv x D)], row_stride elements, found through table, page size page) packed
// into kp / vp, one prefill_*_size block per head; the heads split over `threads` of torch's
// OpenMP team (parallel.h).
extern "C" void prefill_attention_pack(const uint16_t* pool, int64_t row_stride, const int64_t* table, int64_t page,
                                       int64_t T, int64_t Hkv, int64_t D, uint32_t* kp, uint16_t* vp,
                                       int64_t threads) {
    parallel_rows(Hkv, threads, [&](int64_t h0, int64_t count) {
        for (int64_t h = h0; h < h0 + count; h++) {
            pack_keys(pool, row_stride, table, page, h * D, T, D, kp + h * prefill_keys_size(T, D));
            pack_values(pool, row_stride, table, page, Hkv * D + h * D, T, D, vp + h * prefill_values_size(T, D));
        }
    });
}

// q, out [Q, Hq, D] bf16 (token stride q_stride / out_stride elements), the queries at positions
// start .. start + Q - 1, against the packed keys and values of positions 0 .. start + Q - 1.
// Work items [first, last) of Hkv * parts: item i is kv head i / parts and its query blocks
// b = i % parts, i % parts + parts, ... (interleaved, so the parts of a causal chunk cost
// alike). D a multiple of 32, at most 128.
static void attend_items(const uint16_t* q, int64_t q_stride, const uint32_t* kp, const uint16_t* vp, int64_t start,
                         int64_t Q, int64_t Hq, int64_t Hkv, int64_t D, float scale, uint16_t* out, int64_t out_stride,
                         int64_t parts, int64_t first, int64_t last) {
    const int64_t T = start + Q, G = Hq / Hkv, blocks = (Q + kT - 1) / kT;
    const FlushDenormals flush;   // the softmax's far tail (simd.h)
    configure();
    for (int64_t item = first; item < last; item++) {
        const int64_t h = item / parts;
        const uint32_t* kh = kp + h * prefill_keys_size(T, D);
        const uint16_t* vh = vp + h * prefill_values_size(T, D);
        for (int64_t b = item % parts; b < blocks; b += parts) {
            const int64_t r0 = b * kT;
            for (int64_t g = 0; g < G; g++) {
                const int64_t head = h * G + g;
                attend_block(q + r0 * q_stride + head * D, q_stride, Q - r0 < kT ? Q - r0 : kT, start + r0, kh, vh,
                             D, scale, out + r0 * out_stride + head * D, out_stride);
            }
        }
    }
    _tile_release();
}

// every work item of Hkv * parts (see attend_items) split over `threads` of torch's OpenMP team;
// each thread configures its own tiles
extern "C" void prefill_attention_amx(const uint16_t* q, int64_t q_stride, const uint32_t* kp, const uint16_t* vp,
                                      int64_t start, int64_t Q, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                                      uint16_t* out, int64_t out_stride, int64_t parts, int64_t threads) {
    parallel_rows(Hkv * parts, threads, [&](int64_t first, int64_t count) {
        attend_items(q, q_stride, kp, vp, start, Q, Hq, Hkv, D, scale, out, out_stride, parts, first, first + count);
    });
}
