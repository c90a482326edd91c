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
/* bf16 with AVX512-BF16: q.k with vdpbf16ps straight on the stored bf16 (no conversion pass),
 * P.V with 16-lane FMAs; one token's K/V row is loaded once for all G query heads.
 * Needs D % 32 == 0. Same online-softmax-per-block scheme as the generic code. */
static int paged_decode_bf16_avx512(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                    const int64_t* tables, const int64_t* lens, uint16_t* out,
                                    int B, int Hkv, int G, int D, int64_t N, int BS,
                                    int max_blocks, float scale) {
    const int C32 = D / 32, C16 = D / 16;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item) {
        const int b = item / Hkv, h = item % Hkv;
        __m512bh qv[MAX_G][MAX_D / 32];
        __m512 acc[MAX_G][MAX_D / 16];
        float m[MAX_G], l[MAX_G], s[MAX_G][MAX_BS];
        for (int g = 0; g < G; ++g) {
            const uint16_t* qp = q + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;
            for (int c = 0; c < C32; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
            for (int c = 0; c < C16; ++c) acc[g][c] = _mm512_setzero_ps();
            m[g] = -INFINITY;
            l[g] = 0.f;
        }
        const int64_t len = lens[b];
        for (int64_t start = 0; start < len; start += BS) {
            const int n = (int)(len - start < BS ? len - start : BS);
            const int64_t blk = tables[(int64_t)b * max_blocks + start / BS];
            const uint16_t* kp = kc + (h * N + blk) * BS * D;
            const uint16_t* vp = vc + (h * N + blk) * BS * D;
            if (start + BS < len) {
                /* Blocks are scattered in the pool, so the hardware prefetcher cannot guess the
                 * next one: ask for it now, while this block is being computed. */
                const int64_t nxt = tables[(int64_t)b * max_blocks + start / BS + 1];
                const char* nk = (const char*)(kc + (h * N + nxt) * BS * D);
                const char* nv = (const char*)(vc + (h * N + nxt) * BS * D);
                for (int64_t off = 0; off < (int64_t)BS * D * 2; off += 64) {
                    __builtin_prefetch(nk + off);
                    __builtin_prefetch(nv + off);
                }
            }
            for (int t = 0; t < n; ++t) {
                __m512bh kv[MAX_D / 32];
                for (int c = 0; c < C32; ++c)
                    kv[c] = (__m512bh)_mm512_loadu_si512(kp + (int64_t)t * D + 32 * c);
                for (int g = 0; g < G; ++g) {
                    __m512 dot = _mm512_setzero_ps();
                    for (int c = 0; c < C32; ++c) dot = _mm512_dpbf16_ps(dot, qv[g][c], kv[c]);
                    s[g][t] = _mm512_reduce_add_ps(dot) * scale;
                }
            }
            for (int g = 0; g < G; ++g) {
                /* 16 scores per vector; lanes past n are masked out (max: -inf, exp: 0). */
                float m_blk = -INFINITY;
                for (int c = 0; c < n; c += 16) {
                    const __mmask16 k = (__mmask16)(n - c >= 16 ? 0xffff : (1u << (n - c)) - 1);
                    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s[g] + c);
                    const float mc = _mm512_reduce_max_ps(sv);
                    m_blk = mc > m_blk ? mc : m_blk;
                }
                const float m_new = m_blk > m[g] ? m_blk : m[g];
                const float corr = expf(m[g] - m_new);
                float sum = 0.f;
                for (int c = 0; c < n; c += 16) {
                    const __mmask16 k = (__mmask16)(n - c >= 16 ? 0xffff : (1u << (n - c)) - 1);
                    const __m512 sv = _mm512_maskz_loadu_ps(k, s[g] + c);
                    const __m512 pv = _mm512_maskz_mov_ps(
                        k, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
                    _mm512_storeu_ps(s[g] + c, pv);
                    sum += _mm512_reduce_add_ps(pv);
                }
                l[g] = l[g] * corr + sum;
                m[g] = m_new;
                const __m512 cv = _mm512_set1_ps(corr);
                for (int c = 0; c < C16; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
            }
            for (int t = 0; t < n; ++t) {
                for (int c = 0; c < C16; ++c) {
                    const __m256i raw = _mm256_loadu_si256(
                        (const __m256i*)(vp + (int64_t)t * D + 16 * c));
                    /* bf16 -> f32 is a 16-bit left shift of each lane */
                    const __m512 vf = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                    for (int g = 0; g < G; ++g)
                        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][t]), vf, acc[g][c]);
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            uint16_t* op = out + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;
            const __m512 inv = _mm512_set1_ps(1.f / l[g]);
            for (int c = 0; c < C16; ++c) {
                const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
                _mm256_storeu_si256((__m256i*)(op + 16 * c), (__m256i)o);
            }
        }
    }
    return 0;
}
#endif

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
