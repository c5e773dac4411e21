/* Dense float32 matmuls on weights packed in panels (hispec_kernels.h). */
#include "simd.h"

/* ---- float32 matmuls of 5 .. 512 rows (batched decode steps, verification windows, prefill chunks) ----
 * y[M, N] = x[M, K] W[N, K]^T with W packed once into panels of PANEL_N output columns,
 * [ceil(N / PANEL_N)][K][PANEL_N] (the tail zero-padded): a panel is read front to back while
 * PANEL_M rows of x accumulate PANEL_M x PANEL_N outputs in registers. Every output is one
 * fused multiply-add chain over k = 0 .. K-1 in order, so it depends on its own row of x alone
 * (not on M, nor on which rows share a tile, nor on the vector width: fma rounds once). Tiles:
 * 8 rows x 48 columns in AVX-512 registers, 6 x 16 in AVX2 ones (there the panels are 16 wide), a plain fmaf loop elsewhere. */

int64_t hs_panel_width(void) { return PANEL_N; }  /* the packed layout's panel width on this build */

void hs_panel_pack(const float *w, int64_t N, int64_t K, float *out) {
    int64_t P = (N + PANEL_N - 1) / PANEL_N;
    for (int64_t p = 0; p < P; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PANEL_N; j++) {
                int64_t n = p * PANEL_N + j;
                out[(p * K + k) * PANEL_N + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* Row k of the next panel into L2 while this one is computed. Where the rows take several passes
 * over a panel (more than PANEL_M), the weights would otherwise stream from memory in the first
 * pass only, the core waiting, then compute from L2 in the others; in one pass the hardware's
 * own prefetcher follows the panels (contiguous) as well. */
static inline __attribute__((always_inline)) void prefetch_panel_row(const float *next, int64_t k) {
    for (int c = 0; c < PANEL_N; c += 16) __builtin_prefetch(next + k * PANEL_N + c, 0, 2);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 registers): R <= 6 rows (a constant after inlining) of x times a 16-column panel,
 * from column c0, into out[r0 + r][c0 ..]: 12 accumulators, the columns kept in registers. */
static inline __attribute__((always_inline)) void panel_strip(const float *x, int64_t K, const float *panel,
                                                             const float *next, float out[][PANEL_N], int r0,
                                                             int c0, const int R) {
    __m256 acc[6][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = panel + k * PANEL_N + c0;
        if (next) prefetch_panel_row(next, k);
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_broadcast_ss(x + (r0 + r) * K + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r0 + r] + c0, acc[r][0]);
        _mm256_storeu_ps(out[r0 + r] + c0 + 8, acc[r][1]);
    }
}
#endif

/* m (a constant after inlining) rows of x times one panel: y[r, n0 .. n0 + nvalid - 1]. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t K, const float *panel,
                                                            const float *next, float *y, int64_t N, int64_t n0,
                                                            int64_t nvalid, const int m) {
    float out[PANEL_M][PANEL_N];
#if defined(__AVX512F__)
    __m512 acc[PANEL_M][3];
    for (int r = 0; r < m; r++)
        for (int c = 0; c < 3; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = panel + k * PANEL_N;
        if (next) prefetch_panel_row(next, k);
        __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
        for (int r = 0; r < m; r++) {
            __m512 xv = _mm512_set1_ps(x[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
        }
    }
    for (int r = 0; r < m; r++)
        for (int c = 0; c < 3; c++) _mm512_storeu_ps(out[r] + c * 16, acc[r][c]);
#elif defined(__AVX2__) && defined(__FMA__)
    panel_strip(x, K, panel, next, out, 0, 0, m);
#else
    for (int r = 0; r < m; r++)
        for (int j = 0; j < PANEL_N; j++) out[r][j] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        if (next) prefetch_panel_row(next, k);
        for (int r = 0; r < m; r++) {
            float xv = x[r * K + k];
            for (int j = 0; j < PANEL_N; j++) out[r][j] = fmaf(xv, panel[k * PANEL_N + j], out[r][j]);
        }
    }
#endif
    for (int r = 0; r < m; r++) memcpy(y + r * N + n0, out[r], (size_t)nvalid * sizeof(float));
}

/* All M rows of x times one panel (output columns n0 .. n0 + nvalid - 1), PANEL_M rows at a time. */
void hs_panel_rows(const float *x, int64_t M, int64_t K, const float *panel, const float *next, float *y,
                       int64_t N, int64_t n0, int64_t nvalid) {
    for (int64_t m0 = 0; m0 < M; m0 += PANEL_M) {
        const float *xr = x + m0 * K;
        float *yr = y + m0 * N;
        const float *nx = m0 == 0 ? next : NULL;  /* the first pass fetches the next panel */
        switch (M - m0 < PANEL_M ? M - m0 : PANEL_M) {  /* constant row counts keep acc in registers */
            case 1: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 1); break;
            case 2: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 2); break;
            case 3: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 3); break;
            case 4: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 4); break;
            case 5: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 5); break;
            case 6: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 6); break;
#if PANEL_M == 8
            case 7: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, 7); break;
#endif
            default: panel_tile(xr, K, panel, nx, yr, N, n0, nvalid, PANEL_M); break;
        }
    }
}

void hs_panel_matmul(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, float *y, int parallel) {
    int64_t P = (N + PANEL_N - 1) / PANEL_N;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t p = 0; p < P; p++) {
        const float *panel = packed + p * K * PANEL_N;
        int64_t n0 = p * PANEL_N, nvalid = N - n0 < PANEL_N ? N - n0 : PANEL_N;
        hs_panel_rows(x, M, K, panel, M > PANEL_M && p + 1 < P ? panel + K * PANEL_N : NULL, y, N, n0, nvalid);
    }
}
