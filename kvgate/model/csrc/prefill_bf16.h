/* Causal prefill attention in bf16, reading K/V straight from the paged pool: every prompt
 * (or prompt chunk) of a step in one call. Included by paged_decode.c (after math_avx512.h and
 * q8_block_to_bf16) in its AVX512-BF16 builds: on AMX-BF16 tiles where the build has them and
 * the tile state was granted (amx_ready), with vdpbf16ps on AVX-512 registers otherwise (Zen 4,
 * Cooper Lake, a Xeon whose hypervisor hides the tiles). Both read the same operand layouts and
 * round where the other does; their sums run in different orders, so they agree to float32
 * rounding, not bit for bit. Elsewhere prefill_attention_bf16 refuses (-1) and the caller keeps
 * PyTorch's matmul paths.
 *
 * Layouts (row-major):
 *   q, out     [T, Hkv * G, D] bf16, the step's rows
 *   k/v cache  [Hkv, N, BS, D] bf16, this step's K/V already written; or, with NG > 0,
 *              int8 / fp8 rows [Hkv, N, BS, D + 4 NG] bytes, decoded to bf16 as they are
 *              laid out (q8_block_to_bf16: what KVCodec.decode gives, and the decode reads)
 *   slices     [S, 4] int64: token_start, token_end (rows of q), start_pos (tokens cached
 *              before the slice), table_at (offset of the slice's block ids in tables, from
 *              its first block)
 * Row r of a slice sits at position start_pos + r and sees keys 0 .. start_pos + r.
 *
 * Work items are (slice, KV head, block of rows: pf_item_rows). An item lays out its keys once,
 * for all its rows and the G query heads of its KV head, as the tiles' B operands (which are
 * also what one vdpbf16ps takes for 16 keys or 16 dims):
 *   kt  K for S = Q K^T: per 16 keys and 32 dims a 16 x 16 dword transpose (row j: the pair
 *       of dims 2j, 2j + 1 of each of the 16 keys);
 *   vi  V for O = P V: per 32 keys and 16 dims, row j holds keys 2j and 2j + 1 interleaved
 *       (dims in order).
 * Then per query head and 16 rows: S (float32, into a scratch row per query), softmax per row
 * over its causal keys in float32 with the probabilities rounded to bf16 (as the PyTorch paths
 * round them before their P V matmul), O, rounded to bf16 once. Keys past a row's position are
 * never read by its softmax, and get probability 0. A row's sums run over its own q and keys
 * in one order whatever else the step holds: its output does not depend on the batch.
 */
#ifndef KVGATE_PREFILL_BF16_H
#define KVGATE_PREFILL_BF16_H

#include <stdlib.h>

#ifdef KVGATE_AMX
#include "amx.h"
#endif
#include "transpose_avx512.h"

/* Query rows of a work item: 64 (enough items for every thread on short prompts); 256 from
 * contexts of 2k keys, where laying the keys out once per item starts to count. */
static inline int64_t pf_item_rows(int64_t max_keys) { return max_keys <= 2048 ? 64 : 256; }

/* The calling thread's scratch of n bytes, 64-byte aligned, kept for its next calls (grown
 * as needed; the engine's threads live as long as it does). NULL if it cannot grow. */
static void* pf_scratch(size_t n) {
    static __thread void* buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, (n + 63) & ~(size_t)63);
        cap = buf ? n : 0;
    }
    return buf;
}

/* The rows of a layer's cache: bf16, or quantized (NG scales a row; fp8: e4m3 codes). */
typedef struct {
    const void* base;
    int64_t N;
    int BS, D, NG;
    const float* fp8; /* non-NULL: e4m3 codes (the table the decode kernels take) */
} pf_cache;

/* Key n's row of KV head h as bf16 (NULL past the keys the item reads): in the pool, or
 * decoded into tmp [D] where the rows are quantized. */
static inline const uint16_t* pf_row(const pf_cache* c, const int64_t* table, int64_t n,
                                     int64_t nkeys, int h, uint16_t* tmp) {
    if (n >= nkeys) return NULL;
    const int64_t slot = ((int64_t)h * c->N + table[n / c->BS]) * c->BS + n % c->BS;
    if (!c->NG) return (const uint16_t*)c->base + slot * c->D;
    const uint8_t* row = (const uint8_t*)c->base + slot * (c->D + 4 * c->NG);
    q8_block_to_bf16(row, tmp, 1, c->D, c->NG, c->fp8);
    return tmp;
}

/* Keys [0, nkeys) of KV head h into kt (per 16 keys, D / 32 tiles of 16 x 16 dwords) and vi
 * (per 32 keys, D / 16 tiles); keys up to the next whole tile are zero. */
static void pf_layout(const pf_cache* kc, const pf_cache* vc, const int64_t* table,
                      int64_t nkeys, int h, uint32_t* kt, uint32_t* vi, uint16_t* tmp) {
    const int D = kc->D, DS = D / 32, DC = D / 16;
    for (int64_t k0 = 0; k0 < nkeys; k0 += 16) {
        const uint16_t* rows[16];
        for (int n = 0; n < 16; ++n) rows[n] = pf_row(kc, table, k0 + n, nkeys, h, tmp + n * D);
        for (int ds = 0; ds < DS; ++ds) {
            __m512i r[16];
            for (int n = 0; n < 16; ++n)
                r[n] = rows[n] ? _mm512_loadu_si512(rows[n] + 32 * ds) : _mm512_setzero_si512();
            transpose16_in(r); /* r[j]: dims 2j, 2j + 1 of the 16 keys */
            uint32_t* dst = kt + ((k0 / 16) * DS + ds) * 256;
            for (int j = 0; j < 16; ++j) _mm512_store_si512(dst + 16 * j, r[j]);
        }
    }
    for (int64_t k0 = 0; k0 < nkeys; k0 += 32) {
        for (int j = 0; j < 16; ++j) {
            const uint16_t* a = pf_row(vc, table, k0 + 2 * j, nkeys, h, tmp);
            const uint16_t* b = pf_row(vc, table, k0 + 2 * j + 1, nkeys, h, tmp + D);
            for (int dc = 0; dc < DC; ++dc) {
                const __m256i va = a ? _mm256_loadu_si256((const __m256i*)(a + 16 * dc))
                                     : _mm256_setzero_si256();
                const __m256i vb = b ? _mm256_loadu_si256((const __m256i*)(b + 16 * dc))
                                     : _mm256_setzero_si256();
                /* per 128-bit lane: dims 0-3 (lo) and 4-7 (hi) of it, a and b alternating */
                const __m256i lo = _mm256_unpacklo_epi16(va, vb);
                const __m256i hi = _mm256_unpackhi_epi16(va, vb);
                uint32_t* dst = vi + ((k0 / 32) * DC + dc) * 256 + 16 * j;
                _mm256_store_si256((__m256i*)dst, _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_store_si256((__m256i*)(dst + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
            }
        }
    }
}

#ifdef KVGATE_AMX
/* Zero the first n (<= 4) accumulator tiles, 0-3 (tile numbers are immediates). */
static inline void pf_tiles_zero(int n) {
    for (int i = 0; i < n; ++i) {
        switch (i) {
            case 0: _tile_zero(0); break;
            case 1: _tile_zero(1); break;
            case 2: _tile_zero(2); break;
            default: _tile_zero(3); break;
        }
    }
}
#endif

/* The scores of 16 query rows qs [16, D] against keys [0, nk): s [16, ss] float32, unscaled,
 * written for whole tiles of 16 keys. */
#ifdef KVGATE_AMX
static void pf_scores_amx(const uint16_t* qs, const uint32_t* kt, int64_t nk, int D, float* s,
                          int64_t ss) {
    const int DS = D / 32;
    const int64_t nkt = (nk + 15) / 16;
    /* S = Q K^T, 4 tiles of 16 keys at a time (C in tiles 0-3, Q in 4, K in 5) */
    for (int64_t t0 = 0; t0 < nkt; t0 += 4) {
        const int nt = nkt - t0 < 4 ? (int)(nkt - t0) : 4;
        pf_tiles_zero(nt);
        for (int ds = 0; ds < DS; ++ds) {
            _tile_loadd(4, qs + 32 * ds, D * 2);
            for (int i = 0; i < nt; ++i) {
                _tile_loadd(5, kt + ((t0 + i) * DS + ds) * 256, 64);
                switch (i) {
                    case 0: _tile_dpbf16ps(0, 4, 5); break;
                    case 1: _tile_dpbf16ps(1, 4, 5); break;
                    case 2: _tile_dpbf16ps(2, 4, 5); break;
                    default: _tile_dpbf16ps(3, 4, 5); break;
                }
            }
        }
        float* sd = s + 16 * t0;
        for (int i = 0; i < nt; ++i) {
            switch (i) {
                case 0: _tile_stored(0, sd, ss * 4); break;
                case 1: _tile_stored(1, sd + 16, ss * 4); break;
                case 2: _tile_stored(2, sd + 32, ss * 4); break;
                default: _tile_stored(3, sd + 48, ss * 4); break;
            }
        }
    }
}

/* o [rows, D] bf16 (row stride out_stride) = p [16, ps] bf16 x V, over nks runs of 32 keys. */
static void pf_values_amx(const uint16_t* p, int64_t ps, const uint32_t* vi, int64_t nks,
                          int rows, int D, uint16_t* out, int64_t out_stride) {
    const int DC = D / 16;
    /* O = P V, 4 tiles of 16 dims at a time (C in 0-3, P in 4, V in 5) */
    float o[16 * 64] __attribute__((aligned(64)));
    for (int d0 = 0; d0 < DC; d0 += 4) {
        const int nd = DC - d0 < 4 ? DC - d0 : 4;
        pf_tiles_zero(nd);
        for (int64_t ks = 0; ks < nks; ++ks) {
            _tile_loadd(4, p + 32 * ks, ps * 2);
            for (int i = 0; i < nd; ++i) {
                _tile_loadd(5, vi + (ks * DC + d0 + i) * 256, 64);
                switch (i) {
                    case 0: _tile_dpbf16ps(0, 4, 5); break;
                    case 1: _tile_dpbf16ps(1, 4, 5); break;
                    case 2: _tile_dpbf16ps(2, 4, 5); break;
                    default: _tile_dpbf16ps(3, 4, 5); break;
                }
            }
        }
        for (int i = 0; i < nd; ++i) {
            switch (i) {
                case 0: _tile_stored(0, o, 256); break;
                case 1: _tile_stored(1, o + 16, 256); break;
                case 2: _tile_stored(2, o + 32, 256); break;
                default: _tile_stored(3, o + 48, 256); break;
            }
        }
        for (int m = 0; m < rows; ++m)
            for (int i = 0; i < nd; ++i)
                _mm256_storeu_si256((__m256i*)(out + m * out_stride + 16 * (d0 + i)),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(o + 64 * m + 16 * i)));
    }
}
#endif

/* pf_scores_amx on AVX-512 registers: per 16 keys, 16 accumulators (one a row); a K dword
 * (two dims of 16 keys) loaded once for the 16 rows, each row's q pair broadcast. */
static void pf_scores_avx512(const uint16_t* qs, const uint32_t* kt, int64_t nk, int D,
                             float* s, int64_t ss) {
    const int DS = D / 32;
    const int64_t nkt = (nk + 15) / 16;
    const uint32_t* qd = (const uint32_t*)qs; /* row m, dims 2i, 2i + 1: qd[m * D / 2 + i] */
    for (int64_t t = 0; t < nkt; ++t) {
        __m512 acc[16];
        for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
        for (int ds = 0; ds < DS; ++ds) {
            const uint32_t* kd = kt + (t * DS + ds) * 256;
            for (int j = 0; j < 16; ++j) {
                const __m512bh k = (__m512bh)_mm512_load_si512(kd + 16 * j);
                for (int m = 0; m < 16; ++m)
                    acc[m] = _mm512_dpbf16_ps(
                        acc[m], (__m512bh)_mm512_set1_epi32((int)qd[m * (D / 2) + 16 * ds + j]), k);
            }
        }
        for (int m = 0; m < 16; ++m) _mm512_storeu_ps(s + m * ss + 16 * t, acc[m]);
    }
}

/* pf_values_amx on AVX-512 registers: 4 rows x 64 dims at a time (16 accumulators); per key
 * pair, 4 V dwords loaded once for the 4 rows, each row's pair of probabilities broadcast. */
static void pf_values_avx512(const uint16_t* p, int64_t ps, const uint32_t* vi, int64_t nks,
                             int rows, int D, uint16_t* out, int64_t out_stride) {
    const int DC = D / 16;
    for (int m0 = 0; m0 < rows; m0 += 4) {
        const int nm = rows - m0 < 4 ? rows - m0 : 4;
        for (int d0 = 0; d0 < DC; d0 += 4) {
            const int nd = DC - d0 < 4 ? DC - d0 : 4;
            __m512 acc[4][4];
            for (int m = 0; m < 4; ++m)
                for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
            for (int64_t ks = 0; ks < nks; ++ks) {
                for (int j = 0; j < 16; ++j) {
                    __m512bh v[4];
                    for (int i = 0; i < nd; ++i)
                        v[i] = (__m512bh)_mm512_load_si512(vi + (ks * DC + d0 + i) * 256 + 16 * j);
                    for (int m = 0; m < nm; ++m) {
                        uint32_t pair;
                        memcpy(&pair, p + (m0 + m) * ps + 32 * ks + 2 * j, 4);
                        const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pair);
                        for (int i = 0; i < nd; ++i)
                            acc[m][i] = _mm512_dpbf16_ps(acc[m][i], pb, v[i]);
                    }
                }
            }
            for (int m = 0; m < nm; ++m)
                for (int i = 0; i < nd; ++i)
                    _mm256_storeu_si256(
                        (__m256i*)(out + (m0 + m) * out_stride + 16 * (d0 + i)),
                        (__m256i)_mm512_cvtneps_pbh(acc[m][i]));
        }
    }
}

/* One query head's rows [r0, r0 + rows) of a slice (rows <= 16): S, softmax, O. qs: the 16
 * rows of q [16, D] (zero past rows); s [16, ss] float32 and p [16, ps] bf16 scratch. */
static void pf_rows(int tiles, const uint16_t* qs, const uint32_t* kt, const uint32_t* vi,
                    int64_t pos0, int rows, int D, float scale, float* s, int64_t ss,
                    uint16_t* p, int64_t ps, uint16_t* out, int64_t out_stride) {
    const int64_t nk = pos0 + rows; /* keys of the last row */
    const int64_t nks = (nk + 31) / 32;
#ifdef KVGATE_AMX
    if (tiles)
        pf_scores_amx(qs, kt, nk, D, s, ss);
    else
#endif
        pf_scores_avx512(qs, kt, nk, D, s, ss);
    /* softmax of each row over keys 0 .. pos0 + m, probabilities rounded to bf16; zeros to
     * the end of the last 32 keys the P V tiles read (and whole rows past `rows`) */
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < 16; ++m) {
        float* sr = s + m * ss;
        uint16_t* pr = p + m * ps;
        const int64_t valid = m < rows ? pos0 + m + 1 : 0;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t c = 0; c < valid; c += 16) {
            const __mmask16 k =
                (__mmask16)(valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sr + c), sc);
            _mm512_storeu_ps(sr + c, v);
            mx = _mm512_mask_max_ps(mx, k, mx, v);
        }
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 total = _mm512_setzero_ps();
        for (int64_t c = 0; c < valid; c += 16) {
            const __mmask16 k =
                (__mmask16)(valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mv)));
            _mm512_storeu_ps(sr + c, e);
            total = _mm512_add_ps(total, e);
        }
        const __m512 inv = _mm512_set1_ps(valid ? 1.f / _mm512_reduce_add_ps(total) : 0.f);
        for (int64_t c = 0; c < 32 * nks; c += 16) {
            const __mmask16 live = (__mmask16)(c >= valid ? 0
                : valid - c >= 16 ? 0xffff : (1u << (valid - c)) - 1);
            const __m512 pv = _mm512_maskz_mul_ps(live, _mm512_loadu_ps(sr + c), inv);
            _mm256_storeu_si256((__m256i*)(pr + c), (__m256i)_mm512_cvtneps_pbh(pv));
        }
    }
#ifdef KVGATE_AMX
    if (tiles) {
        pf_values_amx(p, ps, vi, nks, rows, D, out, out_stride);
        return;
    }
#endif
    (void)tiles;
    pf_values_avx512(p, ps, vi, nks, rows, D, out, out_stride);
}

static int prefill_attention_tiles(const uint16_t* q, const void* kc, const void* vc,
                                 const int64_t* slices, const int64_t* tables, uint16_t* out,
                                 int S, int Hkv, int G, int D, int64_t N, int BS, float scale,
                                 int64_t max_keys, int NG, const float* fp8) {
    if (D % 32 || D > 256 || S <= 0 || (NG && D % NG)) return -1;
#ifdef KVGATE_AMX
    const int tiles = amx_ready;
#else
    const int tiles = 0;
#endif
    const pf_cache kcache = {kc, N, BS, D, NG, fp8}, vcache = {vc, N, BS, D, NG, fp8};
    const int64_t QB = pf_item_rows(max_keys);
    int64_t items = 0;
    for (int s = 0; s < S; ++s)
        items += Hkv * ((slices[4 * s + 1] - slices[4 * s] + QB - 1) / QB);
    int64_t* work = malloc((size_t)items * 3 * sizeof(int64_t));
    if (!work) return -1;
    int64_t w = 0;
    for (int s = 0; s < S; ++s)
        for (int h = 0; h < Hkv; ++h)
            for (int64_t r0 = 0; r0 < slices[4 * s + 1] - slices[4 * s]; r0 += QB) {
                work[3 * w] = s;
                work[3 * w + 1] = h;
                work[3 * w + 2] = r0;
                ++w;
            }
    const int Hq = Hkv * G;
    /* per thread: kt, vi for max_keys keys (whole tiles), s [16, ss], p [16, ps], q rows */
    const int64_t kpad = (max_keys + 63) / 64 * 64;
    const size_t kt_bytes = (size_t)kpad * D * 2, s_bytes = (size_t)16 * kpad * 4;
    const size_t p_bytes = (size_t)16 * kpad * 2, q_bytes = (size_t)16 * D * 2;
    const size_t tmp_bytes = NG ? (size_t)16 * D * 2 : 0; /* decoded quantized rows */
    int failed = 0;
    #pragma omp parallel
    {
        char* buf = pf_scratch(2 * kt_bytes + s_bytes + p_bytes + q_bytes + tmp_bytes);
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
#ifdef KVGATE_AMX
        if (tiles) amx_configure_2x2(16, 16);
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (!buf) continue;
            uint32_t* kt = (uint32_t*)buf;
            uint32_t* vi = (uint32_t*)(buf + kt_bytes);
            float* sbuf = (float*)(buf + 2 * kt_bytes);
            uint16_t* pbuf = (uint16_t*)(buf + 2 * kt_bytes + s_bytes);
            uint16_t* qs = (uint16_t*)(buf + 2 * kt_bytes + s_bytes + p_bytes);
            uint16_t* tmp = qs + 16 * D;
            const int64_t* sl = slices + 4 * work[3 * it];
            const int h = (int)work[3 * it + 1];
            const int64_t r0 = work[3 * it + 2], lq = sl[1] - sl[0];
            const int64_t r1 = r0 + QB < lq ? r0 + QB : lq;
            const int64_t nkeys = sl[2] + r1; /* keys of the item's last row */
            pf_layout(&kcache, &vcache, tables + sl[3], nkeys, h, kt, vi, tmp);
            for (int g = 0; g < G; ++g) {
                for (int64_t t = r0; t < r1; t += 16) {
                    const int rows = r1 - t < 16 ? (int)(r1 - t) : 16;
                    for (int m = 0; m < 16; ++m) {
                        if (m < rows)
                            memcpy(qs + m * D, q + ((sl[0] + t + m) * Hq + h * G + g) * D,
                                   (size_t)D * 2);
                        else
                            memset(qs + m * D, 0, (size_t)D * 2);
                    }
                    pf_rows(tiles, qs, kt, vi, sl[2] + t, rows, D, scale, sbuf, kpad, pbuf, kpad,
                            out + ((sl[0] + t) * Hq + h * G + g) * D, (int64_t)Hq * D);
                }
            }
        }
#ifdef KVGATE_AMX
        if (tiles) _tile_release();
#endif
    }
    free(work);
    return failed ? -1 : 0;
}
#endif
