/* Paged-attention decode on the CPU: one query token per sequence, K/V read straight from the
 * block pool (no gathered copy), online softmax, fp32 accumulation.
 *
 * Layouts (row-major):
 *   q, out       [B, Hkv * G, D]          G query heads share one KV head (GQA)
 *   k/v cache    [Hkv, N, BS, D]          head-major block pool of one layer
 *   tables       [B, max_blocks] int64    block ids of each sequence
 *   lens         [B] int64                tokens of context of each sequence (>= 1)
 * Work items are (sequence, kv head) pairs; each reads its K/V once for all G query heads.
 * Paths, first that applies: AVX512-BF16 (bf16, D % 32 == 0), AVX2 + FMA (bf16 and f32,
 * D % 8 == 0; also in the AVX-512 builds), scalar C.
 */
#define _GNU_SOURCE /* syscall(), for the amx build's tile state (amx.h) */
#include <math.h>
#include <stdint.h>

#include "isa.h"
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

/* One block of n keys (rows at stride D in kf / vf, float) for one query head: scores,
 * then one online-softmax update (running max m, sum l, accumulator acc) for the block. */
static inline void attend_block(const float* qf, const float* kf, const float* vf, int n,
                                int D, float* m, float* l, float* acc, float* s) {
    float m_blk = -INFINITY;
    for (int t = 0; t < n; ++t) {
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qf[d] * kf[t * D + d];
        s[t] = dot;
        m_blk = dot > m_blk ? dot : m_blk;
    }
    const float m_new = m_blk > *m ? m_blk : *m;
    const float corr = expf(*m - m_new);
    float sum = 0.f;
    for (int t = 0; t < n; ++t) { s[t] = expf(s[t] - m_new); sum += s[t]; }
    *l = *l * corr + sum;
    *m = m_new;
    for (int d = 0; d < D; ++d) acc[d] *= corr;
    for (int t = 0; t < n; ++t) {
        const float p = s[t];
        for (int d = 0; d < D; ++d) acc[d] += p * vf[t * D + d];
    }
}

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
            for (int g = 0; g < G; ++g)                                                        \
                attend_block(qf[g], kf, vf, n, D, &m[g], &l[g], acc[g], s);                    \
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
DEFINE_DECODE(paged_decode_f32_generic, float, LOAD_F32, STORE_F32)

/* Quantized K/V rows (kv_codec.py): a row of one token and KV head is D bytes of int8 or fp8
 * (e4m3) values, then NG float32 scales, one per D / NG values; row stride D + 4 NG bytes,
 * cache [Hkv, N, BS, D + 4 NG]. Each block's rows are decoded to float once (values times
 * their group's scale) into the same scratch the float paths use, then scored and
 * accumulated as there: the pool is read at 1 byte a value, never copied. fp8 bytes go
 * through a 256-entry table of their values (exact: e4m3 has 256 codes). */
static inline void decode_q8_rows(const uint8_t* src, float* dst, int n, int D, int NG,
                                  const float* fp8, int round_bf16) {
    const int row = D + 4 * NG, gs = D / NG;
    for (int t = 0; t < n; ++t) {
        const uint8_t* r = src + (int64_t)t * row;
        float sc[MAX_D / 8];
        memcpy(sc, r + D, (size_t)NG * 4);
        float* o = dst + (int64_t)t * D;
        if (fp8) {
            for (int d = 0; d < D; ++d) o[d] = fp8[r[d]] * sc[d / gs];
        } else {
            for (int g = 0; g < NG; ++g) {
                const int8_t* v = (const int8_t*)r + g * gs;
                const float s = sc[g];
                for (int d = 0; d < gs; ++d) o[g * gs + d] = (float)v[d] * s;
            }
        }
        /* A bf16 model's other paths read the decoded rows as bf16 (KVCodec.decode): the
         * same values here. */
        if (round_bf16)
            for (int d = 0; d < D; ++d) o[d] = bf16_to_f32(f32_to_bf16(o[d]));
    }
}

#define DEFINE_DECODE_Q8(NAME, T, LOAD, STORE, ROUND)                                          \
int NAME(const T* q, const uint8_t* kc, const uint8_t* vc, const int64_t* tables,             \
         const int64_t* lens, T* out, int B, int Hkv, int G, int D, int64_t N, int BS,         \
         int max_blocks, float scale, int NG, const float* fp8) {                              \
    if (G > MAX_G || D > MAX_D || BS > MAX_BS || NG < 1 || NG > MAX_D / 8 || D % NG)          \
        return -1;                                                                             \
    const int64_t row = D + 4 * NG;                                                            \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                           \
    for (int item = 0; item < B * Hkv; ++item) {                                               \
        const int b = item / Hkv, h = item % Hkv;                                              \
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];                         \
        float kf[MAX_BS * MAX_D], vf[MAX_BS * MAX_D], s[MAX_BS];                               \
        for (int g = 0; g < G; ++g) {                                                          \
            const T* qp = q + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;                 \
            for (int d = 0; d < D; ++d) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; }   \
            m[g] = -INFINITY; l[g] = 0.f;                                                      \
        }                                                                                      \
        const int64_t len = lens[b];                                                           \
        for (int64_t start = 0; start < len; start += BS) {                                    \
            const int n = (int)(len - start < BS ? len - start : BS);                          \
            const int64_t blk = tables[(int64_t)b * max_blocks + start / BS];                  \
            decode_q8_rows(kc + (h * N + blk) * BS * row, kf, n, D, NG, fp8, ROUND);           \
            decode_q8_rows(vc + (h * N + blk) * BS * row, vf, n, D, NG, fp8, ROUND);           \
            for (int g = 0; g < G; ++g)                                                        \
                attend_block(qf[g], kf, vf, n, D, &m[g], &l[g], acc[g], s);                    \
        }                                                                                      \
        for (int g = 0; g < G; ++g) {                                                          \
            T* op = out + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * D;                     \
            const float inv = 1.f / l[g];                                                      \
            for (int d = 0; d < D; ++d) op[d] = STORE(acc[g][d] * inv);                        \
        }                                                                                      \
    }                                                                                          \
    return 0;                                                                                  \
}

DEFINE_DECODE_Q8(paged_decode_q8_bf16_generic, uint16_t, bf16_to_f32, f32_to_bf16, 1)
DEFINE_DECODE_Q8(paged_decode_q8_f32, float, LOAD_F32, STORE_F32, 0)

#ifdef KVGATE_AVX512BF16
#include <immintrin.h>

#include "math_avx512.h"

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
/* Quantized rows (kv_codec.py; NG scales a row, one per 32 values) of a block decoded to
 * bf16, 16 values at a time: values x their scale, rounded to nearest even: what
 * KVCodec.decode gives a bf16 model, and what the generic path computes. An e4m3 byte is
 * an fp16 of 2^-8 its value once its 7 low bits move up 7 (sign to bit 15): e4m3's exponent
 * bias is 7, fp16's 15, and both have subnormals where the exponent is 0; so e4m3 codes are
 * converted by fp16 hardware and their scale taken x 256 (both exact: the products equal
 * value x scale, bit for bit). A table gather did the same at several times the cost.
 * (0x7f, e4m3's NaN, reads as 480; the encoder never writes it.) */
static inline __m512 e4m3x16_avx512(__m128i b) {
    const __m256i x = _mm256_cvtepu8_epi16(b);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

static inline void q8_block_to_bf16(const uint8_t* src, uint16_t* dst, int n, int D, int NG,
                                    const float* fp8) {
    const int row = D + 4 * NG;
    for (int t = 0; t < n; ++t) {
        const uint8_t* r = src + (int64_t)t * row;
        for (int g = 0; g < NG; ++g) { /* 32 values and their scale */
            float sc;
            memcpy(&sc, r + D + 4 * g, 4);
            const __m512 s = _mm512_set1_ps(fp8 ? sc * 256.f : sc);
            for (int d = 32 * g; d < 32 * g + 32; d += 16) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(r + d));
                const __m512 v = fp8 ? e4m3x16_avx512(b)
                                     : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
                _mm256_storeu_si256((__m256i*)(dst + (int64_t)t * D + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, s)));
            }
        }
    }
}

#include "prefill_bf16.h" /* after q8_block_to_bf16, which it reads quantized rows with */

/* kc / vc: bf16 rows [Hkv, N, BS, D]; or, with NG > 0, quantized rows [Hkv, N, BS, D + 4 NG]
 * bytes (kq / vq), each block decoded to bf16 in a scratch first (1 byte a value read from
 * the pool, then the same arithmetic as bf16 rows). */
static inline __attribute__((always_inline)) void decode_item_avx512(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* tables,
    const int64_t* lens, uint16_t* out, int item, int Hkv, const int G, const int C32,
    int64_t N, int BS, int max_blocks, float scale, const uint8_t* kq, const uint8_t* vq,
    int NG, const float* fp8) {
    const int D = 32 * C32;
    /* bytes a cache row, and a block's decoded rows */
    const int64_t row_bytes = NG ? D + 4 * NG : 2 * D;
    uint16_t kscr[NG ? MAX_BS * MAX_D : 1], vscr[NG ? MAX_BS * MAX_D : 1];
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
        const char* kbase = NG ? (const char*)kq : (const char*)kc;
        const char* vbase = NG ? (const char*)vq : (const char*)vc;
        if (start + 2 * BS < len) {
            /* Blocks are scattered in the pool, so the hardware prefetcher cannot guess the
             * next one: ask for it now, while this block is being computed. */
            const int64_t nxt = tables[(int64_t)b * max_blocks + start / BS + 2];
            const char* nk = kbase + (h * N + nxt) * BS * row_bytes;
            const char* nv = vbase + (h * N + nxt) * BS * row_bytes;
            for (int64_t off = 0; off < (int64_t)BS * row_bytes; off += 64) {
                __builtin_prefetch(nk + off);
                __builtin_prefetch(nv + off);
            }
        }
        const int in_block = (int)(len - start < BS ? len - start : BS);
        const uint16_t* kblk = kc + (h * N + blk) * BS * D;
        const uint16_t* vblk = vc + (h * N + blk) * BS * D;
        if (NG) {
            const int64_t at = (h * N + blk) * BS * row_bytes;
            q8_block_to_bf16((const uint8_t*)kbase + at, kscr, in_block, D, NG, fp8);
            q8_block_to_bf16((const uint8_t*)vbase + at, vscr, in_block, D, NG, fp8);
            kblk = kscr;
            vblk = vscr;
        }
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
                /* e^(m - m_new) in a vector: a libm expf here is a call, across which
                 * every live zmm register is spilled and reloaded (all are caller-saved) */
                const __m512 cv = exp512(_mm512_set1_ps(m[g] - m_new));
                const __m512 p = _mm512_maskz_mov_ps(
                    valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                l[g] = l[g] * _mm512_cvtss_f32(cv) + _mm512_reduce_add_ps(p);
                m[g] = m_new;
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

/* One work item per (sequence, kv head). The common head shapes (G query heads per KV head,
 * D = 32 * C32) get the item's body compiled for them: with G and C32 constant the
 * accumulators, q and the tile's dot products stay in registers or plain spill slots, where
 * the generic body indexes them by runtime G (SmolLM2's G = 3, D = 64 on a Zen 4, 32 sequences:
 * 1.24-1.45x by itself, alternated against the same source without it). Same operations in
 * the same order either way: the results are identical. */
#define ITEM(G_, C_)                                                                        \
    decode_item_avx512(q, kc, vc, tables, lens, out, item, Hkv, G_, C_, N, BS, max_blocks,   \
                       scale, kq, vq, NG, fp8)
/* bf16 rows (kq = vq = NULL, NG = 0), or quantized ones (kc = vc = NULL). */
static int paged_decode_bf16_avx512(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                    const int64_t* tables, const int64_t* lens, uint16_t* out,
                                    int B, int Hkv, int G, int D, int64_t N, int BS,
                                    int max_blocks, float scale, const uint8_t* kq,
                                    const uint8_t* vq, int NG, const float* fp8) {
    const int C32 = D / 32;
    const int shape = C32 == 2 || C32 == 4 || C32 == 8 ? G * 16 + C32 : 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item) {
        switch (shape) { /* (G, D): SmolLM2 (3, 64), Qwen2.5 0.5B (7, 64) and 1.5B (6, 128),
                          * Llama 3 8B (4, 128), Qwen2.5 7B (7, 128), Gemma 3 270M (4, 256) */
            case 1 * 16 + 2: ITEM(1, 2); break;
            case 2 * 16 + 2: ITEM(2, 2); break;
            case 3 * 16 + 2: ITEM(3, 2); break;
            case 4 * 16 + 2: ITEM(4, 2); break;
            case 7 * 16 + 2: ITEM(7, 2); break;
            case 1 * 16 + 4: ITEM(1, 4); break;
            case 2 * 16 + 4: ITEM(2, 4); break;
            case 4 * 16 + 4: ITEM(4, 4); break;
            case 6 * 16 + 4: ITEM(6, 4); break;
            case 7 * 16 + 4: ITEM(7, 4); break;
            case 8 * 16 + 4: ITEM(8, 4); break;
            case 4 * 16 + 8: ITEM(4, 8); break;
            case 8 * 16 + 8: ITEM(8, 8); break;
            default: ITEM(G, C32);
        }
    }
    return 0;
}
#undef ITEM
#endif

#ifdef KVGATE_AVX2
#include <immintrin.h>

#include "bf16_avx2.h"
#include "math_avx2.h"

/* Nearest-even bf16 rounding (as torch rounds) of values known to be finite and >= 0, such
 * as exp256's results: bf16x8_round without its NaN handling, half the work. */
AVX2_INLINE __m256 round_bf16_nonneg(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Lane t of sum8x8's result is the sum of the 8 lanes of v[t]: the transpose-and-add tree of
 * sum16x16 for 8 lanes, 13 shuffles and 7 adds for 8 dot products instead of 8 horizontal
 * sums. In two steps, so that tokens 0-3 and 4-7 can be reduced apart (qk_heads):
 * sum8x8_quad reduces 4 vectors to [their sums over lanes 0-3 | over lanes 4-7], in-lane;
 * sum8x8_join adds the halves of two such, lane-crossing only through 128-bit extract/insert
 * (a lane-crossing permute is slow on Zen). */
AVX2_INLINE __m256 sum8x8_quad(const __m256 w[4]) {
    /* pairs of 32-bit lanes, then pairs of 64-bit lanes, inside each 128-bit lane */
    const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(w[0], w[1]),
                                     _mm256_unpackhi_ps(w[0], w[1]));
    const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(w[2], w[3]),
                                     _mm256_unpackhi_ps(w[2], w[3]));
    const __m256d a = _mm256_castps_pd(s01), b = _mm256_castps_pd(s23);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
}

AVX2_INLINE __m256 sum8x8_join(__m256 quad0, __m256 quad1) {
    const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(quad0), _mm256_extractf128_ps(quad0, 1));
    const __m128 hi = _mm_add_ps(_mm256_castps256_ps128(quad1), _mm256_extractf128_ps(quad1, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

AVX2_INLINE __m256 sum8x8(const __m256 v[8]) {
    return sum8x8_join(sum8x8_quad(v), sum8x8_quad(v + 4));
}

/* Rows (q, K, V, out; D elements, bf16 or f32 by the flag `bf16`) are read 16 dims at a time
 * (chunk c: dims 16c .. 16c + 15) into two 8-lane fp32 vectors:
 *   bf16: one 32-byte load. Each 32-bit word holds dims 2i (low half) and 2i + 1 (high half):
 *         shifted up 16, or masked, it *is* the fp32 of one of them. So lo = the even dims,
 *         hi = the odd dims: two cheap in-lane ops, no lane-crossing widening.
 *   f32:  lo = dims 16c .. 16c + 7, hi = 16c + 8 .. 16c + 15.
 * q and the accumulators live in the same order, so dot products and P.V need no reordering;
 * the output store puts the dims back. D % 16 == 8 leaves one last vector, natural order. */
AVX2_INLINE void load_chunk(const void* row, int c, int bf16, __m256* lo, __m256* hi) {
    if (bf16) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + 16 * c));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm256_loadu_ps((const float*)row + 16 * c);
        *hi = _mm256_loadu_ps((const float*)row + 16 * c + 8);
    }
}

AVX2_INLINE __m256 load_last8(const void* row, int D, int bf16) {
    return bf16 ? bf16x8_load((const uint16_t*)row + D - 8)
                : _mm256_loadu_ps((const float*)row + D - 8);
}

AVX2_INLINE void store_chunk(void* row, int c, int bf16, __m256 lo, __m256 hi) {
    if (bf16) {
        /* even dims to the low halves of the words, odd dims to the high halves */
        const __m256i w = _mm256_or_si256(bf16x8_round_bits(lo),
                                          _mm256_slli_epi32(bf16x8_round_bits(hi), 16));
        _mm256_storeu_si256((__m256i*)((uint16_t*)row + 16 * c), w);
    } else {
        _mm256_storeu_ps((float*)row + 16 * c, lo);
        _mm256_storeu_ps((float*)row + 16 * c + 8, hi);
    }
}

AVX2_INLINE void store_last8(void* row, int D, int bf16, __m256 x) {
    if (bf16) bf16x8_store((uint16_t*)row + D - 8, x);
    else _mm256_storeu_ps((float*)row + D - 8, x);
}

/* Scores of a tile (8 K rows kr) for query heads g and g + 1: sc[g + i], lane t = q.k_t.
 * The two heads share every K load and widening; the 2 x 4 accumulators of four tokens at a
 * time stay in registers (eight independent FMA chains). */
AVX2_INLINE void qk_head_pair(__m256 (*qv)[MAX_D / 8], int g, const char* const* kr, int C,
                              int last, int D, int bf16, __m256* sc) {
    __m256 quad[2][2];
    for (int half = 0; half < 2; ++half) {
        __m256 d[2][4];
        for (int i = 0; i < 2; ++i)
            for (int t = 0; t < 4; ++t) d[i][t] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
            for (int t = 0; t < 4; ++t) {
                __m256 lo, hi;
                load_chunk(kr[4 * half + t], c, bf16, &lo, &hi);
                for (int i = 0; i < 2; ++i) {
                    d[i][t] = _mm256_fmadd_ps(qv[g + i][2 * c], lo, d[i][t]);
                    d[i][t] = _mm256_fmadd_ps(qv[g + i][2 * c + 1], hi, d[i][t]);
                }
            }
        }
        if (last) {
            for (int t = 0; t < 4; ++t) {
                const __m256 k = load_last8(kr[4 * half + t], D, bf16);
                for (int i = 0; i < 2; ++i)
                    d[i][t] = _mm256_fmadd_ps(qv[g + i][2 * C], k, d[i][t]);
            }
        }
        for (int i = 0; i < 2; ++i) quad[i][half] = sum8x8_quad(d[i]);
    }
    for (int i = 0; i < 2; ++i) sc[g + i] = sum8x8_join(quad[i][0], quad[i][1]);
}

/* The same for one head: 8 accumulators, one per token. */
AVX2_INLINE void qk_head(__m256 (*qv)[MAX_D / 8], int g, const char* const* kr, int C,
                         int last, int D, int bf16, __m256* sc) {
    __m256 d[8];
    for (int t = 0; t < 8; ++t) d[t] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
        for (int t = 0; t < 8; ++t) {
            __m256 lo, hi;
            load_chunk(kr[t], c, bf16, &lo, &hi);
            d[t] = _mm256_fmadd_ps(qv[g][2 * c], lo, d[t]);
            d[t] = _mm256_fmadd_ps(qv[g][2 * c + 1], hi, d[t]);
        }
    }
    if (last) {
        for (int t = 0; t < 8; ++t)
            d[t] = _mm256_fmadd_ps(qv[g][2 * C], load_last8(kr[t], D, bf16), d[t]);
    }
    sc[g] = sum8x8(d);
}

/* P.V of a tile for heads g .. g + NH - 1, chunks c .. c + NP - 1 (NH * NP <= 4):
 * acc[g + i][2c ...] = acc * corr[g + i] + sum over the n tokens of p[g + i][t] * V row t.
 * The 2 NH NP accumulators stay in registers across the tile; NH = 2 shares each V load and
 * widening between two heads. */
AVX2_INLINE void pv_heads(__m256 (*acc)[MAX_D / 8], int g, int NH, const char* const* vr,
                          float (*p)[8], int n, int c, int NP, int bf16, const __m256* corr) {
    __m256 a[2][8];
    for (int i = 0; i < NH; ++i)
        for (int k = 0; k < 2 * NP; ++k)
            a[i][k] = _mm256_mul_ps(acc[g + i][2 * c + k], corr[g + i]);
    for (int t = 0; t < n; ++t) {
        __m256 pt[2];
        for (int i = 0; i < NH; ++i) pt[i] = _mm256_broadcast_ss(&p[g + i][t]);
        for (int k = 0; k < NP; ++k) {
            __m256 lo, hi;
            load_chunk(vr[t], c + k, bf16, &lo, &hi);
            for (int i = 0; i < NH; ++i) {
                a[i][2 * k] = _mm256_fmadd_ps(pt[i], lo, a[i][2 * k]);
                a[i][2 * k + 1] = _mm256_fmadd_ps(pt[i], hi, a[i][2 * k + 1]);
            }
        }
    }
    for (int i = 0; i < NH; ++i)
        for (int k = 0; k < 2 * NP; ++k) acc[g + i][2 * c + k] = a[i][k];
}

/* The AVX2 + FMA decode, bf16 or f32 (the flag is a constant at both call sites, so each
 * gets its own branch-free copy). Tokens are taken 8 at a time (a "tile", never crossing a
 * block):
 *  - scores: one accumulator per (head, token), K widened in registers as it is read and
 *    shared by two query heads at a time (qk_head_pair); each head's 8 dot products summed
 *    together by the sum8x8 tree;
 *  - one online-softmax update per tile and head, the running sum kept as 8 lanes;
 *  - P.V, again two heads per V load (pv_heads), with the probabilities rounded to bf16 in
 *    bf16 mode (the rounding the PyTorch path applies before its P.V matmul; fp32 mode keeps
 *    them fp32, as PyTorch does).
 * Rows past the end of a partial tile are never read: their row pointer repeats the tile's
 * last valid row and their scores are set to -inf (probability exactly 0). Needs D % 8 == 0.
 * One work item: sequence b, KV head h. */
/* The 8 e4m3 codes in the low bytes of b as floats of 2^-8 their value, through F16C
 * (e4m3x16_avx512's twin: the bits moved into an fp16's places). */
AVX2_INLINE __m256 e4m3x8_avx2(__m128i b) {
    const __m128i x = _mm_cvtepu8_epi16(b);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

/* Quantized rows of a block decoded to bf16 (q8_block_to_bf16's AVX2 twin): values x their
 * group's scale (one per 32 values), rounded to nearest even; e4m3 codes through F16C as
 * there (an fp16 of 2^-8 the value, the scale x 256). */
AVX2_INLINE void q8_block_to_bf16_avx2(const uint8_t* src, uint16_t* dst, int n, int D, int NG,
                                       const float* fp8) {
    const int row = D + 4 * NG;
    for (int t = 0; t < n; ++t) {
        const uint8_t* r = src + (int64_t)t * row;
        for (int g = 0; g < NG; ++g) { /* 32 values and their scale */
            float sc;
            memcpy(&sc, r + D + 4 * g, 4);
            const __m256 s = _mm256_set1_ps(fp8 ? sc * 256.f : sc);
            for (int d = 32 * g; d < 32 * g + 32; d += 16) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(r + d));
                __m256 lo, hi;
                if (fp8) {
                    lo = e4m3x8_avx2(b);
                    hi = e4m3x8_avx2(_mm_srli_si128(b, 8));
                } else {
                    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                }
                bf16x16_store_avx2(dst + (int64_t)t * D + d, _mm256_mul_ps(lo, s),
                                   _mm256_mul_ps(hi, s));
            }
        }
    }
}

/* kc / vc as the dtype flag says; or, with NG > 0 (bf16 only), quantized rows [Hkv, N, BS,
 * D + 4 NG] bytes (kq / vq), each block decoded to bf16 in a scratch first. */
AVX2_INLINE void decode_avx2_item(const void* q, const void* kc, const void* vc,
                                  const int64_t* tables, const int64_t* lens, void* out, int b,
                                  int h, int Hkv, int G, int D, int64_t N, int BS,
                                  int max_blocks, float scale, const int bf16,
                                  const uint8_t* kq, const uint8_t* vq, int NG,
                                  const float* fp8) {
    const int64_t es = bf16 ? 2 : 4;          /* bytes per element */
    const int64_t row = (int64_t)D * es;      /* bytes per K/V row */
    const int64_t cache_row = NG ? D + 4 * NG : row; /* bytes per row in the pool */
    uint16_t kscr[NG ? MAX_BS * MAX_D : 1], vscr[NG ? MAX_BS * MAX_D : 1];
    if (NG) kc = kq, vc = vq;
    const int C = D / 16, last = D % 16 != 0; /* whole chunks; one more 8-dim vector */
    /* [g][j]: vector j of head g's row, in load_chunk's order (j = 2c, 2c + 1, then the
     * last 8 dims at j = 2C); q pre-scaled */
    __m256 qv[MAX_G][MAX_D / 8], acc[MAX_G][MAX_D / 8], lsum[MAX_G];
    float m[MAX_G];
    for (int g = 0; g < G; ++g) {
        const char* qp = (const char*)q + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * row;
        const __m256 sv = _mm256_set1_ps(scale);
        for (int c = 0; c < C; ++c) {
            __m256 lo, hi;
            load_chunk(qp, c, bf16, &lo, &hi);
            qv[g][2 * c] = _mm256_mul_ps(lo, sv);
            qv[g][2 * c + 1] = _mm256_mul_ps(hi, sv);
        }
        if (last) qv[g][2 * C] = _mm256_mul_ps(load_last8(qp, D, bf16), sv);
        for (int j = 0; j < 2 * C + last; ++j) acc[g][j] = _mm256_setzero_ps();
        lsum[g] = _mm256_setzero_ps();
        m[g] = -INFINITY;
    }
    const __m256 iota = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const int64_t len = lens[b];
    for (int64_t start = 0; start < len; start += BS) {
        const int64_t blk = tables[(int64_t)b * max_blocks + start / BS];
        const char* kblk = (const char*)kc + (h * N + blk) * BS * cache_row;
        const char* vblk = (const char*)vc + (h * N + blk) * BS * cache_row;
        if (start + 2 * BS < len) {
            /* Blocks are scattered in the pool, so the hardware prefetcher cannot guess the
             * next one: ask for the one after next now, as the AVX512 path does. */
            const int64_t nxt = tables[(int64_t)b * max_blocks + start / BS + 2];
            const char* nk = (const char*)kc + (h * N + nxt) * BS * cache_row;
            const char* nv = (const char*)vc + (h * N + nxt) * BS * cache_row;
            for (int64_t off = 0; off < BS * cache_row; off += 64) {
                __builtin_prefetch(nk + off);
                __builtin_prefetch(nv + off);
            }
        }
        const int in_block = (int)(len - start < BS ? len - start : BS);
        if (NG) {
            q8_block_to_bf16_avx2((const uint8_t*)kblk, kscr, in_block, D, NG, fp8);
            q8_block_to_bf16_avx2((const uint8_t*)vblk, vscr, in_block, D, NG, fp8);
            kblk = (const char*)kscr;
            vblk = (const char*)vscr;
        }
        for (int t0 = 0; t0 < in_block; t0 += 8) {
            const int n = in_block - t0 < 8 ? in_block - t0 : 8;
            const char* kr[8];
            const char* vr[8];
            for (int t = 0; t < 8; ++t) {
                const int64_t off = (int64_t)(t0 + (t < n ? t : n - 1)) * row;
                kr[t] = kblk + off;
                vr[t] = vblk + off;
            }
            const __m256 valid = _mm256_cmp_ps(iota, _mm256_set1_ps((float)n), _CMP_LT_OQ);
            /* Three passes over the heads (scores, softmax, P.V) rather than one per head: the
             * softmax is a long dependent chain (max, exp, rounding) that the core can then
             * overlap across heads instead of stalling each head's P.V on it. */
            __m256 sc[MAX_G], corr[MAX_G];
            float pt[MAX_G][8]; /* probabilities of the tile's tokens, bf16-rounded in bf16 */
            int g = 0;
            for (; g + 2 <= G; g += 2) qk_head_pair(qv, g, kr, C, last, D, bf16, sc);
            if (g < G) qk_head(qv, g, kr, C, last, D, bf16, sc);
            /* lanes past n: -inf, so they add nothing to the max and exp to 0 */
            for (g = 0; g < G; ++g)
                sc[g] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc[g], valid);
            for (g = 0; g < G; ++g) {
                const float m_tile = hmax8(sc[g]);
                corr[g] = _mm256_set1_ps(1.f);
                if (m_tile > m[g]) { /* a new running max: rescale what came before */
                    corr[g] = exp256(_mm256_set1_ps(m[g] - m_tile));
                    m[g] = m_tile;
                }
                const __m256 p = exp256(_mm256_sub_ps(sc[g], _mm256_set1_ps(m[g])));
                lsum[g] = _mm256_fmadd_ps(lsum[g], corr[g], p);
                _mm256_storeu_ps(pt[g], bf16 ? round_bf16_nonneg(p) : p);
            }
            for (g = 0; g + 2 <= G; g += 2) {
                int c = 0;
                for (; c + 2 <= C; c += 2) pv_heads(acc, g, 2, vr, pt, n, c, 2, bf16, corr);
                if (c < C) pv_heads(acc, g, 2, vr, pt, n, c, 1, bf16, corr);
            }
            if (g < G) {
                int c = 0;
                for (; c + 4 <= C; c += 4) pv_heads(acc, g, 1, vr, pt, n, c, 4, bf16, corr);
                for (; c + 2 <= C; c += 2) pv_heads(acc, g, 1, vr, pt, n, c, 2, bf16, corr);
                if (c < C) pv_heads(acc, g, 1, vr, pt, n, c, 1, bf16, corr);
            }
            if (last) {
                for (g = 0; g < G; ++g) {
                    __m256 a = _mm256_mul_ps(acc[g][2 * C], corr[g]);
                    for (int t = 0; t < n; ++t)
                        a = _mm256_fmadd_ps(_mm256_broadcast_ss(pt[g] + t),
                                            load_last8(vr[t], D, bf16), a);
                    acc[g][2 * C] = a;
                }
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        char* op = (char*)out + ((int64_t)b * Hkv * G + (int64_t)h * G + g) * row;
        const __m256 inv = _mm256_set1_ps(1.f / hsum8(lsum[g]));
        for (int c = 0; c < C; ++c)
            store_chunk(op, c, bf16, _mm256_mul_ps(acc[g][2 * c], inv),
                        _mm256_mul_ps(acc[g][2 * c + 1], inv));
        if (last) store_last8(op, D, bf16, _mm256_mul_ps(acc[g][2 * C], inv));
    }
}

/* The parallel loops live here, not in decode_avx2_item: OpenMP outlines a loop body before
 * inlining, so a loop there would get one copy with the dtype flag a runtime variable. */
static void decode_avx2_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                             const int64_t* tables, const int64_t* lens, uint16_t* out, int B,
                             int Hkv, int G, int D, int64_t N, int BS, int max_blocks,
                             float scale) {
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item)
        decode_avx2_item(q, kc, vc, tables, lens, out, item / Hkv, item % Hkv, Hkv, G, D, N,
                         BS, max_blocks, scale, 1, NULL, NULL, 0, NULL);
}

static void decode_avx2_q8(const uint16_t* q, const uint8_t* kc, const uint8_t* vc,
                           const int64_t* tables, const int64_t* lens, uint16_t* out, int B,
                           int Hkv, int G, int D, int64_t N, int BS, int max_blocks, float scale,
                           int NG, const float* fp8) {
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item)
        decode_avx2_item(q, NULL, NULL, tables, lens, out, item / Hkv, item % Hkv, Hkv, G, D,
                         N, BS, max_blocks, scale, 1, kc, vc, NG, fp8);
}

static void decode_avx2_f32(const float* q, const float* kc, const float* vc,
                            const int64_t* tables, const int64_t* lens, float* out, int B,
                            int Hkv, int G, int D, int64_t N, int BS, int max_blocks,
                            float scale) {
    #pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item)
        decode_avx2_item(q, kc, vc, tables, lens, out, item / Hkv, item % Hkv, Hkv, G, D, N,
                         BS, max_blocks, scale, 0, NULL, NULL, 0, NULL);
}
#endif

/* Causal softmax of a fresh prompt's attention scores, for the short-prompt prefill path:
 * scores [R, n] bf16 (q.k^T of R query rows; row r is query r % n of its head), scaled,
 * softmax over keys 0..r % n in float32, probabilities rounded to bf16; keys past the query
 * get 0. Replaces PyTorch's float copy, scale, causal mask, softmax and bf16 copy. */
#define MAX_SOFTMAX_KEYS 4096

int causal_softmax_bf16(const uint16_t* scores, uint16_t* probs, int64_t R, int n,
                        float scale) {
#ifdef KVGATE_AVX512BF16
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
#elif defined(KVGATE_AVX2)
    if (n > MAX_SOFTMAX_KEYS) return -1;
    #pragma omp parallel for schedule(static) if (R * n > 16384)
    for (int64_t r = 0; r < R; ++r) {
        const uint16_t* s = scores + r * n;
        uint16_t* o = probs + r * n;
        const int valid = (int)(r % n) + 1;
        /* valid keys rounded up to whole vectors: the lanes past `valid` hold -inf scores,
         * then exactly 0 probabilities, so every pass runs on whole vectors */
        const int span = (valid + 7) & ~7;
        const __m256 sc = _mm256_set1_ps(scale);
        float e[MAX_SOFTMAX_KEYS + 8]; /* scaled scores, then their exp */
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < span; c += 8) {
            uint16_t pad[8] = {0xff80, 0xff80, 0xff80, 0xff80, 0xff80, 0xff80, 0xff80, 0xff80};
            const uint16_t* src = s + c;
            if (c + 8 > valid) { /* bf16 -inf past the last valid key */
                memcpy(pad, s + c, (size_t)(valid - c) * 2);
                src = pad;
            }
            const __m256 v = _mm256_mul_ps(bf16x8_load(src), sc);
            _mm256_storeu_ps(e + c, v);
            mv = _mm256_max_ps(mv, v);
        }
        const __m256 m = _mm256_set1_ps(hmax8(mv));
        __m256 total = _mm256_setzero_ps();
        for (int c = 0; c < span; c += 8) {
            const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + c), m));
            _mm256_storeu_ps(e + c, p);
            total = _mm256_add_ps(total, p);
        }
        const __m256 inv = _mm256_set1_ps(1.f / hsum8(total));
        for (int c = 0; c < n; c += 8) {
            const __m256 p = c < span ? _mm256_mul_ps(_mm256_loadu_ps(e + c), inv)
                                      : _mm256_setzero_ps();
            if (c + 8 <= n) {
                bf16x8_store(o + c, p);
            } else { /* the row's last n % 8 keys */
                uint16_t tail[8];
                bf16x8_store(tail, p);
                memcpy(o + c, tail, (size_t)(n - c) * 2);
            }
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
#ifdef KVGATE_AVX512BF16
    if (D % 32 == 0)
        return paged_decode_bf16_avx512(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                        max_blocks, scale, NULL, NULL, 0, NULL);
#endif
#ifdef KVGATE_AVX2
    if (D % 8 == 0) {
        decode_avx2_bf16(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS, max_blocks, scale);
        return 0;
    }
#endif
    return paged_decode_bf16_generic(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                     max_blocks, scale);
}

/* Quantized rows read by a bf16 model: AVX512-BF16, else AVX2, where D % 32 == 0 (a scale
 * per 32 values), else the generic path. Each block's rows are decoded to bf16 in a scratch
 * (what KVCodec.decode gives), then attended as bf16 rows are. */
int paged_decode_q8_bf16(const uint16_t* q, const uint8_t* kc, const uint8_t* vc,
                         const int64_t* tables, const int64_t* lens, uint16_t* out, int B,
                         int Hkv, int G, int D, int64_t N, int BS, int max_blocks, float scale,
                         int NG, const float* fp8) {
#ifdef KVGATE_AVX512BF16
    if (G <= MAX_G && D <= MAX_D && BS <= MAX_BS && D % 32 == 0 && NG * 32 == D)
        return paged_decode_bf16_avx512(q, NULL, NULL, tables, lens, out, B, Hkv, G, D, N, BS,
                                        max_blocks, scale, kc, vc, NG, fp8);
#endif
#ifdef KVGATE_AVX2
    if (G <= MAX_G && D <= MAX_D && BS <= MAX_BS && D % 32 == 0 && NG * 32 == D) {
        decode_avx2_q8(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS, max_blocks, scale, NG,
                       fp8);
        return 0;
    }
#endif
    return paged_decode_q8_bf16_generic(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                        max_blocks, scale, NG, fp8);
}

/* Quantized rows [n, D + 4 NG] -> bf16 [n, D], what KVCodec.decode gives a bf16 model: the
 * context a prefill gathers from the pool, decoded here instead of by PyTorch (which turns
 * e4m3 into float at ~0.5 G values/s on an AVX-512 Xeon, int8 at ~6). The vector bodies
 * the paged decode decodes its blocks with, where a scale covers 32 values; else the
 * generic one. Threads split rows, DECODE_ROWS_CHUNK at a time. */
#define DECODE_ROWS_CHUNK 256
int decode_rows_q8_bf16(const uint8_t* rows, uint16_t* out, int64_t n, int D, int NG,
                        const float* fp8) {
    if (D > MAX_D || NG < 1 || NG > MAX_D / 8 || D % NG) return -1;
    const int64_t row = D + 4 * NG;
    const int vec = D % 32 == 0 && NG * 32 == D;
    (void)vec; /* no vector body in the generic build */
    const int64_t chunks = (n + DECODE_ROWS_CHUNK - 1) / DECODE_ROWS_CHUNK;
    #pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t0 = c * DECODE_ROWS_CHUNK;
        const int m = (int)(n - t0 < DECODE_ROWS_CHUNK ? n - t0 : DECODE_ROWS_CHUNK);
        const uint8_t* src = rows + t0 * row;
        uint16_t* dst = out + t0 * D;
#ifdef KVGATE_AVX512BF16
        if (vec) {
            q8_block_to_bf16(src, dst, m, D, NG, fp8);
            continue;
        }
#endif
#ifdef KVGATE_AVX2
        if (vec) {
            q8_block_to_bf16_avx2(src, dst, m, D, NG, fp8);
            continue;
        }
#endif
        float buf[MAX_D];
        for (int t = 0; t < m; ++t) {
            decode_q8_rows(src + (int64_t)t * row, buf, 1, D, NG, fp8, 0);
            for (int d = 0; d < D; ++d) dst[(int64_t)t * D + d] = f32_to_bf16(buf[d]);
        }
    }
    return 0;
}

/* float32: the AVX2 path in every vector build (there is no AVX-512 f32 path), else scalar. */
int paged_decode_f32(const float* q, const float* kc, const float* vc, const int64_t* tables,
                     const int64_t* lens, float* out, int B, int Hkv, int G, int D, int64_t N,
                     int BS, int max_blocks, float scale) {
    if (G > MAX_G || D > MAX_D || BS > MAX_BS) return -1;
#ifdef KVGATE_AVX2
    if (D % 8 == 0) {
        decode_avx2_f32(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS, max_blocks, scale);
        return 0;
    }
#endif
    return paged_decode_f32_generic(q, kc, vc, tables, lens, out, B, Hkv, G, D, N, BS,
                                    max_blocks, scale);
}

/* Causal prefill attention of every slice of a step over the paged pool (prefill_bf16.h),
 * bf16 rows (NG = 0) or int8 / fp8 rows with NG scales each (kv_codec.py): 0, or -1 where
 * this build has no AVX512-BF16 path (the caller keeps PyTorch's). */
int prefill_attention_bf16(const uint16_t* q, const void* kc, const void* vc,
                           const int64_t* slices, const int64_t* tables, uint16_t* out, int S,
                           int Hkv, int G, int D, int64_t N, int BS, float scale,
                           int64_t max_keys, int NG, const float* fp8) {
#ifdef KVGATE_AVX512BF16
    return prefill_attention_tiles(q, kc, vc, slices, tables, out, S, Hkv, G, D, N, BS, scale,
                                   max_keys, NG, fp8);
#else
    (void)q; (void)kc; (void)vc; (void)slices; (void)tables; (void)out; (void)S; (void)Hkv;
    (void)G; (void)D; (void)N; (void)BS; (void)scale; (void)max_keys; (void)NG; (void)fp8;
    return -1;
#endif
}

/* How prefill_attention_bf16 runs: 2 on AMX tiles, 1 with vdpbf16ps on AVX-512 registers,
 * 0 not at all (this build has no AVX512-BF16). */
int prefill_attention_ready(void) {
#if defined(KVGATE_AMX)
    return amx_ready ? 2 : 1;
#elif defined(KVGATE_AVX512BF16)
    return 1;
#else
    return 0;
#endif
}

KVGATE_DEFINE_ISA()
