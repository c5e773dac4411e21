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
#include <sys/mman.h>
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

/* The weights and activations, as the decode op finds them: in transparent huge pages (2 MiB) where
 * Linux gives them (hispec/kernels/hugepages.py moves a loaded model's tensors into such an arena; on
 * 4 KiB pages every 4 KiB of the stream is a TLB miss and the hardware prefetchers stop at each
 * page's end). A bump allocator over one mapping advised MADV_HUGEPAGE, 64-byte aligned; malloc where
 * the mapping fails or HUGE=0 is set in the environment. */
static char *arena, *arena_end;

static void *alloc(size_t n) {
    n = (n + 63) / 64 * 64;
    if (arena && arena + n <= arena_end) {
        void *p = arena;
        arena += n;
        return p;
    }
    return malloc(n);
}

static void arena_init(size_t bytes) {
    const char *env = getenv("HUGE");
    if (env && env[0] == '0') return;
    const size_t huge = (size_t)2 << 20;
    bytes = (bytes + 2 * huge) / huge * huge;
    char *p = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    char *start = (char *)(((uintptr_t)p + huge - 1) / huge * huge);
#ifdef MADV_HUGEPAGE
    madvise(start, bytes, MADV_HUGEPAGE);
#endif
    arena = start;
    arena_end = start + bytes;
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
    /* the arena: per weight of n values n / 2 bytes of codes, n / 4 of float32 scales, n / 8 of float16 ones */
    size_t bytes = (size_t)hn * (size_t)hk * 2 + (size_t)maxt * ((size_t)maxk + (size_t)(hn > 4096 ? hn : 4096)) * 4;
    for (int j = 0; j < 4; j++) bytes += (size_t)layers * (size_t)N[j] * (size_t)K[j];
    arena_init(bytes + (size_t)(layers * 4 + 8) * 128);
    uint8_t **qs = malloc(sizeof *qs * (size_t)(layers * 4));
    float **dm = malloc(sizeof *dm * (size_t)(layers * 4));
    uint16_t **hm = malloc(sizeof *hm * (size_t)(layers * 4));  /* the same scales in float16, for q8a */
    for (int i = 0; i < layers * 4; i++) {
        const size_t n = (size_t)N[i % 4] * (size_t)K[i % 4], nb = n / 32;
        qs[i] = alloc(n / 2);
        dm[i] = alloc(2 * nb * sizeof(float));
        for (size_t b = 0; b < n / 2; b++) qs[i][b] = (uint8_t)next();
        for (size_t b = 0; b < nb; b++) dm[i][b] = 1e-3f + (float)(next() % 100) * 2e-4f, dm[i][nb + b] = -1e-2f;
        hm[i] = alloc(2 * nb * sizeof(uint16_t));
        for (size_t b = 0; b < 2 * nb; b++) hm[i][b] = half_bits(dm[i][b]);
    }
    const size_t hsize = (size_t)hn * (size_t)hk;
    int8_t *hq = alloc(hsize);
    float *hd = alloc(hsize / 32 * sizeof(float)), *x = alloc((size_t)maxt * (size_t)maxk * sizeof(float)),
          *y = alloc((size_t)maxt * (size_t)(hn > 4096 ? hn : 4096) * sizeof(float));
    for (size_t i = 0; i < hsize; i++) hq[i] = (int8_t)next();
    uint16_t *hhd = alloc(hsize / 32 * sizeof(uint16_t));
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
