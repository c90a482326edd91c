/* The vector path a kernel library is compiled with, chosen by the compiler target alone
 * (-march per level, see model/cpu_isa.py), and reported back to Python by kvgate_isa().
 *
 *   KVGATE_AMX         AMX-TILE + AMX-BF16 (Sapphire Rapids and later), on top of AVX512-BF16:
 *                      tdpbf16ps on 16 x 16 tiles. linear.c (bf16) and qlinear.c (AMX-INT8's
 *                      tdpbsud) have paths of their own here, and report amx; paged_decode.c's
 *                      prefill attention runs on tiles here (prefill_bf16.h) while the library
 *                      reports avx512bf16 like the others of the amx level.
 *   KVGATE_AVX512BF16  AVX512F + AVX512-BF16: vdpbf16ps on bf16 pairs, 16 fp32 lanes
 *   KVGATE_AVX2        AVX2 + FMA: 8 fp32 lanes, bf16 widened in registers. Also defined in
 *                      the AVX-512 builds (those CPUs run AVX2), where an op has no
 *                      AVX-512 path of its own, or for dtypes that path does not take.
 * Neither: plain C; Python then keeps that library's ops on PyTorch (one fallback rule).
 */
#ifndef KVGATE_ISA_H
#define KVGATE_ISA_H

#if defined(__AVX2__) && defined(__FMA__)
#define KVGATE_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVGATE_AVX512BF16 1
#endif

#if defined(KVGATE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVGATE_AMX 1
#endif

#if defined(KVGATE_AVX512BF16)
#define KVGATE_ISA_NAME "avx512bf16"
#elif defined(KVGATE_AVX2)
#define KVGATE_ISA_NAME "avx2"
#else
#define KVGATE_ISA_NAME "generic"
#endif

/* Defines the library's kvgate_isa(); include this header from exactly one source per library. */
#define KVGATE_DEFINE_ISA() \
    const char* kvgate_isa(void) { return KVGATE_ISA_NAME; }

#endif
