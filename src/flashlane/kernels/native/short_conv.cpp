// Causal depthwise short convolution + SiLU (kernels/short_conv.py) for every sequence of a step,
// decode tokens and prefill chunks alike, from and into each sequence's conv state (its last K-1
// pre-conv inputs, [C, K-1], oldest first). Per token and channel: sum over the K taps in tap
// order, multiply then add, as the torch prefill path does; vectorised over channels. What it
// replaces is a dozen index / scatter / gather ops per call, which cost far more than the
// arithmetic at these sizes. A prefill chunk's tokens are split over `threads` of torch's OpenMP
// team (parallel.h): each output token reads only the window, so the numbers do not change.
#include "parallel.h"
#include "simd.h"
#include <immintrin.h>
#include <stdint.h>

#include <vector>

static inline float silu1(float v) { return v / (1.0f + exp1(-v)); }

// x [N, C] (row stride ldx), w [C, K]; state [S, C, K - 1] updated in place; cu [B + 1] token
// offsets, slots [B] state rows, fresh [B] (1: the sequence starts at position 0, its row's
// content is ignored); out [N, C]; a sequence of at least min_tokens tokens is split over `threads`
extern "C" void short_conv_f32(const float* x, int64_t ldx, const float* w, int64_t C, int64_t K, float* state,
                               const int64_t* cu, int64_t B, const int64_t* slots, const uint8_t* fresh, float* out,
                               int64_t threads, int64_t min_tokens) {
    const int64_t H = K - 1;
    thread_local std::vector<float> wt, hist;
    wt.resize(K * C);
    hist.resize(H * C);
    for (int64_t c = 0; c < C; c++)
        for (int64_t m = 0; m < K; m++) wt[m * C + c] = w[c * K + m];
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        float* st = state + slots[b] * C * H;
        for (int64_t j = 0; j < H; j++)
            for (int64_t c = 0; c < C; c++) hist[j * C + c] = fresh[b] ? 0.0f : st[c * H + j];
        const int64_t first = cu[b], n = cu[b + 1] - cu[b];
        // row i of the sequence's window: its H history rows, then its n new rows (this thread's
        // scratch, by address: the team's other threads have thread_local copies of their own)
        const float *hp = hist.data(), *wp = wt.data();
        auto row = [&](int64_t i) -> const float* { return i < H ? hp + i * C : x + (first + i - H) * ldx; };
        parallel_rows(n, n >= min_tokens ? threads : 1, [&](int64_t t0, int64_t count) {
            for (int64_t t = t0; t < t0 + count; t++) {
                float* o = out + (first + t) * C;
                int64_t c = 0;
                for (; c + 8 <= C; c += 8) {
                    __m256 acc = zero;
                    for (int64_t m = 0; m < K; m++)
                        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(row(t + m) + c),
                                                               _mm256_loadu_ps(wp + m * C + c)));
                    _mm256_storeu_ps(o + c, _mm256_div_ps(acc, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, acc)))));
                }
                for (; c < C; c++) {
                    float acc = 0.0f;
                    for (int64_t m = 0; m < K; m++) acc = acc + row(t + m)[c] * wp[m * C + c];
                    o[c] = silu1(acc);
                }
            }
        });
        for (int64_t j = 0; j < H; j++) {            // the newest K-1 inputs become the state
            const float* r = row(n + j);
            for (int64_t c = 0; c < C; c++) st[c * H + j] = r[c];
        }
    }
}
