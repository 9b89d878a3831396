// What the AMX tile kernels share (row_gemm_amx.cpp, prefill_attention_amx.cpp): the tile
// configuration and bf16 rounding.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

inline uint16_t to_bf16(float x) {   // round to nearest even (finite values), as torch does
    uint32_t b;
    memcpy(&b, &x, 4);
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
