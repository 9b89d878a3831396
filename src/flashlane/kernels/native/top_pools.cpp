// The indexer's top-k for prefill blocks and eager decode rows (kernels/indexer.py, ``_top_pools``):
// per row of scores, the indices of the n highest, highest first, equal scores lower index first:
// the first n of a stable descending sort.
//
// Wide rows first try a sampled threshold: a strided sample of the row gives a value t that
// about 4n scores reach, and one vector pass collects every score above t and the first n equal
// to it (lowest index first). Whenever at least n scores reach t this holds every pick: a score
// left out is below every candidate, or ties at t with a higher index than n kept ones. Where
// fewer reach t, too many exceed it, or t is -inf (a masked sample), the row takes the radix
// select: each score as an order-preserving 32-bit key, a histogram of the keys' top bits finds
// the bucket holding the n-th highest, one more pass takes every score of that bucket and those
// above it. Either way an exact selection among the candidates keeps n, sorted.
// Measured (Sapphire Rapids, 1 thread) on a block of tiny-standard's 16K-token prefill, 256 rows
// of 12,288 scores a quarter of which are 0: 46 us a row for the radix select alone, 15 with the
// sampled threshold first. Rows narrower than kMinWide take the radix select (it was faster there).
#include "parallel.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {
struct Pick {
    float score;
    int64_t index;
};
constexpr int kBits = 11;
constexpr uint32_t kBuckets = 1u << kBits;
constexpr int64_t kSample = 128;        // sampled scores per row
constexpr int64_t kAim = 4;             // the sampled threshold aims at kAim * n candidates
constexpr int64_t kMaxOver = 32;        // more than kMaxOver * n candidates: the radix select
constexpr int64_t kMinWide = 4096;      // narrower rows: the radix select (measured faster there)
// larger float, larger key (-inf lowest; scores hold no NaN); -0.0 + 0.0 is +0.0, so the two zeros,
// which tie, get one key
inline uint32_t key_of(float x) {
    x += 0.0f;
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// the n picks of ``cand`` (every score of the row that can be picked, in index order), sorted
// (score descending, index ascending) to out: the n-th highest value v from the scores alone, then
// every candidate above v and the first ones (lowest indices) equal to it, packed as 64-bit keys
void finish(const std::vector<Pick>& cand, int64_t n, std::vector<float>& values, std::vector<uint64_t>& keys,
            int64_t* out) {
    values.resize(cand.size());
    for (size_t i = 0; i < cand.size(); i++) values[i] = cand[i].score;
    std::nth_element(values.begin(), values.begin() + (n - 1), values.end(), std::greater<float>());
    const float v = values[n - 1];
    int64_t ties = n - std::count_if(values.begin(), values.begin() + (n - 1), [v](float x) { return x > v; });
    keys.clear();
    for (const Pick& p : cand) {
        if (p.score > v || (p.score == v && ties-- > 0))
            keys.push_back(static_cast<uint64_t>(key_of(p.score)) << 32 | (0xffffffffu - static_cast<uint32_t>(p.index)));
    }
    std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
    for (int64_t i = 0; i < n; i++) out[i] = 0xffffffffu - static_cast<uint32_t>(keys[i]);
}

// every score whose key's top bits reach the bucket holding the n-th highest, in index order
void radix_candidates(const float* s, int64_t M, int64_t n, std::vector<uint32_t>& hist, std::vector<Pick>& cand) {
    std::fill(hist.begin(), hist.end(), 0u);
    for (int64_t j = 0; j < M; j++) hist[key_of(s[j]) >> (32 - kBits)]++;
    uint32_t bucket = kBuckets - 1;
    int64_t above = 0;
    while (above + hist[bucket] < n) above += hist[bucket--];
    cand.clear();
    for (int64_t j = 0; j < M; j++)
        if ((key_of(s[j]) >> (32 - kBits)) >= bucket) cand.push_back({s[j], j});
}

// every j with s[j] > t into cand and, after them, the first n (lowest j) with s[j] == t: all a
// row's picks when there are at least n such j. False where there are fewer, or more than ``cap``
// above t. Ties at t are kept apart because scores tie in runs (a query whose ReLU'd heads all
// vanish scores 0 on many pools), and a run at the threshold must not fill the candidates.
bool collect(const float* s, int64_t M, int64_t n, float t, int64_t cap, std::vector<Pick>& cand,
             std::vector<Pick>& ties) {
    cand.clear();
    ties.clear();
    int64_t tied = 0;
    const auto take = [&](int64_t j) {
        if (s[j] > t) {
            cand.push_back({s[j], j});
        } else {
            if (tied < n) ties.push_back({s[j], j});
            tied++;
        }
    };
    const __m256 vt = _mm256_set1_ps(t);
    int64_t j = 0;
    for (; j + 8 <= M; j += 8) {
        const __m256 v = _mm256_loadu_ps(s + j);
        const unsigned reach = _mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_GE_OQ));
        if (!reach) continue;           // most of a row
        unsigned above = _mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_GT_OQ));
        unsigned equal = reach & ~above;
        for (; above; above &= above - 1) cand.push_back({s[j + __builtin_ctz(above)], j + __builtin_ctz(above)});
        if (tied >= n) {                // enough ties kept: only their count matters now
            tied += __builtin_popcount(equal);
        } else {
            for (; equal; equal &= equal - 1) take(j + __builtin_ctz(equal));
        }
        if (static_cast<int64_t>(cand.size()) > cap) return false;
    }
    for (; j < M; j++)
        if (s[j] >= t) take(j);
    const int64_t above = static_cast<int64_t>(cand.size());
    if (above > cap || above + tied < n) return false;
    if (above < n) cand.insert(cand.end(), ties.begin(), ties.begin() + (n - above));
    return true;
}

// a value about kAim * n of the row's scores reach, from a strided sample (-inf where the sample
// lands on masked scores; the caller then takes the radix select)
float sampled_threshold(const float* s, int64_t M, int64_t n, std::vector<float>& sample) {
    const int64_t stride = M / kSample;
    sample.resize(kSample);
    for (int64_t i = 0; i < kSample; i++) sample[i] = s[i * stride + stride / 2];
    // the r-th highest of the sample: r / kSample of the row above it, aiming at kAim * n
    const int64_t r = std::min<int64_t>(kSample - 1, std::max<int64_t>(1, (kAim * n * kSample) / M));
    std::nth_element(sample.begin(), sample.begin() + r, sample.end(), std::greater<float>());
    return sample[r];
}
}  // namespace

static void top_rows(const float* scores, int64_t R, int64_t M, int64_t ld, int64_t n, int64_t* out) {
    thread_local std::vector<uint32_t> hist;
    thread_local std::vector<Pick> cand, ties;
    thread_local std::vector<float> sample, values;
    thread_local std::vector<uint64_t> keys;
    hist.resize(kBuckets);
    const bool wide = M >= kMinWide && kAim * n * 16 <= M;
    for (int64_t r = 0; r < R; r++) {
        const float* s = scores + r * ld;
        bool found = false;
        if (wide) {
            const float t = sampled_threshold(s, M, n, sample);
            found = !std::isinf(t) && collect(s, M, n, t, kMaxOver * n, cand, ties);
        }
        if (!found) radix_candidates(s, M, n, hist, cand);
        finish(cand, n, values, keys, out + r * n);
    }
}

// scores [R, M] (row stride ld), 0 < n <= M; out [R, n]; the rows split over `threads` of torch's
// OpenMP team (parallel.h), each row's picks its own
extern "C" void top_pools_f32(const float* scores, int64_t R, int64_t M, int64_t ld, int64_t n, int64_t* out,
                              int64_t threads) {
    parallel_rows(R, threads, [&](int64_t r, int64_t count) { top_rows(scores + r * ld, count, M, ld, n, out + r * n); });
}
