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

#include "bf16_avx512.h"

static inline __m512 round16(__m512 x) { /* f32 -> nearest-even bf16 -> f32, as torch rounds */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round(x)), 16));
}

/* The vector twin of rotate(): D % 32 == 0, 16 lanes at a time; roll(x, D/2) swaps halves. */
static inline void rotate16(const uint16_t* x, const uint16_t* cos, const uint16_t* sin_signed,
                            uint16_t* out, int D) {
    const int half = D / 2;
    for (int c = 0; c < D; c += 16) {
        const int rc = (c + half) % D;
        const __m512 a = round16(_mm512_mul_ps(bf16x16_load(x + c), bf16x16_load(cos + c)));
        const __m512 b = round16(_mm512_mul_ps(bf16x16_load(x + rc), bf16x16_load(sin_signed + c)));
        _mm256_storeu_si256((__m256i*)(out + c), bf16x16_round(_mm512_add_ps(a, b)));
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

#ifdef HAVE_AVX512BF16
/* e^x for 16 lanes, as SLEEF's expf_u10 (PyTorch's vectorised exp) computes it: x = q ln2 + s
 * with q = round(x / ln2) and ln2 split in two parts, e^s by a degree-7 polynomial, then
 * scaled by 2^q. Matching SLEEF's steps is what makes silu below round as torch's does. */
static inline __m512 exp_sleef16(__m512 d) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    u = _mm512_scalef_ps(u, q);
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ),
                           _mm512_setzero_ps());
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                           _mm512_set1_ps(INFINITY));
    return u;
}
#endif

/* gate_up [T, 2I] -> out [T, I] = silu(gate) * up, rounded as torch's F.silu then * round:
 * silu(x) = x / (1 + e^-x) in float32 rounded to bf16, then the product rounded. */
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int T, int I) {
    #pragma omp parallel for schedule(static) if ((int64_t)T * I > 8192)
    for (int t = 0; t < T; ++t) {
        const uint16_t* g = gate_up + (int64_t)t * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + (int64_t)t * I;
        int i = 0;
#ifdef HAVE_AVX512BF16
        for (; i + 16 <= I; i += 16) {
            const __m512 x = bf16x16_load(g + i);
            const __m512 e = exp_sleef16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 silu = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            _mm256_storeu_si256((__m256i*)(o + i),
                                bf16x16_round(_mm512_mul_ps(silu, bf16x16_load(u + i))));
        }
#endif
        for (; i < I; ++i) {
            const float x = ld(g[i]);
            o[i] = st(r(x / (1.f + expf(-x))) * ld(u[i]));
        }
    }
}

/* Sum of a float row in exactly the order PyTorch 2.x's CPU sum kernel uses for a contiguous
 * row (aten/src/ATen/native/cpu/SumKernel.cpp, as this build runs it: 8-lane vectors), so
 * a norm computed here rounds where torch.rms_norm does, bit for bit:
 *  - the row is read as V = n / 8 vectors, taken 4 at a time (4 interleaved partial sums);
 *  - each partial is a cascade: rows are added into level 0, and every 2^p rows a level
 *    is folded into the one above (p = max(4, ceil(log2(rows)) / 4), 4 levels);
 *  - leftover vectors go into partial 0, partials are added 0 + 1 + 2 + 3;
 *  - then, starting from 0: the n % 8 leftover scalars, then the 8 lanes in order. */
#define SUM_LANES 8
#define SUM_ILP 4
#define SUM_LEVELS 4

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) ++r;
    return r;
}

static float torch_row_sum(const float* row, int n) {
    const int64_t nvec = n / SUM_LANES, rows = nvec / SUM_ILP;
    float acc[SUM_LEVELS][SUM_ILP][SUM_LANES];
    memset(acc, 0, sizeof acc);
    const int power = ceil_log2(rows) / SUM_LEVELS > 4 ? ceil_log2(rows) / SUM_LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    for (; i + step <= rows;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < SUM_ILP; ++k)
                for (int l = 0; l < SUM_LANES; ++l)
                    acc[0][k][l] += row[(i * SUM_ILP + k) * SUM_LANES + l];
        for (int j = 1; j < SUM_LEVELS; ++j) {
            for (int k = 0; k < SUM_ILP; ++k)
                for (int l = 0; l < SUM_LANES; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < SUM_ILP; ++k)
            for (int l = 0; l < SUM_LANES; ++l)
                acc[0][k][l] += row[(i * SUM_ILP + k) * SUM_LANES + l];
    for (int j = 1; j < SUM_LEVELS; ++j)
        for (int k = 0; k < SUM_ILP; ++k)
            for (int l = 0; l < SUM_LANES; ++l) acc[0][k][l] += acc[j][k][l];
    float* part0 = acc[0][0];
    for (int64_t v = rows * SUM_ILP; v < nvec; ++v)
        for (int l = 0; l < SUM_LANES; ++l) part0[l] += row[v * SUM_LANES + l];
    for (int k = 1; k < SUM_ILP; ++k)
        for (int l = 0; l < SUM_LANES; ++l) part0[l] += acc[0][k][l];
    float total = 0.f;
    for (int64_t e = nvec * SUM_LANES; e < n; ++e) total += row[e];
    for (int l = 0; l < SUM_LANES; ++l) total += part0[l];
    return total;
}

#define MAX_HIDDEN 16384

/* residual [T, H] += x (x may be NULL); out [T, H] = weight * RMSNorm(residual), rounded as
 * PyTorch's `residual.add_(x)` then `weight * F.rms_norm(residual, (H,), eps=eps)` round:
 * the sum of squares in torch's order, mean = sum / H, 1 / sqrt(mean + eps) in float32,
 * then x * r rounded to bf16, then times the weight rounded again. */
int add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                      uint16_t* out, int T, int H, float eps) {
    if (H > MAX_HIDDEN) return -1;
    #pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; ++t) {
        uint16_t* res = residual + (int64_t)t * H;
        float v[MAX_HIDDEN], sq[MAX_HIDDEN];
        for (int i = 0; i < H; ++i) {
            if (x) res[i] = st(ld(res[i]) + ld(x[(int64_t)t * H + i]));
            v[i] = ld(res[i]);
            sq[i] = v[i] * v[i];
        }
        const float mean = torch_row_sum(sq, H) / (float)H;
        const float inv = 1.f / sqrtf(mean + eps);
        uint16_t* o = out + (int64_t)t * H;
        for (int i = 0; i < H; ++i) o[i] = st(ld(weight[i]) * r(v[i] * inv));
    }
    return 0;
}

/* 1 when the AVX512-BF16 path was compiled in (it beats PyTorch at every row count). */
int fused_ops_vectorized(void) {
#ifdef HAVE_AVX512BF16
    return 1;
#else
    return 0;
#endif
}
