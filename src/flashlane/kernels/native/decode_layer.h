// The weight table a whole-layer decode kernel takes (decode_layer.cpp in float32,
// decode_layer_bf16.cpp in bfloat16), laid out as decode_layer.py's ctypes structures.
#pragma once
#include <stdint.h>

#include <vector>

// one linear: float32 weights, int8 weights widened (weight-only), int8 weights with int8
// activations (W8A8), GGUF Q4_1 / Q8_0 blocks repacked by 8 rows (block_gemm.cpp), or bf16
// weights on AMX tiles (the bf16 layer's only kind); [out, in] row-major, bias (float32) may be
// null, scale: int8 kinds' per-row scales (the block kinds carry theirs)
enum Kind : int32_t { LIN_F32 = 0, LIN_I8W = 1, LIN_W8A8 = 2, LIN_Q4_1 = 3, LIN_Q8_0 = 4, LIN_BF16_AMX = 5 };
struct Linear {
    const void* w;
    const float* scale;
    const float* bias;
    int32_t kind;
};

// ln1 / ln2: the RMSNorm weights, in the layer's dtype
struct LayerWeights {
    const void *ln1, *ln2;
    Linear q, k, v, o, gate, up, down;
};

// One call's activations for M rows, carved from a per-thread buffer of the layer's dtype
template <typename T>
struct LayerScratch {
    T *x, *h1, *o, *q, *qr, *att, *k, *kr, *v, *g, *u, *a;
    LayerScratch(std::vector<T>& buf, int64_t M, int64_t D, int64_t nq, int64_t nkv, int64_t I) {
        buf.resize(M * (3 * D + 3 * nq + 3 * nkv + 3 * I));
        x = buf.data();        // normed rows, [M, D]
        h1 = x + M * D;        // after attention, [M, D]
        o = h1 + M * D;        // o_proj / down_proj out, [M, D]
        q = o + M * D;         // [M, nq], then RoPE'd into qr
        qr = q + M * nq;
        att = qr + M * nq;     // attention out, [M, nq]
        k = att + M * nq;      // [M, nkv], then RoPE'd into kr
        kr = k + M * nkv;
        v = kr + M * nkv;
        g = v + M * nkv;       // [M, I]
        u = g + M * I;
        a = u + M * I;
    }
};
