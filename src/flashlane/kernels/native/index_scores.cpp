// The DSA indexer's prefill scores (kernels/indexer.py, ``_score_pools``) without the [S, H, M]
// per-head products in memory: score[s, m] = sum_h w[s, h] * ReLU(scale * (q[s, h] . k[m])), the
// dot product summed in d order with FMAs. torch's path writes, rescales and re-reads every
// per-head product (H x the scores' size), which at long contexts is most of a prefill chunk's
// indexer time.
//
// A register tile of four queries by two vectors of pools: per d, two key loads and four query
// broadcasts feed eight FMAs. The keys come in blocks of ``index_scores_block()`` pools,
// [ceil(M / block), D, block] (a block's D x block values contiguous: rows of a [D, M]
// transpose lie M floats apart and, at long contexts, on one cache set). Built with AVX-512 the
// vectors hold 16 lanes (blocks of 32 pools), else 8 (AVX2, blocks of 16); both variants round
// alike, lane for lane. The sums run in one fixed order whatever the batch (its rounding is not
// torch's GEMM's).
#include "parallel.h"
#include "simd.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace {
#ifdef __AVX512F__
using Vec = F32x16;
#else
using Vec = F32x8;
#endif
constexpr int kVecs = 2;                          // key vectors per block
constexpr int kBlock = Vec::kLanes * kVecs;       // pools per block
constexpr int64_t kSpanBytes = 128 * 1024;        // keys scored by every row before the next span

// NQ queries (a compile-time count, so their sums stay in registers) against blocks [first, last)
template <int NQ>
void tile(const float* qs, const float* ws, const float* kb, int64_t H, int64_t D, int64_t M, float scale,
          int64_t first, int64_t last, float* out) {
    using T = Vec::T;
    const T vscale = Vec::set1(scale), zero = Vec::zero();
    for (int64_t mb = first; mb < last; mb++) {
        const float* kv = kb + mb * D * kBlock;
        T total[NQ][kVecs];
        for (int i = 0; i < NQ; i++)
            for (int v = 0; v < kVecs; v++) total[i][v] = zero;
        for (int64_t h = 0; h < H; h++) {
            T acc[NQ][kVecs];
            for (int i = 0; i < NQ; i++)
                for (int v = 0; v < kVecs; v++) acc[i][v] = zero;
            for (int64_t d = 0; d < D; d++) {
                T k[kVecs];
                for (int v = 0; v < kVecs; v++) k[v] = Vec::load(kv + d * kBlock + v * Vec::kLanes);
                for (int i = 0; i < NQ; i++) {
                    const T b = Vec::set1(qs[(i * H + h) * D + d]);
                    for (int v = 0; v < kVecs; v++) acc[i][v] = Vec::fmadd(b, k[v], acc[i][v]);
                }
            }
            for (int i = 0; i < NQ; i++) {
                const T wh = Vec::set1(ws[i * H + h]);
                for (int v = 0; v < kVecs; v++)
                    total[i][v] = Vec::fmadd(wh, Vec::max(Vec::mul(acc[i][v], vscale), zero), total[i][v]);
            }
        }
        const int64_t m = mb * kBlock, valid = M - m < kBlock ? M - m : kBlock;
        for (int i = 0; i < NQ; i++) {
            float* o = out + i * M + m;
            if (valid == kBlock) {
                for (int v = 0; v < kVecs; v++) Vec::store(o + v * Vec::kLanes, total[i][v]);
            } else {
                alignas(64) float lanes[kBlock];
                for (int v = 0; v < kVecs; v++) Vec::store(lanes + v * Vec::kLanes, total[i][v]);
                memcpy(o, lanes, valid * sizeof(float));
            }
        }
    }
}
}  // namespace

// pools per key block of this build
extern "C" int64_t index_scores_block() { return kBlock; }

// rows of [rows, H, D] queries q and [rows, H] weights w, all of one sequence whose keys are kb
// [ceil(M / block), D, block] (zero-padded past M); out [rows, M]
static void scores_rows(const float* q, const float* w, const float* kb, int64_t rows, int64_t H, int64_t D, int64_t M,
                        float scale, float* out) {
    // the keys in spans of about kSpanBytes, each span scored by every row before the next: a span
    // stays in L2 while the rows stream past it (all of a long context's keys would not)
    const int64_t blocks = (M + kBlock - 1) / kBlock;
    const int64_t span = std::max<int64_t>(1, kSpanBytes / (D * kBlock * static_cast<int64_t>(sizeof(float))));
    for (int64_t first = 0; first < blocks; first += span) {
        const int64_t last = std::min(blocks, first + span);
        int64_t s = 0;
        for (; s + 4 <= rows; s += 4) tile<4>(q + s * H * D, w + s * H, kb, H, D, M, scale, first, last, out + s * M);
        for (; s < rows; s++) tile<1>(q + s * H * D, w + s * H, kb, H, D, M, scale, first, last, out + s * M);
    }
}

// the rows split over `threads` of torch's OpenMP team (parallel.h); each row's scores are its own
extern "C" void index_scores_f32(const float* q, const float* w, const float* kb, int64_t rows, int64_t H, int64_t D,
                                 int64_t M, float scale, float* out, int64_t threads) {
    parallel_rows(rows, threads, [&](int64_t s, int64_t count) {
        scores_rows(q + s * H * D, w + s * H, kb, count, H, D, M, scale, out + s * M);
    });
}
