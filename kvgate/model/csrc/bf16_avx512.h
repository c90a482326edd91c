/* bf16 <-> float32 for 16 lanes with AVX512, rounding exactly as PyTorch does. */
#ifndef KVGATE_BF16_AVX512_H
#define KVGATE_BF16_AVX512_H
#include "isa.h"
#ifdef KVGATE_AVX512BF16
#include <immintrin.h>

/* 16 bf16 -> f32 (exact: a shift) */
static inline __m512 bf16x16_load(const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* f32 -> bf16 bits, nearest even, exactly as torch rounds. Not the AVX512-BF16 conversion
 * instruction: it flushes subnormal inputs and results to zero; torch does not. */
static inline __m256i bf16x16_round(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i b = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    b = _mm512_mask_mov_epi32(
        b, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(b);
}
#endif
#endif
