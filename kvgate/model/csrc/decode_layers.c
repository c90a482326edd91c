/* Decoder layers of a pure decode step (one query token per sequence), bf16, in one call.
 *
 * At batch 1 a layer's work is nine small kernels (three of them linears over ~9 MB of
 * weights) and each, called from Python through ctypes, paid ~16 us before starting (tensor
 * allocation, argument conversion): about 270 calls and 4-7 ms of a 20 ms token on the AMD
 * EPYC. This file adds no arithmetic of its own: it runs the same kernels from the other
 * libraries (passed in as function pointers), in the same order, on the same inputs, so a
 * step's results are bit-identical to the per-op path (tested), and only the calls' cost goes.
 *
 * Per layer, with T tokens, hidden H, query / KV heads Hq / Hkv of D, intermediate I:
 *   qkv = h Wqkv^T (+ b)          [T, (Hq + 2 Hkv) D]
 *   q, k = rope(qkv); K/V -> cache
 *   attn = paged decode(q)        [T, Hq D]
 *   h = norm(residual += attn Wo^T, post_norm)
 *   act = silu(h Wg^T) * (h Wu^T) [T, I]
 *   h = norm(residual += act Wd^T, next_norm)  (the next layer's input norm, or the final one)
 */
#include <stdint.h>

#include "isa.h"

typedef int (*linear_widen_fn)(const void* x, const void* wp, const float* scale,
                               const void* bias, void* y, int M, int N, int K, int wtype,
                               int io_bf16);
typedef int (*linear_dot_fn)(const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
                             uint16_t* y, int M, int N, int K);
typedef void (*rope_fn)(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                        const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                        uint16_t* k_out, uint16_t* k_cache, uint16_t* v_cache, int T, int Hq,
                        int Hkv, int D, int64_t num_slots);
typedef int (*attend_fn)(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                         const int64_t* tables, const int64_t* lens, uint16_t* out, int B,
                         int Hkv, int G, int D, int64_t N, int BS, int max_blocks, float scale);
typedef void (*rope_q8_fn)(const uint16_t* qkv, const int64_t* positions, const uint16_t* cos,
                           const uint16_t* sin_signed, const int64_t* slots, uint16_t* q_out,
                           uint16_t* k_out, uint8_t* k_cache, uint8_t* v_cache, int T, int Hq,
                           int Hkv, int D, int64_t num_slots, int NG, int fp8,
                           const float* k_offset);
typedef int (*attend_q8_fn)(const uint16_t* q, const uint8_t* kc, const uint8_t* vc,
                            const int64_t* tables, const int64_t* lens, uint16_t* out, int B,
                            int Hkv, int G, int D, int64_t N, int BS, int max_blocks,
                            float scale, int NG, const float* fp8);
typedef int (*add_norm_fn)(const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                           uint16_t* out, int T, int H, float eps);
typedef void (*silu_mul_fn)(const uint16_t* gate_up, uint16_t* out, int T, int I);

/* One linear layer as its kernel takes it (the Python side's NativeLinear). */
typedef struct {
    void* fn;            /* linear_avx2 (kind 0) or linear_bf16 (kind 1) */
    const void* weight;  /* packed as that kernel reads it */
    const float* scale;  /* int8 scales, or NULL */
    const void* bias;    /* bf16 [N], or NULL */
    int32_t kind, n, k, wtype;
} kvg_linear;

typedef struct {
    kvg_linear qkv, o, gate_up, down;
    const uint16_t* post_norm;
    const uint16_t* next_norm;
    void* k_cache;   /* head-major [Hkv, N, BS, D] bf16, or [Hkv, N, BS, D + 4 NG] bytes */
    void* v_cache;
    const float* k_offset;  /* [Hkv, D] that quantized keys are stored less, or NULL */
} kvg_layer;

typedef struct {
    void* rope;
    void* attend;
    void* add_norm;
    void* silu_mul;
    const uint16_t* cos;         /* [P, D] */
    const uint16_t* sin_signed;  /* [P, D] */
    int32_t hq, hkv, d, hidden, inter, num_blocks, block_size;
    float eps, scale;
    /* Quantized K/V rows (kv_codec.py): scales a row (0: bf16 rows, rope and attend above),
     * the fp8 value table (NULL: int8), and the kernels that write and read them. */
    int32_t kv_groups;
    const float* fp8;
    void* rope_q8;
    void* attend_q8;
} kvg_model;

typedef struct {
    const int64_t* positions;  /* [T] */
    const int64_t* slots;      /* [T] flat cache slot of each token's K/V */
    const int64_t* tables;     /* [T * max_blocks] block tables, 0-padded */
    const int64_t* lens;       /* [T] context lengths, this token included */
    uint16_t* residual;        /* [T, H], updated in place */
    uint16_t* h;               /* [T, H]: in, layer l0's normed input; out, the last's output */
    uint16_t* scratch;         /* kvg_scratch_elems(model, T) bf16 */
    int32_t t, max_blocks;
} kvg_step;

static int64_t qkv_elems(const kvg_model* m, int64_t T) {
    return T * (m->hq + 2 * m->hkv) * m->d;
}

/* bf16 elements of scratch a step of T tokens needs. */
int64_t kvg_scratch_elems(const kvg_model* m, int T) {
    const int64_t t = T;
    return qkv_elems(m, t) + 2 * t * m->hq * m->d + t * m->hkv * m->d + t * m->hidden +
           3 * t * m->inter;
}

static int linear(const kvg_linear* l, const uint16_t* x, uint16_t* y, int M) {
    if (l->kind == 0)
        return ((linear_widen_fn)l->fn)(x, l->weight, l->scale, l->bias, y, M, l->n, l->k,
                                        l->wtype, 1);
    return ((linear_dot_fn)l->fn)(x, (const uint16_t*)l->weight, (const uint16_t*)l->bias, y, M,
                                  l->n, l->k);
}

/* Layers [l0, l1) of the step; 0, or the negative index - 1 of the op that refused. */
int kvg_decode_layers(const kvg_model* m, const kvg_layer* layers, int l0, int l1,
                      const kvg_step* s) {
    const int T = s->t, H = m->hidden, I = m->inter;
    uint16_t* qkv = s->scratch;
    uint16_t* q = qkv + qkv_elems(m, T);
    uint16_t* k = q + (int64_t)T * m->hq * m->d;
    uint16_t* attn = k + (int64_t)T * m->hkv * m->d;
    uint16_t* out = attn + (int64_t)T * m->hq * m->d;  /* o's and down's output, [T, H] */
    uint16_t* gate_up = out + (int64_t)T * H;
    uint16_t* act = gate_up + (int64_t)T * 2 * I;
    const int64_t num_slots = (int64_t)m->num_blocks * m->block_size;
    for (int i = l0; i < l1; ++i) {
        const kvg_layer* L = &layers[i];
        if (linear(&L->qkv, s->h, qkv, T)) return -1;
        if (m->kv_groups) {
            ((rope_q8_fn)m->rope_q8)(qkv, s->positions, m->cos, m->sin_signed, s->slots, q, k,
                                     L->k_cache, L->v_cache, T, m->hq, m->hkv, m->d, num_slots,
                                     m->kv_groups, m->fp8 != 0, L->k_offset);
            if (((attend_q8_fn)m->attend_q8)(q, L->k_cache, L->v_cache, s->tables, s->lens, attn,
                                             T, m->hkv, m->hq / m->hkv, m->d, m->num_blocks,
                                             m->block_size, s->max_blocks, m->scale,
                                             m->kv_groups, m->fp8))
                return -2;
        } else {
            ((rope_fn)m->rope)(qkv, s->positions, m->cos, m->sin_signed, s->slots, q, k,
                               L->k_cache, L->v_cache, T, m->hq, m->hkv, m->d, num_slots);
            if (((attend_fn)m->attend)(q, L->k_cache, L->v_cache, s->tables, s->lens, attn, T,
                                       m->hkv, m->hq / m->hkv, m->d, m->num_blocks,
                                       m->block_size, s->max_blocks, m->scale))
                return -2;
        }
        if (linear(&L->o, attn, out, T)) return -3;
        if (((add_norm_fn)m->add_norm)(out, s->residual, L->post_norm, s->h, T, H, m->eps))
            return -4;
        if (linear(&L->gate_up, s->h, gate_up, T)) return -5;
        ((silu_mul_fn)m->silu_mul)(gate_up, act, T, I);
        if (linear(&L->down, act, out, T)) return -6;
        if (((add_norm_fn)m->add_norm)(out, s->residual, L->next_norm, s->h, T, H, m->eps))
            return -7;
    }
    return 0;
}

KVGATE_DEFINE_ISA()
