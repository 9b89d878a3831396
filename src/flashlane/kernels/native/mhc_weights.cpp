// The per-token weights of a manifold-constrained hyper-connection (kernels/mhc.py, hc_pre) from
// the mixed projection of the normed streams: pre = sigmoid(a s + b) + eps, post = 2 sigmoid(.),
// comb = softmax over each row of an n x n block + eps, then Sinkhorn (a column step, then
// iters - 1 row and column rounds). In torch these are ~120 ops on [N, n, n] tensors of a few
// floats each, about two thirds of a hyper-connected layer's eager time at one token; here one
// pass per token, in the torch formulas' order of operations (multiply, then add; no FMA).
#include <math.h>
#include <stdint.h>

static inline float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }

// mixed [N, (2 + n) n] (a_pre | a_post | a_comb row-major); base [(2 + n) n]; scale = (pre, post,
// comb); outputs pre [N, n], post [N, n], comb [N, n, n]
extern "C" void mhc_weights_f32(const float* mixed, int64_t N, int64_t n, const float* base, const float* scale,
                                float hc_eps, int64_t iters, float* pre, float* post, float* comb) {
    const int64_t width = (2 + n) * n;
    for (int64_t t = 0; t < N; t++) {
        const float* a = mixed + t * width;
        float* pr = pre + t * n;
        float* po = post + t * n;
        float* c = comb + t * n * n;
        for (int64_t i = 0; i < n; i++) {
            pr[i] = sigmoid1(a[i] * scale[0] + base[i]) + hc_eps;
            po[i] = 2.0f * sigmoid1(a[n + i] * scale[1] + base[n + i]);
        }
        for (int64_t i = 0; i < n; i++) {
            float* row = c + i * n;
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                row[j] = a[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
                m = row[j] > m ? row[j] : m;
            }
            float s = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                row[j] = expf(row[j] - m);
                s += row[j];
            }
            for (int64_t j = 0; j < n; j++) row[j] = row[j] / s + hc_eps;
        }
        for (int64_t round = 0; round < iters; round++) {
            if (round > 0)
                for (int64_t i = 0; i < n; i++) {
                    float s = 0.0f;
                    for (int64_t j = 0; j < n; j++) s += c[i * n + j];
                    s += hc_eps;
                    for (int64_t j = 0; j < n; j++) c[i * n + j] /= s;
                }
            for (int64_t j = 0; j < n; j++) {
                float s = 0.0f;
                for (int64_t i = 0; i < n; i++) s += c[i * n + j];
                s += hc_eps;
                for (int64_t i = 0; i < n; i++) c[i * n + j] /= s;
            }
        }
    }
}
