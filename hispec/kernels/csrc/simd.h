/* What the kernel files share (internal: not part of the library's interface): bfloat16
 * conversions, row loads and stores, 16-lane float sums and maxima, a vectorised exp, and the panel
 * layout that the dense and GGUF matmuls both use.
 *
 * Sums use 16 independent lanes combined in a fixed order (vectorisable without reassociating
 * float additions; built with -ffp-contract=off), so results do not depend on the vector width.
 * Tensors are contiguous, row-major; "bf" flags say a buffer holds bfloat16 (uint16) instead of
 * float32. Conversions to bfloat16 round to nearest even, as PyTorch does.
 */
#ifndef HISPEC_SIMD_H
#define HISPEC_SIMD_H

#include "hispec_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16

typedef uint16_t bf16;

static inline float bf2f(bf16 b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2bf(float f) {
    uint32_t u;
    if (f != f) return 0x7FC0;
    memcpy(&u, &f, 4);
    return (bf16)((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
}

static inline void load_row(const void *src, int bf, int64_t off, int64_t n, float *dst) {
    if (bf) {
        const bf16 *s = (const bf16 *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf2f(s[i]);
    } else {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *dst, int bf, int64_t off, int64_t n, const float *src) {
    if (bf) {
        bf16 *d = (bf16 *)dst + off;
        for (int64_t i = 0; i < n; i++) d[i] = f2bf(src[i]);
    } else {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
    }
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* Sums run in LANES = 16 lanes, held as two 8-lane halves: 64-byte generic vectors are split
 * into 16-byte pieces and spilled to the stack on AVX2 builds, 32-byte ones stay in registers
 * (and AVX-512 builds handle either). The halves' element-wise operations are those of 16 lanes. */
static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Sum of the 16 lanes (lo: 0-7, hi: 8-15), pairwise in a fixed order (the same on any vector width). */
static inline float hsum16(v8 lo, v8 hi) {
    v8 b = lo + hi;
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    /* the same 16 lane sums in one register: lane l < 8 is lo's lane l, lane l >= 8 hi's lane l - 8 */
    __m512 acc = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    __m256 l = _mm512_castps512_ps256(acc), h = _mm512_extractf32x8_ps(acc, 1);
    memcpy(&lo, &l, sizeof lo);
    memcpy(&hi, &h, sizeof hi);
#else
    for (; i + LANES <= n; i += LANES) {
        lo += load8(a + i) * load8(b + i);
        hi += load8(a + i + 8) * load8(b + i + 8);
    }
#endif
    float s = hsum16(lo, hi);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* mask ? a : b lane by lane (mask: a comparison's all-ones / zero lanes). */
static inline v8 pick(v8i mask, v8 a, v8 b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (mask & ai) | (~mask & bi);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* The largest of s[0 .. n-1]: 16 lanes' maxima, then theirs (a maximum is exact in any order). */
static inline float row_max(const float *s, int64_t n) {
    float m = s[0];  /* n >= 1 */
    int64_t j = 0;
    if (n >= LANES) {
        v8 lo = load8(s), hi = load8(s + 8);
        for (j = LANES; j + LANES <= n; j += LANES) {
            v8 a = load8(s + j), b = load8(s + j + 8);
            lo = pick(a > lo, a, lo);
            hi = pick(b > hi, b, hi);
        }
        for (int i = 0; i < 8; i++) {
            m = lo[i] > m ? lo[i] : m;
            m = hi[i] > m ? hi[i] : m;
        }
    }
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp of each lane to ~2 ulp by range reduction (x = n ln2 + r, |r| <= ln2 / 2) and a degree-6
 * polynomial: branch-free, in vector registers (libm's expf is neither). One body for 8 and 16
 * lanes: the same operations lane by lane, so a lane's bits do not depend on the width. */
#define FAST_EXP_BODY(V, VI)                                                                     \
    {                                                                                            \
        const V lo = {0}, c0 = lo - 87.0f, c1 = lo + 88.0f;                                      \
        VI big = (VI)(x > c1), small = (VI)(x < c0), xi, ci;                                     \
        memcpy(&xi, &x, sizeof xi);                                                              \
        memcpy(&ci, &c1, sizeof ci);                                                             \
        xi = (big & ci) | (~big & xi);                                                           \
        memcpy(&ci, &c0, sizeof ci);                                                             \
        xi = (small & ci) | (~small & xi); /* as x < -87 ? -87 : (x > 88 ? 88 : x) */            \
        memcpy(&x, &xi, sizeof x);                                                               \
        V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                            \
        V r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;                           \
        V p = lo + 1.0f / 720.0f;                                                                \
        p = p * r + 1.0f / 120.0f;                                                               \
        p = p * r + 1.0f / 24.0f;                                                                \
        p = p * r + 1.0f / 6.0f;                                                                 \
        p = p * r + 0.5f;                                                                        \
        p = p * r + 1.0f;                                                                        \
        p = p * r + 1.0f;                                                                        \
        VI e = (__builtin_convertvector(n, VI) + 127) << 23; /* 2^n */                           \
        V scale;                                                                                 \
        memcpy(&scale, &e, sizeof scale);                                                        \
        return p * scale;                                                                        \
    }

static inline v8 fast_exp8(v8 x) FAST_EXP_BODY(v8, v8i)

/* fast_exp8 on 16 lanes (one AVX-512 register; two halves elsewhere). */
static inline v16 fast_exp16(v16 x) FAST_EXP_BODY(v16, v16i)

/* One lane of fast_exp8 (tails of the vector loops). */
static inline float fast_exp(float x) {
    v8 v = {x};
    return fast_exp8(v)[0];
}


/* ---- the dense panel layout (panel.c; gguf.c's q4 prompt kernel rebuilds its weights in it) ----
 * Tiles: 8 rows x 48 columns in AVX-512 registers, 6 x 16 in AVX2 ones (there the panels are 16
 * wide), a plain fmaf loop elsewhere. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PANEL_N 16 /* AVX2's 16 registers: 6 rows x 16 columns of accumulators */
#define PANEL_M 6
#else
#define PANEL_N 48
#define PANEL_M 8
#endif

/* All M rows of x times one panel (output columns n0 .. n0 + nvalid - 1), PANEL_M rows at a time
 * (panel.c); ``next``: the panel after it, prefetched during the first pass (or NULL). */
__attribute__((visibility("hidden"))) void hs_panel_rows(const float *x, int64_t M, int64_t K, const float *panel,
                                                         const float *next, float *y, int64_t N, int64_t n0,
                                                         int64_t nvalid);

/* body(ctx, t0, t1) over the rows [0, T): on the calling thread below `min` rows, else split into
 * equal stretches over the threads. Below `min` no OpenMP region is entered at all: a region with
 * `if (0)` still costs libgomp ~0.6 us (a team of one set up and torn down), six times a decode
 * step's norm of one row. */
static inline void for_rows(int64_t T, int64_t min, void (*body)(void *ctx, int64_t t0, int64_t t1), void *ctx) {
    if (T < min) {
        if (T > 0) body(ctx, 0, T);
        return;
    }
#pragma omp parallel
    {
#ifdef _OPENMP
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
#else
        const int64_t n = 1, i = 0;
#endif
        const int64_t t0 = T * i / n, t1 = T * (i + 1) / n;
        if (t0 < t1) body(ctx, t0, t1);
    }
}

/* AMX, Intel's tile unit: 1 when the CPU has AMX-TILE and Linux lets this process use the tile
 * registers (arch_prctl ARCH_REQ_XCOMP_PERM: asked once per file that asks; asking again is free). */
static inline int hs_amx_tiles(void) {
#if defined(__x86_64__) && defined(__linux__)
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    unsigned a, b, c, d;
    s = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1);
    if (s) s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    return s;
#else
    return 0;
#endif
}

/* A tile configuration for LDTILECFG (palette 1): each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_config;

#endif
