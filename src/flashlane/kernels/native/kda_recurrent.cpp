// The KDA recurrence (kernels/kda.py) token by token for every sequence of a step, decode tokens
// and prefill chunks alike, from and into each sequence's state row. Per head and token:
//   q, k L2-normalised (eps 1e-6 inside the sqrt), q scaled by Dk^-0.5; a = exp(g)
//   S <- diag(a) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
// The state [Dk, Dv] of one head stays in L1 while the sequence's tokens pass: two sweeps over it
// per token (decay + recall, then write + read-out), vectorised over Dv, with u and o in registers
// where Dv is 8, 16, 32 or 64. At the small head dims of the tiny presets this is far cheaper on a
// CPU than the chunked (WY) form, whose many small matmuls and solves cost more in dispatch than
// in arithmetic; and a sequence's numbers no longer depend on where its prefill was cut into chunks.
#include "parallel.h"
#include "simd.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

static inline float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void decay(const float* g, int64_t n, float* a) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, exp256(_mm256_loadu_ps(g + i)));
    for (; i < n; i++) a[i] = exp1(g[i]);
}

// q and k of one head L2-normalised (q also scaled by Dk^-0.5) into qn, kn; the decay exp(g) into a
static void prepare(const float* q, const float* k, const float* g, int64_t Dk, float* qn, float* kn, float* a) {
    const float qs = 1.0f / sqrtf(dot(q, q, Dk) + 1e-6f) , ks = 1.0f / sqrtf(dot(k, k, Dk) + 1e-6f);
    const float scale = 1.0f / sqrtf((float)Dk);
    for (int64_t c = 0; c < Dk; c++) {
        qn[c] = q[c] * qs * scale;
        kn[c] = k[c] * ks;
    }
    decay(g, Dk, a);
}

// one token of one head: S [Dk, Dv] in place, o [Dv]
static void step(float* S, const float* q, const float* k, const float* v, const float* g, float beta, int64_t Dk,
                 int64_t Dv, float* qn, float* kn, float* a, float* u, float* o) {
    prepare(q, k, g, Dk, qn, kn, a);
    for (int64_t j = 0; j < Dv; j++) u[j] = 0.0f;
    for (int64_t c = 0; c < Dk; c++) {          // S <- diag(a) S, and S^T k on the way
        float* row = S + c * Dv;
        const __m256 ac = _mm256_set1_ps(a[c]), kc = _mm256_set1_ps(kn[c]);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) {
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), ac);
            _mm256_storeu_ps(row + j, s);
            _mm256_storeu_ps(u + j, _mm256_fmadd_ps(s, kc, _mm256_loadu_ps(u + j)));
        }
        for (; j < Dv; j++) {
            row[j] *= a[c];
            u[j] += row[j] * kn[c];
        }
    }
    for (int64_t j = 0; j < Dv; j++) {
        u[j] = beta * (v[j] - u[j]);
        o[j] = 0.0f;
    }
    for (int64_t c = 0; c < Dk; c++) {          // S <- S + k u^T, and S^T q on the way
        float* row = S + c * Dv;
        const __m256 kc = _mm256_set1_ps(kn[c]), qc = _mm256_set1_ps(qn[c]);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) {
            const __m256 s = _mm256_fmadd_ps(kc, _mm256_loadu_ps(u + j), _mm256_loadu_ps(row + j));
            _mm256_storeu_ps(row + j, s);
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(s, qc, _mm256_loadu_ps(o + j)));
        }
        for (; j < Dv; j++) {
            row[j] += kn[c] * u[j];
            o[j] += row[j] * qn[c];
        }
    }
}

// ``step`` for Dv = 8 NV (NV 1, 2, 4, 8): u and o live in registers instead of memory, the same operations in the
// same order (bit-identical results)
template <int NV>
static void step_fixed(float* S, const float* q, const float* k, const float* v, const float* g, float beta,
                       int64_t Dk, float* qn, float* kn, float* a, float* o) {
    prepare(q, k, g, Dk, qn, kn, a);
    __m256 u[NV], out[NV];
    for (int j = 0; j < NV; j++) u[j] = out[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < Dk; c++) {
        float* row = S + c * 8 * NV;
        const __m256 ac = _mm256_set1_ps(a[c]), kc = _mm256_set1_ps(kn[c]);
        for (int j = 0; j < NV; j++) {
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), ac);
            _mm256_storeu_ps(row + 8 * j, s);
            u[j] = _mm256_fmadd_ps(s, kc, u[j]);
        }
    }
    const __m256 b = _mm256_set1_ps(beta);
    for (int j = 0; j < NV; j++) u[j] = _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v + 8 * j), u[j]));
    for (int64_t c = 0; c < Dk; c++) {
        float* row = S + c * 8 * NV;
        const __m256 kc = _mm256_set1_ps(kn[c]), qc = _mm256_set1_ps(qn[c]);
        for (int j = 0; j < NV; j++) {
            const __m256 s = _mm256_fmadd_ps(kc, u[j], _mm256_loadu_ps(row + 8 * j));
            _mm256_storeu_ps(row + 8 * j, s);
            out[j] = _mm256_fmadd_ps(s, qc, out[j]);
        }
    }
    for (int j = 0; j < NV; j++) _mm256_storeu_ps(o + 8 * j, out[j]);
}

// every token of one sequence's head, with the step for its Dv
template <int NV>
static void run_fixed(float* S, const float* q, const float* k, const float* v, const float* g, const float* beta,
                      int64_t first, int64_t last, int64_t H, int64_t h, int64_t Dk, float* qn, float* kn, float* a,
                      float* out) {
    for (int64_t t = first; t < last; t++) {
        const int64_t hk = (t * H + h) * Dk, hv = (t * H + h) * 8 * NV;
        step_fixed<NV>(S, q + hk, k + hk, v + hv, g + hk, beta[t * H + h], Dk, qn, kn, a, out + hv);
    }
}

// q, k, g [N, H, Dk], v [N, H, Dv], beta [N, H] (float32, contiguous); cu [B + 1] token offsets of
// the B sequences; slots [B] their rows of the state pool [S, H, Dk, Dv] (updated in place); fresh
// [B]: 1 where the sequence starts at position 0 (its row's content is ignored); out [N, H, Dv]
// Every head of every sequence is independent: the step's (sequence, head) pairs, numbered
// head-major (h * B + b) so that each part gets a share of a long prefill's heads, split over
// `threads` of torch's OpenMP team (parallel.h), with the same numbers as one thread.
extern "C" void kda_recurrent_f32(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                  const int64_t* cu, int64_t B, const int64_t* slots, const uint8_t* fresh,
                                  float* pool, int64_t H, int64_t Dk, int64_t Dv, float* out, int64_t threads) {
    parallel_rows(B * H, threads, [&](int64_t first, int64_t count) {
        thread_local std::vector<float> scratch;
        scratch.resize(3 * Dk + Dv);
        float *qn = scratch.data(), *kn = qn + Dk, *a = kn + Dk, *u = a + Dk;
        for (int64_t unit = first; unit < first + count; unit++) {
            const int64_t b = unit % B, h = unit / B;
            float* S = pool + (slots[b] * H + h) * Dk * Dv;   // stays in L1 across the sequence's tokens
            if (fresh[b])
                for (int64_t i = 0; i < Dk * Dv; i++) S[i] = 0.0f;
            switch (Dv % 8 ? 0 : Dv / 8) {
                case 1: run_fixed<1>(S, q, k, v, g, beta, cu[b], cu[b + 1], H, h, Dk, qn, kn, a, out); continue;
                case 2: run_fixed<2>(S, q, k, v, g, beta, cu[b], cu[b + 1], H, h, Dk, qn, kn, a, out); continue;
                case 4: run_fixed<4>(S, q, k, v, g, beta, cu[b], cu[b + 1], H, h, Dk, qn, kn, a, out); continue;
                case 8: run_fixed<8>(S, q, k, v, g, beta, cu[b], cu[b + 1], H, h, Dk, qn, kn, a, out); continue;
                default: break;
            }
            for (int64_t t = cu[b]; t < cu[b + 1]; t++) {
                const int64_t hk = (t * H + h) * Dk, hv = (t * H + h) * Dv;
                step(S, q + hk, k + hk, v + hv, g + hk, beta[t * H + h], Dk, Dv, qn, kn, a, u, out + hv);
            }
        }
    });
}
