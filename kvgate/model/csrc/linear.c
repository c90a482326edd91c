/* y = x W^T (+ b) on the CPU, with W packed once at load time (model/linear.py).
 *
 * Two vector paths, chosen by the build's target (isa.h):
 *  - linear_bf16 with AVX512-BF16 (below): bf16 pairs multiplied by vdpbf16ps;
 *  - linear_avx2 with AVX2 + FMA (further below): bf16 or int8 weights widened to float32 in
 *    registers, for bf16 or float32 activations. Also built into the AVX-512 libraries, for
 *    int8 weights there.
 * Both keep one float32 summation order per output whatever the batch holds, so a
 * sequence's logits never depend on what it is batched with.
 *
 * linear_bf16 (AVX512-BF16) layouts:
 *   x    [M, K] bf16, K even
 *   wp   [N / 32, K / 2, 32, 2] bf16: W packed in panels of 32 output columns; for each pair
 *        of input features (2j, 2j + 1), the panel's 32 columns hold (W[n][2j], W[n][2j+1])
 *        side by side: one vdpbf16ps multiplies that pair for 16 columns at once
 *   bias [N] bf16 or NULL; y [M, N] bf16
 *
 * Each output is one float32 sum over k in pairs (2j, 2j + 1), j ascending, rounded to bf16
 * once (nearest even) after the bias is added. A panel (32 columns x K) is streamed once and
 * serves every row of x while it sits in L1/L2; rows go up to 8 at a time, 16 accumulators.
 *
 * The amx build (KVGATE_AMX, Sapphire Rapids and later) runs linear_bf16 on AMX tiles over the
 * very same packed panels: 16 pairs of a panel's half (16 columns) are one 16 x 64-byte B
 * tile, at a row stride of 128 bytes. Each output is then one float32 accumulation over K in
 * steps of 32 inputs (tdpbf16ps), whatever the batch: a row's sums never depend on the rows
 * beside it, the padding rows of a partial tile included, so every M (1 as well) takes the
 * tiles and batching still changes nothing. The summation order is AMX's, not vdpbf16ps's, so
 * the two builds agree to within rounding, not bit for bit; a layer whose K is not a multiple
 * of 32 runs the vdpbf16ps path at every M. Measured (2 Sapphire Rapids-class cores, the four
 * linears of a SmolLM2 layer): vdpbf16ps 190-200 GFLOP/s from 32 rows up, oneDNN's AMX GEMM
 * 880 at 32 rows and 1,800 at 160.
 */
#define _GNU_SOURCE /* syscall(), for the amx build's arch_prctl */
#include <stdint.h>

#include "isa.h"
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef KVGATE_AVX512BF16
#include <immintrin.h>

#include "bf16_avx512.h"

/* One row's 32 columns of a panel: lo, hi (columns 0-15, 16-31) plus the bias (bf16, or
 * NULL), stored at y as float32 (f32) or rounded once to bf16. Both paths end here. */
static inline void store_row32(__m512 lo, __m512 hi, const uint16_t* bias, void* y, int f32) {
    if (bias) {
        lo = _mm512_add_ps(lo, bf16x16_load(bias));
        hi = _mm512_add_ps(hi, bf16x16_load(bias + 16));
    }
    if (f32) {
        _mm512_storeu_ps((float*)y, lo);
        _mm512_storeu_ps((float*)y + 16, hi);
    } else {
        _mm256_storeu_si256((__m256i*)y, bf16x16_round(lo));
        _mm256_storeu_si256((__m256i*)((uint16_t*)y + 16), bf16x16_round(hi));
    }
}

/* One panel, ROWS rows of x starting at x: acc[r][h] is columns 16h..16h+15 of row r. */
#define DEFINE_TILE(ROWS)                                                                     \
static inline void tile_##ROWS(const uint16_t* x, int64_t K, const uint16_t* panel,          \
                               const uint16_t* bias, void* y, int64_t N, int f32) {           \
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
    for (int r = 0; r < ROWS; ++r)                                                            \
        store_row32(acc[r][0], acc[r][1], bias,                                               \
                    f32 ? (void*)((float*)y + r * N) : (void*)((uint16_t*)y + r * N), f32);   \
}

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

typedef void (*tile_fn)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, void*,
                        int64_t, int);
static const tile_fn TILES[9] = {0, tile_1, tile_2, tile_3, tile_4,
                                 tile_5, tile_6, tile_7, tile_8};
#endif

#ifdef KVGATE_AMX
#include <stdlib.h>

#include "amx.h" /* the tile state (amx_ready: refused, vdpbf16ps runs and is reported) */

/* Tiles by amx_configure_2x2 (amx.h): C in 0-3, x in 4-5, the weights' column halves in
 * 6-7 (16 rows of pairs each). A tile's row of C is one float32 sum whatever the tile's row
 * count, so a block of M < 16 rows configured as M rows gives the same outputs as those rows
 * padded to 16, for a sixteenth of the multiplies. */

/* out [16 nb, 32] float32 = nb (1 or 2) blocks of rows of x (at xb, row stride K; as many
 * rows as the configuration gives each block) times one panel, over K in steps of 32 inputs
 * (K % 32 == 0). Block 1's rows start 16 rows after block 0's, in x and in out. */
static inline void amx_panel(const uint16_t* xb, int64_t K, int nb, const uint16_t* panel,
                             float* out) {
    _tile_zero(0);
    _tile_zero(1);
    if (nb == 2) { /* tiles 2, 3 have no rows where block 1 is unused */
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* w = panel + (k / 2) * 64; /* pairs k/2 .. k/2 + 15, 128 bytes each */
        _tile_loadd(6, w, 128);                   /* columns 0-15 */
        _tile_loadd(7, w + 32, 128);              /* columns 16-31 */
        _tile_loadd(4, xb + k, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (nb == 2) {
            _tile_loadd(5, xb + 16 * K + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    if (nb == 2) {
        _tile_stored(2, out + 16 * 32, 128);
        _tile_stored(3, out + 16 * 32 + 16, 128);
    }
}

/* The calling thread's scratch of at least n bf16 values, kept for its next calls (a prefill
 * whose rows are not a multiple of 32 pads its last rows on every linear; a calloc each time
 * was one allocation per linear per step). At most 32 K values per calling thread, held for
 * the thread's life: the engine's threads live as long as it does. NULL if it cannot grow. */
static uint16_t* amx_scratch(size_t n) {
    static __thread uint16_t* buf;
    static __thread size_t cap;
    if (n > cap) {
        uint16_t* grown = realloc(buf, n * sizeof(uint16_t));
        if (!grown) return NULL;
        buf = grown;
        cap = n;
    }
    return buf;
}

/* linear_bf16 on tiles, K % 32 == 0. Rows go 32 at a time (2 x 2 C tiles). Fewer than 32 in
 * all (decode) take tiles of exactly their rows, straight from x; the rows left over after
 * whole blocks of 32 are copied once, zero-padded, to whole tiles of 16 (one configuration
 * for every block: reconfiguring per panel would cost more than the padding saves). */
static int linear_amx(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, void* y,
                      int M, int N, int K, int f32) {
    const int panels = N / 32, full = M / 32, rest = M % 32, rest_nb = (rest + 15) / 16;
    const uint16_t* tail = x + (int64_t)full * 32 * K; /* the rows after the whole blocks */
    int ra = 16, rb = 16;
    if (!full) {
        ra = M < 16 ? M : 16;
        rb = M - ra;
    } else if (rest) {
        const size_t used = (size_t)rest * K, whole = (size_t)rest_nb * 16 * K;
        uint16_t* pad = amx_scratch(whole);
        if (!pad) return -1;
        memcpy(pad, tail, used * sizeof(uint16_t));
        memset(pad + used, 0, (whole - used) * sizeof(uint16_t)); /* padding rows: 0 */
        tail = pad;
    }
    #pragma omp parallel
    {
        amx_configure_2x2(ra, rb); /* per thread: the tile configuration is thread state */
        float out[32 * 32] __attribute__((aligned(64)));
        /* Panels handed out one at a time, not in two fixed halves: on a server's 2 cores
         * the HTTP thread and the client preempt one of the two threads now and then, and
         * with fixed halves the step then waits for the preempted half (SmolLM2, 32
         * sequences, a busy loop taking 10% / 20% of one core beside: decode steps +20% /
         * +37% with fixed halves, +12% / +24% with panels handed out). Each panel's outputs
         * are the same whichever thread computes it. */
        #pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < panels; ++p) {
            const uint16_t* panel = wp + (int64_t)p * K * 32;
            const uint16_t* b = bias ? bias + p * 32 : NULL;
            for (int blk = 0; blk < full + (rest > 0); ++blk) {
                const int last = blk == full, rows = last ? rest : 32;
                amx_panel(last ? tail : x + (int64_t)blk * 32 * K, K, last ? rest_nb : 2, panel,
                          out);
                for (int r = 0; r < rows; ++r) {
                    const int64_t off = ((int64_t)blk * 32 + r) * N + p * 32;
                    store_row32(_mm512_load_ps(out + r * 32), _mm512_load_ps(out + r * 32 + 16),
                                b, f32 ? (void*)((float*)y + off) : (void*)((uint16_t*)y + off),
                                f32);
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#endif

/* 0 on success; -1 where this build or these shapes are not handled (caller falls back).
 * y is bf16 [M, N], or with f32 (linear_bf16_f32) float32 [M, N]: the sums themselves, not
 * rounded (the LM head's logits). */
static int linear_bf16_impl(const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
                            void* y, int M, int N, int K, int f32) {
#ifdef KVGATE_AVX512BF16
    if (K % 2 || N % 32 || M <= 0) return -1;
#ifdef KVGATE_AMX
    if (amx_ready && K % 32 == 0) return linear_amx(x, wp, bias, y, M, N, K, f32);
#endif
    const int panels = N / 32;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < panels; ++p) {
        const uint16_t* panel = wp + (int64_t)p * K * 32;
        const uint16_t* b = bias ? bias + p * 32 : NULL;
        /* As few tiles as 8 rows at a time need, their rows spread evenly: 33 rows go
         * 7+7+7+6+6, not 8+8+8+8+1, whose 1-row tile re-reads the panel for 2 FMAs per
         * pair and costs a quarter of a full tile. */
        const int tiles = (M + 7) / 8, base = M / tiles, longer = M % tiles;
        for (int t = 0, m = 0; t < tiles; ++t) {
            const int rows = base + (t < longer);
            const int64_t off = (int64_t)m * N + p * 32;
            void* yt = f32 ? (void*)((float*)y + off) : (void*)((uint16_t*)y + off);
            TILES[rows](x + (int64_t)m * K, K, panel, b, yt, N, f32);
            m += rows;
        }
    }
    return 0;
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)f32;
    return -1;
#endif
}

int linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                int M, int N, int K) {
    return linear_bf16_impl(x, wp, bias, y, M, N, K, 0);
}

int linear_bf16_f32(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, float* y,
                    int M, int N, int K) {
    return linear_bf16_impl(x, wp, bias, y, M, N, K, 1);
}

#ifdef KVGATE_AVX2
#include <math.h>
#include <stdlib.h>

#include "bf16_avx2.h"

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* linear_avx2 layouts:
 *   x     [M, K] bf16 (io_bf16) or float32
 *   wp    W in panels of 16 output columns. bf16 (wtype 0): [N / 16, K, 16], the panel's 16
 *         weights of input k side by side, columns in the order 0-3, 8-11, 4-7, 12-15, so
 *         that unpacking with zeros (per 128-bit lane) widens them to float32 in column
 *         order 0-7 and 8-15. int8 (wtype 1, 2): [N / 16, K / 2, 2, 8, 2], per pair of inputs
 *         (k, k + 1) columns 0-7 then 8-15, each column's two weights side by side (the
 *         operand order of vpmaddwd); K even;
 *   scale wtype 1: [N] float32, W[n, k] = scale[n] q[n, k] (per output channel);
 *         wtype 2: [N / 16, K / 32, 16] float32, W[n, k] = scale[n / 16, k / 32, n % 16] q[n, k]
 *         (blocks of 32 inputs, as llama.cpp's Q8_0); wtype 0: NULL
 *   bias  [N] as x, or NULL; y [M, N] as x.
 * bf16: each output is one float32 FMA chain over k ascending, plus the bias, rounded once
 * to bf16 (nearest even). x is widened to float32 once per call, so the inner loop is a
 * broadcast and two FMAs per row and input feature.
 * int8: integer dot products (see "int8 weights" below): x is quantized once per call, each
 * row to int16 with one scale, and each output sums exact int32 products over runs of inputs,
 * the runs' sums added in float32 in k order; then times the weight and row scales, plus
 * the bias, rounded once. Either way each output's arithmetic is fixed by its own row:
 * batching never changes it.
 *
 * A tile is R rows x P panels: 2 R P accumulators, R P <= 6 (12 of the 16 ymm registers;
 * the weights of one panel and one broadcast take the rest). Few rows take several panels
 * at once, so there are always 8-12 independent FMA chains to cover the FMA latency. */

/* The 16 weights of input k of one panel, as float32: columns 0-7 in lo, 8-15 in hi. gs: the
 * panel's block scales [K / 32, 16] (int8 in blocks only). */
static inline void w16_bf16(const void* panel, const float* gs, int64_t k, __m256* lo,
                            __m256* hi) {
    (void)gs;
    const __m256i w = _mm256_loadu_si256((const __m256i*)((const uint16_t*)panel + k * 16));
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
}

/* (The unroll pragmas make gcc unroll before it scalarises acc[][][]: without them the 12
 * accumulators went to the stack and back on every k, half the speed.)
 * out [R, 16 P] float32 (+)= x [R rows at stride K] times P consecutive panels (stride pstride
 * elements of the weight type), over inputs k0 <= k < k1: the sums continue from out when
 * `more`, so a run of k ranges in ascending order is the same FMA chain as one range. */
#define DEFINE_WTILE(WNAME, WT, R, P)                                                          \
static void tile_##WNAME##_##R##_##P(const float* x, int64_t K, const WT* w, int64_t pstride, \
                                     const float* gs, int64_t k0, int64_t k1, int more,      \
                                     float* out) {                                           \
    __m256 acc[R][P][2];                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                                 \
            acc[r][p][0] = more ? _mm256_loadu_ps(out + r * 16 * P + p * 16)                  \
                                : _mm256_setzero_ps();                                        \
            acc[r][p][1] = more ? _mm256_loadu_ps(out + r * 16 * P + p * 16 + 8)              \
                                : _mm256_setzero_ps();                                        \
        }                                                                                     \
    for (int64_t k = k0; k < k1; ++k) {                                                       \
        _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                                 \
            __m256 lo, hi;                                                                    \
            w16_##WNAME(w + p * pstride, gs ? gs + p * K / 2 : gs, k, &lo, &hi);             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                             \
                const __m256 a = _mm256_broadcast_ss(x + r * K + k);                          \
                acc[r][p][0] = _mm256_fmadd_ps(a, lo, acc[r][p][0]);                          \
                acc[r][p][1] = _mm256_fmadd_ps(a, hi, acc[r][p][1]);                          \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                       \
        _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                                 \
            _mm256_storeu_ps(out + r * 16 * P + p * 16, acc[r][p][0]);                        \
            _mm256_storeu_ps(out + r * 16 * P + p * 16 + 8, acc[r][p][1]);                    \
        }                                                                                     \
}

#define DEFINE_WTILES(WNAME, WT)                                                               \
DEFINE_WTILE(WNAME, WT, 1, 1) DEFINE_WTILE(WNAME, WT, 1, 2) DEFINE_WTILE(WNAME, WT, 1, 3)        \
DEFINE_WTILE(WNAME, WT, 1, 4) DEFINE_WTILE(WNAME, WT, 2, 1) DEFINE_WTILE(WNAME, WT, 2, 2)        \
DEFINE_WTILE(WNAME, WT, 2, 3) DEFINE_WTILE(WNAME, WT, 3, 1) DEFINE_WTILE(WNAME, WT, 3, 2)        \
DEFINE_WTILE(WNAME, WT, 4, 1) DEFINE_WTILE(WNAME, WT, 5, 1) DEFINE_WTILE(WNAME, WT, 6, 1)        \
typedef void (*tile_##WNAME##_fn)(const float*, int64_t, const WT*, int64_t, const float*,    \
                                  int64_t, int64_t, int, float*);                             \
/* [R][P]: the tile of R rows and P panels (NULL where R P > 6 or P > PANELS[R]) */          \
static const tile_##WNAME##_fn TILES_##WNAME[7][5] = {                                        \
    {0},                                                                                      \
    {0, tile_##WNAME##_1_1, tile_##WNAME##_1_2, tile_##WNAME##_1_3, tile_##WNAME##_1_4},      \
    {0, tile_##WNAME##_2_1, tile_##WNAME##_2_2, tile_##WNAME##_2_3, 0},                       \
    {0, tile_##WNAME##_3_1, tile_##WNAME##_3_2, 0, 0},                                        \
    {0, tile_##WNAME##_4_1, 0, 0, 0},                                                         \
    {0, tile_##WNAME##_5_1, 0, 0, 0},                                                         \
    {0, tile_##WNAME##_6_1, 0, 0, 0},                                                         \
};

DEFINE_WTILES(bf16, uint16_t)


/* int8 weights: integer dot products. Widening int8 to float32 cost more instructions than
 * its FMAs (int8 ran at 19.6 GFLOP/s at one row and 51.5 at 32, bf16 at 30.4 and 63.0, on
 * the AMD EPYC), so x is quantized instead: each row to int16 with one scale
 * (sx = max |x| / 32767, q = round-to-even(x / sx)), and vpmaddwd multiplies a pair of int16
 * inputs by the int8 weights widened to int16 (one vpmovsxbw for 16 weights), summing the
 * pair into int32: 3 instructions per 16 multiply-adds where widening took 8.
 * int32 sums run over at most RUN_PAIRS pairs (2 * 32767 * 127 * 128 < 2^31: no overflow),
 * then go to float32: per channel (wtype 1) runs of K_CHUNK inputs, plain sums; in blocks
 * (wtype 2) runs of 32, each times its block's weight scale. */
#define RUN_PAIRS 128

/* acc += the pair products of w and a, per int32 lane. With AVX512-VNNI (the avx512bf16
 * builds: Cooper Lake, Sapphire Rapids, Zen 4) one vpdpwssd does vpmaddwd's products and the
 * add; the int32 sums are the same integers (no pair reaches 2^31, see above), so both
 * builds give bit-identical outputs. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MADD_ACC(acc, w, a) _mm256_dpwssd_epi32((acc), (w), (a))
#else
#define MADD_ACC(acc, w, a) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (a)))
#endif

#define DEFINE_ITILE(R, P)                                                                     \
static void itile_##R##_##P(const int16_t* x, int64_t K, const int8_t* w, int64_t pstride,   \
                            const float* gs, int64_t k0, int64_t k1, int more, float* out) { \
    const int64_t run = gs ? 32 : 2 * RUN_PAIRS;                                              \
    for (int64_t s0 = k0; s0 < k1; s0 += run) {                                               \
        const int64_t s1 = s0 + run < k1 ? s0 + run : k1;                                     \
        __m256i acc[R][P][2];                                                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                   \
            _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                             \
                acc[r][p][0] = _mm256_setzero_si256();                                        \
                acc[r][p][1] = _mm256_setzero_si256();                                        \
            }                                                                                 \
        for (int64_t k = s0; k < s1; k += 2) {                                                \
            _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                             \
                const int8_t* wk = w + p * pstride + k * 16;                                  \
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wk)); \
                const __m256i hi =                                                            \
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wk + 16)));         \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                         \
                    int32_t pair;                                                             \
                    memcpy(&pair, x + r * K + k, 4);                                          \
                    const __m256i a = _mm256_set1_epi32(pair);                                \
                    acc[r][p][0] = MADD_ACC(acc[r][p][0], lo, a);                             \
                    acc[r][p][1] = MADD_ACC(acc[r][p][1], hi, a);                             \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        const int add = more || s0 > k0;                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)                                   \
            _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p)                               \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {                         \
                    float* o = out + r * 16 * P + p * 16 + h * 8;                             \
                    __m256 v = _mm256_cvtepi32_ps(acc[r][p][h]);                              \
                    if (gs)                                                                   \
                        v = _mm256_mul_ps(                                                    \
                            v, _mm256_loadu_ps(gs + p * (K / 2) + (s0 >> 5) * 16 + h * 8));   \
                    _mm256_storeu_ps(o, add ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);      \
                }                                                                             \
    }                                                                                         \
}

DEFINE_ITILE(1, 1) DEFINE_ITILE(1, 2) DEFINE_ITILE(1, 3) DEFINE_ITILE(1, 4)
DEFINE_ITILE(2, 1) DEFINE_ITILE(2, 2) DEFINE_ITILE(2, 3) DEFINE_ITILE(3, 1) DEFINE_ITILE(3, 2)
DEFINE_ITILE(4, 1) DEFINE_ITILE(5, 1) DEFINE_ITILE(6, 1)
typedef void (*itile_fn)(const int16_t*, int64_t, const int8_t*, int64_t, const float*, int64_t,
                         int64_t, int, float*);
static const itile_fn ITILES[7][5] = {
    {0},
    {0, itile_1_1, itile_1_2, itile_1_3, itile_1_4},
    {0, itile_2_1, itile_2_2, itile_2_3, 0},
    {0, itile_3_1, itile_3_2, 0, 0},
    {0, itile_4_1, 0, 0, 0},
    {0, itile_5_1, 0, 0, 0},
    {0, itile_6_1, 0, 0, 0},
};

/* Row m of x (bf16 or float32, K values) -> q [K] int16 and its scale (0 for a zero row). */
static float quantize_row(const void* x, int io_bf16, int64_t m, int64_t K, int16_t* q) {
    const uint16_t* xb = (const uint16_t*)x + m * K;
    const float* xf = (const float*)x + m * K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, io_bf16 ? bf16x8_load(xb + k)
                                                               : _mm256_loadu_ps(xf + k)));
    float amax = hmax8(mx);
    for (int64_t j = k; j < K; ++j) {
        float v = io_bf16 ? bf16_to_f32(xb[j]) : xf[j];
        v = v < 0 ? -v : v;
        amax = v > amax ? v : amax;
    }
    const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16) {
        const __m256 a = io_bf16 ? bf16x8_load(xb + k) : _mm256_loadu_ps(xf + k);
        const __m256 b = io_bf16 ? bf16x8_load(xb + k + 8) : _mm256_loadu_ps(xf + k + 8);
        const __m256i qa = _mm256_cvtps_epi32(_mm256_mul_ps(a, vinv));
        const __m256i qb = _mm256_cvtps_epi32(_mm256_mul_ps(b, vinv));
        /* packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> reorder the quadwords */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(qa, qb), 0xd8);
        _mm256_storeu_si256((__m256i*)(q + k), packed);
    }
    for (; k < K; ++k) {
        const float v = (io_bf16 ? bf16_to_f32(xb[k]) : xf[k]) * inv;
        const float r = nearbyintf(v);
        q[k] = (int16_t)(r > 32767.f ? 32767.f : r < -32768.f ? -32768.f : r);
    }
    return amax / 32767.0f;
}

/* Panels a tile of R rows takes at once. */
static const int PANELS[7] = {0, 4, 3, 2, 1, 1, 1};
#define MAX_ROWS 6
#define BLOCK_TILES 16 /* tiles of rows per block: 96 rows at most */
#define K_CHUNK 256    /* inputs per chunk; a multiple of 32 (the int8 blocks) */

/* y rows [m, m + R), columns [16 p, 16 p + 16 P) from the tile's float32 sums: times the
 * column's scale (int8 per channel) and the row's (int8), plus the bias, rounded once. */
static void epilogue(const float* acc, int R, int P, int64_t m, int64_t p, const float* scale,
                     const float* row_scale, const void* bias, void* y, int64_t N,
                     int io_bf16) {
    const int64_t n0 = p * 16, cols = 16 * (int64_t)P;
    for (int r = 0; r < R; ++r) {
        for (int64_t c = 0; c < cols; c += 8) {
            __m256 v = _mm256_loadu_ps(acc + r * cols + c);
            if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + n0 + c));
            if (row_scale) v = _mm256_mul_ps(v, _mm256_set1_ps(row_scale[m + r]));
            if (io_bf16) {
                if (bias) v = _mm256_add_ps(v, bf16x8_load((const uint16_t*)bias + n0 + c));
                bf16x8_store((uint16_t*)y + (m + r) * N + n0 + c, v);
            } else {
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps((const float*)bias + n0 + c));
                _mm256_storeu_ps((float*)y + (m + r) * N + n0 + c, v);
            }
        }
    }
}

/* 0 on success; -1 where these shapes are not handled (the caller falls back). */
int linear_avx2(const void* x, const void* wp, const float* scale, const void* bias, void* y,
                int M, int N, int K, int wtype, int io_bf16) {
    if (N % 16 || M <= 0 || K <= 0 || wtype < 0 || wtype > 2) return -1;
    if ((wtype == 0) != (scale == NULL) || (wtype == 2 && K % 32) || (wtype && K % 2)) return -1;
    /* bf16 weights: x as float32 (xf); int8: x as int16 (xq), a scale per row (sx). */
    float* xf = NULL;
    int16_t* xq = NULL;
    float* sx = NULL;
    if (wtype) {
        xq = (int16_t*)malloc((size_t)M * K * sizeof(int16_t));
        sx = (float*)malloc((size_t)M * sizeof(float));
        if (!xq || !sx) {
            free(xq);
            free(sx);
            return -1;
        }
        #pragma omp parallel for schedule(static) if ((int64_t)M * K > 65536)
        for (int m = 0; m < M; ++m) sx[m] = quantize_row(x, io_bf16, m, K, xq + (int64_t)m * K);
    } else if (io_bf16) {
        xf = (float*)malloc((size_t)M * K * sizeof(float));
        if (!xf) return -1;
        const uint16_t* xb = (const uint16_t*)x;
        #pragma omp parallel for schedule(static) if ((int64_t)M * K > 65536)
        for (int64_t i = 0; i < (int64_t)M * K; i += 8) {
            if (i + 8 <= (int64_t)M * K) {
                _mm256_storeu_ps(xf + i, bf16x8_load(xb + i));
            } else {
                for (int64_t j = i; j < (int64_t)M * K; ++j) xf[j] = bf16_to_f32(xb[j]);
            }
        }
    }
    const float* xs = io_bf16 ? xf : (const float*)x;
    const int64_t panels = N / 16, pstride = (int64_t)K * 16;
    /* As few tiles as MAX_ROWS rows at a time need, their rows spread evenly (33 rows go
     * 6+6+6+5+5+5, not 6+6+6+6+6+3). Tiles of base + 1 rows take at most that many panels. */
    const int tiles = (M + MAX_ROWS - 1) / MAX_ROWS, base = M / tiles, longer = M % tiles;
    const int P = PANELS[base + (longer > 0)];
    /* Rows go in blocks of up to BLOCK_TILES tiles whose float32 x fits in ~128 KiB of L2,
     * and each block meets every panel of the thread's range: W is streamed from memory once
     * per block, and x once per call (panels outermost streamed all of x once per panel: 5x
     * the traffic of W for a 768-row prefill). Inside a block, inputs go in chunks of K_CHUNK,
     * every tile of the block taking the chunk in turn: the chunk of the panel (8 KiB of
     * bf16) and of one tile's x (6 KiB) stay in L1, where a whole panel row of K = 1536 did
     * not (49 KiB). */
    const int64_t block_rows = 32768 / K > MAX_ROWS ? 32768 / K : MAX_ROWS;
    int block_tiles = (int)(block_rows / (base + 1)) > 1 ? (int)(block_rows / (base + 1)) : 1;
    block_tiles = block_tiles < BLOCK_TILES ? block_tiles : BLOCK_TILES;
    #pragma omp parallel
    {
        /* Contiguous ranges of panels per thread: each streams its own part of W. */
        int nt = 1, tid = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        const int64_t p_lo = panels * tid / nt, p_hi = panels * (tid + 1) / nt;
        float acc[BLOCK_TILES][MAX_ROWS * 16 * 4];
        for (int t0 = 0; t0 < tiles; t0 += block_tiles) {
            const int t1 = t0 + block_tiles < tiles ? t0 + block_tiles : tiles;
            for (int64_t p = p_lo; p < p_hi; p += P) {
                const int pn = p_hi - p < P ? (int)(p_hi - p) : P;
                for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
                    const int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
                    for (int t = t0; t < t1; ++t) {
                        const int rows = base + (t < longer);
                        const int64_t x0 = ((int64_t)t * base + (t < longer ? t : longer)) * K;
                        float* a = acc[t - t0];
                        if (wtype == 0)
                            TILES_bf16[rows][pn](xs + x0, K, (const uint16_t*)wp + p * pstride,
                                                 pstride, NULL, k0, k1, k0 > 0, a);
                        else /* in blocks: the panel's scales, [K / 32, 16] floats = K / 2 */
                            ITILES[rows][pn](xq + x0, K, (const int8_t*)wp + p * pstride,
                                             pstride, wtype == 2 ? scale + p * (K / 2) : NULL,
                                             k0, k1, k0 > 0, a);
                    }
                }
                for (int t = t0; t < t1; ++t) {
                    const int64_t m = (int64_t)t * base + (t < longer ? t : longer);
                    epilogue(acc[t - t0], base + (t < longer), pn, m, p,
                             wtype == 1 ? scale : NULL, sx, bias, y, N, io_bf16);
                }
            }
        }
    }
    free(xf);
    free(xq);
    free(sx);
    return 0;
}
#else
int linear_avx2(const void* x, const void* wp, const float* scale, const void* bias, void* y,
                int M, int N, int K, int wtype, int io_bf16) {
    (void)x; (void)wp; (void)scale; (void)bias; (void)y; (void)M; (void)N; (void)K;
    (void)wtype; (void)io_bf16;
    return -1;
}
#endif

#ifdef KVGATE_AMX
/* The one library with an AMX path says so, when Linux granted the tile state. */
const char* kvgate_isa(void) { return amx_ready ? "amx" : KVGATE_ISA_NAME; }
#else
KVGATE_DEFINE_ISA()
#endif
