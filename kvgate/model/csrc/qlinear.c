/* y = x W^T (+ b) with W kept in llama.cpp's GGML block formats, read in place (from the
 * GGUF file's memory map: nothing is dequantized or repacked at load), and x quantized to
 * int8 per block of 32 inputs (W4A8 .. W8A8, as llama.cpp's Q8_0 activations).
 *
 * Weight types (GGML enum values; a block holds 32 or 256 inputs of one output row):
 *   Q4_0  2  32 / 18 B: f16 d, 16 B nibbles           w = d (q - 8)
 *   Q4_1  3  32 / 20 B: f16 d, f16 m, 16 B nibbles    w = d q + m
 *   Q5_0  6  32 / 22 B: f16 d, u32 high bits, nibbles w = d (q - 16)
 *   Q5_1  7  32 / 24 B: f16 d, f16 m, u32, nibbles    w = d q + m
 *   Q8_0  8  32 / 34 B: f16 d, 32 x int8              w = d q
 *   Q4_K 12 256 / 144 B: f16 d, f16 dmin, 8 x (6-bit scale, 6-bit min), 128 B nibbles
 *                                                     w = d sc_j q - dmin m_j (sub-block j of 32)
 *   Q5_K 13 256 / 176 B: Q4_K's plus 32 B of fifth bits
 *   Q6_K 14 256 / 210 B: 128 B low nibbles, 64 B high pairs, 16 x int8 scales, f16 d
 *                                                     w = d sc_j (q - 32) (sub-block j of 16)
 *
 * Every type decodes to one canonical form, per group of 16 inputs g:
 *   w[k] = ws[g] q[k] + wo[g], q[k] an unsigned byte (Q8_0's int8 + 128)
 * and each output is computed as
 *   y[m, n] = sum_g dx[m, g / 2] (ws[n, g] dot_g(q[n], xq[m]) + wo[n, g] isum_g(xq[m]))
 * with xq the int8 activations (round to nearest even of x / dx, dx = max |x| / 127 per 32),
 * isum_g their sums over the group. The integer dot products are exact (vpdpbusd with
 * AVX512-VNNI; vpmaddubsw + vpmaddwd on AVX2, with the bytes shifted to signed so no pair can
 * saturate: 2 x 128 x 127 < 2^15); the scales are applied in float32 in one order per output
 * for every batch size: a sequence's outputs never depend on the rows it is batched with.
 * With AVX512-VNNI a column of a type whose ws and wo hold per 32 inputs (all but Q6_K) takes
 * one float32 step per 32 (the pair's exact integer sum, xs32 = dx x the block's sum).
 * On AVX2 the K-quant columns (Q4_K, Q5_K, Q6_K) take x in two levels instead (a float step
 * per 256 inputs times an integer per 32: quantize_x256) and their sub-block scales inside
 * the integer sums, two float32 steps per 256 on exact integer totals (kq_sums).
 *
 * Loops: columns are split into contiguous ranges per thread; rows go in blocks of ~8 MiB of
 * int8 x (whole multiples of 16 rows), each block decoding the columns again. AVX512-VNNI:
 * panels of 16 columns interleaved for x broadcast into vpdpbusd (qlinear_panels), or for
 * one row, the same sums without interleaving (qlinear_row1; whole panels of Q4_K or Q6_K by
 * row1_run, 128 inputs per load and the scales of 16 rows loaded at once); for 2-15 rows,
 * whole panels of Q4_K, Q6_K, Q8_0, Q4_0 or Q4_1 decoded in registers and multiplied there
 * (qlinear_few: 2 rows of Q4_K cost 1.1x one row, 8 rows 1.3x, against 1.5x and 2.1x through a
 * stored panel). AVX2: up to 8
 * rows on columns decoded in registers (qlinear_few_range), more on blocks of 2 decoded columns
 * (qtile) or, for the K-quants, of 8 interleaved ones (kq8); Zen 2, 2 threads, Qwen 1.5B
 * shapes at 1 row: Q4_K 9.3 -> 14.7 GB/s, Q6_K 12.0 -> 17.0 with the K-quants' integer sums
 * per 256; at 32 rows 83 -> 166 and 89 -> 163 GFLOP/s with kq8. Measured on Zen 4, one thread, a
 * 4096 x 1536 layer in cache: one row at 24 (Q4_K) and 20 (Q6_K) G weights/s, 13.6 and 13.1
 * before row1_run; the Qwen 1.5B file's batch-1 decode at 64% of the streaming read bound (2
 * threads). Many rows: 137 G multiply-adds/s per core for Q4_K (float32 steps per 32 inputs,
 * panel_per32), 110 for Q6_K (per 16), against 111 for both with every step per 16.
 * AMX-INT8 (the amx build, 16 rows and more): the same decoded panels as the B tiles of
 * tdpbsud, 16 rows of x as A, the group sums through the same float32 steps (bit-identical);
 * Xeon with AMX, 2 threads, Qwen 1.5B shapes: Q4_K 480 -> 518 GFLOP/s at 32 rows, 662 -> 825
 * at 512; Q6_K 376 -> 415 and 529 -> 591 (bench/qlinears.py). The float32 steps, not the
 * tiles, bound it: without them the tiles reach ~1.6 TFLOP/s.
 */
#define _GNU_SOURCE /* syscall(), for the AMX tile state (amx.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* One run of output rows of W in one block format (the q, k and v projections of a fused
 * layer may differ in type: Q4_K_M files keep some v and down projections in Q6_K). */
typedef struct {
    const uint8_t* data; /* rows x row_bytes */
    int64_t rows;
    int64_t row_bytes;
    int32_t type;
    int32_t pad;
} kvg_qseg;

typedef struct {
    const kvg_qseg* segs;
    int32_t nsegs;
    int32_t k; /* inputs per row */
} kvg_qweight;

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};

/* Inputs per block and bytes per block of a supported type; 0 otherwise. */
__attribute__((unused)) static int block_inputs(int type) {
    switch (type) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
        default: return 0;
    }
}

__attribute__((unused)) static int block_bytes(int type) {
    switch (type) {
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q5_0: return 22;
        case T_Q5_1: return 24;
        case T_Q8_0: return 34;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        default: return 0;
    }
}

/* 1 where this library multiplies the type natively. */
int kvg_qtype_supported(int type) {
#ifdef KVGATE_AVX2
    return block_inputs(type) > 0;
#else
    (void)type;
    return 0;
#endif
}

#ifdef KVGATE_AVX2
#include <immintrin.h>

#include "bf16_avx2.h"

static inline float f16_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes of nibbles -> 32 values: low nibbles (elements 0-15), then high ones (16-31). */
static inline __m256i nibbles16(const uint8_t* qs) {
    const __m128i v = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Bit j of bits -> byte j: 0x10 where set, else 0 (the fifth bit of Q5_0 / Q5_1 values). */
static inline __m256i fifth_bits(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick),
                                       mask);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, mask), _mm256_set1_epi8(0x10));
}

/* Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales (sc, bytes 0-7) and mins (mn) from their 12
 * packed bytes, four bytes at a time: bytes 0-3 hold sc 0-3 (low 6 bits) and the top 2 bits of
 * sc 4-7; bytes 4-7 mn 0-3 and the top bits of mn 4-7; bytes 8-11 the low 4 bits of sc 4-7
 * (low nibbles) and of mn 4-7 (high nibbles). */
static inline void k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc0 = a & six, mn0 = b & six;
    const uint32_t sc1 = (c & four) | (((a >> 6) & two) << 4);
    const uint32_t mn1 = ((c >> 4) & four) | (((b >> 6) & two) << 4);
    memcpy(sc, &sc0, 4);
    memcpy(sc + 4, &sc1, 4);
    memcpy(mn, &mn0, 4);
    memcpy(mn + 4, &mn1, 4);
}

/* 8 per-32 values v[j] -> 16 per-16 values at out: v0 v0 v1 v1 ... v7 v7. */
static inline void store_pairs(float* out, __m256 v) {
    const __m256 lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    const __m256 hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
}

/* Inputs [k0, k0 + 64) of a row (k0 % 64 == 0) as 64 unsigned bytes in lo (inputs 0-31)
 * and hi (32-63); with half, only [k0, k0 + 32) (a row of 32-input blocks ending there), hi
 * zero. Returned in registers: a 64-byte load of two 32-byte stores would wait for them. */
static inline void decode64_regs(const uint8_t* row, int type, int64_t k0, int half, __m256i* lo_out,
                                 __m256i* hi_out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    switch (type) {
        case T_Q4_0:
        case T_Q4_1:
        case T_Q5_0:
        case T_Q5_1:
        case T_Q8_0: {
            const int bs = block_bytes(type);
            const int head = type == T_Q4_1 || type == T_Q5_1 ? 4 : 2;
            const int five = type == T_Q5_0 || type == T_Q5_1;
            for (int i = 0; i < 2; ++i) {
                __m256i v = _mm256_setzero_si256();
                if (!i || !half) {
                    const uint8_t* blk = row + (k0 / 32 + i) * bs;
                    if (type == T_Q8_0) {
                        v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + 2)),
                                             _mm256_set1_epi8((char)0x80));
                    } else {
                        uint32_t hb = 0;
                        if (five) memcpy(&hb, blk + head, 4);
                        v = nibbles16(blk + head + 4 * five);
                        if (five) v = _mm256_or_si256(v, fifth_bits(hb));
                    }
                }
                *(i ? hi_out : lo_out) = v;
            }
            return;
        }
        case T_Q4_K:
        case T_Q5_K: {
            const uint8_t* blk = row + k0 / 256 * block_bytes(type);
            const int c = (int)(k0 % 256) / 64; /* sub-blocks 2c (low nibbles), 2c + 1 (high) */
            const int five = type == T_Q5_K;
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * five + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                const __m256i one = _mm256_set1_epi8(1);
                const __m256i hv = _mm256_loadu_si256((const __m256i*)(blk + 16));
                lo = _mm256_or_si256(
                    lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), one), 4));
                hi = _mm256_or_si256(
                    hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * c + 1), one), 4));
            }
            *lo_out = lo;
            *hi_out = hi;
            return;
        }
        case T_Q6_K: {
            /* inputs 128 h + 32 s + l: low nibble of ql[64 h + 32 (s & 1) + l] (high nibble
             * for s >= 2), high pair (qh[32 h + l] >> 2 s) & 3 */
            const uint8_t* blk = row + k0 / 256 * block_bytes(type);
            const int t = (int)(k0 % 256) / 64, h = t / 2, top = t % 2; /* s = 2 top, 2 top + 1 */
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
            const __m256i m2 = _mm256_set1_epi8(3);
            const __m256i a = top ? _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4)
                                  : _mm256_and_si256(l0, m4);
            const __m256i b = top ? _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)
                                  : _mm256_and_si256(l1, m4);
            const __m256i ha = _mm256_and_si256(_mm256_srli_epi16(hv, 4 * top), m2);
            const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 4 * top + 2), m2);
            *lo_out = _mm256_or_si256(a, _mm256_slli_epi16(ha, 4));
            *hi_out = _mm256_or_si256(b, _mm256_slli_epi16(hb, 4));
            return;
        }
        default:
            *lo_out = *hi_out = _mm256_setzero_si256();
    }
}

/* decode64_regs, stored: 64 bytes at out. */
static inline void decode64(const uint8_t* row, int type, int64_t k0, int half, uint8_t* out) {
    __m256i lo, hi;
    decode64_regs(row, type, k0, half, &lo, &hi);
    _mm256_storeu_si256((__m256i*)out, lo);
    _mm256_storeu_si256((__m256i*)(out + 32), hi);
}

/* Scales and offsets of inputs [k0, k0 + 256) of a row (k0 % 256 == 0), per group of 16:
 * ws, wo [16], zeros past K: w[k] = ws[g] q[k] + wo[g]. Returns the zero point z of types
 * stored as d (q - z), whose exact float32 value is ws (q - z) (wo = -z ws then), or -1 for
 * the types with an offset (w = ws q + wo): what dequantize uses to give exactly gguf's
 * float32 values. */
static inline int decode_scales256(const uint8_t* row, int type, int64_t k0, int64_t K, float* ws,
                                   float* wo) {
    switch (type) {
        case T_Q4_0:
        case T_Q4_1:
        case T_Q5_0:
        case T_Q5_1:
        case T_Q8_0: {
            const int bs = block_bytes(type);
            const int with_min = type == T_Q4_1 || type == T_Q5_1;
            const float zp = type == T_Q4_0 ? 8.0f : type == T_Q8_0 ? 128.0f : 16.0f;
            for (int i = 0; i < 8; ++i) {
                float d = 0.0f, off = 0.0f;
                if (k0 + 32 * i < K) {
                    const uint8_t* blk = row + (k0 / 32 + i) * bs;
                    d = f16_at(blk);
                    off = with_min ? f16_at(blk + 2) : -zp * d;
                }
                ws[2 * i] = ws[2 * i + 1] = d;
                wo[2 * i] = wo[2 * i + 1] = off;
            }
            return with_min ? -1 : (int)zp;
        }
        case T_Q4_K:
        case T_Q5_K: {
            /* gguf's float32 values: (d sc) q - (dmin mn) */
            const uint8_t* blk = row + k0 / 256 * block_bytes(type);
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            uint64_t sc8, mn8;
            memcpy(&sc8, sc, 8);
            memcpy(&mn8, mn, 8);
            const __m256 scf =
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc8)));
            const __m256 mnf =
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn8)));
            store_pairs(ws, _mm256_mul_ps(_mm256_set1_ps(d), scf));
            store_pairs(wo, _mm256_sub_ps(_mm256_setzero_ps(),
                                          _mm256_mul_ps(_mm256_set1_ps(dmin), mnf)));
            return -1;
        }
        case T_Q6_K: {
            const uint8_t* blk = row + k0 / 256 * block_bytes(type);
            const __m128i sc16 = _mm_loadu_si128((const __m128i*)(blk + 192));
            const __m256 vd = _mm256_set1_ps(f16_at(blk + 208)), z = _mm256_set1_ps(-32.0f);
            const __m256 s0 = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc16)));
            const __m256 s1 = _mm256_mul_ps(
                vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8))));
            _mm256_storeu_ps(ws, s0);
            _mm256_storeu_ps(ws + 8, s1);
            _mm256_storeu_ps(wo, _mm256_mul_ps(z, s0));
            _mm256_storeu_ps(wo + 8, _mm256_mul_ps(z, s1));
            return 32;
        }
        default:
            memset(ws, 0, 16 * sizeof(float));
            memset(wo, 0, 16 * sizeof(float));
            return -2;
    }
}

/* One row of K inputs (K % 32 == 0) -> q [Kp] bytes, ws and wo [Kp / 16] (Kp: K rounded up
 * to 64; q zero, ws and wo zero past K). Returns decode_scales256's zero point. */
static int decode_row(const uint8_t* row, int type, int64_t K, uint8_t* q, float* ws,
                      float* wo) {
    int zp = -2;
    for (int64_t k0 = 0; k0 < K; k0 += 64) decode64(row, type, k0, K - k0 < 64, q + k0);
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        float gs[16], go[16];
        zp = decode_scales256(row, type, k0, K, gs, go);
        const int64_t groups = (K - k0 < 256 ? K - k0 : 256) / 16;
        memcpy(ws + k0 / 16, gs, (size_t)groups * sizeof(float));
        memcpy(wo + k0 / 16, go, (size_t)groups * sizeof(float));
    }
    return zp;
}

/* Row n of W: its segment's type and bytes. */
static inline const uint8_t* weight_row(const kvg_qweight* w, int64_t n, int* type) {
    for (int s = 0; s < w->nsegs; ++s) {
        if (n < w->segs[s].rows) {
            *type = w->segs[s].type;
            return w->segs[s].data + n * w->segs[s].row_bytes;
        }
        n -= w->segs[s].rows;
    }
    *type = -1;
    return NULL;
}

static int weight_ok(const kvg_qweight* w, int N, int K) {
    if (K <= 0 || K % 32 || w->k != K || w->nsegs <= 0) return 0;
    int64_t rows = 0;
    for (int s = 0; s < w->nsegs; ++s) {
        const int t = w->segs[s].type, bi = block_inputs(t);
        if (!bi || K % bi || w->segs[s].row_bytes != (int64_t)K / bi * block_bytes(t)) return 0;
        rows += w->segs[s].rows;
    }
    return rows == N;
}

/* The float32 weights of `count` rows of W (row ids in rows[]), into out [count, K] as float32
 * or (out_bf16) bf16 rounded to nearest even: exactly gguf.quants' float32 values. 0, or -1
 * for a bad row id, type or shape. */
int kvg_qdequant_rows(const kvg_qweight* w, const int64_t* rows, int count, int64_t N,
                      void* out, int out_bf16) {
    const int64_t K = w->k;
    if (!weight_ok(w, (int)N, (int)K)) return -1;
    int bad = 0;
    #pragma omp parallel if ((int64_t)count * K > 65536)
    {
        const int64_t Kp = (K + 63) / 64 * 64;
        uint8_t* q = (uint8_t*)malloc((size_t)Kp);
        float* ws = (float*)malloc((size_t)Kp / 16 * sizeof(float));
        float* wo = (float*)malloc((size_t)Kp / 16 * sizeof(float));
        float* tmp = (float*)malloc((size_t)K * sizeof(float));
        if (!q || !ws || !wo || !tmp) {
            #pragma omp atomic write
            bad = 1;
        }
        #pragma omp for schedule(static)
        for (int i = 0; i < count; ++i) {
            int type;
            const uint8_t* row =
                rows[i] >= 0 && rows[i] < N && q && ws && wo && tmp ? weight_row(w, rows[i], &type)
                                                                    : NULL;
            if (!row) {
                #pragma omp atomic write
                bad = 1;
                continue;
            }
            const int zp = decode_row(row, type, K, q, ws, wo);
            float* dst = out_bf16 ? tmp : (float*)out + (int64_t)i * K;
            for (int64_t k = 0; k < K; ++k) {
                const float s = ws[k / 16];
                dst[k] = zp >= 0 ? s * (float)((int)q[k] - zp) : s * (float)q[k] + wo[k / 16];
            }
            if (out_bf16) {
                uint16_t* o = (uint16_t*)out + (int64_t)i * K;
                for (int64_t k = 0; k < K; k += 8) bf16x8_store(o + k, _mm256_loadu_ps(tmp + k));
            }
        }
        free(q);
        free(ws);
        free(wo);
        free(tmp);
    }
    return bad ? -1 : 0;
}

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Activations: row m of x (K values) -> xq [Kp] int8 (zeros past K), dx [Kp / 32] (0 for an
 * all-zero block), xs [Kp / 16] = dx x the group's integer sum, xs32 [Kp / 32] the same per
 * block of 32 (one rounding of the exact sum). Kp: K rounded up to 64. */
static void quantize_x(const void* x, int io_bf16, int64_t m, int64_t K, int64_t Kp, int8_t* xq,
                       float* dx, float* xs, float* xs32) {
    const uint16_t* xb = (const uint16_t*)x + m * K;
    const float* xf = (const float*)x + m * K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; ++b) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i)
            v[i] = io_bf16 ? bf16x8_load(xb + 32 * b + 8 * i) : _mm256_loadu_ps(xf + 32 * b + 8 * i);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                                _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                                _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h);
        /* a NaN anywhere in the block makes its scale NaN: every output it reaches is NaN, as
         * in a float product (vmaxps would drop it, and x / d would saturate to -128) */
        const __m256 unord = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
            _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
        const float d = _mm256_movemask_ps(unord) ? __builtin_nanf("") : amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        /* packs works per 128-bit lane: restore element order with one permute at the end */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
        const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered =
            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(xq + 32 * b), ordered);
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 16; ++i) {
            s0 += xq[32 * b + i];
            s1 += xq[32 * b + 16 + i];
        }
        dx[b] = d;
        xs[2 * b] = d * (float)s0;
        xs[2 * b + 1] = d * (float)s1;
        xs32[b] = d * (float)(s0 + s1);
    }
    for (int64_t k = K; k < Kp; ++k) xq[k] = 0;
    for (int64_t b = K / 32; b < Kp / 32; ++b) dx[b] = xs[2 * b] = xs[2 * b + 1] = xs32[b] = 0.0f;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* sum_g wo[g] xs[g] over G groups (a multiple of 4), in one fixed order. */
static inline float offset_dot(const float* wo, const float* xs, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(wo + g), _mm256_loadu_ps(xs + g), acc);
    float s = hsum8(acc);
    for (; g < G; ++g) s += wo[g] * xs[g];
    return s;
}

/* The calling thread's scratch of at least n bytes, kept for its next calls (the engine's
 * threads live as long as it does). NULL if it cannot grow. */
static void* thread_scratch(size_t n) {
    static __thread void* buf;
    static __thread size_t cap;
    if (n > cap) {
        void* grown = realloc(buf, n);
        if (!grown) return NULL;
        buf = grown;
        cap = n;
    }
    return buf;
}

/* One output value: v + bias, stored as float32 or rounded once to bf16 (nearest even). */
static inline void store_one(void* y, int64_t at, float v, int f32) {
    if (f32) {
        ((float*)y)[at] = v;
    } else {
        ((uint16_t*)y)[at] = (uint16_t)_mm256_cvtsi256_si32(bf16x8_round_bits(_mm256_set1_ps(v)));
    }
}

/* The activations of a call, quantized once: xq [M][Kp], dx [M][Kp / 32], xs [M][Kp / 16],
 * xs32 [M][Kp / 32]; for the AVX2 K-quant columns also in two levels per 256 and 32
 * (quantize_x256: xk [M][K], dk [M][K / 256], sk [M][K / 256][32], bk [M][K / 16]; NULL where
 * no column takes them). */
typedef struct {
    const int8_t* xq;
    const float* dx;
    const float* xs;
    const float* xs32;
    int64_t Kp;
    const int8_t* xk;
    const float* dk;
    const int16_t* sk;
    const int16_t* bk;
    const int32_t* o6;
} qacts;

#if defined(KVGATE_AVX512BF16) && defined(__AVX512VNNI__)
#include "bf16_avx512.h"

/* ---- AVX512-VNNI: panels of 16 columns, x broadcast --------------------------------------
 * A panel's decoded bytes are interleaved as vpdpbusd takes them: for each 4 inputs, the 16
 * columns' 4 bytes side by side (64 bytes: qi [Kp / 4][16] dwords), and its scales and offsets
 * per group of 16 inputs side by side (ws, wo [Kp / 16][16] floats). A row's 4 int8 inputs are
 * broadcast to all 16 lanes: one vpdpbusd is 64 multiply-adds, 16 columns x 4 inputs, and each
 * lane sums its column's exact int32 products over the group; then, per group, to float32,
 * times the column's scale and the row's block scale, plus the offset times the row's group
 * sum: 8 instructions per 256 multiply-adds (per 512 for panels whose types have per-32
 * scales: panel_per32), in one order for every row whatever M is. */
#define PANEL 16
#define MAX_R 4
#define MAX_P 2
#define AMX_ROWS 16 /* rows per AMX tile; row blocks are whole multiples of it */

/* 64 decoded bytes of a row in one register. */
static inline __m512i decode64_zmm(const uint8_t* row, int type, int64_t k0, int half) {
    __m256i lo, hi;
    decode64_regs(row, type, k0, half, &lo, &hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

#include "transpose_avx512.h" /* transpose16_in */

/* dst[j][i] = r[i][j] for 16 x 16 32-bit values in registers (r is clobbered; dst's row
 * stride in elements). */
static inline void transpose16_regs2(__m512i r[16], uint32_t* dst, uint32_t* dst8, int64_t ds);

static inline void transpose16_regs(__m512i r[16], uint32_t* dst, int64_t ds) {
    transpose16_regs2(r, dst, dst + 8 * ds, ds);
}

/* transpose16_regs with rows 8-15 of the result at dst8 (rows j >= 8 at dst8 + (j - 8) ds). */
static inline void transpose16_regs2(__m512i r[16], uint32_t* dst, uint32_t* dst8, int64_t ds) {
    transpose16_in(r);
    for (int j = 0; j < 8; ++j) {
        _mm512_storeu_si512(dst + j * ds, r[j]);
        _mm512_storeu_si512(dst8 + j * ds, r[8 + j]);
    }
}

/* dst[j][i] = src[i][j] for a 16 x 16 block of 32-bit values (row strides in elements). */
static inline void transpose16(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
    transpose16_regs(r, dst, ds);
}

/* Groups of 16 inputs a panel's scales are laid out for: Kp / 16 rounded up to 16 (whole
 * 16 x 16 transposes). */
static inline int64_t panel_groups(int64_t Kp) { return (Kp / 16 + 15) / 16 * 16; }

/* The rows of one panel, as decode_panel and qlinear_row1 read them side by side. */
typedef struct {
    const uint8_t* rows[PANEL];
    int types[PANEL];
} panel_rows;

static int panel_open(const kvg_qweight* w, int64_t n0, int cols, panel_rows* pr) {
    for (int c = 0; c < PANEL; ++c) {
        pr->rows[c] = NULL;
        pr->types[c] = -1;
        if (c < cols && !(pr->rows[c] = weight_row(w, n0 + c, &pr->types[c]))) return -1;
    }
    return 0;
}

/* The 16 rows of a panel are read side by side: 16 streams (32 with both threads), more than
 * the hardware prefetchers follow, and each crosses pages. Measured on the Qwen file (28 gate
 * projections, Zen 4, 2 threads): 5 GB/s of Q4_K read per call, against 11.7 with the weights
 * in L3. So while a panel is worked on, the next one (16 rows, one contiguous run of the file
 * within a segment) is prefetched into L2 in address order, an even share of it per 64 inputs. */
typedef struct {
    const uint8_t* rows[PANEL];
    int64_t rb[PANEL];
    int cols, c;
    int64_t off, step;
} prefetcher;

static void prefetch_start(prefetcher* pf, const kvg_qweight* w, int64_t n0, int64_t N,
                           int64_t K, int64_t steps) {
    pf->cols = n0 < N ? (N - n0 < PANEL ? (int)(N - n0) : PANEL) : 0;
    pf->c = 0;
    pf->off = 0;
    int64_t total = 0;
    for (int c = 0; c < pf->cols; ++c) {
        int type;
        pf->rows[c] = weight_row(w, n0 + c, &type);
        pf->rb[c] = pf->rows[c] ? K / block_inputs(type) * block_bytes(type) : 0;
        total += pf->rb[c];
    }
    pf->step = ((total + steps - 1) / steps + 63) / 64 * 64;
}

static inline void prefetch_step(prefetcher* pf) {
    for (int64_t left = pf->step; left > 0 && pf->c < pf->cols;) {
        const int64_t rest = pf->rb[pf->c] - pf->off, n = left < rest ? left : rest;
        for (int64_t b = 0; b < n; b += 64)
            _mm_prefetch((const char*)(pf->rows[pf->c] + pf->off + b), _MM_HINT_T1);
        pf->off += n;
        left -= n;
        if (pf->off >= pf->rb[pf->c]) {
            ++pf->c;
            pf->off = 0;
        }
    }
}

/* Scales and offsets of inputs [k0, k0 + 256) of the panel's columns, one column per lane:
 * ws, wo [16 groups][16]. */
static inline void panel_scales(const panel_rows* pr, int64_t k0, int64_t K, float* ws,
                                float* wo) {
    float gs[PANEL * 16] __attribute__((aligned(64))), go[PANEL * 16] __attribute__((aligned(64)));
    for (int c = 0; c < PANEL; ++c)
        decode_scales256(pr->rows[c], pr->types[c], k0, K, gs + 16 * c, go + 16 * c);
    transpose16((const uint32_t*)gs, 16, (uint32_t*)ws, PANEL);
    transpose16((const uint32_t*)go, 16, (uint32_t*)wo, PANEL);
}

/* ---- Whole panels of Q4_K or Q6_K: decoded 128 inputs at a time ----------------------------
 * qlinear_row1's arithmetic (the same exact group sums, the same float32 steps in the same
 * order: bit-identical outputs) for a panel whose 16 rows are one run of one segment of
 * Q4_K or Q6_K, the types of Q4_K_M files. What it saves per 16 columns x 256 inputs: the
 * scales are loaded and decoded 16 columns at a time, lanes already the columns (no
 * per-column decode and no 16 x 16 transposes: ~100 instructions instead of ~460), and a
 * column's bytes are decoded 128 at a time from one 64-byte load with no per-column type
 * dispatch. Q4_K's 64-byte runs of nibbles hold sub-blocks (0, 2) in their low nibbles and
 * (1, 3) in their high ones, so the row's int8 x is laid out once per call in that order
 * (q4k_order); Q6_K's runs are in input order. */

/* A whole panel's rows as one run of a Q4_K or Q6_K segment: its first row (NULL if not). */
static inline const uint8_t* panel_run(const kvg_qweight* w, int64_t n0, int cols, int* type,
                                       int64_t* rb) {
    if (cols != PANEL) return NULL;
    for (int s = 0; s < w->nsegs; ++s) {
        const kvg_qseg* g = &w->segs[s];
        if (n0 < g->rows) {
            if (n0 + PANEL > g->rows || (g->type != T_Q4_K && g->type != T_Q6_K)) return NULL;
            *type = g->type;
            *rb = g->row_bytes;
            return g->data + n0 * g->row_bytes;
        }
        n0 -= g->rows;
    }
    return NULL;
}

/* A whole panel's rows as one run of a segment of a 32-input block type (Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1): its first row, or NULL. Such a panel's scales are gathered 16 rows at a time
 * per block (scales32) instead of decoded row by row and transposed (panel_scales: per 256
 * inputs 16 x 8 scalar half-float reads and two 16 x 16 transposes, which made one row of
 * Q8_0 5x slower than the int8 WidenLinear on SmolLM2's and Qwen's shapes). */
static inline const uint8_t* panel_run32(const kvg_qweight* w, int64_t n0, int cols, int* type,
                                         int64_t* rb) {
    if (cols != PANEL) return NULL;
    for (int s = 0; s < w->nsegs; ++s) {
        const kvg_qseg* g = &w->segs[s];
        if (n0 < g->rows) {
            if (n0 + PANEL > g->rows || block_inputs(g->type) != 32) return NULL;
            *type = g->type;
            *rb = g->row_bytes;
            return g->data + n0 * g->row_bytes;
        }
        n0 -= g->rows;
    }
    return NULL;
}

/* Byte b (0-3) of every dword of v, zero-extended. */
static inline __m512i byte_of(__m512i v, int b) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(0xFF));
}

/* 16 half floats (the low 16 bits of each dword of v) -> float32. */
static inline __m512 half_lanes(__m512i v) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

/* Bytes [0, 16) at p of 16 rows (row c's at p + c rb) as four registers, lanes the rows:
 * out[j] lane c = dword j of row c's 16 bytes. 16 loads and 8 unpacks within 128-bit lanes
 * (register k's lane L holds row k + 4 L, so the lanes come out in row order); four
 * vpgatherdd of the same dwords were ~14% of a one-row call's samples on Zen 4 (perf). */
static inline __attribute__((always_inline)) void rows_dwords4(const uint8_t* p, int64_t rb,
                                                                __m512i out[4]) {
    __m512i z[4];
#define ROW16(r) _mm_loadu_si128((const __m128i*)(p + (r) * rb))
    for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(ROW16(k)), ROW16(k + 4), 1);
        z[k] = _mm512_inserti32x4(_mm512_inserti32x4(v, ROW16(k + 8), 2), ROW16(k + 12), 3);
    }
#undef ROW16
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* decode_scales256 of one 256-input block of 16 rows at once (blk: row 0's block; row c's at
 * + c rb), lanes the rows: ws, wo [16 groups][16]. */
static inline __attribute__((always_inline)) void run_scales(const uint8_t* blk, int64_t rb,
                                                              int type, float* ws, float* wo) {
    const __m512 zero = _mm512_setzero_ps();
    if (type == T_Q4_K) {
        __m512i head[4]; /* d and dmin, then the 12 bytes of scales and mins */
        rows_dwords4(blk, rb, head);
        const __m512i g0 = head[0], a = head[1], b = head[2], c = head[3];
        const __m512 d = half_lanes(g0), dmin = half_lanes(_mm512_srli_epi32(g0, 16));
        const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f);
        const __m512i top = _mm512_set1_epi32(0x30303030);
        /* k_scales, 16 rows at a time */
        const __m512i sc[2] = {
            _mm512_and_si512(a, six),
            _mm512_or_si512(_mm512_and_si512(c, four), _mm512_and_si512(_mm512_srli_epi32(a, 2), top))};
        const __m512i mn[2] = {
            _mm512_and_si512(b, six),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), four),
                            _mm512_and_si512(_mm512_srli_epi32(b, 2), top))};
        for (int j = 0; j < 8; ++j) {
            const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(byte_of(sc[j / 4], j % 4)));
            const __m512 o = _mm512_sub_ps(
                zero, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(byte_of(mn[j / 4], j % 4))));
            _mm512_storeu_ps(ws + (2 * j) * PANEL, s);
            _mm512_storeu_ps(ws + (2 * j + 1) * PANEL, s);
            _mm512_storeu_ps(wo + (2 * j) * PANEL, o);
            _mm512_storeu_ps(wo + (2 * j + 1) * PANEL, o);
        }
    } else { /* Q6_K: 16 int8 scales at 192, f16 d at 208 */
        __m512i tail[4]; /* bytes [194, 210): dword 3 holds d in its high half */
        rows_dwords4(blk + 194, rb, tail);
        const __m512 d = half_lanes(_mm512_srli_epi32(tail[3], 16));
        const __m512 z = _mm512_set1_ps(-32.0f);
        __m512i scales[4];
        rows_dwords4(blk + 192, rb, scales);
        for (int i = 0; i < 4; ++i) {
            const __m512i v = scales[i];
            for (int b = 0; b < 4; ++b) {
                const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
                const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                _mm512_storeu_ps(ws + (4 * i + b) * PANEL, s);
                _mm512_storeu_ps(wo + (4 * i + b) * PANEL, _mm512_mul_ps(z, s));
            }
        }
    }
}

/* decode_scales256's values for one 32-input block of the 16 rows of a panel_run32 run, lanes
 * the rows (blk: row 0's block, row c's at + offs[c]): the scale d and the offset (the min
 * of Q4_1 / Q5_1, else -zp d), the same float32 values. */
static inline void scales32(const uint8_t* blk, __m512i offs, int type, __m512* sc, __m512* of) {
    const __m512i g = _mm512_i32gather_epi32(offs, blk, 1); /* d (and m) at the block's head */
    const __m512 d = half_lanes(g);
    *sc = d;
    if (type == T_Q4_1 || type == T_Q5_1) {
        *of = half_lanes(_mm512_srli_epi32(g, 16));
    } else {
        const float zp = type == T_Q4_0 ? 8.0f : type == T_Q8_0 ? 128.0f : 16.0f;
        *of = _mm512_mul_ps(_mm512_set1_ps(-zp), d);
    }
}

/* 64 inputs [k0, k0 + 64) of each of the 16 rows of a panel_run32 run (blk: row 0's first
 * block of them, rows rb apart) as decode64_regs gives them (the same bytes), with the type a
 * constant at each call site (always inlined: no per-row dispatch). half: only the first
 * block (the row ends there), the second 32 bytes zero. */
static inline __attribute__((always_inline)) void decode_pairs(const uint8_t* blk, int64_t rb,
                                                               const int type, const int half,
                                                               __m512i r[16]) {
    const int bs = block_bytes(type);
    for (int c = 0; c < PANEL; ++c, blk += rb) {
        __m256i lo, hi = _mm256_setzero_si256();
        if (type == T_Q8_0) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + 2)), flip);
            if (!half)
                hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + bs + 2)), flip);
        } else { /* Q4_0, Q4_1 */
            const int head = type == T_Q4_1 ? 4 : 2;
            lo = nibbles16(blk + head);
            if (!half) hi = nibbles16(blk + bs + head);
        }
        r[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
}

/* decode_pairs for any type it specializes (Q8_0, Q4_0, Q4_1): 1 if done. */
static inline int decode_pairs_any(const uint8_t* blk, int64_t rb, int type, int half,
                                   __m512i r[16]) {
    if (type == T_Q8_0) {
        if (half) decode_pairs(blk, rb, T_Q8_0, 1, r); else decode_pairs(blk, rb, T_Q8_0, 0, r);
    } else if (type == T_Q4_0) {
        if (half) decode_pairs(blk, rb, T_Q4_0, 1, r); else decode_pairs(blk, rb, T_Q4_0, 0, r);
    } else if (type == T_Q4_1) {
        if (half) decode_pairs(blk, rb, T_Q4_1, 1, r); else decode_pairs(blk, rb, T_Q4_1, 0, r);
    } else {
        return 0;
    }
    return 1;
}

/* The two blocks' scales of inputs [k0, k0 + 64) of a panel_run32 run into ws, wo [groups][16]
 * (g = k0 / 16 .. + 3, the same value for both groups of a block; zeros past K, as decoded).
 * at: where group k0 / 16 goes. */
static inline void scales_pair32(const uint8_t* run, __m512i offs, int type, int64_t k0, int64_t K,
                                 float* ws_at, float* wo_at) {
    const int bs = block_bytes(type);
    for (int i = 0; i < 2; ++i) {
        __m512 sc = _mm512_setzero_ps(), of = _mm512_setzero_ps();
        if (k0 + 32 * i < K) scales32(run + (k0 / 32 + i) * bs, offs, type, &sc, &of);
        for (int j = 0; j < 2; ++j) {
            _mm512_storeu_ps(ws_at + (2 * i + j) * PANEL, sc);
            _mm512_storeu_ps(wo_at + (2 * i + j) * PANEL, of);
        }
    }
}

static inline __m512i row_offsets(int64_t rb) {
    return _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)rb));
}

/* x [Kp] in Q4_K's nibble order: per 128 inputs, 0-31, 64-95 (the low nibbles of a 64-byte
 * run), then 32-63, 96-127 (the high ones). */
static void q4k_order(const int8_t* x, int64_t K, int8_t* out) {
    for (int64_t k = 0; k < K; k += 128) {
        memcpy(out + k, x + k, 32);
        memcpy(out + k + 32, x + k + 64, 32);
        memcpy(out + k + 64, x + k + 32, 32);
        memcpy(out + k + 96, x + k + 96, 32);
    }
}

/* Inputs [128 h, 128 h + 128) of a block (blk) as unsigned bytes, in two registers of 4
 * groups of 16: the first (!upper; Q4_K: groups 8h + 0, 1, 4, 5 of the block, Q6_K: 8h +
 * 0..3) or the second (Q4_K: 8h + 2, 3, 6, 7; Q6_K: 8h + 4..7). */
static inline __m512i run_decode(const uint8_t* blk, int type, int h, int upper) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == T_Q4_K) {
        const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
        return _mm512_and_si512(upper ? _mm512_srli_epi16(v, 4) : v, m4);
    }
    /* Q6_K: ql[64 h + i] holds inputs 128 h + i (low nibble) and 128 h + 64 + i (high); the
     * high pair of input 128 h + 32 s + l is bits 2s, 2s + 1 of qh[32 h + l], wanted at bits
     * 4-5: shifted left 4 and 2 for s = 0, 1 (the first register's halves), right 0 and 2
     * for s = 2, 3 (the second's); 16-bit shifts, the bits crossing bytes masked off */
    const __m512i l = _mm512_loadu_si512(blk + 64 * h);
    const __m512i q =
        _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
    const __m512i b45 = _mm512_set1_epi8(0x30);
    const __m512i high =
        upper ? _mm512_srlv_epi16(q, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1))
              : _mm512_sllv_epi16(q, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    /* (low & 0x0F) | (high & 0x30) */
    return _mm512_ternarylogic_epi32(upper ? _mm512_srli_epi16(l, 4) : l, m4,
                                     _mm512_and_si512(high, b45), 0xEA);
}

/* decode_panel for a whole panel of one Q4_K / Q6_K run (base: its first row, rb: row bytes):
 * the same bytes and scales, the scales loaded 16 rows at a time and the bytes decoded
 * 128 inputs per load (run_scales, run_decode), each register's two halves of 32 inputs
 * transposed to where their inputs go (Q4_K's registers hold inputs 0-31 and 64-95, or
 * 32-63 and 96-127, of the 128). */
static void decode_run(const uint8_t* base, int64_t rb, int type, int64_t K, prefetcher* pf,
                       uint32_t* qi, float* ws, float* wo) {
    const int bs = block_bytes(type);
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const uint8_t* blk = base + k0 / 256 * bs;
        run_scales(blk, rb, type, ws + k0 / 16 * PANEL, wo + k0 / 16 * PANEL);
        for (int h = 0; h < 2; ++h) {
            const int64_t k = k0 + 128 * h;
            for (int upper = 0; upper < 2; ++upper) {
                prefetch_step(pf);
                __m512i r[16];
                for (int c = 0; c < PANEL; ++c) r[c] = run_decode(blk + c * rb, type, h, upper);
                /* first 32 and second 32 inputs of the register */
                const int64_t at = type == T_Q4_K ? k + 32 * upper : k + 64 * upper;
                const int64_t at8 = type == T_Q4_K ? at + 64 : at + 32;
                transpose16_regs2(r, qi + at / 4 * PANEL, qi + at8 / 4 * PANEL, PANEL);
            }
        }
    }
}

/* Decode columns [n0, n0 + cols) (cols <= 16; the others zero) into one interleaved panel:
 * qi [Kp / 4][16] dwords, ws and wo [panel_groups][16]: 64 inputs of the 16 rows at a time
 * into registers, transposed to 16 dwords per 4 inputs; scales 256 inputs at a time. The
 * panel `next` panels on is prefetched meanwhile. */
static int decode_panel(const kvg_qweight* w, int64_t n0, int cols, int64_t N, int64_t K,
                        int64_t Kp, int next, uint32_t* qi, float* ws, float* wo) {
    panel_rows pr;
    if (panel_open(w, n0, cols, &pr)) return -1;
    prefetcher pf;
    prefetch_start(&pf, w, n0 + next * PANEL, N, K, Kp / 64);
    int type;
    int64_t rb;
    const uint8_t* run = panel_run(w, n0, cols, &type, &rb);
    if (run) {
        decode_run(run, rb, type, K, &pf, qi, ws, wo);
        return 0;
    }
    /* a run of a 32-input type: decoded without per-row dispatch, scales gathered */
    const uint8_t* run32 = panel_run32(w, n0, cols, &type, &rb);
    const __m512i offs = row_offsets(run32 ? rb : 0);
    for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
        prefetch_step(&pf);
        __m512i r[16];
        const int half = K - k0 < 64;
        if (run32 && decode_pairs_any(run32 + k0 / 32 * block_bytes(type), rb, type, half, r)) {
            scales_pair32(run32, offs, type, k0, K, ws + k0 / 16 * PANEL, wo + k0 / 16 * PANEL);
        } else {
            if (k0 % 256 == 0)
                panel_scales(&pr, k0, K, ws + k0 / 16 * PANEL, wo + k0 / 16 * PANEL);
            for (int c = 0; c < PANEL; ++c) r[c] = decode64_zmm(pr.rows[c], pr.types[c], k0, half);
        }
        transpose16_regs(r, qi + k0 / 4 * PANEL, PANEL);
    }
    return 0;
}

/* A column whose type's scale and offset hold for whole blocks of 32 inputs (every type but
 * Q6_K, whose scales are per 16) takes its float32 steps per 32 inputs, on the exact integer
 * sum of the block: half as many. The steps are a property of the column's own type, so a
 * column gets the same output in any batch and in any fused layer. A panel's lanes: bit c of
 * panel_per32 for column c (columns past the panel's end count as either). A panel with
 * both kinds (a fused layer's parts meeting inside it) is computed both ways and blended. */
static inline int per32_type(int type) { return type != T_Q6_K; }

#define ALL_LANES 0xFFFF

static unsigned panel_per32(const kvg_qweight* w, int64_t n0, int cols) {
    unsigned mask = ALL_LANES;
    for (int c = 0; c < cols; ++c) {
        int type;
        if (!weight_row(w, n0 + c, &type) || !per32_type(type)) mask &= ~(1u << c);
    }
    /* the columns past the end: as the others, when those are all of one kind */
    return cols < PANEL && (mask & ((1u << cols) - 1)) == 0 ? 0 : mask;
}

/* R rows x P panels (16 P columns): out [R][P * 16] float32 sums, offsets included. W: the
 * inputs per float32 step (16, or 32 for per32 panels: their ws, wo per 16 repeat in pairs,
 * read at the pair's first; xs is then the rows' xs32). */
#define DEFINE_PTILE(R, P, W)                                                                  \
static void ptile_##R##_##P##_##W(const int8_t* xq, const float* dx, const float* xs,          \
                                  int64_t Kp, const uint32_t* qi, const float* ws,             \
                                  const float* wo, int64_t pstride_q, int64_t pstride_s,       \
                                  float* out) {                                                \
    __m512 acc[R][P];                                                                         \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();  \
    for (int64_t g = 0; g < Kp / W; ++g) {                                                    \
        __m512i isum[R][P];                                                                   \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                                   \
            _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p)                               \
                isum[r][p] = _mm512_setzero_si512();                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < W / 4; ++j) {                             \
            __m512i wv[P];                                                                    \
            _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p)                               \
                wv[p] = _mm512_loadu_si512(qi + p * pstride_q + ((W / 4) * g + j) * PANEL);   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                             \
                int32_t four;                                                                 \
                memcpy(&four, xq + r * Kp + W * g + 4 * j, 4);                                \
                const __m512i xb = _mm512_set1_epi32(four);                                   \
                _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p)                           \
                    isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], wv[p], xb);                  \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                 \
            const __m512 d = _mm512_set1_ps(dx[r * (Kp / 32) + g * W / 32]);                  \
            const __m512 s = _mm512_set1_ps(xs[r * (Kp / W) + g]);                            \
            _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p) {                             \
                const __m512 sc = _mm512_loadu_ps(ws + p * pstride_s + (W / 16) * g * PANEL); \
                const __m512 of = _mm512_loadu_ps(wo + p * pstride_s + (W / 16) * g * PANEL); \
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][p]),                   \
                                            _mm512_mul_ps(sc, d), acc[r][p]);                 \
                acc[r][p] = _mm512_fmadd_ps(of, s, acc[r][p]);                                \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 2") for (int p = 0; p < P; ++p)                                   \
            _mm512_storeu_ps(out + r * MAX_P * PANEL + p * PANEL, acc[r][p]);                 \
}

DEFINE_PTILE(1, 1, 16) DEFINE_PTILE(2, 1, 16) DEFINE_PTILE(3, 1, 16) DEFINE_PTILE(4, 1, 16)
DEFINE_PTILE(1, 2, 16) DEFINE_PTILE(2, 2, 16) DEFINE_PTILE(3, 2, 16) DEFINE_PTILE(4, 2, 16)
DEFINE_PTILE(1, 1, 32) DEFINE_PTILE(2, 1, 32) DEFINE_PTILE(3, 1, 32) DEFINE_PTILE(4, 1, 32)
DEFINE_PTILE(1, 2, 32) DEFINE_PTILE(2, 2, 32) DEFINE_PTILE(3, 2, 32) DEFINE_PTILE(4, 2, 32)
typedef void (*ptile_fn)(const int8_t*, const float*, const float*, int64_t, const uint32_t*,
                         const float*, const float*, int64_t, int64_t, float*);
static const ptile_fn PTILES[2][MAX_R + 1][MAX_P + 1] = {
    {
        {0},
        {0, ptile_1_1_16, ptile_1_2_16},
        {0, ptile_2_1_16, ptile_2_2_16},
        {0, ptile_3_1_16, ptile_3_2_16},
        {0, ptile_4_1_16, ptile_4_2_16},
    },
    {
        {0},
        {0, ptile_1_1_32, ptile_1_2_32},
        {0, ptile_2_1_32, ptile_2_2_32},
        {0, ptile_3_1_32, ptile_3_2_32},
        {0, ptile_4_1_32, ptile_4_2_32},
    },
};

/* Rows [r0, r0 + R) of y, columns [16 p, 16 p + cols), from out [R][MAX_P * 16] plus bias. */
static void store_rows(const float* out, int R, int64_t r0, int64_t p, int64_t cols, int64_t N,
                       const float* bias, void* y, int f32) {
    for (int r = 0; r < R; ++r) {
        const float* o = out + r * MAX_P * PANEL;
        const int64_t at = (r0 + r) * N + p * PANEL;
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            __m512 v = _mm512_load_ps(o + c);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * PANEL + c));
            if (f32)
                _mm512_storeu_ps((float*)y + at + c, v);
            else
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + at + c), bf16x16_round(v));
        }
        for (; c < cols; ++c)
            store_one(y, at + c, o[c] + (bias ? bias[p * PANEL + c] : 0.0f), f32);
    }
}

/* A thread's scratch for MAX_P decoded panels: qi [MAX_P][Kp / 4][16] dwords, ws and wo
 * [MAX_P][panel_groups][16] floats (panel i at i sq, i ss). Nonzero when it cannot grow. */
typedef struct {
    uint32_t* qi;
    float* ws;
    float* wo;
} panel_bufs;

static int panel_scratch(int64_t Kp, panel_bufs* b) {
    const int64_t sq = Kp / 4 * PANEL, ss = panel_groups(Kp) * PANEL;
    uint8_t* buf = (uint8_t*)thread_scratch((size_t)MAX_P * (sq * 4 + 2 * ss * 4));
    if (!buf) return -1;
    b->qi = (uint32_t*)buf;
    b->ws = (float*)(b->qi + MAX_P * sq);
    b->wo = b->ws + MAX_P * ss;
    return 0;
}

/* Rows [m0, m1) of y for this thread's panels [p_lo, p_hi). */
static int qlinear_panels(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                          int64_t m0, int64_t m1, int64_t p_lo, int64_t p_hi, int64_t N,
                          int64_t K, int f32) {
    const int64_t Kp = a->Kp, sq = Kp / 4 * PANEL, ss = panel_groups(Kp) * PANEL;
    panel_bufs b;
    if (panel_scratch(Kp, &b)) return -2;
    uint32_t* qi = b.qi;
    float *ws = b.ws, *wo = b.wo;
    float out[MAX_R * MAX_P * PANEL] __attribute__((aligned(64)));
    for (int64_t p = p_lo; p < p_hi; p += MAX_P) {
        const int P = p_hi - p < MAX_P ? (int)(p_hi - p) : MAX_P;
        unsigned per32[MAX_P];
        for (int i = 0; i < P; ++i) {
            const int64_t n0 = (p + i) * PANEL;
            const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            if (decode_panel(w, n0, cols, N, K, Kp, MAX_P, qi + i * sq, ws + i * ss, wo + i * ss))
                return -1;
            per32[i] = panel_per32(w, n0, cols);
        }
        const int64_t cols = (p + P) * PANEL < N ? P * PANEL : N - p * PANEL;
        /* pure panels of one kind side by side: one tile for both; else a tile each, a
         * panel of both kinds twice (per 16, then per 32 blended into its lanes) */
        const int pure0 = per32[0] == 0 || per32[0] == ALL_LANES;
        const int together = P == 1 ? pure0 : pure0 && per32[0] == per32[1];
        for (int64_t r0 = m0; r0 < m1; r0 += MAX_R) {
            const int R = m1 - r0 < MAX_R ? (int)(m1 - r0) : MAX_R;
            const int8_t* xq = a->xq + r0 * Kp;
            const float* dx = a->dx + r0 * (Kp / 32);
            const float* xs16 = a->xs + r0 * (Kp / 16);
            const float* xs32 = a->xs32 + r0 * (Kp / 32);
            if (together) {
                const int k = per32[0] != 0;
                PTILES[k][R][P](xq, dx, k ? xs32 : xs16, Kp, qi, ws, wo, sq, ss, out);
            } else {
                for (int i = 0; i < P; ++i) {
                    const uint32_t* q = qi + i * sq;
                    const float *s = ws + i * ss, *o = wo + i * ss;
                    if (per32[i] != ALL_LANES)
                        PTILES[0][R][1](xq, dx, xs16, Kp, q, s, o, sq, ss, out + i * PANEL);
                    if (per32[i] == 0) continue;
                    float o32[MAX_R * MAX_P * PANEL] __attribute__((aligned(64)));
                    PTILES[1][R][1](xq, dx, xs32, Kp, q, s, o, sq, ss, o32);
                    for (int r = 0; r < R; ++r) {
                        float* at = out + r * MAX_P * PANEL + i * PANEL;
                        _mm512_storeu_ps(at, _mm512_mask_blend_ps((__mmask16)per32[i],
                                                                  _mm512_loadu_ps(at),
                                                                  _mm512_load_ps(o32 + r * MAX_P * PANEL)));
                    }
                }
            }
            store_rows(out, R, r0, p, cols, N, bias, y, f32);
        }
    }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* ---- AMX int8 tiles (Sapphire Rapids and later) -------------------------------------------
 * A decoded panel is already the B operand of tdpbsud (per 4 inputs, the 16 columns' 4
 * unsigned bytes: 64-byte tile rows), and 16 rows of int8 x at row stride Kp are its A operand
 * (signed). So one tdpbsud of 16 rows x W inputs (W = 16 or 32: one float32 step's group)
 * gives the 16 x 16 exact group sums that 4 W vpdpbusd give ptile; they are stored to L1
 * and taken through ptile's float32 steps, in ptile's order (the same two roundings per
 * group per output). The outputs are bit-identical to ptile's and qlinear_row1's, so a batch
 * may go to the tiles while one row goes to row1 and no sequence's logits change.
 * The float32 steps are now most of the work (4 vector instructions per row per group of 16
 * columns, against 1 tdpbsud per 16 rows), and the tiles alternate between two
 * accumulators so the steps of one group overlap the next group's tdpbsud. */
#define KVG_QAMX 1
#include "amx.h" /* the tile state (amx_ready: refused, the VNNI path runs and is reported) */
/* From how many rows a call takes the tiles (measured: see qlinear_range). */
#define AMX_MIN_ROWS 16

/* Palette 1: tiles 0-1 the group sums (16 rows x 16 int32), 2-3 and 4-5 x and the panel for
 * groups of 32 inputs (even and odd groups), 6-7 the same for groups of 16. */
static void amx_configure(void) {
    static const uint8_t rows[8] = {AMX_ROWS, AMX_ROWS, AMX_ROWS, 8, AMX_ROWS, 8, AMX_ROWS, 4};
    static const uint16_t colsb[8] = {64, 64, 32, 64, 32, 64, 16, 64};
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = rows[t];
        c.colsb[t] = colsb[t];
    }
    _tile_loadconfig(&c);
}

/* ptile's float32 steps for group g of 16 rows, their exact sums in sums [16][16]. */
#define AMX_STEPS(W, g, sums)                                                                \
    do {                                                                                      \
        const __m512 sc = _mm512_loadu_ps(ws + (W / 16) * (g) * PANEL);                       \
        const __m512 of = _mm512_loadu_ps(wo + (W / 16) * (g) * PANEL);                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_ROWS; ++r) {                        \
            const __m512 d = _mm512_set1_ps(dx[r * (Kp / 32) + (g) * W / 32]);                \
            const __m512 s = _mm512_set1_ps(xs[r * (Kp / W) + (g)]);                          \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((sums) + 16 * r)),  \
                                     _mm512_mul_ps(sc, d), acc[r]);                           \
            acc[r] = _mm512_fmadd_ps(of, s, acc[r]);                                          \
        }                                                                                     \
    } while (0)

/* 16 rows x one panel: out [16][MAX_P * 16] float32 sums, offsets included, as ptile_R_1_W
 * gives them. xq, dx, xs: the rows' (16 of them, padded with zero rows where fewer). */
#define DEFINE_AMX_TILE(W, A0, B0, A1, B1)                                                    \
static void amx_tile_##W(const int8_t* xq, const float* dx, const float* xs, int64_t Kp,      \
                         const uint32_t* qi, const float* ws, const float* wo, float* out) {  \
    int32_t sums[3][AMX_ROWS * 16] __attribute__((aligned(64)));                              \
    __m512 acc[AMX_ROWS];                                                                     \
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();                          \
    const int64_t G = Kp / W;                                                                 \
    for (int64_t g = 0; g < G + 2; ++g) {                                                     \
        if (g < G) {                                                                          \
            if (g & 1) {                                                                      \
                _tile_zero(1);                                                                \
                _tile_loadd(A1, xq + W * g, Kp);                                              \
                _tile_loadd(B1, qi + (W / 4) * g * PANEL, 64);                                \
                _tile_dpbsud(1, A1, B1);                                                      \
            } else {                                                                          \
                _tile_zero(0);                                                                \
                _tile_loadd(A0, xq + W * g, Kp);                                              \
                _tile_loadd(B0, qi + (W / 4) * g * PANEL, 64);                                \
                _tile_dpbsud(0, A0, B0);                                                      \
            }                                                                                 \
        }                                                                                     \
        if (g >= 1 && g <= G) { /* the previous group's sums, out while this one multiplies */ \
            if ((g - 1) & 1)                                                                  \
                _tile_stored(1, sums[(g - 1) % 3], 64);                                       \
            else                                                                              \
                _tile_stored(0, sums[(g - 1) % 3], 64);                                       \
        }                                                                                     \
        if (g >= 2) AMX_STEPS(W, g - 2, sums[(g - 2) % 3]); /* stored an iteration ago */      \
    }                                                                                         \
    for (int r = 0; r < AMX_ROWS; ++r) _mm512_store_ps(out + r * MAX_P * PANEL, acc[r]);      \
}

DEFINE_AMX_TILE(32, 2, 3, 4, 5)
DEFINE_AMX_TILE(16, 6, 7, 6, 7)

/* ---- The same products with the weights as the A operand ----------------------------------
 * Decoding a panel into the B layout above costs a 16 x 16 dword transpose per 64 inputs of
 * its 16 columns (decode_run), about 40% of a 32-row call (measured on the Xeon with AMX, Qwen
 * shapes from memory: Q4_K 442 GFLOP/s at 32 rows, 702 with the decoding skipped). A tile's A
 * operand is row-major, so a whole Q4_K or Q6_K run decodes straight into it (wr [16][Kp]
 * bytes, one column per row, inputs in order: no transposes), and x, transposed once per call,
 * is the B operand ([Kp / 4][16 rows][4] bytes). tdpbusd (A unsigned, B signed) then gives the
 * same exact group sums transposed (weight columns x rows), and the float32 steps run with
 * the rows in the lanes: the same two roundings per group per output, multiplications
 * commuted (sc d = d sc exactly), so the outputs stay bit-identical to ptile's and row1's. */

/* decode_run's bytes and scales, the bytes row-major: wr [16][Kp] (column c's input k at
 * wr[c Kp + k]). */
static void decode_run_rows(const uint8_t* base, int64_t rb, int type, int64_t K, int64_t Kp,
                            prefetcher* pf, uint8_t* wr, float* ws, float* wo) {
    const int bs = block_bytes(type);
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const uint8_t* blk = base + k0 / 256 * bs;
        run_scales(blk, rb, type, ws + k0 / 16 * PANEL, wo + k0 / 16 * PANEL);
        for (int h = 0; h < 2; ++h) {
            const int64_t k = k0 + 128 * h;
            for (int upper = 0; upper < 2; ++upper) {
                prefetch_step(pf);
                for (int c = 0; c < PANEL; ++c) {
                    const __m512i r = run_decode(blk + c * rb, type, h, upper);
                    uint8_t* at = wr + c * Kp;
                    if (type == T_Q4_K) { /* inputs 32 u .. + 31 and 64 + 32 u .. + 31 */
                        _mm256_storeu_si256((__m256i*)(at + k + 32 * upper), _mm512_castsi512_si256(r));
                        _mm256_storeu_si256((__m256i*)(at + k + 64 + 32 * upper),
                                            _mm512_extracti64x4_epi64(r, 1));
                    } else { /* Q6_K: inputs 64 u .. + 63 */
                        _mm512_storeu_si512(at + k + 64 * upper, r);
                    }
                }
            }
        }
    }
    for (int c = 0; c < PANEL; ++c) memset(wr + c * Kp + K, 0, (size_t)(Kp - K));
}

/* Rows [r0, r0 + R) (R <= 16; zeros past R) of the call's activations as the B operand and
 * the rows' scales with the rows in the lanes: xv [Kp / 4][16] dwords, dT [Kp / 32][16],
 * s16T [Kp / 16][16], s32T [Kp / 32][16] floats. */
typedef struct {
    uint32_t* xv;
    float *dT, *s16T, *s32T;
} rows_b;

static void rows_as_b(const qacts* a, int64_t r0, int R, const rows_b* o) {
    const int64_t Kp = a->Kp, D = Kp / 4;
    uint32_t src[16 * 16] __attribute__((aligned(64)));
    for (int64_t j = 0; j < D; j += 16) {
        for (int r = 0; r < 16; ++r) {
            if (r < R)
                memcpy(src + 16 * r, (const uint32_t*)(a->xq + (r0 + r) * Kp) + j, 64);
            else
                memset(src + 16 * r, 0, 64);
        }
        transpose16(src, 16, o->xv + j * PANEL, PANEL);
    }
    for (int64_t g = 0; g < Kp / 32; ++g)
        for (int r = 0; r < 16; ++r) {
            o->dT[g * 16 + r] = r < R ? a->dx[(r0 + r) * (Kp / 32) + g] : 0.0f;
            o->s32T[g * 16 + r] = r < R ? a->xs32[(r0 + r) * (Kp / 32) + g] : 0.0f;
        }
    for (int64_t g = 0; g < Kp / 16; ++g)
        for (int r = 0; r < 16; ++r)
            o->s16T[g * 16 + r] = r < R ? a->xs[(r0 + r) * (Kp / 16) + g] : 0.0f;
}

/* AMX_STEPS with the rows in the lanes: acc[c] lane r is output (r, c). */
#define AMX_STEPS_T(W, g, sums)                                                               \
    do {                                                                                      \
        const __m512 d = _mm512_load_ps(b->dT + (g) * W / 32 * 16);                           \
        const __m512 s = _mm512_load_ps(xsT + (g) * 16);                                      \
        const float* sc = ws + (W / 16) * (g) * PANEL;                                        \
        const float* of = wo + (W / 16) * (g) * PANEL;                                        \
        _Pragma("GCC unroll 16") for (int c = 0; c < PANEL; ++c) {                            \
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((sums) + 16 * c)),  \
                                     _mm512_mul_ps(_mm512_set1_ps(sc[c]), d), acc[c]);        \
            acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(of[c]), s, acc[c]);                       \
        }                                                                                     \
    } while (0)

/* One decoded run (wr, ws, wo) x 16 rows (b): out [16][MAX_P * 16] as amx_tile_W gives it.
 * Tiles as amx_configure: the A shapes (16 x W bytes) now hold the weights, the B shapes
 * (W / 4 x 64 bytes) the rows. */
#define DEFINE_AMX_ROWS(W, A0, B0, A1, B1)                                                    \
static void amx_rows_##W(const uint8_t* wr, const rows_b* b, int64_t Kp, const float* ws,     \
                         const float* wo, float* out) {                                       \
    int32_t sums[3][PANEL * 16] __attribute__((aligned(64)));                                 \
    float t[PANEL * 16] __attribute__((aligned(64)));                                         \
    const float* xsT = W == 32 ? b->s32T : b->s16T;                                           \
    __m512 acc[PANEL];                                                                        \
    for (int c = 0; c < PANEL; ++c) acc[c] = _mm512_setzero_ps();                             \
    const int64_t G = Kp / W;                                                                 \
    for (int64_t g = 0; g < G + 2; ++g) {                                                     \
        if (g < G) {                                                                          \
            if (g & 1) {                                                                      \
                _tile_zero(1);                                                                \
                _tile_loadd(A1, wr + W * g, Kp);                                              \
                _tile_loadd(B1, b->xv + (W / 4) * g * PANEL, 64);                             \
                _tile_dpbusd(1, A1, B1);                                                      \
            } else {                                                                          \
                _tile_zero(0);                                                                \
                _tile_loadd(A0, wr + W * g, Kp);                                              \
                _tile_loadd(B0, b->xv + (W / 4) * g * PANEL, 64);                             \
                _tile_dpbusd(0, A0, B0);                                                      \
            }                                                                                 \
        }                                                                                     \
        if (g >= 1 && g <= G) {                                                               \
            if ((g - 1) & 1)                                                                  \
                _tile_stored(1, sums[(g - 1) % 3], 64);                                       \
            else                                                                              \
                _tile_stored(0, sums[(g - 1) % 3], 64);                                       \
        }                                                                                     \
        if (g >= 2) AMX_STEPS_T(W, g - 2, sums[(g - 2) % 3]);                                 \
    }                                                                                         \
    for (int c = 0; c < PANEL; ++c) _mm512_store_ps(t + 16 * c, acc[c]);                      \
    transpose16((const uint32_t*)t, 16, (uint32_t*)out, MAX_P * PANEL);                       \
}

DEFINE_AMX_ROWS(32, 2, 3, 4, 5)
DEFINE_AMX_ROWS(16, 6, 7, 6, 7)

/* decode_panel into decode_run_rows's layout, for a panel that is one run of Q4_K, Q6_K or a
 * 32-input type decode_pairs has (Q8_0, Q4_0, Q4_1: their registers are already a column's
 * 64 inputs each, stored as they are): 1 if decoded, 0 if the panel is none of these (then
 * nothing is written). */
static int decode_panel_rows(const kvg_qweight* w, int64_t n0, int cols, int64_t N, int64_t K,
                             int64_t Kp, int next, uint8_t* wr, float* ws, float* wo,
                             int* type) {
    int64_t rb;
    const uint8_t* run = panel_run(w, n0, cols, type, &rb);
    const uint8_t* run32 = run ? NULL : panel_run32(w, n0, cols, type, &rb);
    if (!run && !(run32 && (*type == T_Q8_0 || *type == T_Q4_0 || *type == T_Q4_1))) return 0;
    prefetcher pf;
    prefetch_start(&pf, w, n0 + next * PANEL, N, K, Kp / 64);
    if (run) {
        decode_run_rows(run, rb, *type, K, Kp, &pf, wr, ws, wo);
        return 1;
    }
    const __m512i offs = row_offsets(rb);
    const int bs = block_bytes(*type);
    for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
        prefetch_step(&pf);
        __m512i r[16];
        decode_pairs_any(run32 + k0 / 32 * bs, rb, *type, K - k0 < 64, r);
        scales_pair32(run32, offs, *type, k0, K, ws + k0 / 16 * PANEL, wo + k0 / 16 * PANEL);
        for (int c = 0; c < PANEL; ++c) _mm512_storeu_si512(wr + c * Kp + k0, r[c]);
    }
    return 1;
}

/* The rows_b of every block of 16 rows of [m0, m1), in one allocation (NULL if it fails). */
static rows_b* rows_b_all(const qacts* a, int64_t m0, int64_t m1) {
    const int64_t Kp = a->Kp, nb = (m1 - m0 + AMX_ROWS - 1) / AMX_ROWS;
    const size_t each = (size_t)16 * (Kp + 4 * (Kp / 32 * 2 + Kp / 16));
    const size_t head = (sizeof(rows_b) * (size_t)nb + 63) / 64 * 64;
    uint8_t* mem = (uint8_t*)aligned_alloc(64, head + each * (size_t)nb);
    if (!mem) return NULL;
    rows_b* bs = (rows_b*)mem;
    uint8_t* at = mem + head;
    for (int64_t i = 0; i < nb; ++i, at += each) {
        bs[i].xv = (uint32_t*)at;
        bs[i].dT = (float*)(at + 16 * Kp);
        bs[i].s32T = bs[i].dT + 16 * (Kp / 32);
        bs[i].s16T = bs[i].s32T + 16 * (Kp / 32);
        const int64_t r0 = m0 + i * AMX_ROWS;
        rows_as_b(a, r0, m1 - r0 < AMX_ROWS ? (int)(m1 - r0) : AMX_ROWS, &bs[i]);
    }
    return bs;
}

/* qlinear_panels on tiles: rows [m0, m1) in blocks of 16 (the last block's rows copied,
 * zero-padded, once per call), each block through both panels of a decoded pair. */
static int qlinear_panels_amx(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                              int64_t m0, int64_t m1, int64_t p_lo, int64_t p_hi, int64_t N,
                              int64_t K, int f32) {
    const int64_t Kp = a->Kp, sq = Kp / 4 * PANEL, ss = panel_groups(Kp) * PANEL;
    panel_bufs b;
    if (panel_scratch(Kp, &b)) return -2;
    uint32_t* qi = b.qi;
    float *ws = b.ws, *wo = b.wo;
    /* the rows after the whole blocks of 16, padded: xq [16][Kp], dx, xs32 [16][Kp / 32],
     * xs [16][Kp / 16] */
    const int64_t tail = (m1 - m0) % AMX_ROWS, t0 = m1 - tail;
    int8_t* pad = NULL;
    if (tail) {
        pad = (int8_t*)calloc(1, (size_t)AMX_ROWS * (Kp + 4 * (Kp / 32 * 2 + Kp / 16)));
        if (!pad) return -2;
        memcpy(pad, a->xq + t0 * Kp, (size_t)(tail * Kp));
        float* f = (float*)(pad + AMX_ROWS * Kp);
        memcpy(f, a->dx + t0 * (Kp / 32), (size_t)(tail * (Kp / 32)) * 4);
        memcpy(f + AMX_ROWS * (Kp / 32), a->xs32 + t0 * (Kp / 32), (size_t)(tail * (Kp / 32)) * 4);
        memcpy(f + 2 * AMX_ROWS * (Kp / 32), a->xs + t0 * (Kp / 16), (size_t)(tail * (Kp / 16)) * 4);
    }
    float out[AMX_ROWS * MAX_P * PANEL] __attribute__((aligned(64)));
    float o32[AMX_ROWS * MAX_P * PANEL] __attribute__((aligned(64)));
    rows_b* rb = NULL; /* the rows as B operands, made at the first run decoded row-major */
    for (int64_t p = p_lo; p < p_hi; p += MAX_P) {
        const int P = p_hi - p < MAX_P ? (int)(p_hi - p) : MAX_P;
        unsigned per32[MAX_P];
        int rows_w[MAX_P]; /* 32 or 16: panel i decoded row-major (its W); 0: a VNNI panel */
        for (int i = 0; i < P; ++i) {
            const int64_t n0 = (p + i) * PANEL;
            const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            int type;
            rows_w[i] = 0;
            if (decode_panel_rows(w, n0, cols, N, K, Kp, MAX_P, (uint8_t*)(qi + i * sq),
                                  ws + i * ss, wo + i * ss, &type)) {
                rows_w[i] = per32_type(type) ? 32 : 16;
                if (!rb && !(rb = rows_b_all(a, m0, m1))) {
                    free(pad);
                    return -2;
                }
                continue;
            }
            if (decode_panel(w, n0, cols, N, K, Kp, MAX_P, qi + i * sq, ws + i * ss, wo + i * ss)) {
                free(pad);
                free(rb);
                return -1;
            }
            per32[i] = panel_per32(w, n0, cols);
        }
        const int64_t cols = (p + P) * PANEL < N ? P * PANEL : N - p * PANEL;
        for (int64_t r0 = m0; r0 < m1; r0 += AMX_ROWS) {
            const int R = m1 - r0 < AMX_ROWS ? (int)(m1 - r0) : AMX_ROWS;
            const int8_t* xq = a->xq + r0 * Kp;
            const float* dx = a->dx + r0 * (Kp / 32);
            const float* xs16 = a->xs + r0 * (Kp / 16);
            const float* xs32 = a->xs32 + r0 * (Kp / 32);
            if (R < AMX_ROWS) {
                const float* f = (const float*)(pad + AMX_ROWS * Kp);
                xq = pad;
                dx = f;
                xs32 = f + AMX_ROWS * (Kp / 32);
                xs16 = f + 2 * AMX_ROWS * (Kp / 32);
            }
            for (int i = 0; i < P; ++i) {
                const uint32_t* q = qi + i * sq;
                const float *s = ws + i * ss, *o = wo + i * ss;
                if (rows_w[i]) {
                    const rows_b* b = &rb[(r0 - m0) / AMX_ROWS];
                    if (rows_w[i] == 32)
                        amx_rows_32((const uint8_t*)q, b, Kp, s, o, out + i * PANEL);
                    else
                        amx_rows_16((const uint8_t*)q, b, Kp, s, o, out + i * PANEL);
                    continue;
                }
                if (per32[i] != ALL_LANES) amx_tile_16(xq, dx, xs16, Kp, q, s, o, out + i * PANEL);
                if (per32[i] == 0) continue;
                if (per32[i] == ALL_LANES) {
                    amx_tile_32(xq, dx, xs32, Kp, q, s, o, out + i * PANEL);
                    continue;
                }
                /* a panel of both kinds: per 16, then per 32 blended into its lanes */
                amx_tile_32(xq, dx, xs32, Kp, q, s, o, o32);
                for (int r = 0; r < R; ++r) {
                    float* at = out + r * MAX_P * PANEL + i * PANEL;
                    _mm512_store_ps(at, _mm512_mask_blend_ps((__mmask16)per32[i], _mm512_load_ps(at),
                                                             _mm512_load_ps(o32 + r * MAX_P * PANEL)));
                }
            }
            store_rows(out, R, r0, p, cols, N, bias, y, f32);
        }
    }
    free(pad);
    free(rb);
    return 0;
}

/* ---- Prompt tokens: the blocks widened to bf16 pairs, on tdpbf16ps ------------------------
 * The int8 tiles above spend most of their time in the float32 steps per group (their exact
 * group sums must be scaled one group at a time). Here each decoded panel is widened once per
 * row block to bf16 pairs (w = ws q + wo in float32, rounded once to bf16: tdpbf16ps's B
 * operand, [K / 2][16] dwords) and x, in bf16, multiplies it over the whole K in one
 * accumulator per tile: no per-group steps. 32 rows x 2 panels per pass (4 accumulators, A
 * and B each loaded once for two products). A row's sums do not depend on the rows beside it
 * (each tile row is its own dot products, K in one order; the last tiles hold exactly the
 * rows left), so a prompt token gets the same output in any batch. Widening costs as much
 * for one row as for 16, so this is for prompt tokens only: generated tokens stay on the
 * int8 paths (see QuantLinear). Xeon with AMX, Qwen 1.5B shapes, Q4_K, 2 threads: 560
 * GFLOP/s at 32 rows, 1241 at 128, 1415 at 512, against the int8 tiles' 510, 647 and 695 in
 * the same process; 8 rows 170 against 259, one row 22 against 91. Tiles as linear.c's:
 * amx_configure_2x2 (C 0-3, x 4-5, the two panels 6-7). */
/* A decoded panel (qi, ws, wo) widened: bq [Kp / 2][16] dwords, column c's dword holding the
 * bf16 weights of inputs 2 j and 2 j + 1. */
static void widen_panel(const uint32_t* qi, const float* ws, const float* wo, int64_t Kp,
                        uint32_t* bq) {
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i perm = _mm512_loadu_si512(pairs), byte = _mm512_set1_epi32(0xFF);
    for (int64_t r = 0; r < Kp / 4; ++r) { /* inputs 4 r .. 4 r + 3, group 4 r / 16 */
        const __m512i v = _mm512_loadu_si512(qi + r * PANEL);
        const __m512 s = _mm512_loadu_ps(ws + r / 4 * PANEL), o = _mm512_loadu_ps(wo + r / 4 * PANEL);
        __m512 f[4];
        for (int i = 0; i < 4; ++i) {
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), byte);
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, o);
        }
        _mm512_storeu_si512(bq + 2 * r * PANEL,
                           _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0])));
        _mm512_storeu_si512(bq + (2 * r + 1) * PANEL,
                           _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2])));
    }
}

/* Rows [m0, m1) of y for panels [p_lo, p_hi), x bf16 [M][K] (K a multiple of 32). */
static int qlinear_bf16_range(const kvg_qweight* w, const uint16_t* x, const float* bias, void* y,
                              int64_t M, int64_t N, int64_t K, int f32, int64_t p_lo, int64_t p_hi) {
    const int64_t Kp = (K + 63) / 64 * 64, sq = Kp / 4 * PANEL, ss = panel_groups(Kp) * PANEL;
    const int64_t sb = Kp / 2 * PANEL; /* dwords of one widened panel */
    uint8_t* buf = (uint8_t*)thread_scratch((size_t)(sq * 4 + 2 * ss * 4 + MAX_P * sb * 4));
    if (!buf) return -2;
    uint32_t* qi = (uint32_t*)buf;
    float* ws = (float*)(qi + sq);
    float* wo = ws + ss;
    uint32_t* bq = (uint32_t*)(wo + ss);
    float out[AMX_ROWS * MAX_P * PANEL] __attribute__((aligned(64)));
    /* rows in blocks of ~4 MiB of x, each block widening the panels again */
    int64_t mb = ((int64_t)4 << 20) / (2 * K);
    mb = mb < 2 * AMX_ROWS ? 2 * AMX_ROWS : mb / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    int cr0 = -1, cr1 = -1;
    for (int64_t b0 = 0; b0 < M; b0 += mb) {
        const int64_t b1 = b0 + mb < M ? b0 + mb : M;
        for (int64_t p = p_lo; p < p_hi; p += MAX_P) {
            const int P = p_hi - p < MAX_P ? (int)(p_hi - p) : MAX_P;
            for (int i = 0; i < MAX_P; ++i) {
                if (i >= P) { /* a lone last panel: the second one's products are zeros */
                    memset(bq + i * sb, 0, (size_t)sb * 4);
                    continue;
                }
                const int64_t n0 = (p + i) * PANEL;
                const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
                if (decode_panel(w, n0, cols, N, K, Kp, MAX_P, qi, ws, wo)) return -1;
                widen_panel(qi, ws, wo, Kp, bq + i * sb);
            }
            const int64_t cols = (p + P) * PANEL < N ? P * PANEL : N - p * PANEL;
            for (int64_t r0 = b0; r0 < b1; r0 += 2 * AMX_ROWS) {
                const int R0 = b1 - r0 < AMX_ROWS ? (int)(b1 - r0) : AMX_ROWS;
                const int64_t left = b1 - r0 - AMX_ROWS;
                const int R1 = left <= 0 ? 0 : (left < AMX_ROWS ? (int)left : AMX_ROWS);
                if (R0 != cr0 || R1 != cr1) {
                    amx_configure_2x2(R0, R1);
                    cr0 = R0;
                    cr1 = R1;
                }
                const uint16_t* xa = x + r0 * K;
                const uint16_t* xb = x + (r0 + AMX_ROWS) * K;
                _tile_zero(0);
                _tile_zero(1);
                if (R1) {
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t k = 0; k < K; k += 32) {
                        _tile_loadd(4, xa + k, 2 * K);
                        _tile_loadd(6, bq + k / 2 * PANEL, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_loadd(7, bq + sb + k / 2 * PANEL, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, xb + k, 2 * K);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                } else {
                    for (int64_t k = 0; k < K; k += 32) {
                        _tile_loadd(4, xa + k, 2 * K);
                        _tile_loadd(6, bq + k / 2 * PANEL, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_loadd(7, bq + sb + k / 2 * PANEL, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                _tile_stored(0, out, MAX_P * PANEL * 4);
                _tile_stored(1, out + PANEL, MAX_P * PANEL * 4);
                store_rows(out, R0, r0, p, cols, N, bias, y, f32);
                if (R1) {
                    _tile_stored(2, out, MAX_P * PANEL * 4);
                    _tile_stored(3, out + PANEL, MAX_P * PANEL * 4);
                    store_rows(out, R1, r0 + AMX_ROWS, p, cols, N, bias, y, f32);
                }
            }
        }
    }
    if (cr0 >= 0) _tile_release();
    return 0;
}

int kvg_qlinear_bf16_tiles(const void* x, const void* weight, const void* bias, void* y, int M,
                           int N, int K, int out_f32) {
    const kvg_qweight* w = (const kvg_qweight*)weight;
    if (!amx_ready || K % 32 || w->k != K) return -3;
    if (M <= 0) return 0;
    const int64_t panels = ((int64_t)N + PANEL - 1) / PANEL;
    int failed = 0;
    #pragma omp parallel
    {
        int nt = 1, tid = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        /* contiguous ranges of whole panel pairs per thread */
        const int64_t pairs = (panels + MAX_P - 1) / MAX_P;
        const int64_t q_lo = pairs * tid / nt, q_hi = pairs * (tid + 1) / nt;
        const int64_t p_lo = q_lo * MAX_P, p_hi = q_hi * MAX_P < panels ? q_hi * MAX_P : panels;
        if (p_lo < p_hi) {
            const int rc = qlinear_bf16_range(w, (const uint16_t*)x, (const float*)bias, y, M, N,
                                              K, out_f32, p_lo, p_hi);
            if (rc) {
                #pragma omp atomic write
                failed = rc;
            }
        }
    }
    return failed;
}
#endif

/* p[c]: column c's vpdpbusd of one 64-input chunk (lane 4 g + i: inputs 16 g + 4 i .. + 3)
 * -> out[g]: lane c = column c's exact sum over group g (inputs 16 g .. 16 g + 15). */
static inline void reduce_groups(const __m512i p[16], __m512i out[4]) {
    __m512i s1[8], s2[4];
    for (int c = 0; c < 16; c += 2) /* per 128-bit lane g: c (i0 + i2), c+1 (..), c (i1 + i3), c+1 */
        s1[c / 2] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[c], p[c + 1]),
                                     _mm512_unpackhi_epi32(p[c], p[c + 1]));
    for (int j = 0; j < 8; j += 2) /* lane g: columns 2j .. 2j + 3, whole groups */
        s2[j / 2] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[j], s1[j + 1]),
                                     _mm512_unpackhi_epi64(s1[j], s1[j + 1]));
    /* s2[q] lane g = columns 4q .. 4q + 3 of group g: a 4 x 4 transpose of 128-bit lanes */
    const __m512i t0 = _mm512_shuffle_i32x4(s2[0], s2[1], 0x44);
    const __m512i t1 = _mm512_shuffle_i32x4(s2[0], s2[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(s2[2], s2[3], 0x44);
    const __m512i t3 = _mm512_shuffle_i32x4(s2[2], s2[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    out[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    out[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

/* reduce_groups' first two steps for the products of 4 rows (u0..u3): lane 4g + j of the
 * result holds row j's sum over group g. */
static inline __m512i sum4(__m512i u0, __m512i u1, __m512i u2, __m512i u3) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(u0, u1), _mm512_unpackhi_epi32(u0, u1));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(u2, u3), _mm512_unpackhi_epi32(u2, u3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

/* reduce_groups' last step: s2[q] (sum4 of rows 4q..4q + 3) -> out[g] lane c = row c's sum. */
static inline void sum16(const __m512i s2[4], __m512i out[4]) {
    const __m512i t0 = _mm512_shuffle_i32x4(s2[0], s2[1], 0x44);
    const __m512i t1 = _mm512_shuffle_i32x4(s2[0], s2[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(s2[2], s2[3], 0x44);
    const __m512i t3 = _mm512_shuffle_i32x4(s2[2], s2[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    out[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    out[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

/* The exact group sums of inputs [128 h, 128 h + 128) of a block of 16 rows (row c at blk +
 * c rb) with the row of x (xl, xh: its inputs matching run_decode's two registers): lo[i],
 * hi[i] lane c = row c's sum over group i of the first / second register, as reduce_groups
 * gives them; each row's bytes are loaded once for both, and the products reduced as they
 * come so that few are live at once. */
static inline void run_sums(const uint8_t* blk, int64_t rb, int type, int h, __m512i xl,
                            __m512i xh, __m512i lo[4], __m512i hi[4]) {
    __m512i sl[4], sh[4];
    const uint8_t* p = blk;
    for (int q = 0; q < 4; ++q) {
        __m512i pl[4], ph[4];
        for (int j = 0; j < 4; ++j, p += rb) {
            pl[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), run_decode(p, type, h, 0), xl);
            ph[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), run_decode(p, type, h, 1), xh);
        }
        sl[q] = sum4(pl[0], pl[1], pl[2], pl[3]);
        sh[q] = sum4(ph[0], ph[1], ph[2], ph[3]);
    }
    sum16(sl, lo);
    sum16(sh, hi);
}

/* One whole panel of one Q4_K / Q6_K run (base: its first row, rb: row bytes) times one row:
 * out [16] float32 sums, offsets included (bias not). xo: the row's x in the run's order. */
static inline __attribute__((always_inline)) void row1_run_t(
    const uint8_t* base, int64_t rb, const int type, const int8_t* xo, const qacts* a, int64_t K,
    prefetcher* pf, float* out) {
    const int bs = block_bytes(type);
    float ws[16 * PANEL] __attribute__((aligned(64))), wo[16 * PANEL] __attribute__((aligned(64)));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const uint8_t* blk = base + k0 / 256 * bs;
        run_scales(blk, rb, type, ws, wo);
        for (int h = 0; h < 2; ++h) {
            prefetch_step(pf);
            prefetch_step(pf);
            __m512i lo[4], hi[4];
            run_sums(blk, rb, type, h, _mm512_loadu_si512(xo + k0 + 128 * h),
                     _mm512_loadu_si512(xo + k0 + 128 * h + 64), lo, hi);
            /* ptile's steps in its order: Q4_K's registers hold groups 0, 1, 4, 5 and 2, 3, 6,
             * 7 of these 8, one step per pair (per32); Q6_K's 0-3 and 4-7, one step each */
            if (type == T_Q4_K) {
                const __m512i blocks[4] = {_mm512_add_epi32(lo[0], lo[1]), _mm512_add_epi32(hi[0], hi[1]),
                                           _mm512_add_epi32(lo[2], lo[3]), _mm512_add_epi32(hi[2], hi[3])};
                for (int i = 0; i < 4; ++i) {
                    const int64_t b = k0 / 32 + 4 * h + i;
                    const __m512 d = _mm512_set1_ps(a->dx[b]), s = _mm512_set1_ps(a->xs32[b]);
                    const __m512 sc = _mm512_load_ps(ws + (8 * h + 2 * i) * PANEL);
                    const __m512 of = _mm512_load_ps(wo + (8 * h + 2 * i) * PANEL);
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blocks[i]), _mm512_mul_ps(sc, d), acc);
                    acc = _mm512_fmadd_ps(of, s, acc);
                }
            } else {
                const __m512i groups[8] = {lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]};
                for (int i = 0; i < 8; ++i) {
                    const int64_t g = k0 / 16 + 8 * h + i;
                    const __m512 d = _mm512_set1_ps(a->dx[g / 2]), s = _mm512_set1_ps(a->xs[g]);
                    const __m512 sc = _mm512_load_ps(ws + (8 * h + i) * PANEL);
                    const __m512 of = _mm512_load_ps(wo + (8 * h + i) * PANEL);
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(groups[i]), _mm512_mul_ps(sc, d), acc);
                    acc = _mm512_fmadd_ps(of, s, acc);
                }
            }
        }
    }
    _mm512_store_ps(out, acc);
}

__attribute__((noinline)) static void row1_run(const uint8_t* base, int64_t rb, int type,
                                               const int8_t* xo, const qacts* a, int64_t K,
                                               prefetcher* pf, float* out) {
    if (type == T_Q4_K)
        row1_run_t(base, rb, T_Q4_K, xo, a, K, pf, out);
    else
        row1_run_t(base, rb, T_Q6_K, xo, a, K, pf, out);
}

/* One row of x (M == 1, a batch-1 decode): the panels' arithmetic without interleaving the
 * bytes in memory. Each column's 64 decoded bytes meet the row's 64 int8 inputs in one
 * vpdpbusd, and reduce_groups turns 16 columns' lanes into the same exact group sums the
 * broadcast products give; the float32 steps per group are then ptile's, in ptile's order, so
 * the outputs are bit-identical to a row of any larger batch (tested). */
static int qlinear_row1(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                        int64_t p_lo, int64_t p_hi, int64_t N, int64_t K, int f32) {
    const int64_t Kp = a->Kp;
    float ws[16 * PANEL] __attribute__((aligned(64))), wo[16 * PANEL] __attribute__((aligned(64)));
    int8_t* xq4 = NULL; /* x in Q4_K's order, made on the first Q4_K run */
    for (int64_t p = p_lo; p < p_hi; ++p) {
        const int64_t n0 = p * PANEL;
        const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        panel_rows pr;
        if (panel_open(w, n0, cols, &pr)) return -1;
        prefetcher pf;
        if (p == p_lo) { /* the first panel: at once */
            prefetch_start(&pf, w, n0, N, K, 1);
            prefetch_step(&pf);
        }
        prefetch_start(&pf, w, n0 + PANEL, p + 1 < p_hi ? N : n0 + PANEL, K, Kp / 64);
        int type;
        int64_t rb;
        const uint8_t* run = panel_run(w, n0, cols, &type, &rb);
        if (run) {
            if (type == T_Q4_K && !xq4) {
                xq4 = (int8_t*)thread_scratch((size_t)Kp);
                if (!xq4) return -2;
                q4k_order(a->xq, K, xq4);
            }
            float out[PANEL] __attribute__((aligned(64)));
            row1_run(run, rb, type, type == T_Q4_K ? xq4 : a->xq, a, K, &pf, out);
            for (int c = 0; c < cols; ++c)
                store_one(y, n0 + c, out[c] + (bias ? bias[n0 + c] : 0.0f), f32);
            continue;
        }
        int type32;
        int64_t rb32;
        const uint8_t* run32 = panel_run32(w, n0, cols, &type32, &rb32); /* all lanes per32 */
        const int bs32 = run32 ? block_bytes(type32) : 0;
        const __m512i offs32 = row_offsets(run32 ? rb32 : 0);
        const unsigned lanes32 = panel_per32(w, n0, cols);
        /* per32: the panel's float steps per 32 inputs (all lanes), or both kinds (acc per 16
         * inputs, acc32 per 32, blended at the end) */
        const int per32 = lanes32 == ALL_LANES, both = lanes32 && !per32;
        __m512 acc = _mm512_setzero_ps(), acc32 = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
            prefetch_step(&pf);
            if (!run32 && k0 % 256 == 0) panel_scales(&pr, k0, K, ws, wo);
            const __m512i xv = _mm512_loadu_si512(a->xq + k0);
            __m512i prod[16], sums[4];
            __m512i q[16];
            if (!(run32 && decode_pairs_any(run32 + k0 / 32 * bs32, rb32, type32, K - k0 < 64, q)))
                for (int c = 0; c < PANEL; ++c) q[c] = decode64_zmm(pr.rows[c], pr.types[c], k0, K - k0 < 64);
            for (int c = 0; c < PANEL; ++c)
                prod[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], xv);
            if (run32) { /* the two blocks' scales, gathered once their rows' lines are in
                          * (zeros past K, as decoded) */
                const __m512 zero = _mm512_setzero_ps();
                for (int i = 0; i < 2; ++i) {
                    const int64_t g = k0 / 16 + 2 * i;
                    __m512 sc = zero, of = zero;
                    if (k0 + 32 * i < K) scales32(run32 + (k0 / 32 + i) * bs32, offs32, type32, &sc, &of);
                    _mm512_store_ps(ws + (g % 16) * PANEL, sc);
                    _mm512_store_ps(wo + (g % 16) * PANEL, of);
                }
            }
            reduce_groups(prod, sums);
            if (both) /* the per-32 steps beside the per-16 ones below */
                for (int i = 0; i < 2; ++i) {
                    const int64_t g = k0 / 16 + 2 * i;
                    const __m512 d = _mm512_set1_ps(a->dx[g / 2]), s = _mm512_set1_ps(a->xs32[g / 2]);
                    const __m512 sc = _mm512_load_ps(ws + (g % 16) * PANEL);
                    const __m512 of = _mm512_load_ps(wo + (g % 16) * PANEL);
                    const __m512i blk = _mm512_add_epi32(sums[2 * i], sums[2 * i + 1]);
                    acc32 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk), _mm512_mul_ps(sc, d), acc32);
                    acc32 = _mm512_fmadd_ps(of, s, acc32);
                }
            if (per32) { /* ptile's steps per 32 inputs: the exact block sum, ws of its first 16 */
                sums[0] = _mm512_add_epi32(sums[0], sums[1]);
                sums[1] = _mm512_add_epi32(sums[2], sums[3]);
            }
            for (int i = 0; i < (per32 ? 2 : 4); ++i) {
                const int64_t g = k0 / 16 + (per32 ? 2 * i : i);
                const __m512 d = _mm512_set1_ps(a->dx[g / 2]);
                const __m512 s = _mm512_set1_ps(per32 ? a->xs32[g / 2] : a->xs[g]);
                const __m512 sc = _mm512_load_ps(ws + (g % 16) * PANEL);
                const __m512 of = _mm512_load_ps(wo + (g % 16) * PANEL);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(sc, d), acc);
                acc = _mm512_fmadd_ps(of, s, acc);
            }
        }
        float out[PANEL] __attribute__((aligned(64)));
        _mm512_store_ps(out, both ? _mm512_mask_blend_ps((__mmask16)lanes32, acc, acc32) : acc);
        for (int c = 0; c < cols; ++c)
            store_one(y, n0 + c, out[c] + (bias ? bias[n0 + c] : 0.0f), f32);
    }
    return 0;
}

/* ---- Few rows on whole panels of one run: decoded in registers, never stored --------------
 * For 2 to 15 rows the panels above spend their time on the decoded panel, not on the
 * rows: decode_panel writes 16 x Kp bytes that ptile then reads back, and on the Xeon with AMX
 * (2 threads, Qwen 1.5B shapes from memory) 2 rows of Q4_K cost 2.0x one row, with
 * decode_panel 57% of the samples and ptile 13%. Here a whole panel of one Q4_K or Q6_K run
 * is decoded 64 or 128 inputs at a time into registers in the interleaved order (16 x 16
 * dword transposes in registers) and multiplied at once with up to FEW_R rows of x broadcast,
 * the exact group sums into ptile's float32 steps in ptile's order: the outputs are
 * bit-identical to ptile's, the AMX tiles' and row1's. Q4_K's 64-byte runs are transposed
 * packed (one transpose per 128 inputs instead of two): packed dword j of the run holds the
 * low nibbles of inputs 4j .. 4j + 3 (j < 8) or 64 + 4 (j - 8) .., and their high nibbles 32
 * inputs later, so the four 32-input blocks of the 128 come out of one transpose in order.
 * Same machine, bench/qlinears.py alternated with the stored panels, GFLOP/s at 2 / 4 / 8 / 15
 * rows: Q4_K 69 / 126 / 207 / 266 -> 88 / 168 / 294 / 343, Q6_K 50 / 99 / 164 / 234 -> 62 /
 * 114 / 203 / 230. Passes of 4 rows were as fast up to 4 and lost from 5 (a second decode);
 * passes of 8 decode twice from 9 rows and still match the stored panels there. Whole panels
 * of Q8_0, Q4_0 and Q4_1 runs (SmolLM2's Q4_1, --quantization int8's Q8_0) take the same path,
 * 64 inputs at a time (few_run32_t), avx512bf16 build: GFLOP/s at 2 / 8 rows, Q8_0 38 / 125
 * -> 50 / 171, Q4_1 54 / 159 -> 66 / 204, Q4_0 57 / 171 -> 71 / 219 (alternated, twice). */
#define FEW_R 8
/* Calls of fewer rows take qlinear_few; more take the panels (the AMX tiles from 16). */
#define FEW_BELOW 16

/* isum[r] += the products of 4 interleaved registers (inputs i0 .. i0 + 15 of the 16 columns)
 * with row r's x there, broadcast. */
static inline __attribute__((always_inline)) void few_group(const __m512i* q, const int8_t* xq,
                                                            int64_t Kp, int64_t i0, const int R,
                                                            __m512i* isum) {
    for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) {
            int32_t four;
            memcpy(&four, xq + r * Kp + i0 + 4 * j, 4);
            isum[r] = _mm512_dpbusd_epi32(isum[r], q[j], _mm512_set1_epi32(four));
        }
}

/* ptile's two float32 steps for W-group g (its index in the row) of every row. */
static inline __attribute__((always_inline)) void few_steps(const __m512i* isum, const float* dx,
                                                            const float* xs, int64_t Kp, const int W,
                                                            int64_t g, const float* sc_at,
                                                            const float* of_at, const int R,
                                                            __m512* acc) {
    const __m512 sc = _mm512_load_ps(sc_at), of = _mm512_load_ps(of_at);
    for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dx[r * (Kp / 32) + g * W / 32]);
        const __m512 s = _mm512_set1_ps(xs[r * (Kp / W) + g]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(sc, d), acc[r]);
        acc[r] = _mm512_fmadd_ps(of, s, acc[r]);
    }
}

/* R rows (xq [R][Kp] int8, dx, xs: theirs, xs per 32 inputs for Q4_K, per 16 for Q6_K) x one
 * whole panel of a Q4_K / Q6_K run (base: its first row, rb: row bytes): out [R][MAX_P * 16]
 * float32 sums, offsets included, as ptile_R_1_W gives them. */
static inline __attribute__((always_inline)) void few_run_t(
    const uint8_t* base, int64_t rb, const int type, const int R, const int8_t* xq,
    const float* dx, const float* xs, int64_t Kp, int64_t K, prefetcher* pf, float* out) {
    const int bs = block_bytes(type);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    float ws[16 * PANEL] __attribute__((aligned(64))), wo[16 * PANEL] __attribute__((aligned(64)));
    __m512 acc[FEW_R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const uint8_t* blk = base + k0 / 256 * bs;
        run_scales(blk, rb, type, ws, wo);
        for (int h = 0; h < 2; ++h) {
            const int64_t k = k0 + 128 * h;
            if (type == T_Q4_K) {
                prefetch_step(pf);
                prefetch_step(pf);
                __m512i t[16];
                for (int c = 0; c < PANEL; ++c)
                    t[c] = _mm512_loadu_si512(blk + c * rb + 16 + 64 * h);
                transpose16_in(t);
                /* the four blocks of 32: low nibbles of t[0..7], high ones, then of t[8..15] */
                for (int b = 0; b < 4; ++b) {
                    __m512i isum[FEW_R];
                    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
                    const __m512i* src = t + 8 * (b / 2);
                    const int64_t i0 = k + 32 * b;
                    for (int half = 0; half < 2; ++half) {
                        __m512i q[4];
                        for (int j = 0; j < 4; ++j)
                            q[j] = _mm512_and_si512(b & 1 ? _mm512_srli_epi16(src[4 * half + j], 4)
                                                          : src[4 * half + j], m4);
                        few_group(q, xq, Kp, i0 + 16 * half, R, isum);
                    }
                    const int lg = 8 * h + 2 * b; /* the block's first group in the 256 */
                    few_steps(isum, dx, xs, Kp, 32, i0 / 32, ws + lg * PANEL, wo + lg * PANEL, R,
                              acc);
                }
            } else {
                for (int upper = 0; upper < 2; ++upper) {
                    prefetch_step(pf);
                    __m512i t[16];
                    for (int c = 0; c < PANEL; ++c)
                        t[c] = run_decode(blk + c * rb, T_Q6_K, h, upper);
                    transpose16_in(t); /* t[j]: inputs k + 64 upper + 4 j .. + 3 */
                    for (int i = 0; i < 4; ++i) {
                        __m512i isum[FEW_R];
                        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
                        const int64_t i0 = k + 64 * upper + 16 * i;
                        few_group(t + 4 * i, xq, Kp, i0, R, isum);
                        const int lg = 8 * h + 4 * upper + i;
                        few_steps(isum, dx, xs, Kp, 16, i0 / 16, ws + lg * PANEL, wo + lg * PANEL,
                                  R, acc);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(out + r * MAX_P * PANEL, acc[r]);
}

/* few_run_t for a whole panel of a run of Q8_0, Q4_0 or Q4_1 (32-input blocks; their steps per
 * 32): 64 inputs at a time as decode_pairs gives them, transposed in registers, the two
 * blocks' scales gathered 16 rows at a time (scales32; zeros past K, as decode_panel's). */
static inline __attribute__((always_inline)) void few_run32_t(
    const uint8_t* base, int64_t rb, const int type, const int R, const int8_t* xq,
    const float* dx, const float* xs, int64_t Kp, int64_t K, prefetcher* pf, float* out) {
    const int bs = block_bytes(type);
    const __m512i offs = row_offsets(rb);
    __m512 acc[FEW_R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
        prefetch_step(pf);
        __m512i t[16];
        const uint8_t* blk = base + k0 / 32 * bs;
        if (K - k0 < 64)
            decode_pairs(blk, rb, type, 1, t);
        else
            decode_pairs(blk, rb, type, 0, t);
        transpose16_in(t); /* t[j]: inputs k0 + 4 j .. + 3 */
        for (int b = 0; b < 2; ++b) {
            __m512 sc = _mm512_setzero_ps(), of = _mm512_setzero_ps();
            if (k0 + 32 * b < K) scales32(blk + b * bs, offs, type, &sc, &of);
            float ws[PANEL] __attribute__((aligned(64))), wo[PANEL] __attribute__((aligned(64)));
            _mm512_store_ps(ws, sc);
            _mm512_store_ps(wo, of);
            __m512i isum[FEW_R];
            for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
            for (int half = 0; half < 2; ++half)
                few_group(t + 8 * b + 4 * half, xq, Kp, k0 + 32 * b + 16 * half, R, isum);
            few_steps(isum, dx, xs, Kp, 32, (k0 + 32 * b) / 32, ws, wo, R, acc);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_store_ps(out + r * MAX_P * PANEL, acc[r]);
}

/* The block kinds few_run takes, as FEW_RUNS' first index: -1 for any other type. */
static inline int few_kind(int type) {
    switch (type) {
        case T_Q4_K: return 0;
        case T_Q6_K: return 1;
        case T_Q8_0: return 2;
        case T_Q4_0: return 3;
        case T_Q4_1: return 4;
        default: return -1;
    }
}

#define FEW_RUN(TY, R)                                                                          \
    static void few_run_##TY##_##R(const uint8_t* base, int64_t rb, const int8_t* xq,          \
                                   const float* dx, const float* xs, int64_t Kp, int64_t K,     \
                                   prefetcher* pf, float* out) {                                \
        if (block_inputs(T_##TY) == 256)                                                        \
            few_run_t(base, rb, T_##TY, R, xq, dx, xs, Kp, K, pf, out);                         \
        else                                                                                    \
            few_run32_t(base, rb, T_##TY, R, xq, dx, xs, Kp, K, pf, out);                       \
    }
#define FEW_RUNS_OF(TY)                                                                         \
    FEW_RUN(TY, 1) FEW_RUN(TY, 2) FEW_RUN(TY, 3) FEW_RUN(TY, 4)                                 \
    FEW_RUN(TY, 5) FEW_RUN(TY, 6) FEW_RUN(TY, 7) FEW_RUN(TY, 8)
FEW_RUNS_OF(Q4_K) FEW_RUNS_OF(Q6_K) FEW_RUNS_OF(Q8_0) FEW_RUNS_OF(Q4_0) FEW_RUNS_OF(Q4_1)
#undef FEW_RUNS_OF
#undef FEW_RUN
typedef void (*few_run_fn)(const uint8_t*, int64_t, const int8_t*, const float*, const float*,
                           int64_t, int64_t, prefetcher*, float*);
#define FEW_ROW(TY)                                                                             \
    {0, few_run_##TY##_1, few_run_##TY##_2, few_run_##TY##_3, few_run_##TY##_4,                 \
     few_run_##TY##_5, few_run_##TY##_6, few_run_##TY##_7, few_run_##TY##_8}
static const few_run_fn FEW_RUNS[5][FEW_R + 1] = {
    FEW_ROW(Q4_K), FEW_ROW(Q6_K), FEW_ROW(Q8_0), FEW_ROW(Q4_0), FEW_ROW(Q4_1),
};
#undef FEW_ROW

/* A whole panel few_run takes: one run of a kind it has (its first row; its type and row
 * bytes), else NULL. */
static inline const uint8_t* few_panel(const kvg_qweight* w, int64_t n0, int64_t N, int* type,
                                       int64_t* rb) {
    const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    const uint8_t* run = panel_run(w, n0, cols, type, rb);
    if (!run) run = panel_run32(w, n0, cols, type, rb);
    return run && few_kind(*type) >= 0 ? run : NULL;
}

/* Rows [m0, m1) for this thread's panels [p_lo, p_hi): whole panels of one run of Q4_K, Q6_K,
 * Q8_0, Q4_0 or Q4_1 by few_run, FEW_R rows per pass (decoded again per pass), the others as
 * qlinear_panels. */
static int qlinear_few(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                       int64_t m0, int64_t m1, int64_t p_lo, int64_t p_hi, int64_t N, int64_t K,
                       int f32) {
    const int64_t Kp = a->Kp;
    float out[FEW_R * MAX_P * PANEL] __attribute__((aligned(64)));
    for (int64_t p = p_lo; p < p_hi; ++p) {
        const int64_t n0 = p * PANEL;
        const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        int type;
        int64_t rb;
        const uint8_t* run = few_panel(w, n0, N, &type, &rb);
        if (!run) { /* this and the following panels that are not such runs, as pairs */
            int64_t q = p + 1;
            int t;
            while (q < p_hi && !few_panel(w, q * PANEL, N, &t, &rb)) ++q;
            const int rc = qlinear_panels(w, a, bias, y, m0, m1, p, q, N, K, f32);
            if (rc) return rc;
            p = q - 1;
            continue;
        }
        const int per16 = type == T_Q6_K; /* its steps per 16 inputs, the others' per 32 */
        const float* xs = per16 ? a->xs : a->xs32;
        const int64_t xs_per = per16 ? Kp / 16 : Kp / 32;
        for (int64_t r0 = m0; r0 < m1; r0 += FEW_R) {
            const int R = m1 - r0 < FEW_R ? (int)(m1 - r0) : FEW_R;
            prefetcher pf;
            /* the next panel while this one is read, on the last pass over it */
            prefetch_start(&pf, w, n0 + PANEL, r0 + R >= m1 && p + 1 < p_hi ? N : n0 + PANEL, K,
                           Kp / 64);
            FEW_RUNS[few_kind(type)][R](run, rb, a->xq + r0 * Kp, a->dx + r0 * (Kp / 32),
                                        xs + r0 * xs_per, Kp, K, &pf, out);
            store_rows(out, R, r0, p, cols, N, bias, y, f32);
        }
    }
    return 0;
}

static int qlinear_range(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int f32, int tid, int nt) {
    /* Contiguous ranges of whole panels per thread; rows in blocks of up to 8 MiB of int8 x,
     * the panels decoded again per block. The two decoded panels a tile reads (16 x Kp bytes
     * each) stay in L2 while the rows' x streams past from L3: decoding a panel costs about
     * what 30 rows' products with it cost, so a block of every row of a step's chunk (512 x
     * 8960 bytes for Qwen2.5-1.5B's down projection) is the fastest. Zen 4, 512 rows: blocks
     * of 256 KiB of x (28 rows of the down projection) gave Q4_K 441-490 and Q6_K 306-377
     * GFLOP/s there, 8-16 MiB 589-607 and 458-482; the K = 1536 shapes ~5% more. */
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t p_lo = panels * tid / nt, p_hi = panels * (tid + 1) / nt;
    if (M == 1) return qlinear_row1(w, a, bias, y, p_lo, p_hi, N, K, f32);
    if (M < FEW_BELOW) return qlinear_few(w, a, bias, y, 0, M, p_lo, p_hi, N, K, f32);
    int64_t mb = ((int64_t)8 << 20) / a->Kp;
    mb = mb < AMX_ROWS ? AMX_ROWS : mb / AMX_ROWS * AMX_ROWS;
#ifdef KVG_QAMX
    const int tiles = amx_ready && M >= AMX_MIN_ROWS;
    if (tiles) amx_configure(); /* per thread: the configuration is thread state */
#endif
    int rc = 0;
    for (int64_t m0 = 0; m0 < M && !rc; m0 += mb) {
        const int64_t m1 = m0 + mb < M ? m0 + mb : M;
#ifdef KVG_QAMX
        if (tiles) {
            rc = qlinear_panels_amx(w, a, bias, y, m0, m1, p_lo, p_hi, N, K, f32);
            continue;
        }
#endif
        rc = qlinear_panels(w, a, bias, y, m0, m1, p_lo, p_hi, N, K, f32);
    }
#ifdef KVG_QAMX
    if (tiles) _tile_release();
#endif
    return rc;
}
#else
/* ---- AVX2: decoded columns, row dot products ---------------------------------------------
 * Blocks of C columns are decoded into a per-thread buffer (q [C][Kp], ws and wo
 * [C][Kp / 16]) and each row of x is multiplied by them, R rows at a time. Per 32 inputs:
 * vpmaddubsw of the unsigned bytes with x (exact: every type but Q8_0 decodes to q <= 63, so
 * a pair is at most 2 x 63 x 127 < 2^15), vpmaddwd with ones to 8 int32 lanes of 4 products,
 * to float32 times the lane's weight scale (groups of 16) and the row's (blocks of 32); one
 * dot product of the offsets over the groups at the end. Q8_0's bytes (q up to 255) are
 * shifted to signed first (q - 128: vpmaddubsw of |q - 128| with x signed by q - 128, at most
 * 2 x 128 x 127), its offsets carrying the + 128 (decode_columns' shift): a vpsignb per 32
 * inputs, row and column more, which the others skip (Zen 4 forced to AVX2, Qwen
 * shapes at 512 rows: Q4_K 104-130 -> 151-160 GFLOP/s, Q6_K 89-127 -> 139-162). */
/* The decoded columns of one block: q [C][Kp], ws and wo [C][Kp / 16]; zeros past K. With
 * shift (the AVX2 products use q - 128), wo holds wo + 128 ws: the same sum. */
static int decode_columns(const kvg_qweight* w, int64_t n0, int C, int64_t K, int64_t Kp,
                          uint8_t* q, float* ws, float* wo, int shift) {
    for (int c = 0; c < C; ++c) {
        int type;
        const uint8_t* row = weight_row(w, n0 + c, &type);
        if (!row) return -1;
        uint8_t* qc = q + c * Kp;
        float* sc = ws + c * (Kp / 16);
        float* oc = wo + c * (Kp / 16);
        decode_row(row, type, K, qc, sc, oc);
        memset(qc + K, shift ? 128 : 0, (size_t)(Kp - K));
        for (int64_t g = K / 16; g < Kp / 16; ++g) sc[g] = oc[g] = 0.0f;
        if (shift)
            for (int64_t g = 0; g < K / 16; ++g) oc[g] += 128.0f * sc[g];
    }
    return 0;
}

#define MAX_R 4
#define MAX_C 2
/* S: the columns' bytes are shifted (Q8_0), else taken as they are. */
#define DEFINE_QTILE(R, C, S)                                                                  \
static void qtile_##R##_##C##_##S(const int8_t* xq, const float* dx, int64_t Kp,             \
                                  const uint8_t* q, const float* ws, float* out) {            \
    const __m256i wi = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                             \
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);           \
    __m256 acc[R][C];                                                                         \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();  \
    for (int64_t k = 0; k < Kp; k += 32) {                                                    \
        __m256i wabs[C], wsg[C];                                                              \
        __m256 sv[C];                                                                         \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {                                 \
            const __m256i qv = _mm256_loadu_si256((const __m256i*)(q + c * Kp + k));         \
            wsg[c] = S ? _mm256_xor_si256(qv, flip) : qv;                                     \
            wabs[c] = S ? _mm256_abs_epi8(wsg[c]) : qv;                                       \
            sv[c] = _mm256_permutevar8x32_ps(                                                 \
                _mm256_castps128_ps256(_mm_castpd_ps(                                         \
                    _mm_load_sd((const double*)(ws + c * (Kp / 16) + k / 16)))),              \
                wi);                                                                          \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                                 \
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + r * Kp + k));         \
            const __m256 xs = _mm256_broadcast_ss(dx + r * (Kp / 32) + k / 32);               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) {                             \
                const __m256i p16 =                                                           \
                    _mm256_maddubs_epi16(wabs[c], S ? _mm256_sign_epi8(xv, wsg[c]) : xv);     \
                const __m256i p = _mm256_madd_epi16(p16, ones);                               \
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv[c], xs),  \
                                            acc[r][c]);                                       \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c)                                   \
            out[r * MAX_C + c] = hsum8(acc[r][c]);                                            \
}

typedef void (*qtile_fn)(const int8_t*, const float*, int64_t, const uint8_t*, const float*,
                         float*);
DEFINE_QTILE(1, 1, 0) DEFINE_QTILE(2, 1, 0) DEFINE_QTILE(3, 1, 0) DEFINE_QTILE(4, 1, 0)
DEFINE_QTILE(1, 2, 0) DEFINE_QTILE(2, 2, 0) DEFINE_QTILE(3, 2, 0) DEFINE_QTILE(4, 2, 0)
DEFINE_QTILE(1, 1, 1) DEFINE_QTILE(2, 1, 1) DEFINE_QTILE(3, 1, 1) DEFINE_QTILE(4, 1, 1)
DEFINE_QTILE(1, 2, 1) DEFINE_QTILE(2, 2, 1) DEFINE_QTILE(3, 2, 1) DEFINE_QTILE(4, 2, 1)
static const qtile_fn QTILES[2][MAX_R + 1][MAX_C + 1] = {
    {
        {0},
        {0, qtile_1_1_0, qtile_1_2_0},
        {0, qtile_2_1_0, qtile_2_2_0},
        {0, qtile_3_1_0, qtile_3_2_0},
        {0, qtile_4_1_0, qtile_4_2_0},
    },
    {
        {0},
        {0, qtile_1_1_1, qtile_1_2_1},
        {0, qtile_2_1_1, qtile_2_2_1},
        {0, qtile_3_1_1, qtile_3_2_1},
        {0, qtile_4_1_1, qtile_4_2_1},
    },
};

/* 1 where a column of [n0, n0 + C) is Q8_0 (decoded bytes up to 255: shifted). */
static int columns_shifted(const kvg_qweight* w, int64_t n0, int C) {
    for (int c = 0; c < C; ++c) {
        int type;
        if (weight_row(w, n0 + c, &type) && type == T_Q8_0) return 1;
    }
    return 0;
}

/* ---- AVX2, K-quant columns: integer sums per 256 inputs ---------------------------------
 * Per 32 inputs the columns above take three float32 steps (to float, times the column's and
 * the row's scale, add), and a decode step's few rows spend more time there than on the
 * weights: on Zen 2, ~5 of ~12 instructions per 32 inputs of one row. Q4_K, Q5_K and Q6_K
 * have integer sub-block scales under one float scale per 256 inputs, so for their columns
 * x is quantized in two levels per 256 inputs (quantize_x256, below) and the sub-block scales
 * go into the integer sums (vpmaddwd with the scales instead of ones). Each output then
 * takes its float32 steps on exact integer totals (kq_sums), per 256 inputs b:
 *   Q4_K, Q5_K: T = sum_j sc_j s_j dot_j(q, xk), G = sum_j mn_j s_j sum_j(xk)
 *               acc = fma(float(T), d dk, acc); acc = fma(float(G), -(dmin dk), acc)
 *   Q6_K:       U_h = sum over the groups g of half h (128 inputs) of sc_g s_g dot_g(q - 32, xk)
 *               acc = fma(float(U_0), d dk, acc); acc = fma(float(U_1), d dk, acc)
 * Every total fits int32 (Q5_K's T: 256 x 31 x 127 x 63 x 32 = 2.04e9; Q6_K's U_h: 128 x 32
 * x 127 x 128 x 32 = 2.13e9, hence halves), so they are exact however a path groups its
 * partial sums (int32 additions wrap: partial sums may pass 2^31, totals may not). The few
 * rows (columns decoded in registers, lanes per column folded at the end) and the blocks of 8
 * interleaved columns (kq8, int16 sums per sub-block) group them differently and agree bit
 * for bit: the outputs stay batch-invariant. */
#define KVG_Q8K 1

static inline int is_kq(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Activations per 256 for the K-quant columns, in two levels: one float step D per 256
 * inputs and an integer multiplier s_b in [1, KQ_S] per 32, so that input i of block b is
 * xk_i D s_b (xk_i int8). The multipliers go into the integer sums with the weights' sub-block
 * scales (one vpmullw per row, column and 256 inputs), so the float32 steps stay one per 256;
 * a plain step per 256 (llama.cpp's Q8_K) lets one outlier coarsen 256 inputs: on the Qwen
 * file it cost +4.0% perplexity on the Chinese text (AVX2, Zen 2) against +0.5% for steps per
 * 32, as every other path takes. D = max |x| / (127 KQ_S) over the 256; s_b = ceil(KQ_S
 * amax_b / amax) (1 for an all-zero block), so a block's step is at most its own
 * amax_b / 127 x (1 + 1 / s_b), or D where amax_b < amax / KQ_S. KQ_S = 32 keeps every lane
 * inside int32: a chunk's lane is at most 2 x 16002 x |sc s| <= 2 x 16002 x 128 x 32, eight
 * chunks 1.05e9, Q6_K's offsets 32 x 2 x 2032 x 4096 = 0.53e9 more.
 * Row m (K values, K % 256 == 0) -> xk [K] int8 (round to nearest even of x / (D s_b)),
 * dk [K / 256] = D (NaN where the block holds one), sk [K / 256][32] int16: each block's
 * s_0..s_7 twice (the two 128-bit lanes), then s_0 s_0 s_1 s_1 .. s_7 s_7 (per group of 16),
 * bk [K / 16] the int16 sums of xk per group of 16. */
#define KQ_S 32
static void quantize_x256(const void* x, int io_bf16, int64_t m, int64_t K, int8_t* xk,
                          float* dk, int16_t* sk, int16_t* bk) {
    const uint16_t* xb = (const uint16_t*)x + m * K;
    const float* xf = (const float*)x + m * K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 256; ++b) {
        const int64_t k0 = 256 * b;
        float am[8];
        __m256 unord = _mm256_setzero_ps();
        for (int i = 0; i < 8; ++i) {
            __m256 mx = _mm256_setzero_ps();
            for (int j = 0; j < 4; ++j) {
                const int64_t k = k0 + 32 * i + 8 * j;
                const __m256 v = io_bf16 ? bf16x8_load(xb + k) : _mm256_loadu_ps(xf + k);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
                unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            am[i] = _mm_cvtss_f32(h);
        }
        float amax = 0.0f;
        for (int i = 0; i < 8; ++i) amax = am[i] > amax ? am[i] : amax;
        dk[b] = _mm256_movemask_ps(unord) ? __builtin_nanf("") : amax / (127.0f * KQ_S);
        int16_t* sb = sk + 32 * b;
        for (int i = 0; i < 8; ++i) {
            const int64_t k = k0 + 32 * i;
            const float t = amax > 0 ? ceilf(am[i] * KQ_S / amax) : 1.0f;
            const int sv = t >= 1.0f && t <= KQ_S ? (int)t : t > KQ_S ? KQ_S : 1; /* NaN: 1 */
            const __m256 inv =
                _mm256_set1_ps(amax > 0 ? (127.0f * KQ_S) / (amax * (float)sv) : 0.0f);
            __m256i qi[4];
            for (int j = 0; j < 4; ++j) {
                const __m256 v = io_bf16 ? bf16x8_load(xb + k + 8 * j) : _mm256_loadu_ps(xf + k + 8 * j);
                qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
            }
            const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                                  _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i*)(xk + k), _mm256_permutevar8x32_epi32(
                                                        p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            for (int g = 0; g < 2; ++g) {
                int sum = 0;
                for (int l = 0; l < 16; ++l) sum += xk[k + 16 * g + l];
                bk[k / 16 + g] = (int16_t)sum;
            }
            sb[i] = sb[8 + i] = sb[16 + 2 * i] = sb[17 + 2 * i] = (int16_t)sv;
        }
    }
}

/* A K-quant column's scales for inputs [k0, k0 + 256): its integer multipliers as int16 in
 * registers, each 128-bit lane holding 8 (w[0]: Q4_K/Q5_K sc_0..7, Q6_K sc_0..7; w[1]: Q6_K
 * sc_8..15), times a row's s_b once per 256 (kq_row), then picked per 32 inputs by one
 * vpshufb (kq_mult); the multipliers of the group sums
 * (m: Q4_K/Q5_K mn_j for groups 2j and 2j + 1, Q6_K sc per group); the float scales d, dmin.
 * (Eight broadcast vectors per column and 256 inputs, stored and reloaded, took a quarter of
 * the few-row kernel's time on Zen 2.) */
typedef struct {
    __m256i w[2];
    __m256i m;
    float d, dmin;
} kq_scales;

static inline __attribute__((always_inline)) void kq_scales256(const uint8_t* row, int type,
                                                                int64_t k0, kq_scales* o) {
    const uint8_t* blk = row + k0 / 256 * block_bytes(type);
    if (type == T_Q6_K) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i*)(blk + 192));
        o->m = _mm256_cvtepi8_epi16(sc8);
        o->w[0] = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(o->m));
        o->w[1] = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(o->m, 1));
        o->d = f16_at(blk + 208);
        o->dmin = 0.0f;
    } else {
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        uint64_t sc8, mn8;
        memcpy(&sc8, sc, 8);
        memcpy(&mn8, mn, 8);
        const __m128i pairs = _mm_shuffle_epi8(_mm_cvtsi64_si128((int64_t)mn8),
                                               _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        o->m = _mm256_cvtepu8_epi16(pairs);
        o->w[0] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)sc8)));
        o->w[1] = o->w[0];
        o->d = f16_at(blk);
        o->dmin = f16_at(blk + 2);
    }
}

/* vpshufb indices of kq_mult: [0][j] word j in both lanes (Q4_K/Q5_K sub-block j of 32);
 * [1][j] word 2 (j % 4) in the low lane, 2 (j % 4) + 1 in the high one (Q6_K groups 2j and
 * 2j + 1, from w[j / 4]). */
#define W2(i) (char)(2 * (i)), (char)(2 * (i) + 1)
#define W8(i) W2(i), W2(i), W2(i), W2(i), W2(i), W2(i), W2(i), W2(i)
static const char KQ_PICK[2][8][32] __attribute__((aligned(32))) = {
    {{W8(0), W8(0)}, {W8(1), W8(1)}, {W8(2), W8(2)}, {W8(3), W8(3)},
     {W8(4), W8(4)}, {W8(5), W8(5)}, {W8(6), W8(6)}, {W8(7), W8(7)}},
    {{W8(0), W8(1)}, {W8(2), W8(3)}, {W8(4), W8(5)}, {W8(6), W8(7)},
     {W8(0), W8(1)}, {W8(2), W8(3)}, {W8(4), W8(5)}, {W8(6), W8(7)}},
};
#undef W8
#undef W2

/* 32 inputs: iv += sum over 2 x 2 lanes of s (q . x), q the unsigned weight bytes. */
static inline __m256i kq_step(__m256i iv, __m256i q, __m256i x, __m256i s) {
    return _mm256_add_epi32(iv, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), s));
}

/* A row's and a column's integer multipliers for one block of 256: p[0], p[1] the column's
 * sub-block scales times the row's s_b (picked per 32 by kq_mult), m the group sums' (the
 * column's mins or scales times s_b). sk: the row's 32 multipliers of the block. */
typedef struct {
    __m256i p[2];
    __m256i m;
} kq_mults;

static inline __attribute__((always_inline)) void kq_row(const kq_scales* o, int type,
                                                          const int16_t* sk, kq_mults* out) {
    const __m256i s8 = _mm256_loadu_si256((const __m256i*)sk);
    const __m256i s16 = _mm256_loadu_si256((const __m256i*)(sk + 16));
    out->m = _mm256_mullo_epi16(o->m, s16);
    if (type == T_Q6_K) {
        out->p[0] = _mm256_mullo_epi16(o->w[0], _mm256_permute2x128_si256(s16, s16, 0x00));
        out->p[1] = _mm256_mullo_epi16(o->w[1], _mm256_permute2x128_si256(s16, s16, 0x11));
    } else {
        out->p[0] = out->p[1] = _mm256_mullo_epi16(o->w[0], s8);
    }
}

/* The 16 int16 multipliers of inputs [32 j, 32 j + 32) of the block. */
static inline __m256i kq_mult(const kq_mults* o, int type, int j) {
    const int six = type == T_Q6_K;
    return _mm256_shuffle_epi8(o->p[six ? j / 4 : 0],
                               _mm256_load_si256((const __m256i*)KQ_PICK[six][j]));
}

/* kq_sums: the exact sums of 8 int32 lanes, in two steps: fold8 to 4 lanes, then hsum4x4 for
 * 4 vectors at once, [sum a, sum b, sum c, sum d]. Additions wrap (mod 2^32): a total is
 * exact wherever it fits int32, whatever its partial sums do. */
static inline __m128i fold8(__m256i v) {
    return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

static inline __m128i hsum4x4(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

/* C (<= 4, a constant where inlined) columns' folded lanes -> their 4 totals (0 past C). */
static inline __m128i sums4(const __m128i* v, const int C) {
    const __m128i z = _mm_setzero_si128();
    return hsum4x4(v[0], C > 1 ? v[1] : z, C > 2 ? v[2] : z, C > 3 ? v[3] : z);
}

/* ---- AVX2, few rows: columns decoded in registers straight into the dot products ---------
 * For a decode step's few rows the block below spends its time decoding: each column's whole
 * row goes to a buffer (bytes, then float scales per 16) and is read back once per 4 rows
 * (Zen 4 forced to AVX2, Qwen 1.5B: one stream 96-109 ms a token against llama-server's 35).
 * Here FEW_C columns at a time are decoded 64 inputs at a time into registers
 * (decode64_regs), their scales once per 256 inputs, and up to 2 rows take them; further rows
 * decode the columns again from L1. An output's float32 steps form one dependency chain
 * (their order is fixed for bit-identity), so one row needs several columns in flight to hide
 * the FMA latency: FEW_C x R chains. The integer sums, the float32 steps and their order are
 * qtile's, and a column is shifted exactly when qtile's pair of columns is (columns_shifted
 * of n & ~1): bit-identical to the block path, so a row's outputs do not depend on M. */
#define FEW_ROWS 8
#define FEW_C 4
#define FEW_R 2
#define FEW_AHEAD 8 /* rows: the prefetch distance, ~7 KiB of Q4_K at K = 1536 */

/* The kernel of C columns of type `type` (every one; -1: each its own, types[]) and R rows;
 * R, C, S and type are constants where it is inlined, so the decoding's switch folds away. */
static inline __attribute__((always_inline)) void few_body(
    const int R, const int C, const int S, const int type, const uint8_t* const* rows,
    const int* types, int64_t K, int64_t Kp, const int8_t* xq, const float* dx, float* wo,
    float* out) {
    const __m256i wi = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[FEW_R][FEW_C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    float ws[FEW_C][16], go[16];
    int64_t pf_ahead[FEW_C], pf_per64[FEW_C];
    for (int c = 0; c < C; ++c) {
        const int t = type >= 0 ? type : types[c];
        const int64_t rb = K / block_inputs(t) * block_bytes(t);
        pf_ahead[c] = FEW_AHEAD * rb;
        pf_per64[c] = rb * 64 / K;
    }
    for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
        if (k0 % 256 == 0) {
            const int64_t g0 = k0 / 16, groups = (K - k0 < 256 ? K - k0 : 256) / 16;
            for (int c = 0; c < C; ++c) {
                decode_scales256(rows[c], type >= 0 ? type : types[c], k0, K, ws[c], go);
                if (wo)
                    for (int64_t g = 0; g < groups; ++g)
                        wo[c * (Kp / 16) + g0 + g] = S ? go[g] + 128.0f * ws[c][g] : go[g];
            }
        }
        for (int c = 0; c < C; ++c) {
            __m256i h[2];
            const uint8_t* pf = rows[c] + pf_ahead[c] + k0 * pf_per64[c] / 64;
            _mm_prefetch((const char*)pf, _MM_HINT_T0);
            _mm_prefetch((const char*)pf + 63, _MM_HINT_T0);
            decode64_regs(rows[c], type >= 0 ? type : types[c], k0, K - k0 < 64, &h[0], &h[1]);
            if (S && K - k0 < 64) h[1] = flip; /* past K: the block path's q = 128 */
            for (int i = 0; i < 2; ++i) {
                const int64_t k = k0 + 32 * i;
                const __m256i wsg = S ? _mm256_xor_si256(h[i], flip) : h[i];
                const __m256i wabs = S ? _mm256_abs_epi8(wsg) : h[i];
                const __m256 sv = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(
                        _mm_castpd_ps(_mm_load_sd((const double*)(ws[c] + (k % 256) / 16)))),
                    wi);
                for (int r = 0; r < R; ++r) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + r * Kp + k));
                    const __m256 xs = _mm256_broadcast_ss(dx + r * (Kp / 32) + k / 32);
                    const __m256i p16 =
                        _mm256_maddubs_epi16(wabs, S ? _mm256_sign_epi8(xv, wsg) : xv);
                    const __m256i p = _mm256_madd_epi16(p16, ones);
                    acc[r][c] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, xs), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * FEW_C + c] = hsum8(acc[r][c]);
}

typedef void (*few_fn)(const uint8_t* const*, const int*, int64_t, int64_t, const int8_t*,
                       const float*, float*, float*);
/* TY: the type's name (T_##TY), or ANY for a column-by-column type */
#define T_ANY (-1)
#define DEFINE_FEW(TY, R, C, S)                                                                \
static void few_##TY##_##R##_##C##_##S(const uint8_t* const* rows, const int* types, int64_t K,  \
                                       int64_t Kp, const int8_t* xq, const float* dx,         \
                                       float* wo, float* out) {                               \
    few_body(R, C, S, T_##TY, rows, types, K, Kp, xq, dx, wo, out);                           \
}
#define DEFINE_FEW_RC(TY, S)                                                                   \
    DEFINE_FEW(TY, 1, 1, S) DEFINE_FEW(TY, 1, 2, S) DEFINE_FEW(TY, 1, 3, S)                   \
    DEFINE_FEW(TY, 1, 4, S) DEFINE_FEW(TY, 2, 1, S) DEFINE_FEW(TY, 2, 2, S)                   \
    DEFINE_FEW(TY, 2, 3, S) DEFINE_FEW(TY, 2, 4, S)                                           \
    static const few_fn FEW_##TY##_##S[FEW_R + 1][FEW_C + 1] = {                              \
        {0},                                                                                  \
        {0, few_##TY##_1_1_##S, few_##TY##_1_2_##S, few_##TY##_1_3_##S, few_##TY##_1_4_##S},  \
        {0, few_##TY##_2_1_##S, few_##TY##_2_2_##S, few_##TY##_2_3_##S, few_##TY##_2_4_##S},  \
    };
/* the types of the shipped files get their own code; the rest, and a column shifted for its
 * Q8_0 neighbour, the column-by-column one */
DEFINE_FEW_RC(Q4_K, 0) DEFINE_FEW_RC(Q6_K, 0) DEFINE_FEW_RC(Q8_0, 1) DEFINE_FEW_RC(Q4_0, 0)
DEFINE_FEW_RC(Q4_1, 0) DEFINE_FEW_RC(Q5_0, 0) DEFINE_FEW_RC(ANY, 0) DEFINE_FEW_RC(ANY, 1)

/* The kernels for C columns of one type (or -1) and a shift. */
static const few_fn (*few_table(int type, int shift))[FEW_C + 1] {
    switch (shift ? (type == T_Q8_0 ? T_Q8_0 : T_ANY) : type) {
        case T_Q4_K: return FEW_Q4_K_0;
        case T_Q6_K: return FEW_Q6_K_0;
        case T_Q8_0: return shift ? FEW_Q8_0_1 : FEW_ANY_0;
        case T_Q4_0: return FEW_Q4_0_0;
        case T_Q4_1: return FEW_Q4_1_0;
        case T_Q5_0: return FEW_Q5_0_0;
        default: return shift ? FEW_ANY_1 : FEW_ANY_0;
    }
}

/* K-quant columns for few rows: C columns of one K type decoded 64 inputs at a time in
 * registers (as few_body), their integer sums per 256 inputs folded to each column's exact
 * totals (kq_sums: T and G, or U_0 and U_1) and the float32 steps taken for 4 columns at once
 * in the lanes of one vector, in the order kq8 takes them (bit-identical). */
static inline __attribute__((always_inline)) void few_kq_body(
    const int R, const int C, const int type, const uint8_t* const* rows, int64_t K,
    const qacts* a, int64_t r0, float* out) {
    __m128 acc[FEW_R];
    for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
    const __m128 sign = _mm_set1_ps(-0.0f);
    const int bb = block_bytes(type);
    const int64_t ahead = FEW_AHEAD * (K / 256 * bb); /* FEW_AHEAD rows on */
    kq_scales sc[FEW_C];
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        float dv[FEW_C] = {0}, mv[FEW_C] = {0};
        for (int c = 0; c < C; ++c) {
            kq_scales256(rows[c], type, k0, &sc[c]);
            dv[c] = sc[c].d;
            mv[c] = sc[c].dmin;
        }
        __m256i iv[FEW_R][FEW_C];
        kq_mults mu[FEW_R][FEW_C];
        __m128 dd[FEW_R];
        for (int r = 0; r < R; ++r) {
            dd[r] = _mm_mul_ps(_mm_loadu_ps(dv),
                               _mm_set1_ps(a->dk[(r0 + r) * (K / 256) + k0 / 256]));
            for (int c = 0; c < C; ++c) {
                iv[r][c] = _mm256_setzero_si256();
                kq_row(&sc[c], type, a->sk + ((r0 + r) * (K / 256) + k0 / 256) * 32, &mu[r][c]);
            }
        }
        /* unrolled: Q6_K's decoding and kq_mult branch on h */
#pragma GCC unroll 4
        for (int h = 0; h < 4; ++h) {
            const int64_t k = k0 + 64 * h;
            for (int c = 0; c < C; ++c) {
                const uint8_t* pf = rows[c] + ahead + k0 / 256 * bb + h * bb / 4;
                _mm_prefetch((const char*)pf, _MM_HINT_T0);
                _mm_prefetch((const char*)pf + 63, _MM_HINT_T0);
                __m256i w0, w1;
                decode64_regs(rows[c], type, k, 0, &w0, &w1);
                for (int r = 0; r < R; ++r) {
                    const int8_t* xr = a->xk + (r0 + r) * K + k;
                    iv[r][c] = kq_step(iv[r][c], w0, _mm256_loadu_si256((const __m256i*)xr),
                                       kq_mult(&mu[r][c], type, 2 * h));
                    iv[r][c] = kq_step(iv[r][c], w1, _mm256_loadu_si256((const __m256i*)(xr + 32)),
                                       kq_mult(&mu[r][c], type, 2 * h + 1));
                }
            }
            if (type == T_Q6_K && h % 2) {
                /* U_h of the half just summed: sum (q - 32) x = iv - 32 gm */
                for (int r = 0; r < R; ++r) {
                    const __m256i bk =
                        _mm256_loadu_si256((const __m256i*)(a->bk + (r0 + r) * (K / 16) + k0 / 16));
                    __m128i u[FEW_C];
                    for (int c = 0; c < C; ++c) {
                        const __m256i gm = _mm256_madd_epi16(bk, mu[r][c].m);
                        const __m128i half = h == 1 ? _mm256_castsi256_si128(gm)
                                                    : _mm256_extracti128_si256(gm, 1);
                        u[c] = _mm_sub_epi32(fold8(iv[r][c]), _mm_slli_epi32(half, 5));
                        iv[r][c] = _mm256_setzero_si256();
                    }
                    acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4(u, C)), dd[r], acc[r]);
                }
            }
        }
        if (type != T_Q6_K) {
            for (int r = 0; r < R; ++r) {
                const __m256i bk =
                    _mm256_loadu_si256((const __m256i*)(a->bk + (r0 + r) * (K / 16) + k0 / 16));
                __m128i t[FEW_C], g[FEW_C];
                for (int c = 0; c < C; ++c) {
                    t[c] = fold8(iv[r][c]);
                    g[c] = fold8(_mm256_madd_epi16(bk, mu[r][c].m));
                }
                const __m128 dm = _mm_xor_ps(
                    _mm_mul_ps(_mm_loadu_ps(mv),
                               _mm_set1_ps(a->dk[(r0 + r) * (K / 256) + k0 / 256])),
                    sign);
                acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4(t, C)), dd[r], acc[r]);
                acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4(g, C)), dm, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float v[4];
        _mm_storeu_ps(v, acc[r]);
        for (int c = 0; c < C; ++c) out[r * FEW_C + c] = v[c];
    }
}

typedef void (*few_kq_fn)(const uint8_t* const*, int64_t, const qacts*, int64_t, float*);
#define DEFINE_FEW_KQ(TY, R, C)                                                                \
static void few_kq_##TY##_##R##_##C(const uint8_t* const* rows, int64_t K, const qacts* a,     \
                                    int64_t r0, float* out) {                                 \
    few_kq_body(R, C, T_##TY, rows, K, a, r0, out);                                           \
}
#define DEFINE_FEW_KQ_RC(TY)                                                                   \
    DEFINE_FEW_KQ(TY, 1, 1) DEFINE_FEW_KQ(TY, 1, 2) DEFINE_FEW_KQ(TY, 1, 3)                   \
    DEFINE_FEW_KQ(TY, 1, 4) DEFINE_FEW_KQ(TY, 2, 1) DEFINE_FEW_KQ(TY, 2, 2)                   \
    DEFINE_FEW_KQ(TY, 2, 3) DEFINE_FEW_KQ(TY, 2, 4)                                           \
    static const few_kq_fn FEW_KQ_##TY[FEW_R + 1][FEW_C + 1] = {                              \
        {0},                                                                                  \
        {0, few_kq_##TY##_1_1, few_kq_##TY##_1_2, few_kq_##TY##_1_3, few_kq_##TY##_1_4},      \
        {0, few_kq_##TY##_2_1, few_kq_##TY##_2_2, few_kq_##TY##_2_3, few_kq_##TY##_2_4},      \
    };
DEFINE_FEW_KQ_RC(Q4_K) DEFINE_FEW_KQ_RC(Q5_K) DEFINE_FEW_KQ_RC(Q6_K)

static const few_kq_fn (*few_kq_table(int type))[FEW_C + 1] {
    return type == T_Q4_K ? FEW_KQ_Q4_K : type == T_Q5_K ? FEW_KQ_Q5_K : FEW_KQ_Q6_K;
}

/* 1 where the pair of columns holding n has a Q8_0 column (the AVX2 products shift both). */
static int pair_shifted(const kvg_qweight* w, int64_t n, int64_t N) {
    const int64_t p = n & ~(int64_t)1;
    return columns_shifted(w, p, N - p < 2 ? (int)(N - p) : 2);
}

static int qlinear_few_range(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                             int64_t M, int64_t N, int64_t K, int f32, int tid, int nt) {
    const int64_t Kp = a->Kp;
    /* whole pairs of columns per thread (a column's shift is its pair's) */
    const int64_t pairs = (N + 1) / 2;
    const int64_t n_lo = pairs * tid / nt * 2;
    int64_t n_hi = pairs * (tid + 1) / nt * 2;
    n_hi = n_hi < N ? n_hi : N;
    float* wo = (float*)thread_scratch((size_t)FEW_C * (Kp / 16) * sizeof(float));
    if (!wo) return n_lo < n_hi ? -2 : 0;
    float out[FEW_R * FEW_C];
    const uint8_t* rows[FEW_C];
    int types[FEW_C];
    for (int64_t n0 = n_lo; n0 < n_hi;) {
        rows[0] = weight_row(w, n0, &types[0]);
        if (!rows[0]) return -1;
        if (is_kq(types[0]) && a->xk) {
            /* up to FEW_C K-quant columns of one type: integer sums per 256 */
            int C = 1;
            for (; C < FEW_C && n0 + C < n_hi; ++C) {
                rows[C] = weight_row(w, n0 + C, &types[C]);
                if (!rows[C]) return -1;
                if (types[C] != types[0]) break;
            }
            const few_kq_fn(*table)[FEW_C + 1] = few_kq_table(types[0]);
            for (int64_t r0 = 0; r0 < M; r0 += FEW_R) {
                const int R = M - r0 < FEW_R ? (int)(M - r0) : FEW_R;
                table[R][C](rows, K, a, r0, out);
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < C; ++c)
                        store_one(y, (r0 + r) * N + n0 + c,
                                  out[r * FEW_C + c] + (bias ? bias[n0 + c] : 0.0f), f32);
            }
            n0 += C;
            continue;
        }
        /* up to FEW_C columns of one shift and, for the specialized code, one type */
        const int shift = pair_shifted(w, n0, N);
        int C = 0, same = 1;
        for (; C < FEW_C && n0 + C < n_hi; ++C) {
            if (C && (n0 + C) % 2 == 0 && pair_shifted(w, n0 + C, N) != shift) break;
            rows[C] = weight_row(w, n0 + C, &types[C]);
            if (!rows[C]) return -1;
            if (C && is_kq(types[C]) && a->xk) break;
            same &= types[C] == types[0];
        }
        const few_fn(*table)[FEW_C + 1] = few_table(same ? types[0] : T_ANY, shift);
        for (int c = 0; c < C; ++c)
            for (int64_t g = K / 16; g < Kp / 16; ++g) wo[c * (Kp / 16) + g] = 0.0f;
        for (int64_t r0 = 0; r0 < M; r0 += FEW_R) {
            const int R = M - r0 < FEW_R ? (int)(M - r0) : FEW_R;
            table[R][C](rows, types, K, Kp, a->xq + r0 * Kp, a->dx + r0 * (Kp / 32),
                        r0 ? NULL : wo, out);
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < C; ++c) {
                    const float v = out[r * FEW_C + c] +
                                    offset_dot(wo + c * (Kp / 16), a->xs + (r0 + r) * (Kp / 16),
                                               Kp / 16);
                    store_one(y, (r0 + r) * N + n0 + c, v + (bias ? bias[n0 + c] : 0.0f), f32);
                }
        }
        n0 += C;
    }
    return 0;
}

/* ---- AVX2, K-quant columns for many rows: 8 columns interleaved, int16 sums ---------------
 * For prompts the column-at-a-time sums above take 2 multiplies per 32 inputs (vpmaddubsw,
 * vpmaddwd) plus the multipliers per 256, and Zen 2 runs one multiply per cycle per core:
 * ~85 GFLOP/s at 32 rows on 2 cores, against llama-server's 127 on the same shapes. Here 8
 * columns of one K type are decoded once per block of rows into bytes interleaved by 4 inputs
 * (32 bytes: inputs 4t .. 4t + 3 of columns 0..7; kq8_decode), a row's 4 inputs are
 * broadcast into one vpmaddubsw against all 8 columns, and the products are summed in int16
 * across a sub-block before one vpmaddwd with the 8 columns' sub-block scales times the row's
 * s_b: per 32 inputs 1.5 multiplies with the multipliers and mins (Q4_K), 1.625 (Q5_K), 1.5
 * (Q6_K) (llama.cpp's repacked x86 GEMMs take int16 sums the same way). The int16 words
 * (word 2c: inputs 4t, 4t + 1 of column c; 2c + 1: 4t + 2, 4t + 3) stay exact:
 *   Q4_K: 8 steps, |word| <= 16 x 15 x 127 = 30480
 *   Q5_K: 4 steps (two vpmaddwd per sub-block), 8 x 31 x 127 = 31496
 *   Q6_K: 4 steps (a group of 16), the offset 32 sum x of the word's 8 inputs subtracted
 *         (o6, per row): sum (q - 32) x, |word| <= 8 x 32 x 127 = 32512 (vpaddw wraps, so
 *         the unsigned partial sums may pass 2^15: only the total must fit)
 * The column totals land one per int32 lane, so the float32 steps per 256 are one vector for
 * 8 outputs, on the totals the few-row kernels form (kq_sums): bit-identical. Zen 2, 2
 * threads, Qwen 1.5B shapes (bench/qlinears.py): Q4_K 83 -> 166 GFLOP/s at 32 rows, 192 at
 * 128; Q6_K 89 -> 163, 192. */
#define KQ8_R 4
/* From 8 rows a layer of K-quants only takes kq8 (the few-row kernels below that): Zen 2, 2
 * threads, Qwen 1.5B shapes, GFLOP/s few rows -> kq8: Q4_K 4 rows 98 -> 74, 6 rows 102 -> 97,
 * 8 rows 104 -> 112; Q6_K 8 rows 89 -> 107. */
#define KQ8_MIN_ROWS 8

/* One block of 256 inputs of 8 columns: int16 multipliers for vpmaddwd against the int16
 * words (each column's twice: [c0 c0 c1 c1 .. c7 c7]), float scales per column. */
typedef struct {
    int16_t sc[16][16]; /* [j]: sub-block j's scales (Q4_K, Q5_K: j < 8), Q6_K group j's */
    int16_t mn[8][16];  /* [j]: sub-block j's mins (Q4_K, Q5_K) */
    float d[8], dmin[8];
} kq8_block;

/* r[i] (column i's 8 dwords) -> r[t] (dword t of columns 0..7). */
static inline void transpose8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* Columns n0 .. n0 + 7 (all of type `type`) -> q [K / 4][32] and blocks [K / 256]. */
static int kq8_decode(const kvg_qweight* w, int64_t n0, int type, int64_t K, uint8_t* q,
                      kq8_block* blocks) {
    const uint8_t* rows[8];
    for (int c = 0; c < 8; ++c) {
        int t;
        rows[c] = weight_row(w, n0 + c, &t);
        if (!rows[c] || t != type) return -1;
    }
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
        __m256i lo[8], hi[8];
        for (int c = 0; c < 8; ++c) decode64_regs(rows[c], type, k0, 0, &lo[c], &hi[c]);
        transpose8_epi32(lo);
        transpose8_epi32(hi);
        uint8_t* o = q + k0 / 4 * 32;
        for (int t = 0; t < 8; ++t) {
            _mm256_storeu_si256((__m256i*)(o + 32 * t), lo[t]);
            _mm256_storeu_si256((__m256i*)(o + 32 * (8 + t)), hi[t]);
        }
    }
    /* The scales read as kq_scales256 reads them, but straight into the int16 tables: going
     * through kq_scales256's vectors and back (store, scalar reloads) cost 3-5% at 32 rows
     * (Zen 2, two alternating pairs). */
    const int bb = block_bytes(type);
    for (int64_t b = 0; b < K / 256; ++b) {
        kq8_block* o = blocks + b;
        for (int c = 0; c < 8; ++c) {
            const uint8_t* blk = rows[c] + b * bb;
            if (type == T_Q6_K) {
                for (int j = 0; j < 16; ++j) o->sc[j][2 * c] = o->sc[j][2 * c + 1] = (int8_t)blk[192 + j];
                o->d[c] = f16_at(blk + 208);
                o->dmin[c] = 0.0f;
            } else {
                uint8_t sc[8], mn[8];
                k_scales(blk + 4, sc, mn);
                for (int j = 0; j < 8; ++j) {
                    o->sc[j][2 * c] = o->sc[j][2 * c + 1] = sc[j];
                    o->mn[j][2 * c] = o->mn[j][2 * c + 1] = mn[j];
                }
                o->d[c] = f16_at(blk);
                o->dmin[c] = f16_at(blk + 2);
            }
        }
    }
    return 0;
}

static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* R rows (from r0) x the 8 decoded columns: out [r][8]. */
static inline __attribute__((always_inline)) void kq8_body(const int R, const int type,
                                                            const uint8_t* q,
                                                            const kq8_block* blocks, int64_t K,
                                                            const qacts* a, int64_t r0,
                                                            float* out) {
    const int64_t nb = K / 256;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 acc[KQ8_R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const kq8_block* o = blocks + b;
        const uint8_t* qb = q + b * 2048;
        const int8_t* x[KQ8_R];
        const int16_t* sk[KQ8_R];
        __m256 dd[KQ8_R];
        __m256i T[KQ8_R];
        const __m256 d8 = _mm256_loadu_ps(o->d);
        for (int r = 0; r < R; ++r) {
            x[r] = a->xk + (r0 + r) * K + 256 * b;
            sk[r] = a->sk + ((r0 + r) * nb + b) * 32;
            dd[r] = _mm256_mul_ps(d8, _mm256_set1_ps(a->dk[(r0 + r) * nb + b]));
            T[r] = _mm256_setzero_si256();
        }
        if (type == T_Q6_K) {
            const int32_t* o6[KQ8_R];
            for (int r = 0; r < R; ++r) o6[r] = a->o6 + (r0 + r) * (K / 16) + 16 * b;
            for (int h = 0; h < 2; ++h) {
                for (int g = 8 * h; g < 8 * h + 8; ++g) {
                    __m256i s16[KQ8_R];
#pragma GCC unroll 4
                    for (int t = 0; t < 4; ++t) {
                        const __m256i wv = _mm256_loadu_si256((const __m256i*)(qb + 32 * (4 * g + t)));
                        for (int r = 0; r < R; ++r) {
                            const __m256i p = _mm256_maddubs_epi16(wv, bcast4(x[r] + 16 * g + 4 * t));
                            s16[r] = t ? _mm256_add_epi16(s16[r], p) : p;
                        }
                    }
                    const __m256i scv = _mm256_loadu_si256((const __m256i*)o->sc[g]);
                    for (int r = 0; r < R; ++r) {
                        const __m256i s = _mm256_sub_epi16(s16[r], _mm256_set1_epi32(o6[r][g]));
                        T[r] = _mm256_add_epi32(
                            T[r], _mm256_madd_epi16(s, _mm256_mullo_epi16(
                                                           scv, _mm256_set1_epi16(sk[r][g / 2]))));
                    }
                }
                for (int r = 0; r < R; ++r) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r]), dd[r], acc[r]);
                    T[r] = _mm256_setzero_si256();
                }
            }
        } else {
            const int run = type == T_Q5_K ? 4 : 8; /* steps per int16 sum */
            for (int j = 0; j < 8; ++j) {
                const __m256i scv = _mm256_loadu_si256((const __m256i*)o->sc[j]);
                __m256i mult[KQ8_R];
                for (int r = 0; r < R; ++r)
                    mult[r] = _mm256_mullo_epi16(scv, _mm256_set1_epi16(sk[r][j]));
                for (int t0 = 0; t0 < 8; t0 += run) {
                    __m256i s16[KQ8_R];
#pragma GCC unroll 8
                    for (int t = t0; t < t0 + run; ++t) {
                        const __m256i wv = _mm256_loadu_si256((const __m256i*)(qb + 32 * (8 * j + t)));
                        for (int r = 0; r < R; ++r) {
                            const __m256i p = _mm256_maddubs_epi16(wv, bcast4(x[r] + 32 * j + 4 * t));
                            s16[r] = t > t0 ? _mm256_add_epi16(s16[r], p) : p;
                        }
                    }
                    for (int r = 0; r < R; ++r)
                        T[r] = _mm256_add_epi32(T[r], _mm256_madd_epi16(s16[r], mult[r]));
                }
            }
            const __m256 dmin8 = _mm256_loadu_ps(o->dmin);
            for (int r = 0; r < R; ++r) {
                /* G = sum_j mn_j s_j (bk_2j + bk_2j+1) */
                const int16_t* bk = a->bk + (r0 + r) * (K / 16) + 16 * b;
                __m256i G = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) {
                    int32_t pair;
                    memcpy(&pair, bk + 2 * j, 4);
                    const __m256i mv = _mm256_mullo_epi16(
                        _mm256_loadu_si256((const __m256i*)o->mn[j]), _mm256_set1_epi16(sk[r][j]));
                    G = _mm256_add_epi32(G, _mm256_madd_epi16(mv, _mm256_set1_epi32(pair)));
                }
                const __m256 dm = _mm256_xor_ps(
                    _mm256_mul_ps(dmin8, _mm256_set1_ps(a->dk[(r0 + r) * nb + b])), sign);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r]), dd[r], acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(G), dm, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

typedef void (*kq8_fn)(const uint8_t*, const kq8_block*, int64_t, const qacts*, int64_t, float*);
#define DEFINE_KQ8(TY, R)                                                                      \
static void kq8_##TY##_##R(const uint8_t* q, const kq8_block* blocks, int64_t K,              \
                           const qacts* a, int64_t r0, float* out) {                          \
    kq8_body(R, T_##TY, q, blocks, K, a, r0, out);                                            \
}
#define DEFINE_KQ8_R(TY)                                                                       \
    DEFINE_KQ8(TY, 1) DEFINE_KQ8(TY, 2) DEFINE_KQ8(TY, 3) DEFINE_KQ8(TY, 4)                   \
    static const kq8_fn KQ8_##TY[KQ8_R + 1] = {0, kq8_##TY##_1, kq8_##TY##_2, kq8_##TY##_3,    \
                                               kq8_##TY##_4};
DEFINE_KQ8_R(Q4_K) DEFINE_KQ8_R(Q5_K) DEFINE_KQ8_R(Q6_K)

static const kq8_fn* kq8_table(int type) {
    return type == T_Q4_K ? KQ8_Q4_K : type == T_Q5_K ? KQ8_Q5_K : KQ8_Q6_K;
}

/* Q6_K's offsets for kq8: per group g of 16 inputs of a row, 32 x the sums of xk over inputs
 * {0, 1, 4, 5, 8, 9, 12, 13} (low int16) and {2, 3, 6, 7, 10, 11, 14, 15} (high): the words
 * kq8's int16 sums of a group hold. |32 x 8 x 127| < 2^15. */
static void offsets6(const int8_t* xk, int64_t K, int32_t* o6) {
    for (int64_t g = 0; g < K / 16; ++g) {
        const int8_t* v = xk + 16 * g;
        int e = 0, f = 0;
        for (int i = 0; i < 16; i += 4) {
            e += v[i] + v[i + 1];
            f += v[i + 2] + v[i + 3];
        }
        o6[g] = (int32_t)((uint32_t)(uint16_t)(int16_t)(32 * e) |
                          (uint32_t)(uint16_t)(int16_t)(32 * f) << 16);
    }
}

/* C (<= 7) K-quant columns of one type from n0 for rows [m0, m1), by the few-row kernels
 * (the columns a group of 8 leaves at a part's end). */
static void kq_rest(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                    int64_t n0, int C, int type, int64_t m0, int64_t m1, int64_t N, int64_t K,
                    int f32) {
    const few_kq_fn(*table)[FEW_C + 1] = few_kq_table(type);
    float out[FEW_R * FEW_C];
    for (int c0 = 0; c0 < C; c0 += FEW_C) {
        const int cc = C - c0 < FEW_C ? C - c0 : FEW_C;
        const uint8_t* rows[FEW_C];
        for (int c = 0; c < cc; ++c) {
            int t;
            rows[c] = weight_row(w, n0 + c0 + c, &t);
        }
        for (int64_t r0 = m0; r0 < m1; r0 += FEW_R) {
            const int R = m1 - r0 < FEW_R ? (int)(m1 - r0) : FEW_R;
            table[R][cc](rows, K, a, r0, out);
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < cc; ++c) {
                    const int64_t n = n0 + c0 + c;
                    store_one(y, (r0 + r) * N + n, out[r * FEW_C + c] + (bias ? bias[n] : 0.0f),
                              f32);
                }
        }
    }
}

/* 1 where every part of W is a K-quant. */
static int all_kq(const kvg_qweight* w) {
    for (int s = 0; s < w->nsegs; ++s)
        if (!is_kq(w->segs[s].type)) return 0;
    return 1;
}

static int qlinear_range(const kvg_qweight* w, const qacts* a, const float* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int f32, int tid, int nt) {
    if (M <= FEW_ROWS && !(M >= KQ8_MIN_ROWS && a->xk && all_kq(w)))
        return qlinear_few_range(w, a, bias, y, M, N, K, f32, tid, nt);
    const int64_t Kp = a->Kp;
    /* Contiguous ranges of whole groups of 8 columns per thread; rows in blocks of up to 8 MiB
     * of int8 x, the columns decoded again per block (as the VNNI path's panels; Zen 4 forced
     * to AVX2, the down projection at 512 rows: 256 KiB blocks 138-140 GFLOP/s, 8 MiB
     * 153-159). K-quant columns go 8 of one type at a time to kq8 (the rest of a run to the
     * few-row kernels), the others in pairs to qtile. */
    const int64_t groups = (N + 7) / 8;
    const int64_t n_lo = groups * tid / nt * 8;
    int64_t n_hi = groups * (tid + 1) / nt * 8;
    n_hi = n_hi < N ? n_hi : N;
    const size_t qbytes = (size_t)MAX_C * Kp, sbytes = (size_t)MAX_C * (Kp / 16) * 4;
    const size_t k8bytes = a->xk ? (size_t)8 * K + (size_t)(K / 256) * sizeof(kq8_block) : 0;
    uint8_t* q = (uint8_t*)thread_scratch(qbytes + 2 * sbytes + k8bytes);
    if (!q) return n_lo < n_hi ? -2 : 0;
    float* ws = (float*)(q + qbytes);
    float* wo = (float*)(q + qbytes + sbytes);
    uint8_t* q8 = q + qbytes + 2 * sbytes;
    kq8_block* b8 = (kq8_block*)(q8 + 8 * K);
    int64_t mb = ((int64_t)8 << 20) / Kp;
    mb = mb < MAX_R ? MAX_R : mb / MAX_R * MAX_R;
    float out[KQ8_R * 8];
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m1 = m0 + mb < M ? m0 + mb : M;
        for (int64_t n0 = n_lo; n0 < n_hi;) {
            int type;
            if (!weight_row(w, n0, &type)) return -1;
            if (is_kq(type) && a->xk) {
                int C = 1;
                for (int t; C < 8 && n0 + C < n_hi && weight_row(w, n0 + C, &t) && t == type;)
                    ++C;
                if (C < 8) {
                    kq_rest(w, a, bias, y, n0, C, type, m0, m1, N, K, f32);
                } else {
                    if (kq8_decode(w, n0, type, K, q8, b8)) return -1;
                    const kq8_fn* table = kq8_table(type);
                    for (int64_t r0 = m0; r0 < m1; r0 += KQ8_R) {
                        const int R = m1 - r0 < KQ8_R ? (int)(m1 - r0) : KQ8_R;
                        table[R](q8, b8, K, a, r0, out);
                        for (int r = 0; r < R; ++r)
                            for (int c = 0; c < 8; ++c)
                                store_one(y, (r0 + r) * N + n0 + c,
                                          out[8 * r + c] + (bias ? bias[n0 + c] : 0.0f), f32);
                    }
                }
                n0 += C;
                continue;
            }
            /* a pair from an even column, or one column after a K-quant run that ended odd;
             * shifted as its pair (pair_shifted), as in the few-row kernels */
            int C = 1;
            if (n0 % 2 == 0 && n0 + 1 < n_hi) {
                int t;
                if (!weight_row(w, n0 + 1, &t)) return -1;
                C = is_kq(t) && a->xk ? 1 : 2;
            }
            const int shift = pair_shifted(w, n0, N);
            if (decode_columns(w, n0, C, K, Kp, q, ws, wo, shift)) return -1;
            for (int64_t r0 = m0; r0 < m1; r0 += MAX_R) {
                const int R = m1 - r0 < MAX_R ? (int)(m1 - r0) : MAX_R;
                QTILES[shift][R][C](a->xq + r0 * Kp, a->dx + r0 * (Kp / 32), Kp, q, ws, out);
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < C; ++c) {
                        const float v = out[r * MAX_C + c] +
                                        offset_dot(wo + c * (Kp / 16),
                                                   a->xs + (r0 + r) * (Kp / 16), Kp / 16);
                        store_one(y, (r0 + r) * N + n0 + c, v + (bias ? bias[n0 + c] : 0.0f),
                                  f32);
                    }
            }
            n0 += C;
        }
    }
    return 0;
}
#endif

/* y [M, N] = x [M, K] W^T + bias. x bf16 (io_bf16) or float32; bias float32 [N] or NULL; y
 * float32 (out_f32) or as x. The signature is linear_avx2's (csrc/linear.c), so the fused
 * decode layers call either through one pointer type: `unused` is its scale argument.
 * 0, or -1 for shapes or types not handled here, -2 when memory ran out. */
int kvg_qlinear(const void* x, const void* weight, const float* unused, const void* bias,
                void* y, int M, int N, int K, int out_f32, int io_bf16) {
    (void)unused;
    const kvg_qweight* w = (const kvg_qweight*)weight;
    if (M <= 0 || N <= 0 || !weight_ok(w, N, K)) return -1;
    const int64_t Kp = ((int64_t)K + 63) / 64 * 64;
    int8_t* xq = (int8_t*)malloc((size_t)M * Kp);
    float* dx = (float*)malloc((size_t)M * (Kp / 32) * sizeof(float));
    float* xs = (float*)malloc((size_t)M * (Kp / 16) * sizeof(float));
    float* xs32 = (float*)malloc((size_t)M * (Kp / 32) * sizeof(float));
    int ok = xq && dx && xs && xs32;
    /* the K-quant columns' activations (AVX2), where the layer has such columns */
    int8_t* xk = NULL;
    float* dk = NULL;
    int16_t *sk = NULL, *bk = NULL;
    int32_t* o6 = NULL;
#ifdef KVG_Q8K
    int kq = 0, six = 0;
    for (int s = 0; s < w->nsegs; ++s) {
        kq |= is_kq(w->segs[s].type);
        six |= w->segs[s].type == T_Q6_K;
    }
    if (six && M >= KQ8_MIN_ROWS) { /* kq8's Q6_K offsets */
        o6 = (int32_t*)malloc((size_t)M * (K / 16) * sizeof(int32_t));
        ok = ok && o6;
    }
    if (kq) {
        xk = (int8_t*)malloc((size_t)M * K);
        dk = (float*)malloc((size_t)M * (K / 256) * sizeof(float));
        sk = (int16_t*)malloc((size_t)M * (K / 256) * 32 * sizeof(int16_t));
        bk = (int16_t*)malloc((size_t)M * (K / 16) * sizeof(int16_t));
        ok = ok && xk && dk && sk && bk;
    }
#endif
    int failed = ok ? 0 : -2;
    if (ok) {
        #pragma omp parallel for schedule(static) if ((int64_t)M * K > 65536)
        for (int m = 0; m < M; ++m) {
            quantize_x(x, io_bf16, m, K, Kp, xq + (int64_t)m * Kp, dx + (int64_t)m * (Kp / 32),
                       xs + (int64_t)m * (Kp / 16), xs32 + (int64_t)m * (Kp / 32));
#ifdef KVG_Q8K
            if (xk)
                quantize_x256(x, io_bf16, m, K, xk + (int64_t)m * K, dk + (int64_t)m * (K / 256),
                              sk + (int64_t)m * (K / 256) * 32, bk + (int64_t)m * (K / 16));
            if (o6) offsets6(xk + (int64_t)m * K, K, o6 + (int64_t)m * (K / 16));
#endif
        }
        const qacts acts = {xq, dx, xs, xs32, Kp, xk, dk, sk, bk, o6};
        const int f32 = out_f32 || !io_bf16;
        #pragma omp parallel
        {
            int nt = 1, tid = 0;
#ifdef _OPENMP
            nt = omp_get_num_threads();
            tid = omp_get_thread_num();
#endif
            const int rc = qlinear_range(w, &acts, (const float*)bias, y, M, N, K, f32, tid, nt);
            if (rc) {
                #pragma omp atomic write
                failed = rc;
            }
        }
    }
    free(xq);
    free(dx);
    free(xs);
    free(xs32);
    free(xk);
    free(dk);
    free(sk);
    free(bk);
    free(o6);
    return failed;
}
#else
int kvg_qdequant_rows(const kvg_qweight* w, const int64_t* rows, int count, int64_t N,
                      void* out, int out_bf16) {
    (void)w; (void)rows; (void)count; (void)N; (void)out; (void)out_bf16;
    return -1;
}

int kvg_qlinear(const void* x, const void* weight, const float* unused, const void* bias,
                void* y, int M, int N, int K, int out_f32, int io_bf16) {
    (void)x; (void)weight; (void)unused; (void)bias; (void)y; (void)M; (void)N; (void)K;
    (void)out_f32; (void)io_bf16;
    return -1;
}
#endif

#ifndef KVG_QAMX
int kvg_qlinear_bf16_tiles(const void* x, const void* weight, const void* bias, void* y, int M,
                           int N, int K, int out_f32) {
    (void)x; (void)weight; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)out_f32;
    return -3;
}
#endif

/* 1 where kvg_qlinear_bf16_tiles runs (the amx build, the tile state granted). */
int kvg_qbf16_tiles(void) {
#ifdef KVG_QAMX
    return amx_ready;
#else
    return 0;
#endif
}

#ifdef KVG_QAMX
/* The tiles' path says so when Linux granted the tile state. */
const char* kvgate_isa(void) { return amx_ready ? "amx" : KVGATE_ISA_NAME; }
#else
KVGATE_DEFINE_ISA()
#endif

/* Inputs per activation scale in the products with columns of `type`: 256 for the K-quants
 * on AVX2 (quantize_x256), else 32 (quantize_x). */
int kvg_qact_block(int type) {
#ifdef KVG_Q8K
    return is_kq(type) ? 256 : 32;
#else
    (void)type;
    return 32;
#endif
}
