// The weight table a whole-layer decode kernel takes (decode_layer.cpp in float32,
// decode_layer_bf16.cpp in bfloat16), laid out as decode_layer.py's ctypes structures.
#pragma once
#include <stdint.h>

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
