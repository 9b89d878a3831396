// What the AMX tile kernels share (row_gemm_amx.cpp, prefill_attention_amx.cpp): the tile
// configuration (and simd.h's helpers, bf16 rounding among them).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles [0, n) as 16 rows of 64 bytes (palette 1), for this thread
inline void configure_tiles(int n) {
    TileConfig cfg;
    for (int t = 0; t < n; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
