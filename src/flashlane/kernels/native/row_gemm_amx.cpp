// x @ W^T (+ bias) for up to 16 rows of bfloat16 x against bfloat16 W ([N, K] row-major, as
// loaded, so the same weights serve torch's matmul for prefill), on AMX tiles: the decode and
// small-batch case of a bf16 model, where torch's bf16 linear re-packs the weights on every call.
// W needs no packing because it is the tile multiply's left operand: a tile of 16 of its rows by
// 32 columns is 16 output features by 32 k, read in place with the row stride of W. The rows of x
// are the right operand, packed per call into AMX's pair-interleaved layout (a few KiB) and
// zero-padded to 16, so every output is the same computation whatever the number of rows: a
// row's result does not depend on which other rows share the call (batch-invariant). Float32
// sums; the bias (float32) is added and the result rounded to bf16 once, as torch rounds.
// Built with -mamx-tile -mamx-bf16; the caller checks the CPU flags and calls amx_enable first.
#include "amx.h"
#include "parallel.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

namespace {
constexpr int kRows = 16;            // tile rows: output features per tile, and x rows per call
constexpr int kK = 32;               // bf16 values of k per tile row (64 bytes)

// tiles 0-3: sums of four blocks of 16 features x 16 rows; 4-5: W blocks; 6: the packed rows
void configure() { configure_tiles(7); }

// out[m, n0 + r] = bf16(sums[r, m] + bias) for the call's rows m < M and features r < nr
inline void store_block(const float* sums, int64_t M, int64_t nr, const float* bias, uint16_t* C, int64_t ldc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < nr; r++) C[m * ldc + r] = bf16_bits(sums[r * kRows + m] + (bias ? bias[r] : 0.0f));
}

// NB blocks of 16 features from W (row stride ldw elements) against the packed rows xp, while
// the next bytes [pf, pf + pf_bytes) (the next block's weights) are prefetched into L2, spread
// over the k steps: the tile loads read 16 rows 64 bytes at a time, a pattern the hardware
// prefetchers follow poorly. SmolLM2's 30 layers of weights from memory at 8 rows (Sapphire
// Rapids): 15.0 against 15.6 ms median, 14.1 against 13.6 GB/s (a plain read: about 14.4)
template <int NB>
void blocks(const uint16_t* W, int64_t ldw, const uint16_t* xp, int64_t K, float* sums, const char* pf = nullptr,
            int64_t pf_bytes = 0) {
    const int64_t steps = K / kK, per_step = (pf_bytes / 64 + steps - 1) / steps * 64;
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (NB > 2) _tile_zero(2);
    if (NB > 3) _tile_zero(3);
    const int64_t stride = ldw * 2;
    for (int64_t k = 0; k < K; k += kK) {
        if (pf) {
            const int64_t at = (k / kK) * per_step;
            for (int64_t b = at; b < at + per_step && b < pf_bytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
        }
        _tile_loadd(6, xp + k * kRows, 64);
        _tile_loadd(4, W + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(5, W + kRows * ldw + k, stride);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (NB > 2) {
            _tile_loadd(4, W + 2 * kRows * ldw + k, stride);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (NB > 3) {
            _tile_loadd(5, W + 3 * kRows * ldw + k, stride);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
    _tile_stored(0, sums, 64);
    if (NB > 1) _tile_stored(1, sums + 256, 64);
    if (NB > 2) _tile_stored(2, sums + 512, 64);
    if (NB > 3) _tile_stored(3, sums + 768, 64);
}
}  // namespace

// Ask the kernel for the AMX tile state (Linux, once per process): 0 when granted.
extern "C" int amx_enable() {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return static_cast<int>(syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
}

// C [M, N] (row stride ldc) = A [M, K] (row stride lda) @ W[N - n0 ...] features [n0, n1) of
// W[N, K]^T (row stride ldw) + bias [N] (float32, may be null); M <= 16, K a multiple of 32.
// Features [n0, n1) only, so callers can split N over threads.
extern "C" void row_gemm_amx_bf16(const uint16_t* A, int64_t M, int64_t lda, const uint16_t* W, int64_t N, int64_t K,
                                  int64_t ldw, const float* bias, uint16_t* C, int64_t ldc, int64_t n0, int64_t n1) {
    // x packed as AMX's right operand: for each k block of 32, 16 pair-rows of 16 x rows x 2 values
    thread_local std::vector<uint16_t> xp;
    xp.assign(static_cast<size_t>(K) * kRows, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 2) {
            uint16_t* dst = xp.data() + (k / kK) * kK * kRows + ((k % kK) / 2) * 2 * kRows + 2 * m;
            dst[0] = A[m * lda + k];
            dst[1] = A[m * lda + k + 1];
        }
    configure();
    alignas(64) float sums[4 * 256];
    int64_t n = n0;
    for (; n + 4 * kRows <= n1; n += 4 * kRows) {
        // the next block's rows, contiguous where W's rows are (ldw == K)
        const int64_t next = std::min<int64_t>(4 * kRows, n1 - n - 4 * kRows);
        const char* pf = next > 0 ? reinterpret_cast<const char*>(W + (n + 4 * kRows) * ldw) : nullptr;
        blocks<4>(W + n * ldw, ldw, xp.data(), K, sums, pf, ldw == K ? next * K * 2 : 0);
        for (int b = 0; b < 4; b++)
            store_block(sums + b * 256, M, kRows, bias ? bias + n + b * kRows : nullptr, C + n + b * kRows, ldc);
    }
    for (; n + kRows <= n1; n += kRows) {
        blocks<1>(W + n * ldw, ldw, xp.data(), K, sums);
        store_block(sums, M, kRows, bias ? bias + n : nullptr, C + n, ldc);
    }
    if (n < n1) {   // the last features: their rows copied into a zero-padded block of 16
        thread_local std::vector<uint16_t> last;
        last.assign(static_cast<size_t>(kRows) * K, 0);
        for (int64_t r = 0; r < n1 - n; r++) memcpy(last.data() + r * K, W + (n + r) * ldw, K * 2);
        blocks<1>(last.data(), K, xp.data(), K, sums);
        store_block(sums, M, n1 - n, bias ? bias + n : nullptr, C + n, ldc);
    }
    _tile_release();
}

// all N features, in blocks of `block` split over `threads` of torch's OpenMP team (parallel.h);
// each thread packs x for itself
extern "C" void row_gemm_amx_bf16_split(const uint16_t* A, int64_t M, int64_t lda, const uint16_t* W, int64_t N,
                                        int64_t K, int64_t ldw, const float* bias, uint16_t* C, int64_t ldc,
                                        int64_t block, int64_t threads) {
    parallel_rows((N + block - 1) / block, threads, [&](int64_t first, int64_t count) {
        row_gemm_amx_bf16(A, M, lda, W, N, K, ldw, bias, C, ldc, first * block,
                          (first + count) * block < N ? (first + count) * block : N);
    });
}
