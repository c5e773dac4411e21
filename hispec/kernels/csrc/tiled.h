/* The tiled layout of q8a's weights (hs_q8a_tile, q8act.c's header comment), shared by the kernels
 * that read it: q8act.c (8-bit activations) and bf16_tiles.c (prompt chunks on bfloat16 tiles).
 * Internal: not part of the library's interface. */
#ifndef HISPEC_TILED_H
#define HISPEC_TILED_H

#include <stdint.h>
#include <stdlib.h>

#include "hispec_kernels.h" /* the formats (HS_Q8A_Q4, HS_Q8A_Q8, HS_Q8A_Q8G16) */

#define BLOCK 32
#define TILE 16 /* output columns per tile of the stored layout (= every path's COLS) */

static inline int block_bytes(int fmt) { return fmt == HS_Q8A_Q4 ? 16 : 32; }
/* weight scales per block of 32 codes: 2 for HS_Q8A_Q8G16 (one per 16), else 1 */
static inline int block_scales(int fmt) { return fmt == HS_Q8A_Q8G16 ? 2 : 1; }

/* Where block b of column n lies in a tiled weight of N columns and nb blocks a column: its byte j
 * is at base + (j / 4) * step + j % 4 (step 64 in a tile; 4, i.e. contiguous, in the last N % 16
 * columns, kept as rows). */
static inline int64_t tiled_block(int64_t n, int64_t b, int64_t nb, int bytes, int64_t N, int *step) {
    const int tail = n >= N / TILE * TILE;
    *step = tail ? 4 : 4 * TILE;
    return tail ? (n * nb + b) * bytes : n / TILE * TILE * nb * bytes + (b * (bytes / 4) * TILE + n % TILE) * 4;
}

/* Where scale (or offset) b of column n lies in the tiled scales [N, nb]. */
static inline int64_t tiled_scale(int64_t n, int64_t b, int64_t nb, int64_t N) {
    if (n >= N / TILE * TILE) return n * nb + b;
    return n / TILE * TILE * nb + b * TILE + n % TILE;
}

/* A thread's room for the last tile of N columns where N is not a multiple of TILE (tile_pad_new:
 * zeroed; all NULL where N is), its columns placed as in a full tile (pad_last_tile), so that every
 * path reads it as it reads the others; the missing columns have zero codes and scales (their
 * outputs are not stored). */
typedef struct {
    uint8_t *w;
    uint16_t *d, *m;
} tile_pad;

static inline tile_pad tile_pad_new(int64_t N, int64_t row_bytes, int64_t nb, int64_t ns) {
    tile_pad p = {NULL, NULL, NULL};
    if (N % TILE) {
        p.w = calloc((size_t)(TILE * row_bytes), 1);
        p.d = calloc((size_t)(TILE * ns), sizeof(uint16_t));
        p.m = calloc((size_t)(TILE * nb), sizeof(uint16_t));
    }
    return p;
}

/* 1 where the room tile_pad_new was asked for was given (or none was needed) */
static inline int tile_pad_ok(tile_pad p, int64_t N) { return N % TILE == 0 || (p.w && p.d && p.m); }

static inline void tile_pad_free(tile_pad p) {
    free(p.w);
    free(p.d);
    free(p.m);
}

/* The last tile's ncols < TILE columns as stored (rows: w [ncols, row bytes], d and m (NULL for 8-bit)
 * [ncols, ns]) into the pad, placed as in a full tile. */
static inline void pad_last_tile(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, int ncols, int64_t nb,
                          int64_t ns, tile_pad pad) {
    const int bytes = block_bytes(fmt);
    for (int c = 0; c < ncols; c++) {
        for (int64_t b = 0; b < nb; b++) {
            int step;
            const int64_t base = tiled_block(c, b, nb, bytes, TILE, &step), at = tiled_scale(c, b, nb, TILE);
            for (int j = 0; j < bytes; j++) pad.w[base + (j / 4) * step + (j & 3)] = w[(c * nb + b) * bytes + j];
            if (m) pad.m[at] = m[c * nb + b];
        }
        for (int64_t b = 0; b < ns; b++) pad.d[tiled_scale(c, b, ns, TILE)] = d[c * ns + b];
    }
}

#endif
