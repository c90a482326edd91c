/* The AMX tile state and a tile configuration, shared by the amx builds' libraries (linear.c,
 * qlinear.c). Include after defining _GNU_SOURCE (for syscall) and only in code compiled for
 * AMX (__AMX_TILE__).
 *
 * Linux gives a process the AMX tile state only when asked (arch_prctl, once, for all its
 * threads); before that the first tile instruction faults. Each library asks when it loads;
 * if refused (an old kernel, or a hypervisor that hides the state), amx_ready stays 0 and the
 * library runs, and reports, its avx512bf16 path. */
#ifndef KVGATE_AMX_H
#define KVGATE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KVG_ARCH_REQ_XCOMP_PERM 0x1023
#define KVG_XFEATURE_XTILEDATA 18

static int amx_ready;

__attribute__((constructor)) static void amx_request(void) {
    amx_ready = syscall(SYS_arch_prctl, KVG_ARCH_REQ_XCOMP_PERM, KVG_XFEATURE_XTILEDATA) == 0;
}

/* _tile_loadconfig's 64-byte operand: palette 1, then per tile its bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Palette 1, tiles of 64-byte rows for a 2 x 2 block of C: tiles 0-3 accumulate C (row
 * block r, column block h: tile 2 r + h), 4-5 hold x (row blocks), 6-7 the other operand
 * (column blocks, 16 rows each). Row block 0 has ra rows, block 1 rb (0: its tiles unused).
 * The configuration is thread state: each thread loads its own. */
static inline void amx_configure_2x2(int ra, int rb) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {ra, ra, rb, rb, ra, rb, 16, 16};
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

#endif
