/* Fused element-wise ops of a bf16 Llama layer, each replacing several small PyTorch ops.
 * Scalar code: it wins where PyTorch's per-op dispatch dominates (decode, few rows), which
 * is where model/ops.py uses it.
 *
 * Built WITHOUT fast-math and with FMA contraction off: every operation rounds to bf16
 * exactly where PyTorch's separate bf16 ops would (torch computes a bf16 op in float32 and
 * rounds the result), so results match the unfused path op for op.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ld(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t st(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)((u >> 16) | ((u & 0xffff) ? 0x40 : 0));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float r(float f) { return ld(st(f)); } /* round a float to bf16 precision */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512BF16 1

static inline __m512 ld16(const uint16_t* p) { /* 16 bf16 -> f32 (exact: a shift) */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline __m512 round16(__m512 x) { /* f32 -> nearest-even bf16 -> f32, as torch rounds */
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* The vector twin of rotate(): D % 32 == 0, 16 lanes at a time; roll(x, D/2) swaps halves. */
static inline void rotate16(const uint16_t* x, const uint16_t* cos, const uint16_t* sin_signed,
                            uint16_t* out, int D) {
    const int half = D / 2;
    for (int c = 0; c < D; c += 16) {
        const int rc = (c + half) % D;
        const __m512 a = round16(_mm512_mul_ps(ld16(x + c), ld16(cos + c)));
        const __m512 b = round16(_mm512_mul_ps(ld16(x + rc), ld16(sin_signed + c)));
        _mm256_storeu_si256((__m256i*)(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    }
}
#endif

/* x [D] -> out [D]: out = x * cos + roll(x, D/2) * sin_signed, rounded per op. */
static inline void rotate(const uint16_t* x, const uint16_t* cos, const uint16_t* sin_signed,
                          uint16_t* out, int D) {
#ifdef HAVE_AVX512BF16
    if (D % 32 == 0) { rotate16(x, cos, sin_signed, out, D); return; }
#endif
    const int half = D / 2;
    for (int d = 0; d < D; ++d) {
        const float a = r(ld(x[d]) * ld(cos[d]));
        const float b = r(ld(x[(d + half) % D]) * ld(sin_signed[d]));
        out[d] = st(a + b);
    }
}


/* qkv [T, (Hq + 2 Hkv) D] -> q_out [T, Hq, D], k_out [T, Hkv, D] rotated; rotated K and V
 * written to the head-major caches [Hkv, N * BS, D] at slots[t]. cos/sin tables [P, D]. */
void rope_write_kv_bf16(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                        const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                        uint16_t* k_out, uint16_t* k_cache, uint16_t* v_cache, int T, int Hq,
                        int Hkv, int D, int64_t num_slots) {
    const int64_t row = (int64_t)(Hq + 2 * Hkv) * D;
    #pragma omp parallel for schedule(static) if (T > 64)
    for (int t = 0; t < T; ++t) {
        const uint16_t* x = qkv + t * row;
        const uint16_t* c = cos + positions[t] * D;
        const uint16_t* s = sin_signed + positions[t] * D;
        for (int h = 0; h < Hq; ++h) rotate(x + h * D, c, s, q_out + ((int64_t)t * Hq + h) * D, D);
        for (int h = 0; h < Hkv; ++h) {
            uint16_t* k = k_out + ((int64_t)t * Hkv + h) * D;
            rotate(x + (Hq + h) * D, c, s, k, D);
            const int64_t at = ((int64_t)h * num_slots + slots[t]) * D;
            memcpy(k_cache + at, k, (size_t)D * 2);
            memcpy(v_cache + at, x + (Hq + Hkv + h) * D, (size_t)D * 2);
        }
    }
}

/* 1 when the AVX512-BF16 path was compiled in (it beats PyTorch at every row count). */
int fused_ops_vectorized(void) {
#ifdef HAVE_AVX512BF16
    return 1;
#else
    return 0;
#endif
}
