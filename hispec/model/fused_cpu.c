/* Fused CPU kernels for one decoder layer's work between its matmuls (hispec/model/fused.py).
 *
 * Built on first use with the machine's C compiler for the machine's own CPU (-march=native),
 * loaded with ctypes. Every function computes each row (token) with the same code whatever the
 * number of rows in the call, so one-token decoding and batched verification agree bit for bit.
 * Sums use 16 independent lanes combined in a fixed order (vectorisable without reassociating
 * float additions; built with -ffp-contract=off), so results do not depend on the vector width.
 *
 * Tensors are contiguous, row-major; "bf" flags say a buffer holds bfloat16 (uint16) instead of
 * float32. Conversions to bfloat16 round to nearest even, as PyTorch does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
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

static void load_row(const void *src, int bf, int64_t off, int64_t n, float *dst) {
    if (bf) {
        const bf16 *s = (const bf16 *)src + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf2f(s[i]);
    } else {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
    }
}

static void store_row(void *dst, int bf, int64_t off, int64_t n, const float *src) {
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

/* exp of 8 lanes to ~2 ulp by range reduction (x = n ln2 + r, |r| <= ln2 / 2) and a degree-6
 * polynomial: branch-free, in vector registers (libm's expf is neither). */
static inline v8 fast_exp8(v8 x) {
    const v8 lo = {0}, c0 = lo - 87.0f, c1 = lo + 88.0f;
    x = pick(x > c1, c1, x);
    x = pick(x < c0, c0, x);  /* as x < -87 ? -87 : (x > 88 ? 88 : x) */
    v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v8 p = lo + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;  /* 2^n */
    v8 scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* One lane of fast_exp8 (tails of the vector loops). */
static inline float fast_exp(float x) {
    v8 v = {x};
    return fast_exp8(v)[0];
}

/* s[j] = fast_exp(s[j] - m) for j < n. */
static void exp_shifted(float *s, int64_t n, float m) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8 x = fast_exp8(load8(s + j) - m);
        memcpy(s + j, &x, sizeof x);
    }
    for (; j < n; j++) s[j] = fast_exp(s[j] - m);
}

/* y = x * rsqrt(mean(x^2) + eps) * w for one row of n floats (y may alias x). */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * w[i];
}

/* out[T, D] = rms_norm(x[T, D]) * w */
void hs_rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, void *out, int out_bf) {
    float *y = malloc((size_t)D * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        rms_row(x + t * D, w, D, eps, y);
        store_row(out, out_bf, t * D, D, y);
    }
    free(y);
}

/* h_out = h + delta (delta float32 or bfloat16); out = rms_norm(h_out) * w. All [T, D]. */
void hs_add_rms_norm(const float *h, const void *delta, int delta_bf, const float *w, int64_t T, int64_t D,
                     float eps, float *h_out, void *out, int out_bf) {
    float *y = malloc((size_t)D * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        load_row(delta, delta_bf, t * D, D, y);
        float *hr = h_out + t * D;
        const float *hi = h + t * D;
        for (int64_t i = 0; i < D; i++) hr[i] = hi[i] + y[i];
        rms_row(hr, w, D, eps, y);
        store_row(out, out_bf, t * D, D, y);
    }
    free(y);
}

/* out[T, I] = silu(gate) * up for gate_up[T, 2I] = [gate | up]; rows shared by the threads from
 * SILU_PARALLEL_MIN outputs (a prompt chunk; one token's are too few to pay for the hand-over). */
#define SILU_PARALLEL_MIN (1 << 16)
void hs_silu_mul(const void *gu, int in_bf, int64_t T, int64_t I, void *out, int out_bf) {
#pragma omp parallel if (T * I >= SILU_PARALLEL_MIN)
    {
        float *g = malloc((size_t)(2 * I) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            load_row(gu, in_bf, t * 2 * I, 2 * I, g);
            int64_t i = 0;
            for (; i + 8 <= I; i += 8) {  /* the scalar line below, 8 lanes at a time */
                v8 x = load8(g + i), y = x / (1.0f + fast_exp8(-x)) * load8(g + I + i);
                memcpy(g + i, &y, sizeof y);
            }
            for (; i < I; i++) g[i] = g[i] / (1.0f + fast_exp(-g[i])) * g[I + i];
            store_row(out, out_bf, t * I, I, g);
        }
        free(g);
    }
}

/* A KV pool is [Hkv, S, D] per layer (S slots): each KV head's rows in slot order, so that a
 * sequence's consecutive blocks are one stretch of memory per head, which is how attention reads
 * them (one head's keys, then its values). The offset of slot ``slot``'s row of head h: */
static inline int64_t kv_offset(int64_t slot, int64_t h, int64_t S, int64_t D) { return (h * S + slot) * D; }

/* Rotate the query and key heads of qkv[T, (Hq + 2 Hkv) * D] (rotate-half RoPE with
 * cos[T, D] and ssin[T, D] = [-sin, sin]: y = x * cos + swap_halves(x) * ssin), write keys
 * and values to the pools [Hkv, S, D] (float32, or bfloat16 if kv_bf: rounded to nearest even, as
 * PyTorch casts) at slots[T], and the rotated queries to q_out[T, Hq, D] (float32; q_out
 * may be NULL to write K/V only). */
void hs_rope_write(const void *qkv, int in_bf, const float *cos_, const float *ssin, const int64_t *slots,
                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, void *kpool, void *vpool, int kv_bf,
                   float *q_out) {
    int64_t width = (Hq + 2 * Hkv) * D, half = D / 2;
    float *row = malloc((size_t)(width + D) * sizeof(float)), *key = row + width;  /* key: a rotated key head */
    for (int64_t t = 0; t < T; t++) {
        load_row(qkv, in_bf, t * width, width, row);
        const float *c = cos_ + t * D, *s = ssin + t * D;
        for (int64_t h = q_out ? 0 : Hq; h < Hq + Hkv; h++) {
            const float *x = row + h * D;
            float *dst = h < Hq ? q_out + (t * Hq + h) * D : key;
            for (int64_t i = 0; i < half; i++) {
                dst[i] = x[i] * c[i] + x[i + half] * s[i];
                dst[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
            if (h >= Hq) store_row(kpool, kv_bf, kv_offset(slots[t], h - Hq, S, D), D, key);
        }
        for (int64_t h = 0; h < Hkv; h++)
            store_row(vpool, kv_bf, kv_offset(slots[t], h, S, D), D, row + (Hq + Hkv + h) * D);
    }
    free(row);
}

/* Paged attention, a tile of up to QUERY_TILE consecutive query tokens of one sequence and one KV
 * head at a time: the G query heads of each token that share KV head kvh ("rows" r = qi * G + g).
 * Each key and value row is read once per tile and used by all its rows while it is in L1 (a
 * prompt chunk's queries share their context), instead of once per query. Each row's arithmetic
 * is that of the row alone, in the same order (scores key by key, softmax over its own length,
 * values accumulated key by key), so a query's output does not depend on the tile it falls in. */
#define QUERY_TILE 8

/* One KV head of a pool [Hkv, S, D] (float32, or bfloat16 if bf), its rows from element ``head``
 * on, read as float32 rows: a float32 pool's rows are used where they lie, a bfloat16 pool's are
 * converted (exactly) into a buffer first, so the arithmetic on them is the same either way and a
 * bfloat16 cache only halves the bytes attention reads. The head's rows are contiguous: a
 * sequence's blocks stream from memory (with the heads interleaved per slot, a head's rows 768
 * bytes apart, attention over 16 sequences of 260 positions took 1.4x as long). */
typedef struct { const void *base; int bf; int64_t head, D, bs; } kv_head;

/* Row ``off`` of block ``blk``: in the pool, or converted into buf[D]. */
static inline const float *kv_row(kv_head p, int64_t blk, int64_t off, float *buf) {
    int64_t at = p.head + (blk * p.bs + off) * p.D;
    if (!p.bf) return (const float *)p.base + at;
    load_row(p.base, 1, at, p.D, buf);
    return buf;
}

/* The first n rows of block ``blk``: a pointer to them, the distance between rows in *stride (in
 * the pool, or converted into buf[n * D]). */
static inline const float *kv_rows(kv_head p, int64_t blk, int64_t n, float *buf, int64_t *stride) {
    int64_t at = p.head + blk * p.bs * p.D;
    *stride = p.D;
    if (!p.bf) return (const float *)p.base + at;
    load_row(p.base, 1, at, n * p.D, buf);
    return buf;
}

#if defined(__AVX512F__)
/* Each register's 16 lanes summed, for 16 registers at once: lane i of the result is the sum of
 * a[i]'s lanes by hsum16's tree (lane l + lane l + 8, then + l + 4, then (0 + 2) + (1 + 3)), the
 * same for every i, so a sum does not depend on its place among the 16. */
static inline __m512 hsum16x16(__m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* per key: 16 lanes -> 8 (l + l + 8); two keys per register */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* 8 -> 4 (l + l + 4); four keys per register, one per 128-bit quarter */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* 4 -> 2 (l + l + 2) */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));  /* 2 -> 1 */
    /* e's lanes hold the keys in the order the shuffles left them: put key i in lane i */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

/* tile_scores with 16 keys at a time (D a multiple of 16): each key's 16 lane sums as dot() makes
 * them (products added in d order per lane), the 16 keys' lanes summed together (hsum16x16), so
 * every score has dot()'s bits. */
static inline __attribute__((always_inline)) void tile_scores16(const float *q, int64_t Hq, kv_head kp,
                                                               const int32_t *table, const int32_t *len, int nq,
                                                               int64_t lmax, int64_t bs, int64_t G, const int64_t D,
                                                               float scale, float *scores, float *buf) {
    static const float zeros[128];  /* the keys past the last: D <= 128 */
    const float *keys[16];
    for (int64_t j0 = 0; j0 < lmax; j0 += 16) {
        int64_t n = lmax - j0 < 16 ? lmax - j0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            int64_t j = j0 + i;
            keys[i] = i < n ? kv_row(kp, table[j / bs], j % bs, buf + i * D) : zeros;
        }
        for (int qi = 0; qi < nq; qi++) {
            if (j0 >= len[qi]) continue;
            for (int64_t g = 0; g < G; g++) {
                const float *qr = q + qi * Hq * D + g * D;
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 16) {
                    __m512 qc = _mm512_loadu_ps(qr + c);
                    for (int i = 0; i < 16; i++) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(qc, _mm512_loadu_ps(keys[i] + c)));
                }
                __m512 sum = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + (qi * G + g) * lmax + j0, (__mmask16)((1u << n) - 1u), sum);
            }
        }
    }
}
#endif

/* scores[r * lmax + j] = (q_r . k_j) * scale for every row r of the tile and key j < len[qi]. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int64_t Hq, kv_head kp,
                                                             const int32_t *table, const int32_t *len, int nq,
                                                             int64_t lmax, int64_t bs, int64_t G, const int64_t D,
                                                             float scale, float *scores, float *buf) {
    for (int64_t j0 = 0; j0 < lmax; j0 += bs) {  /* one block of the table at a time */
        int64_t n = lmax - j0 < bs ? lmax - j0 : bs, stride;  /* stride: between consecutive slots */
        const float *k = kv_rows(kp, table[j0 / bs], n, buf, &stride);
        for (int64_t j = j0; j < j0 + n; j++, k += stride)
            for (int qi = 0; qi < nq; qi++) {
                if (j >= len[qi]) continue;
                const float *qr = q + qi * Hq * D;
                for (int64_t g = 0; g < G; g++) scores[(qi * G + g) * lmax + j] = dot(qr + g * D, k, D) * scale;
            }
    }
}

/* The rows' scores in place -> softmax over each row's own keys. */
static void tile_softmax(float *scores, const int32_t *len, int nq, int64_t G, int64_t lmax) {
    for (int64_t r = 0; r < nq * G; r++) {
        float *s = scores + r * lmax, m = -INFINITY, sum = 0.0f;
        int64_t n = len[r / G];
        for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        exp_shifted(s, n, m);
        for (int64_t j = 0; j < n; j++) sum += s[j];
        for (int64_t j = 0; j < n; j++) s[j] /= sum;
    }
}

/* acc[r] += sum_j p_r[j] v_j, one block of the table at a time (its values stay in L1 for every
 * row); D a constant (64, 128) keeps a row's sums in registers within a block. */
static inline __attribute__((always_inline)) void tile_values(const float *scores, kv_head vp,
                                                             const int32_t *table, const int32_t *len, int nq,
                                                             int64_t lmax, int64_t bs, int64_t G, const int64_t D,
                                                             float *acc, float *buf) {
    memset(acc, 0, (size_t)(nq * G * D) * sizeof(float));
    for (int64_t j0 = 0; j0 < lmax; j0 += bs) {
        int64_t stride;
        const float *vb = kv_rows(vp, table[j0 / bs], lmax - j0 < bs ? lmax - j0 : bs, buf, &stride);
        for (int64_t r = 0; r < nq * G; r++) {
            int64_t n = len[r / G] - j0;
            n = n < bs ? n : bs;
            const float *p = scores + r * lmax + j0, *v = vb;
            float *a = acc + r * D;
#if defined(__AVX512F__)
            if (D % 64 == 0) {  /* 64 columns at a time: 4 AVX-512 registers of sums (the same lanes' sums) */
                for (int64_t c = 0; c < D; c += 64) {
                    __m512 s[4];
                    for (int i = 0; i < 4; i++) s[i] = _mm512_loadu_ps(a + c + i * 16);
                    const float *vc = v + c;
                    for (int64_t j = 0; j < n; j++, vc += stride) {
                        __m512 pj = _mm512_set1_ps(p[j]);
                        for (int i = 0; i < 4; i++) s[i] = _mm512_add_ps(s[i], _mm512_mul_ps(pj, _mm512_loadu_ps(vc + i * 16)));
                    }
                    for (int i = 0; i < 4; i++) _mm512_storeu_ps(a + c + i * 16, s[i]);
                }
            } else
#endif
            if (D % 64 == 0) {  /* 64 columns at a time: 8 AVX2 registers of sums */
                for (int64_t c = 0; c < D; c += 64) {
                    v8 s[8];
                    for (int i = 0; i < 8; i++) s[i] = load8(a + c + i * 8);
                    const float *vc = v + c;
                    for (int64_t j = 0; j < n; j++, vc += stride)
                        for (int i = 0; i < 8; i++) s[i] += p[j] * load8(vc + i * 8);
                    memcpy(a + c, s, sizeof s);
                }
            } else {
                for (int64_t j = 0; j < n; j++, v += stride)
                    for (int64_t d = 0; d < D; d++) a[d] += p[j] * v[d];
            }
        }
    }
}

/* buf: room for max(bs, 16) rows of D floats (a bfloat16 pool's rows, converted). */
static void attend_tile(const float *q, int64_t Hq, kv_head kp, kv_head vp, const int32_t *table, const int32_t *len,
                        int nq, int64_t bs, int64_t G, int64_t D, float scale, float *scores, float *acc, float *buf) {
    int64_t lmax = 0;
    for (int qi = 0; qi < nq; qi++) lmax = len[qi] > lmax ? len[qi] : lmax;
#if defined(__AVX512F__)
    if (D == 64) tile_scores16(q, Hq, kp, table, len, nq, lmax, bs, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores16(q, Hq, kp, table, len, nq, lmax, bs, G, 128, scale, scores, buf);
#else
    if (D == 64) tile_scores(q, Hq, kp, table, len, nq, lmax, bs, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores(q, Hq, kp, table, len, nq, lmax, bs, G, 128, scale, scores, buf);
#endif
    else tile_scores(q, Hq, kp, table, len, nq, lmax, bs, G, D, scale, scores, buf);
    tile_softmax(scores, len, nq, G, lmax);
    if (D == 64) tile_values(scores, vp, table, len, nq, lmax, bs, G, 64, acc, buf);
    else if (D == 128) tile_values(scores, vp, table, len, nq, lmax, bs, G, 128, acc, buf);
    else tile_values(scores, vp, table, len, nq, lmax, bs, G, D, acc, buf);
}

/* Paged attention of T query tokens q[T, Hq, D]: token t belongs to sequence seq[t] (a row of
 * tables[B, max_blocks]) and sees that sequence's first len[t] positions (itself included).
 * out[T, Hq, D] float32 or bfloat16. Work is split over (query tile, KV head) pairs, a tile being
 * up to QUERY_TILE consecutive tokens of one sequence, so each KV head's keys and values are read
 * from memory once per tile (at a decode step attention waits on those reads: splitting a KV
 * head's query heads over the threads instead, each reading the head's K/V, took 1.1-1.4x as long
 * with SmolLM2's 3 KV heads on 2 threads, at 230 and 1,000 positions). With fewer such pairs than
 * threads (one sequence, one KV head), over (tile, query head) ones, so that every thread has work
 * (each head's arithmetic is its own either way). The pools [Hkv, S, D] are float32, or bfloat16
 * if kv_bf (the same arithmetic on the values they hold). */
void hs_paged_attention(const float *q, const void *kpool, const void *vpool, int kv_bf, const int32_t *tables,
                        int64_t max_blocks, const int32_t *seq, const int32_t *len, int64_t T, int64_t Hq,
                        int64_t Hkv, int64_t S, int64_t D, int64_t bs, float scale, void *out, int out_bf,
                        int parallel) {
    int64_t G = Hq / Hkv, ntiles = 0;
    int64_t *first = malloc((size_t)(T + 1) * sizeof(int64_t));  /* first token of each tile */
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || seq[t] != seq[t - 1] || t - first[ntiles - 1] >= QUERY_TILE) first[ntiles++] = t;
    first[ntiles] = T;
#ifdef _OPENMP
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
#else
    const int64_t threads = 1;
#endif
    int64_t parts = ntiles * Hkv < threads ? G : 1, hg = G / parts;  /* items per group, heads per item */
#pragma omp parallel for schedule(dynamic) if (parallel)
    for (int64_t p = 0; p < ntiles * Hkv * parts; p++) {
        int64_t tile = p / (Hkv * parts), kvh = p / parts % Hkv, h0 = kvh * G + p % parts * hg;  /* first head */
        int64_t t0 = first[tile], lmax = 0;
        int nq = (int)(first[tile + 1] - t0);
        for (int qi = 0; qi < nq; qi++) lmax = len[t0 + qi] > lmax ? len[t0 + qi] : lmax;
        float *scores = malloc((size_t)(nq * hg * lmax) * sizeof(float));
        float *acc = malloc((size_t)(nq * hg * D) * sizeof(float));
        float *buf = kv_bf ? malloc((size_t)((bs > 16 ? bs : 16) * D) * sizeof(float)) : NULL;
        kv_head kp = {kpool, kv_bf, kvh * S * D, D, bs}, vp = {vpool, kv_bf, kvh * S * D, D, bs};
        attend_tile(q + (t0 * Hq + h0) * D, Hq, kp, vp, tables + (int64_t)seq[t0] * max_blocks, len + t0, nq, bs,
                    hg, D, scale, scores, acc, buf);
        for (int qi = 0; qi < nq; qi++)
            store_row(out, out_bf, ((t0 + qi) * Hq + h0) * D, hg * D, acc + qi * hg * D);
        free(scores);
        free(acc);
        free(buf);
    }
    free(first);
}

/* ---- float32 matmuls of 5 .. 512 rows (batched decode steps, verification windows, prefill chunks) ----
 * y[M, N] = x[M, K] W[N, K]^T with W packed once into panels of PANEL_N output columns,
 * [ceil(N / PANEL_N)][K][PANEL_N] (the tail zero-padded): a panel is read front to back while
 * PANEL_M rows of x accumulate PANEL_M x PANEL_N outputs in registers. Every output is one
 * fused multiply-add chain over k = 0 .. K-1 in order, so it depends on its own row of x alone
 * (not on M, nor on which rows share a tile, nor on the vector width: fma rounds once). Tiles:
 * 8 rows x 48 columns in AVX-512 registers, 6 x 16 in AVX2 ones (there the panels are 16 wide), a plain fmaf loop elsewhere. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PANEL_N 16 /* AVX2's 16 registers: 6 rows x 16 columns of accumulators */
#define PANEL_M 6
#else
#define PANEL_N 48
#define PANEL_M 8
#endif

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
static void panel_rows(const float *x, int64_t M, int64_t K, const float *panel, const float *next, float *y,
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
        panel_rows(x, M, K, panel, M > PANEL_M && p + 1 < P ? panel + K * PANEL_N : NULL, y, N, n0, nvalid);
    }
}

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

/* The weight formats: a block's 32 integer codes and per-block scale d (and offset m). */
enum { Q8 = 0, Q4 = 1 };
#define BLOCK_BYTES(kind) ((kind) == Q8 ? 32 : 16)

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
    if (kind == Q8) {
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
    const int64_t bytes = BLOCK_BYTES(kind);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < R; r++) {
            __m256i lo, hi;
            /* the same block PREFETCH_ROWS rows on (the rows are contiguous, the threads sweep them in
             * order): the load stalls on memory otherwise, four short rows being too little of a
             * stream for the hardware prefetcher */
            __builtin_prefetch(w + ((r + PREFETCH_ROWS) * nb + b) * bytes, 0, 0);
            __builtin_prefetch(d + (r + PREFETCH_ROWS) * nb + b, 0, 0);
            if (kind == Q4) __builtin_prefetch(m + (r + PREFETCH_ROWS) * nb + b, 0, 0);
            block_codes(w + (r * nb + b) * bytes, kind, &lo, &hi);
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
        const __m256 c = _mm256_mul_ps(_mm256_set1_ps(d[b]), _mm256_loadu_ps(p.scale_t + b * p.tpad + t0));
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
    const int64_t row_bytes = nb * BLOCK_BYTES(kind);
    if (T == 1) {  /* four weight rows at a time: independent chains hide the FMA latency */
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n = 0; n < N; n += 4) {
            const uint8_t *wn = w + n * row_bytes;
            const float *dn = d + n * nb, *mn = m ? m + n * nb : NULL;
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
        const float *dn = d + n * nb, *mn = m ? m + n * nb : NULL;
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
    if (kind == Q8) return ((const int8_t *)w)[j];
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

/* y[T, N] float32 = x[T, K] (float32, or bfloat16 when x_bf) times the transpose of a GGUF
 * Q8_0 weight W[n, k] = d[n, k / 32] * q[n, k] (q int8 [N, K], d float32 [N, K / 32]; K a
 * multiple of 32). The threads share W's rows. */
void hs_q8_matmul(const int8_t *q, const float *d, const void *x, int x_bf, int64_t T, int64_t N, int64_t K,
                  float *y, int parallel) {
    const float *xf = (const float *)x;
    float *conv = NULL;
    if (x_bf) {
        conv = malloc((size_t)(T * K) * sizeof(float));
        load_row(x, 1, 0, T * K, conv);
        xf = conv;
    }
    xq p = x16_prepare(xf, T, K);
    blocks_matmul((const uint8_t *)q, d, NULL, p, T, N, K / 32, Q8, y, parallel);
    x16_release(p);
    free(conv);
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
            panel_rows(x, T, K, panel, NULL, y, N, n0, nvalid);
        }
        free(panel);
    }
}
