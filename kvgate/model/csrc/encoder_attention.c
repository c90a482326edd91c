/* Bidirectional attention of an encoder (the embedder, docs/e5_encoder.py) over packed
 * sequences: no padding, no mask, every token of a sequence attends to every token of it.
 *
 * Layouts (row-major), bf16 or fp32 (the same type in and out):
 *   qkv     [T, 3, H, D]   the QKV projection's output as it comes: q | k | v, heads inside
 *   out     [T, H, D]
 *   starts  [S + 1] int64  sequence s is tokens starts[s] .. starts[s + 1] - 1
 * Work items are (sequence, head) pairs. Each widens its K (transposed, [D][keys]) and V to
 * fp32 once, then takes its queries ROWS at a time: their scores against all keys in
 * registers (ROWS x 16 keys per tile), an exact softmax over the whole row (a row is at most
 * 512 keys, so no online rescaling), and P.V (ROWS x 32 dims per tile). fp32 throughout;
 * bf16 outputs are rounded once, to nearest even.
 *
 * Why: the embedder's sequences are short (~100 tokens) and its heads narrow (32), where
 * PyTorch's CPU flash attention managed 25 GFLOP/s on 2 Zen 4 cores and was a third of the
 * encoder's time for 4% of its FLOPs.
 *
 * AVX2 + FMA (also in the AVX-512 builds), D % 32 == 0 and D <= 256; otherwise, and in a
 * build without AVX2, it returns -1 and Python keeps PyTorch's attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

KVGATE_DEFINE_ISA()

#define MAX_D 256

#ifdef KVGATE_AVX2
#include <immintrin.h>

#include "bf16_avx2.h"
#include "math_avx2.h"
#include "math_avx512.h"

#define ROWS 4 /* queries per tile: ROWS x 2 score and ROWS x 4 output accumulators */

AVX2_INLINE __m256 load8(const void* p, int bf16) {
    return bf16 ? bf16x8_load((const uint16_t*)p) : _mm256_loadu_ps((const float*)p);
}

AVX2_INLINE void store8(void* p, int bf16, __m256 x) {
    if (bf16) bf16x8_store((uint16_t*)p, x);
    else _mm256_storeu_ps((float*)p, x);
}

AVX2_INLINE float load1(const void* p, int64_t i, int bf16) {
    if (!bf16) return ((const float*)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One (sequence, head): n tokens from token t0. scratch holds kt [D][np], v [n][D],
 * q [nq][D] (scaled; rows past n are 0) and s [ROWS][np], np = n rounded up to 16. */
AVX2_INLINE void attend(const void* qkv, void* out, int64_t t0, int n, int h, int H, int D,
                        float scale, int bf16, float* scratch) {
    const int np = (n + 15) & ~15, nq = (n + ROWS - 1) / ROWS * ROWS;
    const int es = bf16 ? 2 : 4;
    float *kt = scratch, *v = kt + (int64_t)D * np, *q = v + (int64_t)n * D;
    float* s = q + (int64_t)nq * D;
    const int64_t row = 3LL * H * D; /* elements from one token to the next */
    const char* base = (const char*)qkv + ((t0 * 3 * H) + h) * D * es;
    const char* kbase = base + (int64_t)H * D * es;
    const char* vbase = base + 2LL * H * D * es;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int j = 0; j < n; ++j) {
        const char* qr = base + j * row * es;
        const char* kr = kbase + j * row * es;
        const char* vr = vbase + j * row * es;
        for (int d = 0; d < D; d += 8) {
            _mm256_storeu_ps(q + (int64_t)j * D + d, _mm256_mul_ps(load8(qr + d * es, bf16), sc));
            _mm256_storeu_ps(v + (int64_t)j * D + d, load8(vr + d * es, bf16));
        }
        for (int d = 0; d < D; ++d) kt[(int64_t)d * np + j] = load1(kr, d, bf16);
    }
    for (int d = 0; d < D; ++d)
        for (int j = n; j < np; ++j) kt[(int64_t)d * np + j] = 0.f;
    memset(q + (int64_t)n * D, 0, sizeof(float) * (size_t)(nq - n) * D);

    for (int i0 = 0; i0 < n; i0 += ROWS) {
        const float* qi = q + (int64_t)i0 * D;
        for (int j0 = 0; j0 < np; j0 += 16) { /* scores: ROWS queries x 16 keys */
            __m256 a[ROWS][2];
            for (int r = 0; r < ROWS; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
            for (int d = 0; d < D; ++d) {
                const __m256 k0 = _mm256_loadu_ps(kt + (int64_t)d * np + j0);
                const __m256 k1 = _mm256_loadu_ps(kt + (int64_t)d * np + j0 + 8);
                for (int r = 0; r < ROWS; ++r) {
                    const __m256 b = _mm256_broadcast_ss(qi + r * D + d);
                    a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
                }
            }
            for (int r = 0; r < ROWS; ++r) {
                _mm256_storeu_ps(s + r * np + j0, a[r][0]);
                _mm256_storeu_ps(s + r * np + j0 + 8, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS; ++r) { /* softmax of each row, over the n real keys */
            float* sr = s + r * np;
            /* Keys past n: -inf for the max, then their lanes are zeroed after exp. Not left
             * to exp256(-inf): its 2^-150 goes through subnormal products, which cost a
             * microcode assist each on Intel cores. */
            for (int j = n; j < np; ++j) sr[j] = -INFINITY;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (int j = 0; j < np; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
            const __m256 m = _mm256_set1_ps(hmax8(mx));
            __m256 total = _mm256_setzero_ps();
            for (int j = 0; j < n; j += 8) {
                __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), m));
                if (j + 8 > n) /* lanes n - j .. 7 are keys past n */
                    p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
                _mm256_storeu_ps(sr + j, p);
                total = _mm256_add_ps(total, p);
            }
            const __m256 inv = _mm256_set1_ps(1.f / hsum8(total));
            for (int j = 0; j < n; j += 8)
                _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), inv));
        }
        const int rows = n - i0 < ROWS ? n - i0 : ROWS;
        for (int c0 = 0; c0 < D; c0 += 32) { /* P.V: ROWS queries x 32 dims */
            __m256 o[ROWS][4];
            for (int r = 0; r < ROWS; ++r)
                for (int c = 0; c < 4; ++c) o[r][c] = _mm256_setzero_ps();
            for (int j = 0; j < n; ++j) {
                const float* vj = v + (int64_t)j * D + c0;
                const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
                const __m256 v2 = _mm256_loadu_ps(vj + 16), v3 = _mm256_loadu_ps(vj + 24);
                for (int r = 0; r < ROWS; ++r) {
                    const __m256 p = _mm256_broadcast_ss(s + r * np + j);
                    o[r][0] = _mm256_fmadd_ps(p, v0, o[r][0]);
                    o[r][1] = _mm256_fmadd_ps(p, v1, o[r][1]);
                    o[r][2] = _mm256_fmadd_ps(p, v2, o[r][2]);
                    o[r][3] = _mm256_fmadd_ps(p, v3, o[r][3]);
                }
            }
            for (int r = 0; r < rows; ++r) {
                char* op = (char*)out + (((t0 + i0 + r) * H + h) * (int64_t)D + c0) * es;
                for (int c = 0; c < 4; ++c) store8(op + 8 * c * es, bf16, o[r][c]);
            }
        }
    }
}


#ifdef KVGATE_AVX512BF16
/* bf16 with AVX512-BF16: vdpbf16ps on pairs, 16 fp32 lanes, half the multiply instructions
 * of two fp32 FMAs per pair and no widening of K or V:
 *  - scores: K re-laid as kp [D/2][np] 32-bit words (each word = dims 2p, 2p + 1 of one key,
 *    as stored), so one load is 16 keys' pair p; a query's pair p is broadcast;
 *  - P.V: V re-laid as vp [np/2][D] words (each = one dim of keys 2t, 2t + 1), the
 *    probabilities rounded to bf16 (as the decode kernel and HF's bf16 attention round them)
 *    and broadcast in pairs of keys.
 * The scale is applied to the fp32 scores. */
#define ROWS512 8

static void attend_bf16_512(const uint16_t* qkv, uint16_t* out, int64_t t0, int n, int h,
                            int H, int D, float scale, void* scratch) {
    const int np = (n + 15) & ~15, P = D / 2;
    uint32_t* kp = scratch;                       /* [P][np] */
    uint32_t* vp = kp + (int64_t)P * np;          /* [np / 2][D] */
    float* s = (float*)(vp + (int64_t)(np / 2) * D); /* [ROWS512][np] */
    uint16_t* pb = (uint16_t*)(s + ROWS512 * np); /* [ROWS512][np] */
    const int64_t row = 3LL * H * D;
    const uint16_t* base = qkv + (t0 * 3 * H + h) * D;
    const uint16_t* kbase = base + (int64_t)H * D;
    const uint16_t* vbase = base + 2LL * H * D;
    for (int j = 0; j < np; ++j) {
        const uint32_t* kr = (const uint32_t*)(kbase + j * row);
        for (int p = 0; p < P; ++p) kp[(int64_t)p * np + j] = j < n ? kr[p] : 0u;
    }
    for (int t = 0; t < np / 2; ++t) {
        const uint16_t* a = vbase + 2 * t * row;
        const uint16_t* b = vbase + (2 * t + 1) * row;
        for (int d = 0; d < D; ++d)
            vp[(int64_t)t * D + d] = (2 * t < n ? a[d] : 0u) | (2 * t + 1 < n ? (uint32_t)b[d] << 16 : 0u);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i0 = 0; i0 < n; i0 += ROWS512) {
        const int rows = n - i0 < ROWS512 ? n - i0 : ROWS512;
        const uint32_t* qr[ROWS512]; /* rows past n repeat the last query; never stored */
        for (int r = 0; r < ROWS512; ++r)
            qr[r] = (const uint32_t*)(base + (int64_t)(i0 + (r < rows ? r : rows - 1)) * row);
        for (int j0 = 0; j0 < np; j0 += 16) {
            __m512 a[ROWS512];
            for (int r = 0; r < ROWS512; ++r) a[r] = _mm512_setzero_ps();
            for (int p = 0; p < P; ++p) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + (int64_t)p * np + j0);
                for (int r = 0; r < ROWS512; ++r)
                    a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qr[r][p]), k);
            }
            for (int r = 0; r < ROWS512; ++r) _mm512_storeu_ps(s + r * np + j0, _mm512_mul_ps(a[r], sc));
        }
        for (int r = 0; r < rows; ++r) { /* softmax over the n real keys, to bf16 */
            float* sr = s + r * np;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < n; j += 16) {
                const __mmask16 live = (__mmask16)(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
                mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(sr + j));
            }
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 total = _mm512_setzero_ps();
            for (int j = 0; j < np; j += 16) {
                const __mmask16 live = (__mmask16)(j >= n ? 0 : n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
                const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m)));
                _mm512_storeu_ps(sr + j, p);
                total = _mm512_add_ps(total, p);
            }
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
            for (int j = 0; j < np; j += 16)
                _mm256_storeu_si256((__m256i*)(pb + r * np + j),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sr + j), inv)));
        }
        for (int c0 = 0; c0 < D; c0 += 32) { /* P.V: ROWS512 queries x 32 dims */
            __m512 o[ROWS512][2];
            for (int r = 0; r < ROWS512; ++r) o[r][0] = o[r][1] = _mm512_setzero_ps();
            for (int t = 0; t < np / 2; ++t) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + (int64_t)t * D + c0);
                const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + (int64_t)t * D + c0 + 16);
                for (int r = 0; r < ROWS512; ++r) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32(((const int*)(pb + r * np))[t]);
                    o[r][0] = _mm512_dpbf16_ps(o[r][0], pp, v0);
                    o[r][1] = _mm512_dpbf16_ps(o[r][1], pp, v1);
                }
            }
            for (int r = 0; r < rows; ++r) {
                uint16_t* op = out + ((t0 + i0 + r) * H + h) * (int64_t)D + c0;
                _mm256_storeu_si256((__m256i*)op, (__m256i)_mm512_cvtneps_pbh(o[r][0]));
                _mm256_storeu_si256((__m256i*)(op + 16), (__m256i)_mm512_cvtneps_pbh(o[r][1]));
            }
        }
    }
}
#endif

static int encoder_attention(const void* qkv, void* out, const int64_t* starts, int S, int H,
                             int D, float scale, int bf16) {
    if (D % 32 != 0 || D > MAX_D) return -1;
    int longest = 0;
    for (int i = 0; i < S; ++i) {
        const int64_t n = starts[i + 1] - starts[i];
        if (n < 0 || n > 1 << 20) return -1;
        longest = n > longest ? (int)n : longest;
    }
    const int np = (longest + 15) & ~15, nq = (longest + ROWS - 1) / ROWS * ROWS;
    /* bytes of one item's scratch: the AVX2 path's floats, or the AVX-512 path's words */
    size_t bytes = sizeof(float) * ((size_t)D * np + (size_t)longest * D + (size_t)nq * D + ROWS * np);
#ifdef KVGATE_AVX512BF16
    const size_t words = (size_t)D / 2 * np + (size_t)np / 2 * D + ROWS512 * np;
    const size_t bytes512 = 4 * words + 2 * (size_t)ROWS512 * np;
    bytes = bytes512 > bytes ? bytes512 : bytes;
#endif
    int failed = 0;
    #pragma omp parallel reduction(| : failed)
    {
        void* scratch = malloc(bytes);
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < S * H; ++item) {
            const int i = item / H, h = item % H;
            const int n = (int)(starts[i + 1] - starts[i]);
            if (!scratch || n == 0) continue;
#ifdef KVGATE_AVX512BF16
            if (bf16) {
                attend_bf16_512(qkv, out, starts[i], n, h, H, D, scale, scratch);
                continue;
            }
#endif
            attend(qkv, out, starts[i], n, h, H, D, scale, bf16, scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
#endif

int encoder_attention_bf16(const uint16_t* qkv, uint16_t* out, const int64_t* starts, int S,
                           int H, int D, float scale) {
#ifdef KVGATE_AVX2
    return encoder_attention(qkv, out, starts, S, H, D, scale, 1);
#else
    (void)qkv; (void)out; (void)starts; (void)S; (void)H; (void)D; (void)scale;
    return -1;
#endif
}

int encoder_attention_f32(const float* qkv, float* out, const int64_t* starts, int S, int H,
                          int D, float scale) {
#ifdef KVGATE_AVX2
    return encoder_attention(qkv, out, starts, S, H, D, scale, 0);
#else
    (void)qkv; (void)out; (void)starts; (void)S; (void)H; (void)D; (void)scale;
    return -1;
#endif
}
