/* Paged-attention decode on the CPU: one query token per sequence, K/V read straight from the
 * block pool (no gathered copy), online softmax, fp32 accumulation.
 *
 * Layouts (row-major):
 *   q, out       [B, Hkv * G, D]          G query heads share one KV head (GQA)
 *   k/v cache    [Hkv, N, BS, D]          head-major block pool of one layer
 *   tables       [B, max_blocks] int64    block ids of each sequence
 *   lens         [B] int64                tokens of context of each sequence (>= 1)
 * Work items are (sequence, kv head) pairs; each reads its K/V once for all G query heads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(u >> 16);  /* inf / nan */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_BS 64

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                    \
int NAME(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,   \
         T* out, int B, int Hkv, int G, int D, int64_t N, int BS, int max_blocks,              \
         float scale) {                                                                        \
    if (G > MAX_G || D > MAX_D || BS > MAX_BS) return -1;                                      \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int item = 0; item < B * Hkv; ++item) {                                               \
        const int b = item / Hkv, h = item % Hkv;                                              \
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];                         \
        float kf[MAX_BS * MAX_D], vf[MAX_BS * MAX_D], s[MAX_BS]; /* rows packed at stride D */ \
        for (int g = 0; g < G; ++g) {                                                          \
            const T* qp = q + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;                 \
            for (int d = 0; d < D; ++d) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; }   \
            m[g] = -INFINITY; l[g] = 0.f;                                                      \
        }                                                                                      \
        const int64_t len = lens[b];                                                           \
        for (int64_t start = 0; start < len; start += BS) {                                    \
            /* One block: convert its K/V rows once, score them for every query head, then */  \
            /* one online-softmax update per block instead of one per token. */                \
            const int n = (int)(len - start < BS ? len - start : BS);                          \
            const int64_t blk = tables[(int64_t)b * max_blocks + start / BS];                  \
            const T* kp = kc + (h * N + blk) * BS * D;                                         \
            const T* vp = vc + (h * N + blk) * BS * D;                                         \
            for (int i = 0; i < n * D; ++i) { kf[i] = LOAD(kp[i]); vf[i] = LOAD(vp[i]); }      \
            for (int g = 0; g < G; ++g) {                                                      \
                float m_blk = -INFINITY;                                                       \
                for (int t = 0; t < n; ++t) {                                                  \
                    float dot = 0.f;                                                           \
                    for (int d = 0; d < D; ++d) dot += qf[g][d] * kf[t * D + d];               \
                    s[t] = dot;                                                                \
                    m_blk = dot > m_blk ? dot : m_blk;                                         \
                }                                                                              \
                const float m_new = m_blk > m[g] ? m_blk : m[g];                               \
                const float corr = expf(m[g] - m_new);                                         \
                float sum = 0.f;                                                               \
                for (int t = 0; t < n; ++t) { s[t] = expf(s[t] - m_new); sum += s[t]; }        \
                l[g] = l[g] * corr + sum;                                                      \
                m[g] = m_new;                                                                  \
                for (int d = 0; d < D; ++d) acc[g][d] *= corr;                                 \
                for (int t = 0; t < n; ++t) {                                                  \
                    const float p = s[t];                                                      \
                    for (int d = 0; d < D; ++d) acc[g][d] += p * vf[t * D + d];                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < G; ++g) {                                                          \
            T* op = out + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;                     \
            const float inv = 1.f / l[g];                                                      \
            for (int d = 0; d < D; ++d) op[d] = STORE(acc[g][d] * inv);                        \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_DECODE(paged_decode_bf16_generic, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
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
/* Lane t of the result is the sum of the 16 lanes of v[t]: a transpose-and-add tree, 15
 * shuffle+add pairs for 16 dot products instead of one full horizontal sum each. */
static inline __m512 sum16x16(const __m512 v[16]) {
    __m512 quad[4];
    for (int i = 0; i < 4; ++i) {
        const __m512* w = v + 4 * i;
        /* pairs of 32-bit lanes, then pairs of 64-bit lanes, inside each 128-bit lane */
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]),
                                         _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]),
                                         _mm512_unpackhi_ps(w[2], w[3]));
        const __m512d a = _mm512_castps_pd(s01), b = _mm512_castps_pd(s23);
        /* per 128-bit lane j: partial sums over lane j of w[0..3] */
        quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* then across the four 128-bit lanes: two rounds of pairing them up */
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xdd));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                   _mm512_shuffle_f32x4(quad[2], quad[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, r, 0x88), _mm512_shuffle_f32x4(p, r, 0xdd));
}

/* bf16 with AVX512-BF16, tokens taken 16 at a time (a "tile", never crossing a block):
 *  - scores: q.k with vdpbf16ps straight on the stored bf16; 16 dot products summed together
 *    by sum16x16, one K row loaded once for all G query heads;
 *  - one online-softmax update per tile;
 *  - P.V with vdpbf16ps too: two tokens' V rows interleaved (unpack) and multiplied by their
 *    two probabilities rounded to bf16 - the rounding HF and the PyTorch path apply to the
 *    probabilities before their P.V matmul. The unpack scrambles dimensions inside 128-bit
 *    lanes; the accumulators are put back in order once, at the end.
 * Needs D % 32 == 0. */
static int paged_decode_bf16_avx512(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                    const int64_t* tables, const int64_t* lens, uint16_t* out,
                                    int B, int Hkv, int G, int D, int64_t N, int BS,
                                    int max_blocks, float scale) {
    const int C32 = D / 32;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item) {
        const int b = item / Hkv, h = item % Hkv;
        __m512bh qv[MAX_G][MAX_D / 32];
        /* acc_lo / acc_hi [g][c]: dims 32c + 8k + i (lo) and 32c + 8k + 4 + i (hi) in lane
         * 4k + i, k = 128-bit lane, i = 0..3 (the order unpacklo/hi_epi16 leave them in) */
        __m512 acc_lo[MAX_G][MAX_D / 32], acc_hi[MAX_G][MAX_D / 32];
        float m[MAX_G], l[MAX_G];
        for (int g = 0; g < G; ++g) {
            const uint16_t* qp = q + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;
            for (int c = 0; c < C32; ++c) {
                qv[g][c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
                acc_lo[g][c] = _mm512_setzero_ps();
                acc_hi[g][c] = _mm512_setzero_ps();
            }
            m[g] = -INFINITY;
            l[g] = 0.f;
        }
        const __m512 scale_v = _mm512_set1_ps(scale);
        const int64_t len = lens[b];
        for (int64_t start = 0; start < len; start += BS) {
            const int64_t blk = tables[(int64_t)b * max_blocks + start / BS];
            const uint16_t* kblk = kc + (h * N + blk) * BS * D;
            const uint16_t* vblk = vc + (h * N + blk) * BS * D;
            if (start + 2 * BS < len) {
                /* Blocks are scattered in the pool, so the hardware prefetcher cannot guess the
                 * next one: ask for it now, while this block is being computed. */
                const int64_t nxt = tables[(int64_t)b * max_blocks + start / BS + 2];
                const char* nk = (const char*)(kc + (h * N + nxt) * BS * D);
                const char* nv = (const char*)(vc + (h * N + nxt) * BS * D);
                for (int64_t off = 0; off < (int64_t)BS * D * 2; off += 64) {
                    __builtin_prefetch(nk + off);
                    __builtin_prefetch(nv + off);
                }
            }
            const int in_block = (int)(len - start < BS ? len - start : BS);
            for (int t0 = 0; t0 < in_block; t0 += 16) {
                const int n = in_block - t0 < 16 ? in_block - t0 : 16;
                const uint16_t* kp = kblk + (int64_t)t0 * D;
                const uint16_t* vp = vblk + (int64_t)t0 * D;
                const __mmask16 valid = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
                __m512 dots[MAX_G][16];
                for (int t = 0; t < 16; ++t) {
                    if (t >= n) {
                        for (int g = 0; g < G; ++g) dots[g][t] = _mm512_setzero_ps();
                        continue;
                    }
                    __m512bh kv[MAX_D / 32];
                    for (int c = 0; c < C32; ++c)
                        kv[c] = (__m512bh)_mm512_loadu_si512(kp + (int64_t)t * D + 32 * c);
                    for (int g = 0; g < G; ++g) {
                        __m512 dot = _mm512_setzero_ps();
                        for (int c = 0; c < C32; ++c) dot = _mm512_dpbf16_ps(dot, qv[g][c], kv[c]);
                        dots[g][t] = dot;
                    }
                }
                uint32_t pairs[MAX_G][8]; /* bf16 probabilities of tokens (2j, 2j + 1) */
                for (int g = 0; g < G; ++g) {
                    /* lanes past n: -inf, so they add nothing to the max and exp to 0 */
                    const __m512 s = _mm512_mask_mul_ps(
                        _mm512_set1_ps(-INFINITY), valid, sum16x16(dots[g]), scale_v);
                    const float m_tile = _mm512_reduce_max_ps(s);
                    const float m_new = m_tile > m[g] ? m_tile : m[g];
                    const float corr = expf(m[g] - m_new);
                    const __m512 p = _mm512_maskz_mov_ps(
                        valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                    l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
                    m[g] = m_new;
                    const __m512 cv = _mm512_set1_ps(corr);
                    for (int c = 0; c < C32; ++c) {
                        acc_lo[g][c] = _mm512_mul_ps(acc_lo[g][c], cv);
                        acc_hi[g][c] = _mm512_mul_ps(acc_hi[g][c], cv);
                    }
                    _mm256_storeu_si256((__m256i*)pairs[g], (__m256i)_mm512_cvtneps_pbh(p));
                }
                for (int t = 0; t < n; t += 2) {
                    for (int c = 0; c < C32; ++c) {
                        const __m512i a = _mm512_loadu_si512(vp + (int64_t)t * D + 32 * c);
                        /* an odd last token pairs with zeros, never with the rows past it */
                        const __m512i z = t + 1 < n
                            ? _mm512_loadu_si512(vp + (int64_t)(t + 1) * D + 32 * c)
                            : _mm512_setzero_si512();
                        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, z);
                        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, z);
                        for (int g = 0; g < G; ++g) {
                            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[g][t / 2]);
                            acc_lo[g][c] = _mm512_dpbf16_ps(acc_lo[g][c], lo, pp);
                            acc_hi[g][c] = _mm512_dpbf16_ps(acc_hi[g][c], hi, pp);
                        }
                    }
                }
            }
        }
        /* out dims 32c + j: j = 8k + i from lane 4k + i of lo (i < 4) or of hi (i >= 4) */
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19,
                                                4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27,
                                                 12, 13, 14, 15, 28, 29, 30, 31);
        for (int g = 0; g < G; ++g) {
            uint16_t* op = out + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;
            const __m512 inv = _mm512_set1_ps(1.f / l[g]);
            for (int c = 0; c < C32; ++c) {
                const __m512 o0 = _mm512_permutex2var_ps(acc_lo[g][c], first, acc_hi[g][c]);
                const __m512 o1 = _mm512_permutex2var_ps(acc_lo[g][c], second, acc_hi[g][c]);
                _mm256_storeu_si256((__m256i*)(op + 32 * c),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o0, inv)));
                _mm256_storeu_si256((__m256i*)(op + 32 * c + 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o1, inv)));
            }
        }
    }
    return 0;
}
#endif

/* Causal softmax of a fresh prompt's attention scores, for the short-prompt prefill path:
 * scores [R, n] bf16 (q.k^T of R query rows; row r is query r % n of its head), scaled,
 * softmax over keys 0..r % n in float32, probabilities rounded to bf16; keys past the query
 * get 0. Replaces PyTorch's float copy, scale, causal mask, softmax and bf16 copy. */
#define MAX_SOFTMAX_KEYS 4096

int causal_softmax_bf16(const uint16_t* scores, uint16_t* probs, int64_t R, int n,
                        float scale) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (n > MAX_SOFTMAX_KEYS) return -1;
    #pragma omp parallel for schedule(static) if (R * n > 16384)
    for (int64_t r = 0; r < R; ++r) {
        const uint16_t* s = scores + r * n;
        uint16_t* o = probs + r * n;
        const int valid = (int)(r % n) + 1;
        const __m512 sc = _mm512_set1_ps(scale);
        float m = -INFINITY;
        for (int c = 0; c < valid; c += 16) {
            const __mmask16 k = (__mmask16)(valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, s + c)), 16)), sc);
            const float mc = _mm512_mask_reduce_max_ps(k, v);
            m = mc > m ? mc : m;
        }
        float e[MAX_SOFTMAX_KEYS + 16]; /* exp of each valid score */
        __m512 total = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m);
        for (int c = 0; c < valid; c += 16) {
            const __mmask16 k = (__mmask16)(valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, s + c)), 16)), sc);
            const __m512 p = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(v, mv)));
            _mm512_storeu_ps(e + c, p);
            total = _mm512_add_ps(total, p);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
        for (int c = 0; c < n; c += 16) {
            const __mmask16 k = (__mmask16)(n - c >= 16 ? 0xffff : (1u << (n - c)) - 1);
            const __mmask16 live = (__mmask16)(c >= valid ? 0
                : valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 p = _mm512_maskz_mul_ps(live, _mm512_loadu_ps(e + c), inv);
            _mm256_mask_storeu_epi16(o + c, k, (__m256i)_mm512_cvtneps_pbh(p));
        }
    }
    return 0;
#else
    (void)scores; (void)probs; (void)R; (void)n; (void)scale;
    return -1;
#endif
}

int paged_decode_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                      const int64_t* tables, const int64_t* lens, uint16_t* out, int B, int Hkv,
                      int G, int D, int64_t N, int BS, int max_blocks, float scale) {
    if (G > MAX_G || D > MAX_D || BS > MAX_BS) return -1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (D % 32 == 0)
        return paged_decode_bf16_avx512(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                        max_blocks, scale);
#endif
    return paged_decode_bf16_generic(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                     max_blocks, scale);
}
