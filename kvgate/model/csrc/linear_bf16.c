/* y = x W^T (+ b) in bf16 for few rows (decode steps), with AVX512-BF16.
 *
 * Layouts:
 *   x    [M, K] bf16, K even
 *   wp   [N / 32, K / 2, 32, 2] bf16: W packed in panels of 32 output columns; for each pair
 *        of input features (2j, 2j + 1), the panel's 32 columns hold (W[n][2j], W[n][2j+1])
 *        side by side: one vdpbf16ps multiplies that pair for 16 columns at once
 *   bias [N] bf16 or NULL; y [M, N] bf16
 *
 * Each output is one float32 sum over k in pairs (2j, 2j + 1), j ascending, rounded to bf16
 * once (nearest even) after the bias is added. A panel (32 columns x K) is streamed once and
 * serves every row of x while it sits in L1/L2; rows go up to 8 at a time, 16 accumulators.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "bf16_avx512.h"

/* One panel, ROWS rows of x starting at x: acc[r][h] is columns 16h..16h+15 of row r. */
#define DEFINE_TILE(ROWS)                                                                     \
static inline void tile_##ROWS(const uint16_t* x, int64_t K, const uint16_t* panel,          \
                               const uint16_t* bias, uint16_t* y, int64_t N) {                \
    __m512 acc[ROWS][2];                                                                      \
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();              \
    const uint32_t* xp = (const uint32_t*)x; /* a pair of bf16 as one 32-bit lane */          \
    const int64_t pairs = K / 2;                                                              \
    for (int64_t j = 0; j < pairs; ++j) {                                                     \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * 64);                    \
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + j * 64 + 32);               \
        for (int r = 0; r < ROWS; ++r) {                                                      \
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs + j]);          \
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, a);                                   \
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, a);                                   \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < ROWS; ++r) {                                                          \
        __m512 lo = acc[r][0], hi = acc[r][1];                                                \
        if (bias) { lo = _mm512_add_ps(lo, bf16x16_load(bias)); hi = _mm512_add_ps(hi, bf16x16_load(bias + 16)); } \
        _mm256_storeu_si256((__m256i*)(y + r * N), bf16x16_round(lo));                              \
        _mm256_storeu_si256((__m256i*)(y + r * N + 16), bf16x16_round(hi));                         \
    }                                                                                         \
}

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

typedef void (*tile_fn)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, uint16_t*,
                        int64_t);
static const tile_fn TILES[9] = {0, tile_1, tile_2, tile_3, tile_4,
                                 tile_5, tile_6, tile_7, tile_8};
#endif

/* 0 on success; -1 where this build or these shapes are not handled (caller falls back). */
int linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                int M, int N, int K) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (K % 2 || N % 32 || M <= 0) return -1;
    const int panels = N / 32;
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        const uint16_t* panel = wp + (int64_t)p * K * 32;
        const uint16_t* b = bias ? bias + p * 32 : NULL;
        /* As few tiles as 8 rows at a time need, their rows spread evenly: 33 rows go
         * 7+7+7+6+6, not 8+8+8+8+1, whose 1-row tile re-reads the panel for 2 FMAs per
         * pair and costs a quarter of a full tile. */
        const int tiles = (M + 7) / 8, base = M / tiles, longer = M % tiles;
        for (int t = 0, m = 0; t < tiles; ++t) {
            const int rows = base + (t < longer);
            TILES[rows](x + (int64_t)m * K, K, panel, b, y + (int64_t)m * N + p * 32, N);
            m += rows;
        }
    }
    return 0;
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)N; (void)K;
    return -1;
#endif
}
