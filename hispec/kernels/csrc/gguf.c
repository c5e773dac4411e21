/* GGUF block weights (Q8_0, Q4_0, Q4_1) times float32 activations (hispec_kernels.h). */
#include "simd.h"

/* ---- GGUF block weights (Q8_0, Q4_0, Q4_1) times float32 activations ----
 * Each row of x is first put in 16-bit form per block of 32 inputs (as llama.cpp does with 8
 * bits): x[k] ~ s[b] * x16[k], x16 = round(x / s) in -32767..32767, s = max|x| / 32767 over the
 * block (error at most half a step: 1.5e-5 of the block's largest |x|, finer than a bfloat16's
 * 2^-9 of each). Per output and block, the 32 products of the weight's integer codes with x16
 * are summed exactly in integers (8 lanes of 4 products), converted to float (exact: below
 * 2^24) and added to 8 float lanes with one fused multiply-add by the block's scale times s[b],
 * blocks in order; the lanes are summed in a fixed order. An output depends on its own row of x
 * alone: not on T, the tiling, the thread split or the vector width; the plain-C fallback
 * computes the same bits. Lane L of a block takes inputs 2L, 2L + 1, 16 + 2L and 17 + 2L. */
/* s [T, nb], s * sum(x16) [T, nb], x16 [T, K]; for T > 1 s and s * sum(x16) also by block, [nb, tpad]
 * (tpad = T + 8: eight rows' values from any row on are one load; NULL for one row) */
typedef struct { float *scale, *msum, *scale_t, *msum_t; int16_t *x16; int64_t tpad; } xq;

static xq x16_prepare(const float *x, int64_t T, int64_t K) {
    int64_t nb = K / 32;
    const int64_t tpad = T + 8;
    xq p = {malloc((size_t)(T * nb) * sizeof(float)), malloc((size_t)(T * nb) * sizeof(float)),
             T > 1 ? calloc((size_t)(nb * tpad), sizeof(float)) : NULL,
             T > 1 ? calloc((size_t)(nb * tpad), sizeof(float)) : NULL,
             malloc((size_t)(T * K) * sizeof(int16_t)), tpad};
    for (int64_t i = 0; i < T * nb; i++) {
        const float *xb = x + i * 32;
        int16_t *qb = p.x16 + i * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            float v = nearbyintf(xb[j] * inv);
            qb[j] = (int16_t)(v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v);
            sum += qb[j];
        }
        p.scale[i] = amax / 32767.0f;
        p.msum[i] = p.scale[i] * (float)sum;  /* |sum| < 2^20: exact in float */
        if (T > 1) {
            p.scale_t[i % nb * tpad + i / nb] = p.scale[i];
            p.msum_t[i % nb * tpad + i / nb] = p.msum[i];
        }
    }
    return p;
}

static void x16_release(xq p) {
    free(p.scale);
    free(p.msum);
    free(p.scale_t);
    free(p.msum_t);
    free(p.x16);
}

static inline float hsum8(v8 a) {
    v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* The weight formats: a block's 32 integer codes and per-block scale d (and offset m); Q8G16: Q8's
 * codes with a scale per 16 (d [N, K / 16]: GGUF Q6_K), each half of a block's lanes times its own. */
enum { Q8 = 0, Q4 = 1, Q8G16 = 2 };
#define BLOCK_BYTES(kind) ((kind) == Q4 ? 16 : 32)
#define BLOCK_SCALES(kind) ((kind) == Q8G16 ? 2 : 1)

/* sum over blocks of m[b] * (s * sum x16)[b], in block order (Q4's offsets; Q8 has none) */
static inline float offset_sum(const float *m, const float *msum, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) acc = fmaf(m[b], msum[b], acc);
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
/* A block's codes as int16: lo = codes 0 .. 15, hi = codes 16 .. 31 (Q4: the file's nibbles,
 * low ones first; Q8: the signed bytes). */
static inline __attribute__((always_inline)) void block_codes(const void *w, const int kind, __m256i *lo, __m256i *hi) {
    if (kind != Q4) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w + 1));
        return;
    }
    __m128i b = _mm_loadu_si128((const __m128i *)w), mask = _mm_set1_epi8(15);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}

/* acc + float(the block's 8 exact lane sums of codes * x16) * c (c: the block's factor in every lane) */
static inline __attribute__((always_inline)) __m256 block_dot(__m256i lo, __m256i hi, const int16_t *x16, __m256 c,
                                                               __m256 acc) {
    __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x16)),
                                 _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x16 + 16))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), c, acc);
}

/* Q8G16: the same with each half times its own factor, the low half (lo: codes 0 .. 15) first; lane L
 * then adds codes 2L, 2L + 1 times c_lo, then 16 + 2L, 17 + 2L times c_hi */
static inline __attribute__((always_inline)) __m256 block_dot2(__m256i lo, __m256i hi, const int16_t *x16, __m256 c_lo,
                                                                __m256 c_hi, __m256 acc) {
    const __m256i s_lo = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x16));
    const __m256i s_hi = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x16 + 16)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi), c_hi, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_lo), c_lo, acc));
}

static inline float lanes_sum(__m256 acc) {
    v8 a;
    memcpy(&a, &acc, sizeof a);
    return hsum8(a);
}

#define PREFETCH_ROWS 16

/* R (a constant after inlining) weight rows times one row of x (t): y[r]. */
static inline __attribute__((always_inline)) void rows_x1(const uint8_t *w, const float *d, const float *m, xq p,
                                                          int64_t t, int64_t nb, const int kind, const int R, float *y) {
    __m256 acc[4];
    float macc[4] = {0};  /* offset_sum, kept beside the lanes (its chain overlaps theirs) */
    const float *xs = p.scale + t * nb, *ms = p.msum + t * nb;
    const int16_t *x16 = p.x16 + t * nb * 32;
    const int64_t bytes = BLOCK_BYTES(kind), ns = nb * BLOCK_SCALES(kind);  /* d: ns scales a row */
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < R; r++) {
            __m256i lo, hi;
            /* the same block PREFETCH_ROWS rows on (the rows are contiguous, the threads sweep them in
             * order): the load stalls on memory otherwise, four short rows being too little of a
             * stream for the hardware prefetcher */
            __builtin_prefetch(w + ((r + PREFETCH_ROWS) * nb + b) * bytes, 0, 0);
            __builtin_prefetch(d + (r + PREFETCH_ROWS) * ns + b * BLOCK_SCALES(kind), 0, 0);
            if (kind == Q4) __builtin_prefetch(m + (r + PREFETCH_ROWS) * nb + b, 0, 0);
            block_codes(w + (r * nb + b) * bytes, kind, &lo, &hi);
            if (kind == Q8G16)
                acc[r] = block_dot2(lo, hi, x16 + b * 32, _mm256_set1_ps(d[r * ns + 2 * b] * xs[b]),
                                    _mm256_set1_ps(d[r * ns + 2 * b + 1] * xs[b]), acc[r]);
            else
                acc[r] = block_dot(lo, hi, x16 + b * 32, _mm256_set1_ps(d[r * nb + b] * xs[b]), acc[r]);
            if (kind == Q4) macc[r] = fmaf(m[r * nb + b], ms[b], macc[r]);
        }
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]) + macc[r];
}

/* One weight row times M (a constant after inlining, <= 8) rows of x (t0 ..): y[i * ystride]. The
 * rows' per-block factors d[b] * s and offset sums m[b] * (s * sum x16) are computed for the eight
 * rows at once, lane i being row i's (the same single rounding as alone). */
static inline __attribute__((always_inline)) void row_xm(const uint8_t *w, const float *d, const float *m, xq p,
                                                         int64_t t0, int64_t nb, const int kind, const int M, float *y,
                                                         int64_t ystride) {
    __m256 acc[8], macc = _mm256_setzero_ps();  /* macc lane i: row i's offset_sum */
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i lo, hi;
        block_codes(w + b * BLOCK_BYTES(kind), kind, &lo, &hi);
        const __m256 xs = _mm256_loadu_ps(p.scale_t + b * p.tpad + t0);
        if (kind == Q8G16) {  /* a factor per half */
            const __m256 c_lo = _mm256_mul_ps(_mm256_set1_ps(d[2 * b]), xs), c_hi = _mm256_mul_ps(_mm256_set1_ps(d[2 * b + 1]), xs);
            for (int i = 0; i < M; i++) {
                const __m256i at = _mm256_set1_epi32(i);
                acc[i] = block_dot2(lo, hi, p.x16 + ((t0 + i) * nb + b) * 32, _mm256_permutevar8x32_ps(c_lo, at),
                                    _mm256_permutevar8x32_ps(c_hi, at), acc[i]);
            }
            continue;
        }
        const __m256 c = _mm256_mul_ps(_mm256_set1_ps(d[b]), xs);
        if (kind == Q4) macc = _mm256_fmadd_ps(_mm256_set1_ps(m[b]), _mm256_loadu_ps(p.msum_t + b * p.tpad + t0), macc);
        for (int i = 0; i < M; i++) {
            const __m256 ci = _mm256_permutevar8x32_ps(c, _mm256_set1_epi32(i));  /* row i's factor */
            acc[i] = block_dot(lo, hi, p.x16 + ((t0 + i) * nb + b) * 32, ci, acc[i]);
        }
    }
    float mo[8];
    _mm256_storeu_ps(mo, macc);
    for (int i = 0; i < M; i++) y[i * ystride] = lanes_sum(acc[i]) + mo[i];
}
#define XM 8 /* rows of x sharing each block's codes */

static void blocks_matmul(const uint8_t *w, const float *d, const float *m, xq p, int64_t T, int64_t N, int64_t nb,
                          const int kind, float *y, int parallel) {
    const int64_t row_bytes = nb * BLOCK_BYTES(kind), ns = nb * BLOCK_SCALES(kind);
    if (T == 1) {  /* four weight rows at a time: independent chains hide the FMA latency */
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += 4) {
            const uint8_t *wn = w + n * row_bytes;
            const float *dn = d + n * ns, *mn = m ? m + n * nb : NULL;
            switch (N - n < 4 ? N - n : 4) {
                case 1: rows_x1(wn, dn, mn, p, 0, nb, kind, 1, y + n); break;
                case 2: rows_x1(wn, dn, mn, p, 0, nb, kind, 2, y + n); break;
                case 3: rows_x1(wn, dn, mn, p, 0, nb, kind, 3, y + n); break;
                default: rows_x1(wn, dn, mn, p, 0, nb, kind, 4, y + n); break;
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const float *dn = d + n * ns, *mn = m ? m + n * nb : NULL;
        for (int64_t t0 = 0; t0 < T; t0 += XM) {
            float *yr = y + t0 * N + n;
            switch (T - t0 < XM ? T - t0 : XM) {  /* constant row counts keep acc in registers */
                case 1: row_xm(wn, dn, mn, p, t0, nb, kind, 1, yr, N); break;
                case 2: row_xm(wn, dn, mn, p, t0, nb, kind, 2, yr, N); break;
                case 3: row_xm(wn, dn, mn, p, t0, nb, kind, 3, yr, N); break;
                case 4: row_xm(wn, dn, mn, p, t0, nb, kind, 4, yr, N); break;
                case 5: row_xm(wn, dn, mn, p, t0, nb, kind, 5, yr, N); break;
                case 6: row_xm(wn, dn, mn, p, t0, nb, kind, 6, yr, N); break;
                case 7: row_xm(wn, dn, mn, p, t0, nb, kind, 7, yr, N); break;
                default: row_xm(wn, dn, mn, p, t0, nb, kind, 8, yr, N); break;
            }
        }
    }
}
#else
/* the same arithmetic one lane at a time (integer sums are exact; fmaf rounds once, as the vector FMA) */
static inline int32_t code(const uint8_t *w, int kind, int j) {  /* code j (0 .. 31) of a block */
    if (kind != Q4) return ((const int8_t *)w)[j];
    return j < 16 ? (w[j] & 15) : (w[j - 16] >> 4);
}

static void blocks_matmul(const uint8_t *w, const float *d, const float *m, xq p, int64_t T, int64_t N, int64_t nb,
                          const int kind, float *y, int parallel) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            float acc[8] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + (n * nb + b) * BLOCK_BYTES(kind);
                const int16_t *x = p.x16 + (t * nb + b) * 32;
                if (kind == Q8G16) {  /* block_dot2: each lane's low pair times c_lo, then its high pair times c_hi */
                    const float c_lo = d[(n * nb + b) * 2] * p.scale[t * nb + b], c_hi = d[(n * nb + b) * 2 + 1] * p.scale[t * nb + b];
                    for (int L = 0; L < 8; L++) {
                        const int32_t s_lo = code(wb, kind, 2 * L) * x[2 * L] + code(wb, kind, 2 * L + 1) * x[2 * L + 1];
                        const int32_t s_hi = code(wb, kind, 16 + 2 * L) * x[16 + 2 * L] + code(wb, kind, 17 + 2 * L) * x[17 + 2 * L];
                        acc[L] = fmaf((float)s_hi, c_hi, fmaf((float)s_lo, c_lo, acc[L]));
                    }
                    continue;
                }
                float c = d[n * nb + b] * p.scale[t * nb + b];
                for (int L = 0; L < 8; L++) {
                    int32_t s = 0;
                    for (int j = 2 * L; j < 2 * L + 2; j++) s += code(wb, kind, j) * x[j] + code(wb, kind, 16 + j) * x[16 + j];
                    acc[L] = fmaf((float)s, c, acc[L]);
                }
            }
            v8 a;
            memcpy(&a, acc, sizeof a);
            y[t * N + n] = hsum8(a) + (kind == Q4 ? offset_sum(m + n * nb, p.msum + t * nb, nb) : 0.0f);
        }
}
#endif

/* y[T, N] float32 = x[T, K] (float32, or bfloat16 when x_bf) times the transpose of an 8-bit
 * weight W[n, k] = d[n, k / group] * q[n, k] (q int8 [N, K], d float32 [N, K / group]; group 32:
 * GGUF Q8_0, or 16: GGUF Q6_K in the 8-bit form; K a multiple of 32). The threads share W's rows. */
void hs_q8_group_matmul(const int8_t *q, const float *d, int group, const void *x, int x_bf, int64_t T, int64_t N,
                        int64_t K, float *y, int parallel) {
    const float *xf = (const float *)x;
    float *conv = NULL;
    if (x_bf) {
        conv = malloc((size_t)(T * K) * sizeof(float));
        load_row(x, 1, 0, T * K, conv);
        xf = conv;
    }
    xq p = x16_prepare(xf, T, K);
    blocks_matmul((const uint8_t *)q, d, NULL, p, T, N, K / 32, group == 16 ? Q8G16 : Q8, y, parallel);
    x16_release(p);
    free(conv);
}

/* The same with a scale per 32 values (d [N, K / 32]: GGUF Q8_0). */
void hs_q8_matmul(const int8_t *q, const float *d, const void *x, int x_bf, int64_t T, int64_t N, int64_t K,
                  float *y, int parallel) {
    hs_q8_group_matmul(q, d, 32, x, x_bf, T, N, K, y, parallel);
}

/* y[T, N] float32 = x[T, K] float32 times the transpose of a GGUF Q4_0 / Q4_1 weight
 * W[n, k] = d[n, b] * q[n, k] + m[n, b], b = k / 32, q in 0..15 as stored in the file: qs[n, b, j]
 * holds q[32 b + j] in its low nibble and q[32 b + 16 + j] in its high one (qs uint8 [N, K / 2]);
 * d, m float32 [N, K / 32] (the file's float16 values; Q4_0: m = -8 d). The offsets add
 * sum_b m[b] * s[b] sum(x16 of block b), in block order, after the lanes. */
void hs_q4_matmul(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t T, int64_t N,
                  int64_t K, float *y, int parallel) {
    xq p = x16_prepare(x, T, K);
    blocks_matmul(qs, d, m, p, T, N, K / 32, Q4, y, parallel);
    x16_release(p);
}

/* The same product for prompt chunks, on the panel kernel: each group of PANEL_N weight rows is
 * rebuilt as float32, w = fma(q, d, m) (the file's value rounded once: q * d is exact), into a
 * panel, and every row of x runs one fused multiply-add chain over k per output, as
 * hs_panel_matmul on the float32 weights (same bits). Rebuilding costs one pass over W per call:
 * cheap against T rows of products, and float32 products are faster than 16-bit ones here. */
void hs_q4_panel_matmul(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t T, int64_t N,
                        int64_t K, float *y, int parallel) {
    int64_t nb = K / 32, P = (N + PANEL_N - 1) / PANEL_N;
#pragma omp parallel if (parallel)
    {
        float *panel = malloc((size_t)(K * PANEL_N) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            int64_t n0 = p * PANEL_N, nvalid = N - n0 < PANEL_N ? N - n0 : PANEL_N;
            for (int64_t j = 0; j < PANEL_N; j++) {
                if (j >= nvalid) {
                    for (int64_t k = 0; k < K; k++) panel[k * PANEL_N + j] = 0.0f;
                    continue;
                }
                const uint8_t *q = qs + (n0 + j) * nb * 16;
                for (int64_t b = 0; b < nb; b++) {
                    float db = d[(n0 + j) * nb + b], mb = m[(n0 + j) * nb + b];
                    for (int i = 0; i < 16; i++) {
                        panel[(b * 32 + i) * PANEL_N + j] = fmaf((float)(q[b * 16 + i] & 15), db, mb);
                        panel[(b * 32 + 16 + i) * PANEL_N + j] = fmaf((float)(q[b * 16 + i] >> 4), db, mb);
                    }
                }
            }
            hs_panel_rows(x, T, K, panel, NULL, y, N, n0, nvalid);
        }
        free(panel);
    }
}
