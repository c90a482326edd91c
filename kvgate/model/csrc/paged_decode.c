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
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)
