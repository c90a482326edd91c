/* bf16 <-> float32 for 8 lanes with AVX2, rounding exactly as PyTorch does. */
#ifndef KVGATE_BF16_AVX2_H
#define KVGATE_BF16_AVX2_H
#include "isa.h"
#ifdef KVGATE_AVX2
#include <immintrin.h>
#include <stdint.h>

/* 8 bf16 -> f32 (exact: a shift) */
static inline __m256 bf16x8_load(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* f32 -> bf16 bits in the low 16 bits of each 32-bit lane, nearest even, as torch rounds
 * (NaN stays a quiet NaN; subnormals are kept, not flushed). */
static inline __m256i bf16x8_round_bits(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i b = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(b, quiet, nan);
}

/* f32 -> nearest-even bf16 -> f32 (the value torch holds after a bf16 op) */
static inline __m256 bf16x8_round(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_round_bits(x), 16));
}

/* Round 8 floats to bf16 and store them. */
static inline void bf16x8_store(uint16_t* p, __m256 x) {
    const __m256i b = bf16x8_round_bits(x);
    /* packus works per 128-bit lane: [b0..3 b0..3 | b4..7 b4..7]; take quadwords 0 and 2 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

/* Round 16 floats (lo: 0-7, hi: 8-15) to bf16 and store them. */
static inline void bf16x16_store_avx2(uint16_t* p, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(bf16x8_round_bits(lo), bf16x8_round_bits(hi)), 0xd8);
    _mm256_storeu_si256((__m256i*)p, packed);
}
#endif
#endif
