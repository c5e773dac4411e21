/* One decode step's matmuls timed in C, as the decode op calls them (no Python between the calls):
 * built and run by scripts/bench-kernels.py (--driver c), linked against hispec's kernel library.
 *
 *   bench-kernels-step LAYERS K1 N1 K2 N2 K3 N3 K4 N4 HEAD_K HEAD_N ROWS,ROWS,.. REPEATS KERNEL [KERNEL ..]
 *
 * KERNEL: "q4" (hs_q4_matmul on the decoder's 4-bit blocks, hs_q8_matmul on the Q8_0 head) or
 * "q8a:ISA" (hs_q8a_matmul_f32 for both, on path ISA of enum hs_q8a_isa; 0: the best this CPU has).
 * Random weights, one per layer and shape, so a step streams the model's size from memory.
 * Kernels and row counts are interleaved within each repeat (after one warm-up round); prints per
 * kernel and row count: "KERNEL ROWS MEDIAN_MS HEAD_MEDIAN_MS". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hispec_kernels.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, by_value);
    return v[n / 2];
}

/* a normal float's float16 bits (truncated): the q8a kernels' scales */
static uint16_t half_bits(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return (uint16_t)((b >> 16 & 0x8000u) | (((b >> 23 & 255u) - 112u) << 10) | (b >> 13 & 1023u));
}

static uint32_t rng = 12345;
static uint32_t next(void) { return rng = rng * 1664525u + 1013904223u; }

int main(int argc, char **argv) {
    if (argc < 15) {
        fprintf(stderr, "usage: %s LAYERS K1 N1 K2 N2 K3 N3 K4 N4 HEAD_K HEAD_N ROWS,.. REPEATS KERNEL..\n", argv[0]);
        return 2;
    }
    const int layers = atoi(argv[1]), hk = atoi(argv[10]), hn = atoi(argv[11]), repeats = atoi(argv[13]);
    int K[4], N[4], rows[16], nrows = 0, maxk = hk, maxt = 1;
    for (int j = 0; j < 4; j++) {
        K[j] = atoi(argv[2 + 2 * j]);
        N[j] = atoi(argv[3 + 2 * j]);
        maxk = K[j] > maxk ? K[j] : maxk;
    }
    for (char *tok = strtok(argv[12], ","); tok && nrows < 16; tok = strtok(NULL, ",")) {
        rows[nrows] = atoi(tok);
        maxt = rows[nrows] > maxt ? rows[nrows] : maxt;
        nrows++;
    }
    const int nk = argc - 14;
    uint8_t **qs = malloc(sizeof *qs * (size_t)(layers * 4));
    float **dm = malloc(sizeof *dm * (size_t)(layers * 4));
    uint16_t **hm = malloc(sizeof *hm * (size_t)(layers * 4));  /* the same scales in float16, for q8a */
    for (int i = 0; i < layers * 4; i++) {
        const size_t n = (size_t)N[i % 4] * (size_t)K[i % 4], nb = n / 32;
        qs[i] = malloc(n / 2);
        dm[i] = malloc(2 * nb * sizeof(float));
        for (size_t b = 0; b < n / 2; b++) qs[i][b] = (uint8_t)next();
        for (size_t b = 0; b < nb; b++) dm[i][b] = 1e-3f + (float)(next() % 100) * 2e-4f, dm[i][nb + b] = -1e-2f;
        hm[i] = malloc(2 * nb * sizeof(uint16_t));
        for (size_t b = 0; b < 2 * nb; b++) hm[i][b] = half_bits(dm[i][b]);
    }
    const size_t hsize = (size_t)hn * (size_t)hk;
    int8_t *hq = malloc(hsize);
    float *hd = malloc(hsize / 32 * sizeof(float)), *x = malloc((size_t)maxt * (size_t)maxk * sizeof(float)),
          *y = malloc((size_t)maxt * (size_t)(hn > 4096 ? hn : 4096) * sizeof(float));
    for (size_t i = 0; i < hsize; i++) hq[i] = (int8_t)next();
    uint16_t *hhd = malloc(hsize / 32 * sizeof(uint16_t));
    for (size_t i = 0; i < hsize / 32; i++) hd[i] = 1e-3f, hhd[i] = half_bits(hd[i]);
    for (int i = 0; i < maxt * maxk; i++) x[i] = (float)((int)(next() % 2001) - 1000) * 1e-3f;
    double *t = malloc(sizeof *t * (size_t)(nk * nrows * repeats)), *th = malloc(sizeof *th * (size_t)(nk * nrows * repeats));
    for (int r = -1; r < repeats; r++)
        for (int k = 0; k < nk; k++)
            for (int ri = 0; ri < nrows; ri++) {
                const int T = rows[ri], q8a = strncmp(argv[14 + k], "q8a:", 4) == 0;
                const int isa = q8a ? atoi(argv[14 + k] + 4) : 0;
                const double t0 = now();
                for (int i = 0; i < layers * 4; i++) {
                    const int64_t n = N[i % 4], kk = K[i % 4];
                    const float *d = dm[i], *m = dm[i] + n * kk / 32;
                    if (q8a)
                        hs_q8a_matmul_f32(HS_Q8A_Q4, qs[i], hm[i], hm[i] + n * kk / 32, x, T, n, kk, y, isa, 1);
                    else
                        hs_q4_matmul(qs[i], d, m, x, T, n, kk, y, 1);
                }
                const double t1 = now();
                if (q8a)
                    hs_q8a_matmul_f32(HS_Q8A_Q8, (const uint8_t *)hq, hhd, NULL, x, T, hn, hk, y, isa, 1);
                else
                    hs_q8_matmul(hq, hd, x, 0, T, hn, hk, y, 1);
                const double t2 = now();
                if (r >= 0) {
                    t[(k * nrows + ri) * repeats + r] = t2 - t0;
                    th[(k * nrows + ri) * repeats + r] = t2 - t1;
                }
            }
    for (int k = 0; k < nk; k++)
        for (int ri = 0; ri < nrows; ri++)
            printf("%s %d %.4f %.4f\n", argv[14 + k], rows[ri], 1e3 * median(t + (k * nrows + ri) * repeats, repeats),
                   1e3 * median(th + (k * nrows + ri) * repeats, repeats));
    return 0;
}
