/* e^x and horizontal reductions for 8 fp32 lanes with AVX2 + FMA, shared by the attention
 * kernels (paged_decode.c, encoder_attention.c). */
#ifndef KVGATE_MATH_AVX2_H
#define KVGATE_MATH_AVX2_H
#include "isa.h"
#ifdef KVGATE_AVX2
#include <immintrin.h>

#define AVX2_INLINE static inline __attribute__((always_inline))

/* e^x for 8 lanes, the AVX2 twin of paged_decode.c's exp512: 2^(x log2 e) split into integer i and fraction
 * f in [-0.5, 0.5]; 2^f by its degree-6 Taylor polynomial (relative error < 2e-8), scaled by
 * 2^i. AVX2 has no scalef: 2^i is built by putting i + 127 into the exponent field, valid
 * only for i in [-126, 127], so the scale is applied as two factors 2^(i/2) and 2^(i - i/2)
 * (each within range for i in [-150, 129]); a result below the normal range then rounds to a
 * subnormal or to 0 instead of wrapping the exponent. x = -inf gives 0, x >= 89 gives inf. */
AVX2_INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f)); /* below this e^x is 0 in float */
    x = _mm256_min_ps(x, _mm256_set1_ps(89.0f));   /* above this it is inf */
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, i);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_cvtps_epi32(i);
    const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* Horizontal max / sum of 8 lanes: halves first (extract is cheap, a lane-crossing permute
 * is not on Zen), then inside 128 bits. */
AVX2_INLINE float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

AVX2_INLINE float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

#endif
#endif
