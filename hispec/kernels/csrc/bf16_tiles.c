/* Prompt chunks' products on bfloat16 AMX tiles, for q8a's tiled weights (tiled.h; q8act.c's header
 * comment has the formats). Where the CPU has AMX-BF16 (Sapphire Rapids and later) and Linux lets the
 * process use the tiles, a prompt chunk's rows x [T, K] float32 times W^T, W the weights' exact values
 * (4-bit: d q + m; 8-bit: d q; group 16: a scale per 16), is taken as
 *
 *   a[t, k] = bf16(x[t, k])                      rounded to nearest even, once per call
 *   w[n, k] = bf16(fma(d, q, m))                 (8-bit: d * q), rounded once, tile by tile
 *   y[t, n] = sum over k of a[t, k] w[n, k]      TDPBF16PS: products added in float32 by the tile unit
 *                                                (its own order within a tile product; tiles in k order)
 *
 * q8a's 8-bit activations take each block's integer sum on the tile unit and scale it in float
 * per block (q8act.c's AMX path); here the scales are folded into the weights once per tile, so the
 * tile unit runs back to back and the vector units only convert. On SmolLM2-135M's four decoder
 * matmuls at 256 rows (2 threads, the Xeon with AMX, thirty-first session) this ran 1.8-2.3x faster
 * than q8a's AMX path, about as fast as oneDNN's bfloat16 product on a dense copy, which this keeps
 * none of: the weights are rebuilt in bfloat16 16 columns at a time (nb KB a tile, in a thread's
 * buffer), a cost per call that is ~1/3 of a 64-row product (at 16 rows q8a is ~1.4x faster; a prompt's
 * rows cannot switch kernels by count without their bits depending on the chunking).
 *
 * A row's outputs depend on that row alone: the tile unit treats the rows apart, the k order is
 * fixed, each output is one thread's; so a prompt's K/V do not depend on how it was cut into chunks.
 * The rows are padded to 32 with zeros (their outputs are not stored); the last N % 16 columns are
 * placed as in a full tile (tiled.h's pad_last_tile). Against float32 the error is the two roundings
 * to bfloat16 (2^-9 of each activation and weight), where q8a rounds an activation by up to
 * amax / 254 of its block. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hispec_kernels.h"
#include "simd.h"  /* hs_amx_tiles, amx_config */
#include "tiled.h" /* BLOCK, TILE, the tiled layout, tile_pad */

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BF16_TILES 1
#include <immintrin.h>

#define ROWS 16  /* rows of an A and a C tile */
#define B_BYTES 1024  /* a B tile: 16 pairs of k (rows) x 16 columns x 2 bfloat16 */

/* Tiles 0-3: C [16, 16] float32 (rows r0 + 16 i, column tile j: tile 2 i + j); 4, 5: A [16, 32]
 * bfloat16 (the two row groups); 6, 7: B [16 pairs, 16 columns x 2] (the two column tiles). */
static void tiles_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = ROWS;
    _tile_loadconfig(&c);
}

/* 16 columns' values (4 lanes each, lanes 4c .. 4c + 3: 4 consecutive k of column c, for c in 0..3 of
 * group g) as float32: codes * d (+ m), one rounding (fma). */
static inline __m512 dequant4(__m128i codes, int is_signed, __m512 d, __m512 m, int has_m) {
    const __m512 q = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes));
    return has_m ? _mm512_fmadd_ps(q, d, m) : _mm512_mul_ps(q, d);
}

/* One dword row of a block (64 bytes: 4 consecutive codes of each of the 16 columns, as int8 or as
 * nibbles already split) -> two B rows (k pairs 2i, 2i + 1 of the block's tile): row 2i holds each
 * column's first two codes, row 2i + 1 the last two. dv, mv: the block's scales spread to 4 lanes
 * a column (dv[g] for columns 4g .. 4g + 3). */
static inline void dword_rows(__m512i codes, int is_signed, const __m512 *dv, const __m512 *mv, int has_m,
                              uint32_t *row_even, uint32_t *row_odd) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512i half[2];  /* columns 0-7, 8-15: dword 2c = codes 0, 1 of column c; 2c + 1 = codes 2, 3 */
    const __m512 f0 = dequant4(_mm512_extracti32x4_epi32(codes, 0), is_signed, dv[0], mv[0], has_m);
    const __m512 f1 = dequant4(_mm512_extracti32x4_epi32(codes, 1), is_signed, dv[1], mv[1], has_m);
    const __m512 f2 = dequant4(_mm512_extracti32x4_epi32(codes, 2), is_signed, dv[2], mv[2], has_m);
    const __m512 f3 = dequant4(_mm512_extracti32x4_epi32(codes, 3), is_signed, dv[3], mv[3], has_m);
    half[0] = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);  /* columns 0-7 */
    half[1] = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);  /* columns 8-15 */
    _mm512_store_si512(row_even, _mm512_permutex2var_epi32(half[0], even, half[1]));
    _mm512_store_si512(row_odd, _mm512_permutex2var_epi32(half[0], odd, half[1]));
}

/* A block's 16 scales (float16 bits) spread to 4 lanes a column: out[g] lane l = s[4g + l / 4]. */
static inline void spread_scales(const uint16_t *s, __m512 *out) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    for (int g = 0; g < 4; g++) {
        const __m512i idx = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                                                  5, 4, 3, 2, 1, 0), 2),
                                             _mm512_set1_epi32(4 * g));
        out[g] = _mm512_permutexvar_ps(idx, v);
    }
}

/* A tile of 16 columns (tw, dt, mt: as stored in a full tile, or the pad) -> its nb B tiles in bt:
 * block b's tile at bt + b * B_BYTES, pair row p (k = 2p, 2p + 1) at + p * 64. */
static void tile_to_bf16(int fmt, const uint8_t *tw, const uint16_t *dt, const uint16_t *mt, int64_t nb, uint8_t *bt) {
    __m512 dv[4], mv[4], dv2[4];
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        uint32_t *rows = (uint32_t *)(bt + b * B_BYTES);  /* 16 rows of 16 dwords */
        if (fmt == HS_Q8A_Q4) {  /* dword i: low nibbles are codes 4i .. 4i + 3, high ones 16 + 4i .. */
            spread_scales(dt + b * TILE, dv);
            spread_scales(mt + b * TILE, mv);
            for (int i = 0; i < 4; i++) {
                const __m512i raw = _mm512_loadu_si512(tw + (b * 4 + i) * 64);
                dword_rows(_mm512_and_si512(raw, nibble), 0, dv, mv, 1, rows + (2 * i) * 16, rows + (2 * i + 1) * 16);
                dword_rows(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), 0, dv, mv, 1,
                           rows + (8 + 2 * i) * 16, rows + (9 + 2 * i) * 16);
            }
        } else {  /* 8-bit: dword i holds codes 4i .. 4i + 3; group 16: dwords 4-7 take the second scale */
            const int g16 = fmt == HS_Q8A_Q8G16;
            spread_scales(dt + (g16 ? 2 * b : b) * TILE, dv);
            if (g16) spread_scales(dt + (2 * b + 1) * TILE, dv2);
            for (int i = 0; i < 8; i++) {
                const __m512i raw = _mm512_loadu_si512(tw + (b * 8 + i) * 64);
                dword_rows(raw, 1, g16 && i >= 4 ? dv2 : dv, dv, 0, rows + (2 * i) * 16, rows + (2 * i + 1) * 16);
            }
        }
    }
}

/* Rows r0 .. r0 + 31 of a (bfloat16 [Tp, K]) times two column tiles' B tiles (b0, b1) -> y. */
static inline void tile_products(const uint16_t *a, int64_t K, int64_t nb, const uint8_t *b0, const uint8_t *b1,
                                 int64_t r0, int64_t T, float *y, int64_t N, int64_t n0, int ncols0, int ncols1,
                                 float *cbuf) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *a0 = a + r0 * K, *a1 = a + (r0 + ROWS) * K;
    if (r0 + ROWS >= T) {  /* the second row group is all padding: its products are skipped */
        for (int64_t b = 0; b < nb; b++) {
            _tile_loadd(4, a0 + b * BLOCK, K * 2);
            _tile_loadd(6, b0 + b * B_BYTES, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + b * B_BYTES, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
    } else for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(4, a0 + b * BLOCK, K * 2);
        _tile_loadd(6, b0 + b * B_BYTES, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + b * B_BYTES, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + b * BLOCK, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    /* C tile (i, j) -> rows r0 + 16 i, columns n0 + 16 j: stored in place where whole, else through cbuf */
#define STORE_C(TILE_ID, I, J, NCOLS)                                                                  \
    do {                                                                                               \
        const int64_t rr = r0 + (I) * ROWS, live = T - rr < ROWS ? T - rr : ROWS;                      \
        if ((NCOLS) > 0 && live > 0) {                                                                 \
            float *yt = y + rr * N + n0 + (J) * TILE;                                                  \
            if (live == ROWS && (NCOLS) == TILE) {                                                     \
                _tile_stored(TILE_ID, yt, N * 4);                                                      \
            } else {                                                                                   \
                _tile_stored(TILE_ID, cbuf, 64);                                                       \
                const __mmask16 mask = (__mmask16)((1u << (NCOLS)) - 1);                               \
                for (int64_t r = 0; r < live; r++)                                                     \
                    _mm512_mask_storeu_ps(yt + r * N, mask, _mm512_load_ps(cbuf + r * TILE));          \
            }                                                                                          \
        }                                                                                              \
    } while (0)
    STORE_C(0, 0, 0, ncols0);
    STORE_C(1, 0, 1, ncols1);
    STORE_C(2, 1, 0, ncols0);
    STORE_C(3, 1, 1, ncols1);
#undef STORE_C
}

/* x [T, K] float32 -> a [Tp, K] bfloat16 (round to nearest even), rows T .. Tp - 1 zero. */
static void rows_to_bf16(const float *x, int64_t T, int64_t Tp, int64_t K, uint16_t *a, int parallel) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < Tp; t++) {
        uint16_t *at = a + t * K;
        if (t >= T) {
            memset(at, 0, (size_t)K * 2);
            continue;
        }
        for (int64_t k = 0; k < K; k += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + t * K + k + 16), _mm512_loadu_ps(x + t * K + k));
            _mm512_storeu_si512(at + k, (__m512i)v);
        }
    }
}

static int run(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, int64_t T, int64_t N,
               int64_t K, float *y, int parallel) {
    const int64_t nb = K / BLOCK, row_bytes = nb * block_bytes(fmt), ns = nb * block_scales(fmt);
    const int64_t tiles = (N + TILE - 1) / TILE, pairs = (tiles + 1) / 2, Tp = (T + 2 * ROWS - 1) / (2 * ROWS) * (2 * ROWS);
    uint16_t *a = aligned_alloc(64, (size_t)(Tp * K) * 2);
    if (!a) return 0;
    rows_to_bf16(x, T, Tp, K, a, parallel);
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        uint8_t *bt = aligned_alloc(64, (size_t)(2 * nb * B_BYTES));  /* the pair's B tiles */
        float *cbuf = aligned_alloc(64, ROWS * TILE * sizeof(float));
        const tile_pad pad = tile_pad_new(N, row_bytes, nb, ns);
        const int ok = bt && cbuf && tile_pad_ok(pad, N);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (ok) tiles_configure();
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < pairs; p++) {
            if (!ok) continue;
            int ncols[2] = {0, 0};
            for (int j = 0; j < 2; j++) {
                const int64_t tile = 2 * p + j, n0 = tile * TILE;
                uint8_t *bj = bt + j * nb * B_BYTES;
                if (tile >= tiles) {  /* an odd last tile: its partner's products are zero, not stored */
                    memset(bj, 0, (size_t)(nb * B_BYTES));
                    continue;
                }
                ncols[j] = (int)(N - n0 < TILE ? N - n0 : TILE);
                const uint8_t *tw = w + n0 * row_bytes;
                const uint16_t *dt = d + n0 * ns, *mt = fmt == HS_Q8A_Q4 ? m + n0 * nb : NULL;
                if (ncols[j] < TILE) {
                    pad_last_tile(fmt, tw, dt, mt, ncols[j], nb, ns, pad);
                    tw = pad.w, dt = pad.d, mt = fmt == HS_Q8A_Q4 ? pad.m : NULL;
                }
                tile_to_bf16(fmt, tw, dt, mt, nb, bj);
            }
            for (int64_t r0 = 0; r0 < Tp; r0 += 2 * ROWS)
                tile_products(a, K, nb, bt, bt + nb * B_BYTES, r0, T, y, N, 2 * p * TILE, ncols[0], ncols[1], cbuf);
        }
        if (ok) _tile_release();
        free(bt);
        free(cbuf);
        tile_pad_free(pad);
    }
    free(a);
    return !failed;
}
#endif

int hs_bf16_tiles(void) {
#ifdef BF16_TILES
    return hs_amx_tiles();
#else
    return 0;
#endif
}

int hs_bf16_tiles_matmul(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                         int64_t N, int64_t K, float *y, int parallel) {
#ifdef BF16_TILES
    if (T <= 0) return 1;
    if (K % BLOCK || !hs_amx_tiles()) return 0;
    return run(fmt, w, d, m, x, T, N, K, y, parallel);
#else
    (void)fmt, (void)w, (void)d, (void)m, (void)x, (void)T, (void)N, (void)K, (void)y, (void)parallel;
    return 0;
#endif
}
