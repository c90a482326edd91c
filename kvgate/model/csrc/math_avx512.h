/* e^x for 16 fp32 lanes with AVX-512, shared by the attention kernels (paged_decode.c,
 * encoder_attention.c). */
#ifndef KVGATE_MATH_AVX512_H
#define KVGATE_MATH_AVX512_H
#include "isa.h"
#ifdef KVGATE_AVX512BF16
#include <immintrin.h>

/* e^x for 16 lanes: 2^(x log2 e) split into integer i and fraction f in [-0.5, 0.5]; 2^f by
 * its degree-6 Taylor polynomial (relative error < 2e-8), scaled by 2^i. x = -inf gives 0. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below this e^x is 0 in float */
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, i);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}
#endif
#endif
