// Helpers shared by the kernels of this folder (AVX2; their AVX-512 twins where it is on).
#pragma once
#include <immintrin.h>
#include <stdint.h>

// For the scope, this thread's float32 denormals are flushed to zero as results and read as zero as
// inputs (MXCSR's FTZ and DAZ; restored after). A softmax's far tail (scores 87 below the max and
// more) is denormal, and every op that touches a denormal costs a microcode assist of about a
// hundred cycles: a decode attention over peaked scores ran 2.4x slower. The flushed values are
// below 1.2e-38 and vanish in any sum of probabilities or of their weighted values.
struct FlushDenormals {
    unsigned int saved;
    FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
    ~FlushDenormals() { _mm_setcsr(saved); }
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// the sum of a vector's eight lanes, in one fixed order
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x for x <= 88.37: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial
// (Taylor, relative error ~2e-7 on that interval), 2^n into the exponent bits
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.37f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);       // ln2, high part
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);          // ln2, low part
    static const float c[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
    __m256 p = _mm256_set1_ps(c[7]);
    for (int i = 6; i >= 0; i--) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float in[8] = {x, 0, 0, 0, 0, 0, 0, 0}, out[8];
    _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(in)));
    return out[0];
}

// bfloat16 (raw uint16 bits) <-> float32. Widening is exact; narrowing rounds to nearest even as
// torch does (finite values; a NaN's payload is not preserved).
static inline float bf16_value(uint16_t h) {
    const uint32_t b = static_cast<uint32_t>(h) << 16;
    float x;
    __builtin_memcpy(&x, &b, 4);
    return x;
}

static inline uint16_t bf16_bits(float x) {
    uint32_t b;
    __builtin_memcpy(&b, &x, 4);
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// eight at a time: widen, narrow (packed bits), and a vector rounded to bf16 values kept as float32
static inline __m256 bf16_load8(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline __m128i bf16_bits8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __m256 bf16_rounded8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

// float32 vectors behind one set of names, for kernels written once over eight lanes (AVX2) and
// sixteen (AVX-512 builds): index_scores.cpp, paged_attention.cpp. ``fold`` and ``fold_max`` bring
// a vector to eight lanes (halves added, or maxed), where both widths reduce in one order.
struct F32x8 {
    using T = __m256;
    static constexpr int kLanes = 8;
    static T zero() { return _mm256_setzero_ps(); }
    static T set1(float x) { return _mm256_set1_ps(x); }
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static T load_bf16(const uint16_t* p) { return bf16_load8(p); }
    static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
    static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T max(T a, T b) { return _mm256_max_ps(a, b); }
    static T exp(T x) { return exp256(x); }
    static __m256 fold(T a) { return a; }
    static __m256 fold_max(T a) { return a; }
};

#ifdef __AVX512F__
// exp256 and the bf16 helpers sixteen lanes at a time, lane for lane the same operations (the
// AVX-512 build of a kernel rounds as its AVX2 build)
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.37f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    static const float c[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
    __m512 p = _mm512_set1_ps(c[7]);
    for (int i = 6; i >= 0; i--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 bf16_load16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// the rounded bf16 bits in each lane's low half
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

struct F32x16 {
    using T = __m512;
    static constexpr int kLanes = 16;
    static T zero() { return _mm512_setzero_ps(); }
    static T set1(float x) { return _mm512_set1_ps(x); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static T load_bf16(const uint16_t* p) { return bf16_load16(p); }
    static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
    static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static T exp(T x) { return exp512(x); }
    static __m256 high(T a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
    static __m256 fold(T a) { return _mm256_add_ps(_mm512_castps512_ps256(a), high(a)); }
    static __m256 fold_max(T a) { return _mm256_max_ps(_mm512_castps512_ps256(a), high(a)); }
};
#endif

// Element access for float32 and bfloat16 data: loads widen to float32 (exact); round8/round1
// give what the dtype's own op would have stored (nothing for float32, bf16 rounding for bf16).
struct F32 {
    using T = float;
    static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
    static float value1(float v) { return v; }
    static __m256 round8(__m256 v) { return v; }
    static float round1(float v) { return v; }
    static void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
    static void store1(float* p, float v) { *p = v; }
};

struct Bf16 {
    using T = uint16_t;
    static __m256 load8(const uint16_t* p) { return bf16_load8(p); }
    static float value1(uint16_t v) { return bf16_value(v); }
    static __m256 round8(__m256 v) { return bf16_rounded8(v); }
    static float round1(float v) { return bf16_value(bf16_bits(v)); }
    static void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v)); }
    static void store1(uint16_t* p, float v) { *p = bf16_bits(v); }
};

// sum of x[i]^2 over n values (float32 lanes by D::load8 / D::value1, one fixed order): the
// accumulation every RMS norm of this folder shares
template <typename D>
static inline float sum_squares(const typename D::T* x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = D::load8(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float s = hsum(acc);
    for (; i < n; i++) s += D::value1(x[i]) * D::value1(x[i]);
    return s;
}
