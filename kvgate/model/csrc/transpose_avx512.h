/* A 16 x 16 transpose of 32-bit values in AVX-512 registers, shared by the kernels that lay
 * out tile or panel operands (qlinear.c, prefill_bf16.h). Include only in code compiled for
 * AVX-512. */
#ifndef KVGATE_TRANSPOSE_AVX512_H
#define KVGATE_TRANSPOSE_AVX512_H
#include <immintrin.h>

/* r[j] := dword j of the 16 registers (lane i of the result: r[i]'s lane j), in registers. */
static inline void transpose16_in(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        const __m512i a0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
        const __m512i a1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
        const __m512i b0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
        const __m512i b1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
        t[e] = _mm512_shuffle_i32x4(a0, b0, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(a1, b1, 0x88);
        t[8 + e] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
        t[12 + e] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
    }
    for (int j = 0; j < 16; ++j) r[j] = t[j];
}

#endif
