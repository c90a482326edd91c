/* Fused element-wise ops of a bf16 Llama layer, each replacing several small PyTorch ops.
 * Vector paths: 16 lanes with AVX512-BF16, 8 lanes with AVX2 + FMA; plain C otherwise (Python
 * then keeps these ops on PyTorch, see model/cpu_kernels.py, so the scalar code is the
 * reference the vector code must equal, and the tail of rows whose length the lanes miss).
 *
 * Built WITHOUT fast-math and with FMA contraction off: every operation rounds to bf16
 * exactly where PyTorch's separate bf16 ops would (torch computes a bf16 op in float32 and
 * rounds the result), so results match the unfused path op for op. The vector code spells
 * out each multiply and add with intrinsics for the same reason; an FMA appears only where
 * torch's own vector code (SLEEF's exp) has one.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Threads for an op of `work` elements: one per `per_thread` of them, at most all OpenMP's.
 * These ops take about 0.6-2 ns per element on one AVX2 core. A parallel region costs about
 * 1 us when the other threads are awake and free, but a whole scheduler time slice (ms) when
 * one of them has been preempted (measured: 8 ms for an 8-row norm on a busy 2-core box), so
 * each thread is given about 10 us of work at least (8 SmolLM2 rows): decode stays on the
 * calling thread, as PyTorch's own element-wise ops do at these sizes. Sizing the team by
 * the work also keeps a many-core machine from waking every core for a few rows. */
static int threads_for(int64_t work, int64_t per_thread) {
#ifdef _OPENMP
    const int64_t n = work / per_thread, most = omp_get_max_threads();
    return n < 1 ? 1 : n < most ? (int)n : (int)most;
#else
    (void)work, (void)per_thread;
    return 1;
#endif
}

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

#ifdef KVGATE_AVX512BF16
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

#ifdef KVGATE_AVX2
#include <immintrin.h>
#define HAVE_AVX2 1

#include "bf16_avx2.h"

/* Rounding to bf16, nearest even, of what an arithmetic op just produced: the only values
 * rounded here. bf16_avx2.h's rounding also tests for NaN and quiets it by hand; here that
 * changes no bit, so it is left out (its compare and blend made SiLU's exp path a third
 * slower on an AVX2 EPYC, and each op rounds 2-3 times per element). Why: x86 arithmetic
 * returns a quiet NaN that is either the default NaN or an operand's NaN, and by induction
 * every operand is a bf16 value or such a result, so every NaN has a zero low half; adding
 * the bias (at most 0x8000) then carries nothing into the high half, which already has its
 * quiet bit. Infinity and overflow round as torch does. */
static inline __m256i rne_bias8(__m256 x) { /* bits + bias: the bf16 in the high 16 bits */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
}

/* f32 -> bf16 -> f32: the value torch holds after a bf16 op */
static inline __m256 round8(__m256 x) {
    return _mm256_castsi256_ps(
        _mm256_and_si256(rne_bias8(x), _mm256_set1_epi32((int32_t)0xffff0000u)));
}

/* Round 8 floats to bf16 and store them. */
static inline void store8(uint16_t* p, __m256 x) {
    const __m256i b = _mm256_srli_epi32(rne_bias8(x), 16);
    /* packus works per 128-bit lane: [b0..3 b0..3 | b4..7 b4..7]; take quadwords 0 and 2 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

/* Round 16 floats (lo: 0-7, hi: 8-15) to bf16 and store them. */
static inline void store16(uint16_t* p, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_srli_epi32(rne_bias8(lo), 16),
                            _mm256_srli_epi32(rne_bias8(hi), 16)),
        0xd8);
    _mm256_storeu_si256((__m256i*)p, packed);
}

/* The 8-lane twin of rotate(): D % 16 == 0, so half = D/2 is a multiple of 8 and no 8-lane
 * chunk straddles the roll. cos/sin_signed come widened to float (cf, sf [D]): every head of
 * a token shares them. Two chunks per step so that 16 results go out in one store. */
static inline void rotate8(const uint16_t* x, const float* cf, const float* sf, uint16_t* out,
                           int D) {
    const int half = D / 2;
    for (int c = 0; c < D; c += 16) {
        __m256 o[2];
        for (int j = 0; j < 2; ++j) {
            const int lo = c + 8 * j, rc = (lo + half) % D;
            const __m256 a = _mm256_mul_ps(bf16x8_load(x + lo), _mm256_loadu_ps(cf + lo));
            const __m256 b = _mm256_mul_ps(bf16x8_load(x + rc), _mm256_loadu_ps(sf + lo));
            o[j] = _mm256_add_ps(round8(a), round8(b));
        }
        store16(out + c, o[0], o[1]);
    }
}
#endif

/* x [D] -> out [D]: out = x * cos + roll(x, D/2) * sin_signed, rounded per op. */
static inline void rotate(const uint16_t* x, const uint16_t* cos, const uint16_t* sin_signed,
                          uint16_t* out, int D) {
    const int half = D / 2;
    for (int d = 0; d < D; ++d) {
        const float a = r(ld(x[d]) * ld(cos[d]));
        const float b = r(ld(x[(d + half) % D]) * ld(sin_signed[d]));
        out[d] = st(a + b);
    }
}

/* Longest head the 8-lane path widens its cos/sin row for (two float [D] on the stack). */
#define MAX_ROPE_D 512

/* One token's heads: x [Hq + Hkv, D] (its q then k heads, contiguous in the qkv row) ->
 * q [Hq, D], k [Hkv, D], all with the token's cos/sin_signed rows [D]. */
static inline void rotate_heads(const uint16_t* x, const uint16_t* cos,
                                const uint16_t* sin_signed, uint16_t* q, uint16_t* k, int Hq,
                                int Hkv, int D) {
#ifdef HAVE_AVX512BF16
    if (D % 32 == 0) {
        for (int h = 0; h < Hq + Hkv; ++h)
            rotate16(x + h * D, cos, sin_signed, h < Hq ? q + h * D : k + (h - Hq) * D, D);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (D % 16 == 0 && D <= MAX_ROPE_D) {
        float cf[MAX_ROPE_D], sf[MAX_ROPE_D];  /* widened once, read by every head */
        for (int d = 0; d < D; d += 8) {
            _mm256_storeu_ps(cf + d, bf16x8_load(cos + d));
            _mm256_storeu_ps(sf + d, bf16x8_load(sin_signed + d));
        }
        for (int h = 0; h < Hq + Hkv; ++h)
            rotate8(x + h * D, cf, sf, h < Hq ? q + h * D : k + (h - Hq) * D, D);
        return;
    }
#endif
    for (int h = 0; h < Hq + Hkv; ++h)
        rotate(x + h * D, cos, sin_signed, h < Hq ? q + h * D : k + (h - Hq) * D, D);
}

/* Quantized K/V rows (kv_codec.py): D bytes of int8 or fp8 (e4m3) values, then NG float32
 * scales, one per D / NG values (the group's largest magnitude over 127 or 448; 1 for an
 * all-zero group), row stride D + 4 NG bytes. Bit-identical to KVCodec.encode (tested): the
 * same float32 divisions (this file has no fast-math), round half to even, clamp. */

/* A float in [-448, 448] to e4m3fn, rounded to nearest even: 3 mantissa bits, exponent bias
 * 7, subnormals below 2^-6 in steps of 2^-9; 0x7e (448) is the largest code (0x7f is NaN). */
static inline uint8_t f32_to_e4m3(float f) {
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    const float a = fabsf(f);
    if (!(a < 480.f)) return sign | (isnan(f) ? 0x7f : 0x7e);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f); /* 8: 2^-6, code 0x08 */
    int e;
    const float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    int q = (int)nearbyintf(m * 16.f);
    if (q == 16) q = 8, e += 1;
    const int code = ((e + 6) << 3) | (q - 8);
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

static void encode_row_q8(const uint16_t* x, uint8_t* out, int D, int NG, int fp8) {
    const int gs = D / NG;
    const float top = fp8 ? 448.f : 127.f;
    for (int g = 0; g < NG; ++g) {
        const uint16_t* xs = x + g * gs;
        float amax = 0.f;
        for (int d = 0; d < gs; ++d) {
            const float a = fabsf(ld(xs[d]));
            if (a > amax) amax = a;
        }
        float sc = amax / top;
        if (!(sc > 0.f)) sc = 1.f;
        uint8_t* o = out + g * gs;
        for (int d = 0; d < gs; ++d) {
            float v = ld(xs[d]) / sc;
            if (fp8) {
                o[d] = f32_to_e4m3(v < -448.f ? -448.f : v > 448.f ? 448.f : v);
            } else {
                v = nearbyintf(v);
                o[d] = (uint8_t)(int8_t)(v < -127.f ? -127.f : v > 127.f ? 127.f : v);
            }
        }
        memcpy(out + D + 4 * g, &sc, 4);
    }
}

/* qkv [T, (Hq + 2 Hkv) D] -> q_out [T, Hq, D], k_out [T, Hkv, D] rotated; rotated K and V
 * written to the head-major caches at slots[t]: rows of D bf16 ([Hkv, N * BS, D], NG = 0),
 * or quantized rows of D + 4 NG bytes (encode_row_q8). cos/sin tables [P, D]. k_offset
 * (float32 [Hkv, D], or NULL; quantized rows only): subtracted from each rotated k, rounded
 * to bf16 as torch's (k.float() - offset).to(bfloat16), before k is returned and encoded
 * (kv_codec.key_offset: it changes no attention weight).
 * Threads split tokens, one per ROPE_PER_THREAD rotated elements (SmolLM2: 12 heads of 64,
 * 768 a token, about 1 us on one AVX2 core): 2 threads from 16 tokens on. */
#define ROPE_PER_THREAD 6144
static void rope_write_rows(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                            const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                            uint16_t* k_out, void* k_cache, void* v_cache, int T, int Hq,
                            int Hkv, int D, int64_t num_slots, int NG, int fp8,
                            const float* k_offset) {
    const int64_t row = (int64_t)(Hq + 2 * Hkv) * D;
    const int64_t width = NG ? D + 4 * NG : 2 * D; /* bytes a cache row */
    const int64_t work = (int64_t)T * (Hq + (NG ? 3 : 1) * Hkv) * D;
    const int nt = threads_for(work, ROPE_PER_THREAD);
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < T; ++t) {
        const uint16_t* x = qkv + t * row;
        uint16_t* k = k_out + (int64_t)t * Hkv * D;
        rotate_heads(x, cos + positions[t] * D, sin_signed + positions[t] * D,
                     q_out + (int64_t)t * Hq * D, k, Hq, Hkv, D);
        if (k_offset)
            for (int i = 0; i < Hkv * D; ++i) k[i] = st(ld(k[i]) - k_offset[i]);
        for (int h = 0; h < Hkv; ++h) {
            uint8_t* kr = (uint8_t*)k_cache + ((int64_t)h * num_slots + slots[t]) * width;
            uint8_t* vr = (uint8_t*)v_cache + ((int64_t)h * num_slots + slots[t]) * width;
            const uint16_t* v = x + (Hq + Hkv + h) * D;
            if (NG) {
                encode_row_q8(k + h * D, kr, D, NG, fp8);
                encode_row_q8(v, vr, D, NG, fp8);
            } else {
                memcpy(kr, k + h * D, (size_t)D * 2);
                memcpy(vr, v, (size_t)D * 2);
            }
        }
    }
}

void rope_write_kv_bf16(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                        const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                        uint16_t* k_out, uint16_t* k_cache, uint16_t* v_cache, int T, int Hq,
                        int Hkv, int D, int64_t num_slots) {
    rope_write_rows(qkv, positions, cos, sin_signed, slots, q_out, k_out, k_cache, v_cache, T,
                    Hq, Hkv, D, num_slots, 0, 0, NULL);
}

/* The same, K and V encoded as they are written (int8, or fp8 with fp8 != 0), K less
 * k_offset (NULL: none). */
void rope_write_kv_q8(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                      const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                      uint16_t* k_out, uint8_t* k_cache, uint8_t* v_cache, int T, int Hq,
                      int Hkv, int D, int64_t num_slots, int NG, int fp8,
                      const float* k_offset) {
    if (NG < 1) return;
    rope_write_rows(qkv, positions, cos, sin_signed, slots, q_out, k_out, k_cache, v_cache, T,
                    Hq, Hkv, D, num_slots, NG, fp8, k_offset);
}

/* SLEEF's expf_u10 (PyTorch's vectorised exp): x = q ln2 + s with q = round(x / ln2) and ln2
 * split in two parts (L2U + L2L), e^s by a degree-7 polynomial in s (P0..P5 by Horner, then
 * 1 + s + s^2 * P), then scaled by 2^q; 0 below -104, inf above 100. Matching SLEEF's steps,
 * FMAs included, is what makes silu below round as torch's does. */
#define SLEEF_R_LN2 1.442695040888963407359924681001892137426645954152985934135449406931f
#define SLEEF_L2U 0.693145751953125f
#define SLEEF_L2L 1.428606765330187045e-06f
#define SLEEF_P0 0.000198527617612853646278381f
#define SLEEF_P1 0.00139304355252534151077271f
#define SLEEF_P2 0.00833336077630519866943359f
#define SLEEF_P3 0.0416664853692054748535156f
#define SLEEF_P4 0.166666671633720397949219f
#define SLEEF_P5 0.5f

#ifdef HAVE_AVX512BF16
/* e^x for 16 lanes: SLEEF's AVX-512 build, which scales by 2^q with vscalefps. */
static inline __m512 exp_sleef16(__m512 d) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(SLEEF_R_LN2)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-SLEEF_L2U), d);
    s = _mm512_fmadd_ps(q, _mm512_set1_ps(-SLEEF_L2L), s);
    __m512 u = _mm512_set1_ps(SLEEF_P0);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(SLEEF_P1));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(SLEEF_P2));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(SLEEF_P3));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(SLEEF_P4));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(SLEEF_P5));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    u = _mm512_scalef_ps(u, q);
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ),
                           _mm512_setzero_ps());
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                           _mm512_set1_ps(INFINITY));
    return u;
}
#endif

#ifdef HAVE_AVX2
/* 2^e as a float built from exponent bits (SLEEF's vpow2i): exact for -126 <= e <= 127. */
static inline __m256 pow2i8(__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
}

/* e^x for 8 lanes: SLEEF's AVX2 build (Sleef_expf8_u10). q is rounded to an int32 by
 * vcvtps2dq (nearest even), and the scaling is SLEEF's ldexp (vldexp2): times 2^(q >> 1),
 * then times 2^(q - (q >> 1)), each factor in range even where 2^q alone is not.
 * SLEEF's range ends (0 below -104, inf above 100: a compare and a select each) are had by
 * clamping d to [-110, 100.5] instead, where its own steps give 0 and inf; min/max put d
 * second so a NaN passes through. Checked on all 2^32 float inputs: the same bits as the
 * masked form (and as torch's float silu on 8M inputs), for two compares and a blend less. */
static inline __m256 exp_sleef8(__m256 d) {
    d = _mm256_min_ps(_mm256_set1_ps(100.5f), _mm256_max_ps(_mm256_set1_ps(-110.f), d));
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(SLEEF_R_LN2)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-SLEEF_L2U), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-SLEEF_L2L), s);
    __m256 u = _mm256_set1_ps(SLEEF_P0);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(SLEEF_P1));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(SLEEF_P2));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(SLEEF_P3));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(SLEEF_P4));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(SLEEF_P5));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i q1 = _mm256_srai_epi32(q, 1);
    return _mm256_mul_ps(_mm256_mul_ps(u, pow2i8(q1)), pow2i8(_mm256_sub_epi32(q, q1)));
}

/* silu(x) = x / (1 + e^-x) for 8 lanes as torch computes it (torch negates with a sign
 * flip), rounded to bf16: the value F.silu leaves in a bf16 tensor. */
static inline __m256 silu8(__m256 x) {
    const __m256 e = exp_sleef8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
    return round8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
}
#endif

#if defined(HAVE_AVX2) && !defined(HAVE_AVX512BF16)
/* SiLU's input is bf16, so silu8 has only 65,536 possible results: they are computed once,
 * on the first call (about 0.3 ms), into a table of floats indexed by the input's bits
 * (256 KB; the few thousand entries real activations hit stay in L1). A lookup is about five
 * times cheaper than the exp and divide on an AVX2 core, and gives the same bits: the table
 * holds exactly what silu8 returns for each input. Not filled at load time: loading the
 * library (to ask kvgate_isa()) must not run AVX2 code. */
#define HAVE_SILU_TABLE 1
static float silu_table[1 << 16];

static void silu_table_fill(void) {
    static int state;  /* 0: empty, 1: being filled, 2: ready (callers may race) */
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == 2) return;
    int expected = 0;
    if (__atomic_compare_exchange_n(&state, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        for (int32_t b = 0; b < (1 << 16); b += 8) {
            const __m256i bits = _mm256_add_epi32(_mm256_set1_epi32(b),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_storeu_ps(silu_table + b,
                             silu8(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16))));
        }
        __atomic_store_n(&state, 2, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != 2) _mm_pause();
    }
}

/* silu of 8 bf16 inputs g [8], from the table. Eight scalar loads put in a vector: cheaper
 * here than vpgatherdd, which is slow on AMD's AVX2 cores. */
static inline __m256 silu_lookup8(const uint16_t* g) {
    return _mm256_setr_ps(silu_table[g[0]], silu_table[g[1]], silu_table[g[2]],
                          silu_table[g[3]], silu_table[g[4]], silu_table[g[5]],
                          silu_table[g[6]], silu_table[g[7]]);
}
#endif

/* g [n], u [n] -> o [n] = silu(g) * u, rounded as torch's F.silu then * round:
 * silu(x) = x / (1 + e^-x) in float32 rounded to bf16, then the product rounded. */
static void silu_mul_span(const uint16_t* g, const uint16_t* u, uint16_t* o, int n) {
    int i = 0;
#if defined(HAVE_AVX512BF16)
    for (; i + 16 <= n; i += 16) {
        const __m512 x = bf16x16_load(g + i);
        const __m512 e = exp_sleef16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        _mm256_storeu_si256((__m256i*)(o + i),
                            bf16x16_round(_mm512_mul_ps(silu, bf16x16_load(u + i))));
    }
#elif defined(HAVE_SILU_TABLE)
    for (; i + 16 <= n; i += 16)
        store16(o + i, _mm256_mul_ps(silu_lookup8(g + i), bf16x8_load(u + i)),
                _mm256_mul_ps(silu_lookup8(g + i + 8), bf16x8_load(u + i + 8)));
    for (; i + 8 <= n; i += 8)
        store8(o + i, _mm256_mul_ps(silu_lookup8(g + i), bf16x8_load(u + i)));
    for (; i < n; ++i) o[i] = st(silu_table[g[i]] * ld(u[i]));
#endif
    for (; i < n; ++i) {
        const float x = ld(g[i]);
        o[i] = st(r(x / (1.f + expf(-x))) * ld(u[i]));
    }
}

/* gate_up [T, 2I] -> out [T, I] = silu(gate) * up (silu_mul_span per row).
 * The work is split in spans of SILU_SPAN outputs (a multiple of 16 lanes), so that a few
 * long rows still share out. One thread per SILU_PER_THREAD outputs (SmolLM2: I = 1536, about
 * 1 us a row on one AVX2 core with the table): 2 threads from 16 rows on. */
#define SILU_SPAN 256
#define SILU_PER_THREAD 12288
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int T, int I) {
#ifdef HAVE_SILU_TABLE
    silu_table_fill();
#endif
    const int spans = (I + SILU_SPAN - 1) / SILU_SPAN;
    const int nt = threads_for((int64_t)T * I, SILU_PER_THREAD);
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t w = 0; w < (int64_t)T * spans; ++w) {
        const int64_t t = w / spans;
        const int i = (int)(w % spans) * SILU_SPAN;
        const int n = I - i < SILU_SPAN ? I - i : SILU_SPAN;
        const uint16_t* g = gate_up + t * 2 * I + i;
        silu_mul_span(g, g + I, out + t * I + i, n);
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

#ifndef HAVE_AVX2
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

/* One row of add_rms_norm_bf16 in plain C; v, sq: float scratch [H]. */
static void add_rms_norm_row(const uint16_t* x, uint16_t* res, const uint16_t* weight,
                             uint16_t* o, int H, float eps, float* v, float* sq) {
    for (int i = 0; i < H; ++i) {
        if (x) res[i] = st(ld(res[i]) + ld(x[i]));
        v[i] = ld(res[i]);
        sq[i] = v[i] * v[i];
    }
    const float mean = torch_row_sum(sq, H) / (float)H;
    const float inv = 1.f / sqrtf(mean + eps);
    for (int i = 0; i < H; ++i) o[i] = st(ld(weight[i]) * r(v[i] * inv));
}
#else
/* (row[8v .. 8v+8))^2: one vector of torch's float32 squares of a bf16 row. */
static inline __m256 sq8(const uint16_t* row, int64_t v) {
    const __m256 x = bf16x8_load(row + v * SUM_LANES);
    return _mm256_mul_ps(x, x);
}

/* torch_row_sum of the squares of a bf16 row [n], one __m256 per 8-lane vector of the model:
 * the same adds in the same order, so the same float, without a float copy of the row. */
static float torch_row_sumsq8(const uint16_t* row, int n) {
    const int64_t nvec = n / SUM_LANES, rows = nvec / SUM_ILP;
    __m256 acc[SUM_LEVELS][SUM_ILP];
    for (int j = 0; j < SUM_LEVELS; ++j)
        for (int k = 0; k < SUM_ILP; ++k) acc[j][k] = _mm256_setzero_ps();
    const int power = ceil_log2(rows) / SUM_LEVELS > 4 ? ceil_log2(rows) / SUM_LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    for (; i + step <= rows;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < SUM_ILP; ++k)
                acc[0][k] = _mm256_add_ps(acc[0][k], sq8(row, i * SUM_ILP + k));
        for (int j = 1; j < SUM_LEVELS; ++j) {
            for (int k = 0; k < SUM_ILP; ++k) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < SUM_ILP; ++k)
            acc[0][k] = _mm256_add_ps(acc[0][k], sq8(row, i * SUM_ILP + k));
    for (int j = 1; j < SUM_LEVELS; ++j)
        for (int k = 0; k < SUM_ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    __m256 part0 = acc[0][0];
    for (int64_t v = rows * SUM_ILP; v < nvec; ++v) part0 = _mm256_add_ps(part0, sq8(row, v));
    for (int k = 1; k < SUM_ILP; ++k) part0 = _mm256_add_ps(part0, acc[0][k]);
    float lanes[SUM_LANES], total = 0.f;
    _mm256_storeu_ps(lanes, part0);
    for (int64_t e = nvec * SUM_LANES; e < n; ++e) total += ld(row[e]) * ld(row[e]);
    for (int l = 0; l < SUM_LANES; ++l) total += lanes[l];
    return total;
}

/* 8 lanes of weight * (v * inv rounded to bf16), the product returned for the caller to round. */
static inline __m256 norm8(const uint16_t* res, const uint16_t* weight, __m256 inv) {
    return _mm256_mul_ps(bf16x8_load(weight), round8(_mm256_mul_ps(bf16x8_load(res), inv)));
}

/* One row of add_rms_norm_bf16 with AVX2: three passes over the row (add, sum of squares,
 * scale), which stays in L1 (a few KB) between them. */
static void add_rms_norm_row8(const uint16_t* x, uint16_t* res, const uint16_t* weight,
                              uint16_t* o, int H, float eps) {
    int i = 0;
    if (x) {
        for (; i + 16 <= H; i += 16)
            store16(res + i, _mm256_add_ps(bf16x8_load(res + i), bf16x8_load(x + i)),
                    _mm256_add_ps(bf16x8_load(res + i + 8), bf16x8_load(x + i + 8)));
        for (; i + 8 <= H; i += 8)
            store8(res + i, _mm256_add_ps(bf16x8_load(res + i), bf16x8_load(x + i)));
        for (; i < H; ++i) res[i] = st(ld(res[i]) + ld(x[i]));
    }
    const float mean = torch_row_sumsq8(res, H) / (float)H;
    const float inv = 1.f / sqrtf(mean + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 16 <= H; i += 16)
        store16(o + i, norm8(res + i, weight + i, vinv), norm8(res + i + 8, weight + i + 8, vinv));
    for (; i + 8 <= H; i += 8) store8(o + i, norm8(res + i, weight + i, vinv));
    for (; i < H; ++i) o[i] = st(ld(weight[i]) * r(ld(res[i]) * inv));
}
#endif

/* residual [T, H] += x (x may be NULL); out [T, H] = weight * RMSNorm(residual), rounded as
 * PyTorch's `residual.add_(x)` then `weight * F.rms_norm(residual, (H,), eps=eps)` round:
 * the sum of squares in torch's order, mean = sum / H, 1 / sqrt(mean + eps) in float32,
 * then x * r rounded to bf16, then times the weight rounded again. Returns -1 (Python then
 * uses torch) only in the plain-C build, for H past its scratch (MAX_HIDDEN).
 * Threads split rows, one per NORM_PER_THREAD elements (SmolLM2: H = 576, about 1 us a row
 * on one AVX2 core): 2 threads from 16 rows on. */
#define NORM_PER_THREAD 4608
int add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                      uint16_t* out, int T, int H, float eps) {
#ifndef HAVE_AVX2
    if (H > MAX_HIDDEN) return -1;
#endif
    const int nt = threads_for((int64_t)T * H, NORM_PER_THREAD);
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < T; ++t) {
        const uint16_t* xt = x ? x + (int64_t)t * H : NULL;
#ifdef HAVE_AVX2
        add_rms_norm_row8(xt, residual + (int64_t)t * H, weight, out + (int64_t)t * H, H, eps);
#else
        float v[MAX_HIDDEN], sq[MAX_HIDDEN];
        add_rms_norm_row(xt, residual + (int64_t)t * H, weight, out + (int64_t)t * H, H, eps, v,
                         sq);
#endif
    }
    return 0;
}

KVGATE_DEFINE_ISA()
