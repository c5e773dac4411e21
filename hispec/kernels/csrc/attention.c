/* Paged attention over the KV pools (hispec_kernels.h). */
#include "simd.h"

/* s[j] = fast_exp(s[j] - m) for j < n. */
static void exp_shifted(float *s, int64_t n, float m) {
    int64_t j = 0;
#if defined(__AVX512F__)  /* (16-lane generic vectors are split and spilled on AVX2 builds) */
    for (; j + 16 <= n; j += 16) {
        v16 x;
        memcpy(&x, s + j, sizeof x);
        x = fast_exp16(x - m);
        memcpy(s + j, &x, sizeof x);
    }
#endif
    for (; j + 8 <= n; j += 8) {
        v8 x = fast_exp8(load8(s + j) - m);
        memcpy(s + j, &x, sizeof x);
    }
    for (; j < n; j++) s[j] = fast_exp(s[j] - m);
}

/* Paged attention, a tile of up to QUERY_TILE consecutive query tokens of one sequence and one KV
 * head at a time: the G query heads of each token that share KV head kvh ("rows" r = qi * G + g).
 * Each key and value row is read once per tile and used by all its rows while it is in L1 (a
 * prompt chunk's queries share their context), instead of once per query. Each row's arithmetic
 * is that of the row alone, in the same order (scores key by key, softmax over its own length,
 * values accumulated key by key, then divided by the row's sum), so a query's output does not
 * depend on the tile it falls in. Products are summed by fused multiply-adds (fma8: an
 * instruction on every AVX2 CPU; a software fmaf, correct but ~40x slower, on x86 CPUs without
 * FMA). Tiles of 32 queries (96 rows of SmolLM2's heads): a prompt chunk's keys are transposed
 * and its values paired (the bfloat16 path) once per 96 rows instead of 24; attention over a
 * 256-query chunk after 512 positions took 0.91-0.95x the time of 8-query tiles, 64 gained nothing
 * more. */
#define QUERY_TILE 32

/* One KV head of a pool [Hkv, S, D] (float32, or bfloat16 if bf), its rows from element ``head``
 * on, read as float32 rows: a float32 pool's rows are used where they lie, a bfloat16 pool's are
 * converted (exactly) into a buffer first, so the arithmetic on them is the same either way and a
 * bfloat16 cache only halves the bytes attention reads (attend_tile_bf, below, reads them as they
 * lie where the CPU multiplies bfloat16). The head's rows are contiguous: a
 * sequence's blocks stream from memory (with the heads interleaved per slot, a head's rows 768
 * bytes apart, attention over 16 sequences of 260 positions took 1.4x as long). */
typedef struct { const void *base; int bf; int64_t head, D; } kv_head;

/* Where a tile's keys lie: key j < tail_start through the sequence's block table, key j >= tail_start at
 * slot tail[j - tail_start] (a token tree: a node's ancestors and itself, wherever they were written;
 * tail_start = INT64_MAX: no tail). */
typedef struct { const int32_t *table; int64_t bs, tail_start; const int64_t *tail; } key_map;

static inline int64_t key_slot(key_map m, int64_t j) {
    return j < m.tail_start ? (int64_t)m.table[j / m.bs] * m.bs + j % m.bs : m.tail[j - m.tail_start];
}

/* The first slot of keys j0 .. j0 + *n - 1, which lie at consecutive slots: to the end of j0's block
 * (or lmax, or the tail's start) in the table, one key in the tail. */
static inline int64_t key_run(key_map m, int64_t j0, int64_t lmax, int64_t *n) {
    if (j0 >= m.tail_start) {
        *n = 1;
        return m.tail[j0 - m.tail_start];
    }
    int64_t end = (j0 / m.bs + 1) * m.bs;
    end = end < lmax ? end : lmax;
    end = end < m.tail_start ? end : m.tail_start;
    *n = end - j0;
    return key_slot(m, j0);
}

/* The slots of keys j0 .. j0 + n - 1 (n <= 16) into slots[]: a run of consecutive slots per block
 * they span (key_run), so one division per block instead of one per key (the block size is known
 * only at run time: an integer division each; the bfloat16 path took four per key, and decode steps
 * took 1.04-1.06x as long). */
static inline void chunk_slots(key_map m, int64_t j0, int64_t n, int64_t *slots) {
    for (int64_t i = 0, run; i < n; i += run) {
        const int64_t first = key_run(m, j0 + i, j0 + n, &run);
        for (int64_t k = 0; k < run; k++) slots[i + k] = first + k;
    }
}

/* The row of slot ``slot``: in the pool, or converted into buf[D]. */
static inline const float *kv_row(kv_head p, int64_t slot, float *buf) {
    int64_t at = p.head + slot * p.D;
    if (!p.bf) return (const float *)p.base + at;
    load_row(p.base, 1, at, p.D, buf);
    return buf;
}

/* The n rows from slot ``slot`` on: a pointer to them, the distance between rows in *stride (in
 * the pool, or converted into buf[n * D]). */
static inline const float *kv_rows(kv_head p, int64_t slot, int64_t n, float *buf, int64_t *stride) {
    int64_t at = p.head + slot * p.D;
    *stride = p.D;
    if (!p.bf) return (const float *)p.base + at;
    load_row(p.base, 1, at, n * p.D, buf);
    return buf;
}

/* a * b + c lane by lane, rounded once (a fused multiply-add: one instruction where the CPU has
 * it, fmaf per lane elsewhere; the same bits either way). Attention's products and sums are fused:
 * half the arithmetic of a multiply and an add, and the same bits on AVX2 and AVX-512. */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
    __m256 r = _mm256_fmadd_ps(*(__m256 *)&a, *(__m256 *)&b, *(__m256 *)&c);
    memcpy(&c, &r, sizeof c);
#else
    for (int i = 0; i < 8; i++) c[i] = fmaf(a[i], b[i], c[i]);
#endif
    return c;
}

static inline v8 splat8(float x) {
    v8 v;
    for (int i = 0; i < 8; i++) v[i] = x;
    return v;
}

/* Sliding windows: query qi of a tile sees keys lo[qi] .. len[qi] - 1 (lo 0 without a window). The
 * tile's loops over keys start at the first whole 16 below the smallest lo (a multiple of 16, as
 * from key 0: the bfloat16 path's chunks of 16 keys and pairs of keys lie where they lie for the
 * query alone); each row's softmax and values start at its own lo, so its arithmetic is that of
 * the query alone, whatever the tile. */
static inline int64_t first_key(const int32_t *lo, int nq) {
    int64_t f = lo[0];
    for (int qi = 1; qi < nq; qi++) f = lo[qi] < f ? lo[qi] : f;
    return f / 16 * 16;
}

/* The longest context among a tile's nq queries (its keys: lmax). */
static inline int64_t longest(const int32_t *len, int64_t nq) {
    int64_t lmax = 0;
    for (int64_t qi = 0; qi < nq; qi++) lmax = len[qi] > lmax ? len[qi] : lmax;
    return lmax;
}

/* a . b: 16 lanes of fused multiply-adds (lane l: the elements i = l mod 16 below the last whole
 * 16, in order), the lanes summed by hsum16's tree, then the rest in order: each score's bits,
 * whichever path computes it (tile_scores16 for D = 64, 128 on AVX-512). */
static inline float dot_fma(const float *a, const float *b, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        lo = fma8(load8(a + i), load8(b + i), lo);
        hi = fma8(load8(a + i + 8), load8(b + i + 8), hi);
    }
    float s = hsum16(lo, hi);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
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

/* tile_scores with 16 keys at a time: each key's 16 lane sums as dot_fma() makes them (fused
 * multiply-adds in d order per lane), the 16 keys' lanes summed together (hsum16x16), so every
 * score has dot_fma()'s bits. */
static inline __attribute__((always_inline)) void tile_scores16(const float *q, int64_t Hq, kv_head kp,
                                                               key_map m, const int32_t *len, const int32_t *lo,
                                                               int64_t jf, int nq, int64_t lmax, int64_t G,
                                                               const int64_t D, float scale, float *scores,
                                                               float *buf) {
    static const float zeros[128];  /* the keys past the last: D <= 128 */
    const float *keys[16];
    for (int64_t j0 = jf; j0 < lmax; j0 += 16) {
        int64_t n = lmax - j0 < 16 ? lmax - j0 : 16, slots[16];
        chunk_slots(m, j0, n, slots);
        for (int64_t i = 0; i < 16; i++) keys[i] = i < n ? kv_row(kp, slots[i], buf + i * D) : zeros;
        for (int qi = 0; qi < nq; qi++) {
            if (j0 >= len[qi] || j0 + 16 <= lo[qi]) continue;
            for (int64_t g = 0; g < G; g++) {
                const float *qr = q + qi * Hq * D + g * D;
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 16) {
                    __m512 qc = _mm512_loadu_ps(qr + c);
                    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(keys[i] + c), acc[i]);
                }
                __m512 sum = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + (qi * G + g) * lmax + j0, (__mmask16)((1u << n) - 1u), sum);
            }
        }
    }
}
#endif

/* scores[r * lmax + j] = (q_r . k_j) * scale for every row r of the tile and key lo[qi] <= j < len[qi]
 * (a key's score is the same whichever keys beside it are scored: keys from jf on). */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int64_t Hq, kv_head kp,
                                                             key_map m, const int32_t *len, const int32_t *lo,
                                                             int64_t jf, int nq, int64_t lmax, int64_t G,
                                                             const int64_t D, float scale, float *scores,
                                                             float *buf) {
    for (int64_t j0 = jf, n; j0 < lmax; j0 += n) {  /* one run of consecutive slots (a block) at a time */
        int64_t stride, slot = key_run(m, j0, lmax, &n);  /* stride: between consecutive slots */
        const float *k = kv_rows(kp, slot, n, buf, &stride);
        for (int64_t j = j0; j < j0 + n; j++, k += stride)
            for (int qi = 0; qi < nq; qi++) {
                if (j >= len[qi] || j < lo[qi]) continue;
                const float *qr = q + qi * Hq * D;
                for (int64_t g = 0; g < G; g++) scores[(qi * G + g) * lmax + j] = dot_fma(qr + g * D, k, D) * scale;
            }
    }
}

/* s[0 .. n-1] summed in 16 lanes (lane l: the elements j = l mod 16 below the last whole 16, in
 * order), the lanes by hsum16's fixed tree, then the rest in order: dot()'s order, vectorised
 * without reassociating, the same bits on any vector width. */
static inline float row_sum(const float *s, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        lo += load8(s + j);
        hi += load8(s + j + 8);
    }
    float sum = hsum16(lo, hi);
    for (; j < n; j++) sum += s[j];
    return sum;
}

/* The rows' scores in place -> exp(score - the row's largest) over each row's own keys, and
 * their sums (sum[r]): the softmax's numerators and denominators (the values' weighted sums are
 * divided once, per output element, instead of every weight). */
static void tile_softmax(float *scores, const int32_t *len, const int32_t *lo, int nq, int64_t G, int64_t lmax,
                         float *sum) {
    for (int64_t r = 0; r < nq * G; r++) {  /* a row's keys: lo .. len - 1 */
        float *s = scores + r * lmax + lo[r / G];
        int64_t n = len[r / G] - lo[r / G];
        exp_shifted(s, n, row_max(s, n));
        sum[r] = row_sum(s, n);
    }
}

/* acc[r] += sum_j p_r[j] v_j, one block of the table at a time (its values stay in L1 for every
 * row); D a constant (64, 128) keeps a row's sums in registers within a block. */
static inline __attribute__((always_inline)) void tile_values(const float *scores, kv_head vp,
                                                             key_map m, const int32_t *len, const int32_t *lo,
                                                             int64_t jf, int nq, int64_t lmax, int64_t G,
                                                             const int64_t D, float *acc, float *buf) {
    memset(acc, 0, (size_t)(nq * G * D) * sizeof(float));
    for (int64_t j0 = jf, run; j0 < lmax; j0 += run) {
        int64_t stride, slot = key_run(m, j0, lmax, &run);
        const float *vb = kv_rows(vp, slot, run, buf, &stride);
        for (int64_t r = 0; r < nq * G; r++) {
            const int64_t first = lo[r / G] > j0 ? lo[r / G] : j0;  /* the row's keys from lo on, in order */
            int64_t n = len[r / G] - first;
            n = n < j0 + run - first ? n : j0 + run - first;
            if (n <= 0) continue;
            const float *p = scores + r * lmax + first, *v = vb + (first - j0) * stride;
            float *a = acc + r * D;
#if defined(__AVX512F__)
            if (D % 64 == 0) {  /* 64 columns at a time: 4 AVX-512 registers of sums (the same lanes' sums) */
                for (int64_t c = 0; c < D; c += 64) {
                    __m512 s[4];
                    for (int i = 0; i < 4; i++) s[i] = _mm512_loadu_ps(a + c + i * 16);
                    const float *vc = v + c;
                    for (int64_t j = 0; j < n; j++, vc += stride) {
                        __m512 pj = _mm512_set1_ps(p[j]);
                        for (int i = 0; i < 4; i++) s[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + i * 16), s[i]);
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
                    for (int64_t j = 0; j < n; j++, vc += stride) {
                        v8 pj = splat8(p[j]);
                        for (int i = 0; i < 8; i++) s[i] = fma8(pj, load8(vc + i * 8), s[i]);
                    }
                    memcpy(a + c, s, sizeof s);
                }
            } else {
                for (int64_t j = 0; j < n; j++, v += stride)
                    for (int64_t d = 0; d < D; d++) a[d] = fmaf(p[j], v[d], a[d]);
            }
        }
    }
}

/* The outputs of a tile's rows into acc[nq * G, D]; scores[nq * G, lmax] and sum[nq * G]: room
 * for its weights and their sums; buf: room for max(bs, 16) rows of D floats (a bfloat16 pool's
 * rows, converted). */
static void attend_tile(const float *q, int64_t Hq, kv_head kp, kv_head vp, key_map m, const int32_t *len,
                        const int32_t *lo, int nq, int64_t G, int64_t D, float scale, float *scores, float *acc,
                        float *sum, float *buf) {
    int64_t lmax = longest(len, nq), jf = first_key(lo, nq);
#if defined(__AVX512F__)
    if (D == 64) tile_scores16(q, Hq, kp, m, len, lo, jf, nq, lmax, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores16(q, Hq, kp, m, len, lo, jf, nq, lmax, G, 128, scale, scores, buf);
#else
    if (D == 64) tile_scores(q, Hq, kp, m, len, lo, jf, nq, lmax, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores(q, Hq, kp, m, len, lo, jf, nq, lmax, G, 128, scale, scores, buf);
#endif
    else tile_scores(q, Hq, kp, m, len, lo, jf, nq, lmax, G, D, scale, scores, buf);
    tile_softmax(scores, len, lo, nq, G, lmax, sum);
    if (D == 64) tile_values(scores, vp, m, len, lo, jf, nq, lmax, G, 64, acc, buf);
    else if (D == 128) tile_values(scores, vp, m, len, lo, jf, nq, lmax, G, 128, acc, buf);
    else tile_values(scores, vp, m, len, lo, jf, nq, lmax, G, D, acc, buf);
    for (int64_t r = 0; r < nq * G; r++)
        for (int64_t d = 0; d < D; d++) acc[r * D + d] /= sum[r];
}

#if defined(__AVX512BF16__)
/* ---- a bfloat16 pool on a CPU with AVX512_BF16: bfloat16 products ----
 * Where the library is built with AVX512_BF16 (hs_attention_bf16_products) and the head size is 64
 * or 128, attention over a bfloat16 pool multiplies as VDPBF16PS does, on "words", two bfloat16 in
 * 32 bits (element 2i in the low half, 2i + 1 in the high): a lane adds the high halves' product by
 * a fused multiply-add, then the low halves' (a product of two bfloat16 is exact in float32). The
 * instruction does 32 multiply-adds where a float32 one does 16, on keys and values read as they lie
 * in the pool. Elsewhere a bfloat16 pool's rows are widened and take attend_tile's float32
 * arithmetic (emulating the instruction's with float32 multiply-adds took 3-4x as long).
 * - Scores: each query element as two bfloat16, h = bf16(x) and l = bf16(x - h) (x to ~2^-17, as
 *   float32 to 2^-24: rounded to one bfloat16, the default model's greedy tokens kept in step with
 *   float32 weights for 42 of 128 on average instead of 50, scripts/numerics.py). Keys 16 at a
 *   time, rearranged once for all the tile's rows (bf_key_quads): a key's score is four partial
 *   sums over its D / 2 words, p_c over the words w = c mod 4 in order (each word's product with
 *   h's word, then with l's), added as (p_0 + p_1) + (p_2 + p_3), times scale.
 * - Values: the softmax weights rounded to bfloat16 (to nearest even); each output element over the
 *   row's keys in pairs (2u, 2u + 1) in order, key 2u + 1's product first; the key after a row's
 *   last has weight 0 (adds nothing). The weights' sum is that of the rounded weights.
 * As above, each row's arithmetic is its own, in a fixed order: a query's output does not depend on
 * the tile it falls in. */

typedef uint32_t word;  /* two bfloat16 */

/* x's 16 lanes rounded to bfloat16 as f2bf does (to nearest even, NaN -> 0x7FC0), as float32 bits,
 * by integer operations: VCVTNEPS2BF16 rounds the same way but flushes denormals to zero and keeps a
 * NaN's payload. */
static inline __m512i bf_bits16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, odd), _mm512_set1_epi32(0x7FFF));
    return _mm512_mask_mov_epi32(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)),
                                 _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

/* The bfloat16 halves of 32 rounded lanes (a: elements 0-15, b: 16-31) as 16 words: word w =
 * (element 2w, element 2w + 1). */
static inline __m512i bf_words(__m512i a, __m512i b) {
    static const uint16_t high_halves[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                             33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_permutex2var_epi16(a, _mm512_loadu_si512(high_halves), b);
}

/* A query row x[D] (D a multiple of 32) as words: each element as h = bf16(x), l = bf16(x - h),
 * w[0 .. D / 2) h's and w[D / 2 .. D) l's. */
static inline void bf_split_row(const float *x, int64_t D, word *w) {
    for (int64_t i = 0; i < D; i += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        const __m512i h0 = bf_bits16(x0), h1 = bf_bits16(x1);
        const __m512i l0 = bf_bits16(_mm512_sub_ps(x0, _mm512_castsi512_ps(h0)));
        const __m512i l1 = bf_bits16(_mm512_sub_ps(x1, _mm512_castsi512_ps(h1)));
        _mm512_storeu_si512(w + i / 2, bf_words(h0, h1));
        _mm512_storeu_si512(w + D / 2 + i / 2, bf_words(l0, l1));
    }
}

static const word zero_words[64];  /* the keys and values past the last (D <= 128) */

/* The 16 keys (or values) j0 .. j0 + 15 as rows of words: a row past lmax reads zeros; their slots
 * (those below lmax) into slots[]. */
static inline void chunk_rows(kv_head p, key_map m, int64_t j0, int64_t lmax, const word *rows[16],
                              int64_t slots[16]) {
    int64_t n = lmax - j0 < 16 ? lmax - j0 : 16;
    chunk_slots(m, j0, n, slots);
    for (int64_t i = 0; i < 16; i++) rows[i] = i < n ? (const word *)((const bf16 *)p.base + p.head + slots[i] * p.D)
                                                     : zero_words;
}

/* A chunk's 16 rows (keys or values j0 .. j0 + 15 below lmax) into the L2 cache ahead of their use
 * (PREFETCH_AHEAD chunks ahead): a chunk's rows lie in one block (2 KB a head for 16 slots of 64), a
 * sequence's blocks wherever its table puts them, too short a run for the hardware's prefetch. At a
 * decode step the layer's K/V come from memory (the weights streamed since its last step pushed them
 * out of the caches); decoding 256 tokens on the default model (2 Zen 4 cores, paired runs) attention
 * took 0.44-0.49 ms a token with a prefetch of the next chunk, 0.49-0.55 without. Into L2, not L1
 * (prefetcht1): a chunk is 32 lines, more than the L1's misses in flight, and the prefetcht0s of
 * one chunk ahead stalled the core until lines came (16% of attention's samples sat on them); at
 * batch 8 (16 held-out prompts, 256 tokens, paired runs) attention took 0.77x as long as with those,
 * the whole generation 0.93x. The values are prefetched twice: chunk by chunk beside the keys
 * (bf_scores), so that they come while the scores are computed instead of after the softmax, and
 * ahead of bf_values as the keys are (for a context whose K and V do not both fit in L2): at batch
 * 8 attention took 0.88-0.90x as long, the generation 0.98x; at batch 1 0.95x (paired runs). */
#define PREFETCH_AHEAD 2
static inline void prefetch_rows(kv_head p, const int64_t *slots, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const char *row = (const char *)((const bf16 *)p.base + p.head + slots[i] * p.D);
        for (int64_t b = 0; b < p.D * (int64_t)sizeof(bf16); b += 64) __builtin_prefetch(row + b, 0, 2);
    }
}

static inline void prefetch_chunk(kv_head p, key_map m, int64_t j0, int64_t lmax) {
    int64_t n = lmax - j0 < 16 ? lmax - j0 : 16, slots[16];
    if (n <= 0) return;
    chunk_slots(m, j0, n, slots);
    prefetch_rows(p, slots, n);
}

/* A chunk's 16 keys (rows of W words) as quads: kq[g * W / 4 + s], 128-bit lane L, holds key
 * g + 4L's words 4s .. 4s + 3 (a 4 x 4 transpose of 128-bit lanes per 16 words of keys g, g + 4,
 * g + 8, g + 12). Half the shuffles of a transpose to a key a lane (which the CPU's dot products
 * wait on: VDPBF16PS shares their port on this Xeon), and a row's words are read four at a time
 * instead of one; bf_score_rows adds four shuffles a row. A decode step's items of 3 rows (SmolLM2:
 * 3 query heads a KV head) took 0.94-0.95x as long over 16-300 keys (D = 64 and 128), prompt tiles
 * of 96 rows 0.97-0.99x (interleaved runs, one thread). */
static inline void bf_key_quads(const word *const keys[16], const int64_t W, __m512i *kq) {
    for (int g = 0; g < 4; g++)
        for (int64_t h = 0; h < W; h += 16) {
            const __m512i a = _mm512_loadu_si512(keys[g] + h), b = _mm512_loadu_si512(keys[g + 4] + h);
            const __m512i c = _mm512_loadu_si512(keys[g + 8] + h), d = _mm512_loadu_si512(keys[g + 12] + h);
            const __m512i ab0 = _mm512_shuffle_i32x4(a, b, 0x44), ab1 = _mm512_shuffle_i32x4(a, b, 0xEE);
            const __m512i cd0 = _mm512_shuffle_i32x4(c, d, 0x44), cd1 = _mm512_shuffle_i32x4(c, d, 0xEE);
            __m512i *v = kq + g * (W / 4) + h / 4;
            v[0] = _mm512_shuffle_i32x4(ab0, cd0, 0x88);
            v[1] = _mm512_shuffle_i32x4(ab0, cd0, 0xDD);
            v[2] = _mm512_shuffle_i32x4(ab1, cd1, 0x88);
            v[3] = _mm512_shuffle_i32x4(ab1, cd1, 0xDD);
        }
}

/* R (1-4) rows' scores for a chunk's 16 keys (n of them stored) from its quads kq: lane (L, c) of
 * p[r][g] is key g + 4L's partial sum p_c, step s adding word 4s + c's products (h's word, then
 * l's: the row's 4 words broadcast to every 128-bit lane). The lanes' sums (p_0 + p_1) + (p_2 +
 * p_3) leave key 4L + g in lane 4L + g: in order. */
static inline __attribute__((always_inline)) void bf_score_rows(const word *const q[4], const __m512i *kq,
                                                               const int64_t W, const int R, float scale, int64_t n,
                                                               float *const out[4]) {
    __m512 p[4][4];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 4; g++) p[r][g] = _mm512_setzero_ps();
    for (int64_t s = 0; s < W / 4; s++) {
        __m512bh h[4], l[4];
        for (int r = 0; r < R; r++) {
            h[r] = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q[r] + 4 * s)));
            l[r] = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q[r] + W + 4 * s)));
        }
        for (int g = 0; g < 4; g++) {
            const __m512bh k = (__m512bh)kq[g * (W / 4) + s];
            for (int r = 0; r < R; r++) {
                p[r][g] = _mm512_dpbf16_ps(p[r][g], h[r], k);
                p[r][g] = _mm512_dpbf16_ps(p[r][g], l[r], k);
            }
        }
    }
    const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++) {  /* per 128-bit lane: (p_0 + p_1, p_2 + p_3) of groups g, g + 1, then the pairs' sums */
        const __m512 *v = p[r];
        const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
        const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(v[2], v[3], 0x88), _mm512_shuffle_ps(v[2], v[3], 0xDD));
        const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
        _mm512_mask_storeu_ps(out[r], lanes, _mm512_mul_ps(z, sc));
    }
}

/* scores[r * lmax + j] = (q_r . k_j) * scale for the tile's rows and keys j < lmax, from the rows'
 * queries as words qw[r * D ..] (h's D / 2 words, then l's): per chunk of 16 keys, the keys as
 * quads in kq[D / 2] once (bf_key_quads), then the rows that see the chunk four at a time
 * (bf_score_rows); each chunk's values (vp, at the same slots) are prefetched meanwhile
 * (PREFETCH_AHEAD). */
static inline __attribute__((always_inline)) void bf_scores(const word *qw, kv_head kp, kv_head vp, key_map m,
                                                           const int32_t *len, const int32_t *lo, int64_t jf, int nq,
                                                           int64_t G, const int64_t D, int64_t lmax, float scale,
                                                           float *scores, __m512i *kq) {
    const int64_t W = D / 2;
    const word *keys[16];
    for (int64_t c = 1; c < PREFETCH_AHEAD; c++) prefetch_chunk(kp, m, jf + 16 * c, lmax);
    for (int64_t j0 = jf; j0 < lmax; j0 += 16) {
        int64_t n = lmax - j0 < 16 ? lmax - j0 : 16;
        int64_t slots[16];
        chunk_rows(kp, m, j0, lmax, keys, slots);
        prefetch_chunk(kp, m, j0 + 16 * PREFETCH_AHEAD, lmax);
        prefetch_rows(vp, slots, n);  /* the chunk's values (the keys' slots), into L2 for bf_values */
        bf_key_quads(keys, W, kq);
        for (int64_t r = 0; r < nq * G;) {
            const word *q[4];
            float *out[4];
            int R = 0;
            for (; r < nq * G && R < 4; r++)
                if (j0 < len[r / G] && j0 + 16 > lo[r / G]) {
                    q[R] = qw + r * D;
                    out[R++] = scores + r * lmax + j0;
                }
            if (R == 4) bf_score_rows(q, kq, W, 4, scale, n, out);
            else if (R == 3) bf_score_rows(q, kq, W, 3, scale, n, out);
            else if (R == 2) bf_score_rows(q, kq, W, 2, scale, n, out);
            else if (R == 1) bf_score_rows(q, kq, W, 1, scale, n, out);
        }
    }
}

/* The lanes j .. j + 15 that hold keys l .. n - 1, as a mask. */
static inline __mmask16 keys_in(int64_t j, int64_t l, int64_t n) {
    const int64_t from = l - j < 0 ? 0 : l - j, to = n - j > 16 ? 16 : n - j;
    return from >= to ? 0 : (__mmask16)(((1u << to) - 1u) & ~((1u << from) - 1u));
}

/* A row's weights s[l .. n) rounded to bfloat16 in place (their bits) and as words from the chunk
 * of l on (j1 = l / 16 * 16): w[u] = (p[2u], p[2u + 1]) for j1 / 2 <= u < (n + 1) / 2, weight 0
 * before l and at n. 32 weights at a time, packed from the registers that rounded them. */
static inline void bf_round_pack(float *s, int64_t j1, int64_t l, int64_t n, word *w) {
    for (int64_t j = j1; j < n; j += 32) {
        const __mmask16 a = keys_in(j, l, n), b = keys_in(j + 16, l, n);
        const __m512i ra = bf_bits16(_mm512_maskz_loadu_ps(a, s + j));  /* (0 outside the keys: weight 0) */
        const __m512i rb = bf_bits16(_mm512_maskz_loadu_ps(b, s + j + 16));
        _mm512_mask_storeu_epi32(s + j, a, ra);
        _mm512_mask_storeu_epi32(s + j + 16, b, rb);
        const int64_t k = (n + 1) / 2 - j / 2 < 16 ? (n + 1) / 2 - j / 2 : 16;  /* words */
        _mm512_mask_storeu_epi32(w + j / 2, (__mmask16)((1u << k) - 1u), bf_words(ra, rb));
    }
}

/* Each row's scores -> its weights exp(score - max) rounded to bfloat16 (in place), their sum, and
 * the weights as words: pw[r * lw + u] = (p[2u], p[2u + 1]), p[n] = 0 after a row's last key. */
static void bf_softmax(float *scores, const int32_t *len, const int32_t *lo, int nq, int64_t G, int64_t lmax,
                       float *sum, word *pw, int64_t lw) {
    for (int64_t r = 0; r < nq * G; r++) {  /* a row's keys: lo .. n - 1; weight 0 from its chunk's start to lo */
        float *s = scores + r * lmax;
        int64_t n = len[r / G], l = lo[r / G];
        exp_shifted(s + l, n - l, row_max(s + l, n - l));
        bf_round_pack(s, l / 16 * 16, l, n, pw + r * lw);
        sum[r] = row_sum(s + l, n - l);
    }
}

/* R rows' sums (1 or 2 rows of one query: the same keys) over np pairs of a chunk's values (pairs:
 * interleaved as in bf_values), in registers. */
static inline __attribute__((always_inline)) void bf_rows(const word *w0, const word *w1, int64_t np,
                                                         const word *pairs, const int64_t D, const int R,
                                                         float *a0, float *a1) {
    __m512 s0[D / 16], s1[D / 16];
    for (int i = 0; i < D / 16; i++) {
        s0[i] = _mm512_loadu_ps(a0 + i * 16);
        if (R == 2) s1[i] = _mm512_loadu_ps(a1 + i * 16);
    }
    for (int64_t u = 0; u < np; u++) {
        __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)w0[u]), b1 = b0;
        if (R == 2) b1 = (__m512bh)_mm512_set1_epi32((int)w1[u]);
        for (int i = 0; i < D / 16; i++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(pairs + u * D + i * 16);
            s0[i] = _mm512_dpbf16_ps(s0[i], b0, v);
            if (R == 2) s1[i] = _mm512_dpbf16_ps(s1[i], b1, v);
        }
    }
    for (int i = 0; i < D / 16; i++) {
        _mm512_storeu_ps(a0 + i * 16, s0[i]);
        if (R == 2) _mm512_storeu_ps(a1 + i * 16, s1[i]);
    }
}

/* acc[r * D ..] = sum_j p_r[j] v_j for the tile's rows, by chunks of 16 keys: each pair's two value
 * rows interleaved into words once a chunk (unpacklo/hi_epi16, by 128-bit lanes), so a row's sums
 * lie permuted until bf_finish_row; the rows of a query two at a time. pairs: room for 8 * D words. */
static inline __attribute__((always_inline)) void bf_values(const word *pw, int64_t lw, kv_head vp, key_map m,
                                                           const int32_t *len, const int32_t *lo, int64_t jf, int nq,
                                                           int64_t G, const int64_t D, int64_t lmax, float *acc,
                                                           word *pairs) {
    const word *vals[16];
    memset(acc, 0, (size_t)(nq * G * D) * sizeof(float));
    for (int64_t c = 1; c < PREFETCH_AHEAD; c++) prefetch_chunk(vp, m, jf + 16 * c, lmax);
    for (int64_t j0 = jf; j0 < lmax; j0 += 16) {
        int64_t slots[16];
        chunk_rows(vp, m, j0, lmax, vals, slots);
        prefetch_chunk(vp, m, j0 + 16 * PREFETCH_AHEAD, lmax);
        for (int64_t u = 0; u < 8; u++)  /* pairs[u * D ..]: pair u's D words, one a column */
            for (int64_t c = 0; c < D; c += 32) {
                __m512i a = _mm512_loadu_si512(vals[2 * u] + c / 2), b = _mm512_loadu_si512(vals[2 * u + 1] + c / 2);
                _mm512_storeu_si512(pairs + u * D + c, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(pairs + u * D + c + 16, _mm512_unpackhi_epi16(a, b));
            }
        for (int64_t r = 0; r < nq * G;) {
            int64_t n = len[r / G] - j0, np = n >= 16 ? 8 : (n + 1) / 2;
            int two = r + 1 < nq * G && (r + 1) / G == r / G;  /* (a query's rows: the same keys) */
            if (j0 + 16 <= lo[r / G]) n = 0;  /* a chunk before the row's window */
            if (n > 0 && two)
                bf_rows(pw + r * lw + j0 / 2, pw + (r + 1) * lw + j0 / 2, np, pairs, D, 2, acc + r * D,
                        acc + (r + 1) * D);
            else if (n > 0)
                bf_rows(pw + r * lw + j0 / 2, NULL, np, pairs, D, 1, acc + r * D, NULL);
            r += 1 + two;
        }
    }
}

/* A row's sums from bf_values' layout into column order, divided by the row's sum: register 2k + h
 * (h = 0: unpacklo, 1: unpackhi) of the 32 columns from 32k, lane 4L + i, holds column
 * 32k + 8L + 4h + i. */
static void bf_finish_row(float *a, int64_t D, float sum) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 s = _mm512_set1_ps(sum);
    for (int64_t k = 0; k < D; k += 32) {
        const __m512 lo = _mm512_loadu_ps(a + k), hi = _mm512_loadu_ps(a + k + 16);
        _mm512_storeu_ps(a + k, _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), s));
        _mm512_storeu_ps(a + k + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), s));
    }
}

/* attend_tile over a bfloat16 pool with bfloat16 products, D = 64 or 128; scores: room for nq * G
 * rows of lmax; qw: for nq * G rows of D + lmax / 2 + 1 words (the queries' and weights'). */
static void attend_tile_bf(const float *q, int64_t Hq, kv_head kp, kv_head vp, key_map m, const int32_t *len,
                           const int32_t *lo, int nq, int64_t G, int64_t D, float scale, float *scores, float *acc,
                           float *sum, word *qw) {
    int64_t lmax = longest(len, nq), rows = nq * G, jf = first_key(lo, nq);
    int64_t lw = lmax / 2 + 1;
    word *pw = qw + rows * D;
    _Alignas(64) word pairs[8 * 128];  /* (a chunk's pairs, read by whole cache lines; D <= 128) */
    for (int64_t r = 0; r < rows; r++) bf_split_row(q + r / G * Hq * D + r % G * D, D, qw + r * D);
    __m512i *kq = (__m512i *)pairs;  /* (a chunk's keys as quads: D / 2 vectors, the size of pairs) */
    if (D == 64) bf_scores(qw, kp, vp, m, len, lo, jf, nq, G, 64, lmax, scale, scores, kq);
    else bf_scores(qw, kp, vp, m, len, lo, jf, nq, G, 128, lmax, scale, scores, kq);
    bf_softmax(scores, len, lo, nq, G, lmax, sum, pw, lw);
    if (D == 64) bf_values(pw, lw, vp, m, len, lo, jf, nq, G, 64, lmax, acc, pairs);
    else bf_values(pw, lw, vp, m, len, lo, jf, nq, G, 128, lmax, acc, pairs);
    for (int64_t r = 0; r < rows; r++) bf_finish_row(acc + r * D, D, sum[r]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- AMX tiles: prompt tokens (attend_tile_amx), a step's products (attend_tile_steps) ----
 * Where the CPU has AMX-BF16 (Sapphire Rapids and later) and Linux lets the process use its tiles,
 * the queries of prompt tokens (hs_paged_attention_window's ``prompt``: a prefill, never a decode
 * step, a verification window or a token tree) over a bfloat16 pool with D = 64 or 128 take a path
 * of their own, on the tile unit (TDPBF16PS: a 16 x 16 block of float32 sums of 32 bfloat16
 * products each, one instruction). The arithmetic is not attend_tile_bf's (the tile unit adds each
 * instruction's products in its own order and precision), so a prompt token's bits differ from the
 * same token decoded alone; every strategy prefills a prompt the same way, so they still give the
 * same tokens, and the engine runs the positions past a prompt (a preempted sequence's) as decoded
 * tokens (``prompt`` 0). A query's arithmetic is its own whatever its tile or chunk: a tile's rows
 * and columns are independent sums, keys come in blocks of 16 (scores) and 32 (values) counted from
 * key 0, and the keys past a query's own are masked out of its softmax and weigh 0.
 * - Scores, key-major: S^T [16 keys, 16 rows] += K [16 keys, 32 of D] . Q^T (the rows' queries as
 *   two bfloat16 each, h = bf16(x), l = bf16(x - h), as attend_tile_bf: h's products, then l's, for
 *   each 32 of D in order), the keys read as they lie in the pool.
 * - Softmax per row over its own keys, 16 rows in the 16 lanes of a vector: scores times scale, the
 *   maximum, exp(s - max) rounded to bfloat16, their sum (key by key, in order).
 * - Values: O^T [16 of D, 16 rows] += V^T [16 of D, 32 keys] . P^T (the rounded weights of two keys
 *   paired), V^T built once per (tile, KV head) for all its rows.
 * SmolLM2's 256-token prompt chunks (2 threads, a Xeon with AMX, the thirtieth session): attention took
 * 10.9 ms against attend_tile_bf's 26.3 after no positions, 34.8 against 136.4 after 768; the mixed
 * serving load (200 requests, `hispec bench serve`'s, stepped offline) 0.93x the time.
 * A step's queries (decode steps, verification windows, tree nodes: a few rows an item, where the
 * prompt path's softmax in lanes would leave most lanes empty) keep attend_tile_bf's row by row
 * softmax and take only their products to the tiles: scores key-major as above, then transposed to
 * rows; values row-major, O [rows, 16 of D] += P [rows, 32 keys] . V (pairs of value rows
 * interleaved, bf_values' layout), with the tiles configured for the group's rows (a product over
 * 1-4 rows takes the tile unit ~0.6x the time of one over 16). */
#define AMX_TILE_ROWS 16
#define amx_permitted hs_amx_tiles  /* (a build with AMX-BF16 runs on a CPU that has it) */

/* This thread's tiles, each of 64 bytes a row: 0-3 the sums of the values (``rows`` rows: the rows
 * of a group), 4 the A operand of the scores and of a prompt's values (16 rows: keys, values), 5 the
 * B operand (16 rows: queries, weights, a step's values), 6 the sums of the scores (16 keys),
 * 7 the A operand of a step's values (``rows`` rows: weights). A prompt's groups take 16 rows. */
static void amx_configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 4 || t == 7 ? (uint8_t)rows : AMX_TILE_ROWS;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* This thread's tiles configured for groups of ``rows`` rows (*configured: the rows they are
 * configured for, 0 none yet). A decode step's items all have the same rows (a KV head's query
 * heads), so a thread configures once a call; the tile unit's time for a product goes with its
 * rows (16 rows 5.1 ns, 1-4 rows 2.9: TDPBF16PS timed alone on the Xeon). */
static inline void amx_rows(int rows, int *configured) {
    if (*configured == rows) return;
    amx_configure(rows);
    *configured = rows;
}

/* dst[p * 16 + n] = src[n * stride + p] for n, p < 16: a 16 x 16 block of 32-bit words transposed
 * (in registers: pairs of rows interleaved, then pairs of pairs, leaving r[4g + c]'s 128-bit lane L
 * rows 4g .. 4g + 3 of column 4L + c; then the lanes gathered). */
static inline void transpose_words(const uint32_t *src, int64_t stride, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i a01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), a23 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i b01 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i b23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_si512(dst + c * 16, _mm512_shuffle_i32x4(a01, b01, 0x88));
        _mm512_storeu_si512(dst + (4 + c) * 16, _mm512_shuffle_i32x4(a01, b01, 0xDD));
        _mm512_storeu_si512(dst + (8 + c) * 16, _mm512_shuffle_i32x4(a23, b23, 0x88));
        _mm512_storeu_si512(dst + (12 + c) * 16, _mm512_shuffle_i32x4(a23, b23, 0xDD));
    }
}

/* The 16 keys (or values) j0 .. j0 + 15 of a head, below lmax, as rows of D bfloat16 one after the
 * other: in the pool where they lie so (their slots consecutive), else copied into buf[16 * D]
 * (zeros past lmax). */
static inline const bf16 *amx_rows16(kv_head p, key_map m, int64_t j0, int64_t lmax, bf16 *buf) {
    const int64_t n = lmax - j0 < 16 ? lmax - j0 : 16;
    int64_t slots[16];
    chunk_slots(m, j0, n, slots);
    const bf16 *base = (const bf16 *)p.base + p.head;
    if (n == 16 && slots[15] == slots[0] + 15) return base + slots[0] * p.D;
    for (int64_t i = 0; i < 16; i++) {
        if (i < n) memcpy(buf + i * p.D, base + slots[i] * p.D, (size_t)p.D * sizeof(bf16));
        else memset(buf + i * p.D, 0, (size_t)p.D * sizeof(bf16));
    }
    return buf;
}

/* V^T for keys 0 .. nk32 * 32 - 1 (zeros past lmax): vt[(c * D / 16 + b) * 256 + d * 16 + u] = the
 * word (v[32c + 2u][16b + d], v[32c + 2u + 1][16b + d]), tile (c, b) the A operand of the values. */
static void amx_values_t(kv_head vp, key_map m, int64_t lmax, int64_t D, int64_t nk32, uint32_t *vt, bf16 *buf) {
    const __m512i pair = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                           0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                           0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
    _Alignas(64) uint32_t w[16 * 16];
    for (int64_t c = 0; c < nk32; c++) {
        const bf16 *lo = amx_rows16(vp, m, 32 * c, lmax, buf);
        const bf16 *hi = amx_rows16(vp, m, 32 * c + 16, lmax, buf + 16 * D);
        for (int64_t b = 0; b < D / 16; b++) {
            for (int64_t u = 0; u < 16; u++) {  /* w[u * 16 + d] = (v[2u][16b + d], v[2u + 1][16b + d]) */
                const bf16 *v0 = (u < 8 ? lo + 2 * u * D : hi + (2 * u - 16) * D) + 16 * b;
                const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)v0)),
                                                      _mm256_loadu_si256((const __m256i *)(v0 + D)), 1);
                _mm512_store_si512(w + u * 16, _mm512_permutexvar_epi16(pair, ab));
            }
            transpose_words(w, 16, vt + (c * (D / 16) + b) * 256);
        }
    }
}

/* A group's query words qw[16 rows, D] (h's D / 2, then l's) as Q^T tiles: qt[(2b + hl) * 256 + p * 16
 * + i] = row i's word 16b + p of h (hl 0) or l. */
static inline void amx_queries_t(const uint32_t *qw, int64_t D, uint32_t *qt) {
    const int64_t W = D / 2;
    for (int64_t b = 0; b < W / 16; b++) {
        transpose_words(qw + 16 * b, D, qt + 2 * b * 256);
        transpose_words(qw + W + 16 * b, D, qt + (2 * b + 1) * 256);
    }
}

/* One chunk's scores, key-major: st[j * 16 + i] = S^T [16 keys, 16 rows] = K . Q^T over each 32 of
 * D in order, h's products then l's (k: the chunk's 16 key rows of D, qt: amx_queries_t's), on tile
 * 6 (16 rows in every configuration), unscaled. */
static inline void amx_chunk_scores(const bf16 *k, const uint32_t *qt, int64_t D, float *st) {
    _tile_zero(6);
    for (int64_t b = 0; b < D / 32; b++) {
        _tile_loadd(4, k + 32 * b, (int)(D * sizeof(bf16)));
        _tile_loadd(5, qt + 2 * b * 256, 64);
        _tile_dpbf16ps(6, 4, 5);
        _tile_loadd(5, qt + (2 * b + 1) * 256, 64);
        _tile_dpbf16ps(6, 4, 5);
    }
    _tile_stored(6, st, 64);
}

/* Scores of a step's rows on the tile unit (attend_tile_steps): the rows' queries as words qw[r * D
 * ..] (h's D / 2, then l's: bf_split_row), 16 rows at a time transposed into Q^T tiles once; per
 * chunk of 16 keys S^T [16 keys, 16 rows] = K . Q^T over each 32 of D in order, h's products then
 * l's (a prompt's sums, amx_group), transposed back and times scale: scores[r * lmax + j], j <
 * lmax. The keys are read where they lie in the pool (a block's 16 slots) and each chunk's values
 * prefetched beside them, as bf_scores does. */
static void amx_step_scores(const word *qw, kv_head kp, kv_head vp, key_map m, int64_t rows, int64_t D,
                            int64_t lmax, float scale, float *scores) {
    const int64_t nk16 = (lmax + 15) / 16;
    _Alignas(64) uint32_t qt[8 * 256];    /* Q^T: tile 2b + hl, words 16b .. 16b + 15 of h (hl 0) or l (D <= 128) */
    _Alignas(64) uint32_t q16[16 * 128];  /* a group's rows' words (zeros past them) */
    _Alignas(64) bf16 kbuf[16 * 128];
    _Alignas(64) float st[256], s[256];   /* S^T: st[j * 16 + i] (key j, row i); S: s[i * 16 + j] */
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        memcpy(q16, qw + r0 * D, (size_t)(nr * D) * sizeof(word));
        memset(q16 + nr * D, 0, (size_t)((16 - nr) * D) * sizeof(word));
        amx_queries_t(q16, D, qt);
        for (int64_t c = 0; c < nk16; c++) {
            const int64_t n = lmax - 16 * c < 16 ? lmax - 16 * c : 16;
            const bf16 *k = amx_rows16(kp, m, 16 * c, lmax, kbuf);
            if (r0 == 0) prefetch_chunk(kp, m, 16 * (c + PREFETCH_AHEAD), lmax);
            if (r0 == 0) prefetch_chunk(vp, m, 16 * c, lmax);
            amx_chunk_scores(k, qt, D, st);
            transpose_words((const uint32_t *)st, 16, (uint32_t *)s);
            const __mmask16 keys = (__mmask16)((1u << n) - 1u);
            for (int64_t i = 0; i < nr; i++)
                _mm512_mask_storeu_ps(scores + (r0 + i) * lmax + 16 * c, keys, _mm512_mul_ps(_mm512_load_ps(s + i * 16), sc));
        }
    }
}

/* A step's values paired for the tile unit: for each 32 keys c (zeros past lmax) and 64 of D (part
 * h), pv[((c * D / 64 + h) * 16 + u) * 64 ..] = pair u's words (v[32c + 2u][d], v[32c + 2u + 1][d])
 * for those 64 columns, in bf_values' order (unpacklo/hi_epi16 by 128-bit lanes): the B operand
 * of the values, 16 columns a tile, whose sums bf_finish_row puts back in column order. */
static void amx_step_pairs(kv_head vp, key_map m, int64_t lmax, int64_t D, word *pv) {
    const int64_t nk32 = (lmax + 31) / 32, parts = D / 64;
    for (int64_t c = 0; c < nk32; c++) {
        const word *vals[32];
        int64_t slots[16];
        chunk_rows(vp, m, 32 * c, lmax, vals, slots);
        if (32 * c + 16 < lmax) chunk_rows(vp, m, 32 * c + 16, lmax, vals + 16, slots);
        else
            for (int i = 16; i < 32; i++) vals[i] = zero_words;
        for (int64_t h = 0; h < parts; h++)
            for (int64_t u = 0; u < 16; u++) {
                word *out = pv + ((c * parts + h) * 16 + u) * 64;
                for (int64_t k = 0; k < 2; k++) {  /* columns 64h + 32k .. + 31 */
                    const __m512i a = _mm512_loadu_si512(vals[2 * u] + 32 * h + 16 * k);
                    const __m512i b = _mm512_loadu_si512(vals[2 * u + 1] + 32 * h + 16 * k);
                    _mm512_store_si512(out + 32 * k, _mm512_unpacklo_epi16(a, b));
                    _mm512_store_si512(out + 32 * k + 16, _mm512_unpackhi_epi16(a, b));
                }
            }
    }
}

/* acc[r * D ..] = sum_j p_r[j] v_j for a step's rows on the tile unit, 16 rows at a time (the
 * tiles configured for the group's rows): O [rows, 16 of D] += P [rows, 32 keys] . V (the weights'
 * words pw[r * lw ..], 0 past a row's keys; the pairs pv of amx_step_pairs), each 32 keys in order,
 * 64 of D at a time; the sums in bf_values' column order. */
static void amx_step_values(const word *pw, int64_t lw, const word *pv, int64_t rows, int64_t D, int64_t lmax,
                            float *acc, int *configured) {
    const int64_t nk32 = (lmax + 31) / 32, parts = D / 64;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        amx_rows((int)nr, configured);
        for (int64_t h = 0; h < parts; h++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < nk32; c++) {
                const word *b = pv + (c * parts + h) * 16 * 64;
                _tile_loadd(7, pw + r0 * lw + 16 * c, (int)(lw * sizeof(word)));
                _tile_loadd(5, b, 256);
                _tile_dpbf16ps(0, 7, 5);
                _tile_loadd(5, b + 16, 256);
                _tile_dpbf16ps(1, 7, 5);
                _tile_loadd(5, b + 32, 256);
                _tile_dpbf16ps(2, 7, 5);
                _tile_loadd(5, b + 48, 256);
                _tile_dpbf16ps(3, 7, 5);
            }
            float *a = acc + r0 * D + 64 * h;
            const int stride = (int)(D * sizeof(float));
            _tile_stored(0, a, stride);
            _tile_stored(1, a + 16, stride);
            _tile_stored(2, a + 32, stride);
            _tile_stored(3, a + 48, stride);
        }
    }
}

/* attend_tile_bf's work for a step's queries (decode steps, verification windows, token trees: not
 * a prompt's; no sliding window) over a bfloat16 pool with D = 64 or 128, its products on the tile
 * unit: the queries split as attend_tile_bf splits them, the scores (amx_step_scores), the softmax
 * weights rounded to bfloat16 and their sum (bf_softmax), the values (amx_step_values), each row
 * divided by its sum. The tile unit adds each product's terms in its own order, so the bits are
 * not attend_tile_bf's; they are every step's on such a CPU (the engine gives every step's queries
 * to this path), and a query's are its own whatever its tile, rows or keys beside it: the tile's
 * sums are per element, keys come in chunks of 16 and 32 from key 0, and a key past a row's own
 * has weight 0. own: scratch of amx_step_scratch() floats. Decode steps of 16 sequences over
 * 260-600 positions took 0.85-0.86x attend_tile_bf's time, verification windows of 3-16 queries
 * 0.61-0.73x (SmolLM2's heads, 2 threads, the Xeon with AMX). */
static void attend_tile_steps(const float *q, int64_t Hq, kv_head kp, kv_head vp, key_map m, const int32_t *len,
                              int nq, int64_t G, int64_t D, float scale, float *scores, float *acc, float *sum,
                              word *own, int *configured) {
    static const int32_t from0[QUERY_TILE];  /* (no window: every row's keys from 0) */
    const int64_t lmax = longest(len, nq), rows = nq * G, nk32 = (lmax + 31) / 32, lw = 16 * nk32;
    word *qw = own, *pw = qw + rows * D, *pv = pw + rows * lw;  /* (each a whole number of lines) */
    for (int64_t c = 0; c < PREFETCH_AHEAD; c++) prefetch_chunk(kp, m, 16 * c, lmax);  /* (before the queries' split) */
    for (int64_t r = 0; r < rows; r++) bf_split_row(q + r / G * Hq * D + r % G * D, D, qw + r * D);
    amx_rows(rows < AMX_TILE_ROWS ? (int)rows : AMX_TILE_ROWS, configured);  /* (the first group's; 4-6 as any) */
    amx_step_scores(qw, kp, vp, m, rows, D, lmax, scale, scores);
    amx_step_pairs(vp, m, lmax, D, pv);
    bf_softmax(scores, len, from0, nq, G, lmax, sum, pw, lw);
    for (int64_t r = 0; r < rows; r++) {  /* weight 0 past each row's keys, to the last 32 */
        const int64_t used = (len[r / G] + 1) / 2;
        memset(pw + r * lw + used, 0, (size_t)(lw - used) * sizeof(word));
    }
    amx_step_values(pw, lw, pv, rows, D, lmax, acc, configured);
    for (int64_t r = 0; r < rows; r++) bf_finish_row(acc + r * D, D, sum[r]);
}

/* The floats of attend_tile_steps' own scratch for ``rows`` rows over lmax keys. */
static inline int64_t amx_step_scratch(int64_t rows, int64_t lmax, int64_t D) {
    const int64_t lw = 16 * ((lmax + 31) / 32);
    return rows * D + rows * lw + lw * D;  /* (D a multiple of 64: each part whole lines) */
}

/* One group of up to 16 rows (rows r0 .. r0 + nr - 1 of the item: query r / G, head r % G) over
 * keys 0 .. lmax - 1 -> acc[r * D ..] (their outputs, not yet divided) and sum[r]. st: room for
 * nk16 * 256 floats (the scores, key-major), pt: nk32 * 256 words (the weights, paired), qt: for
 * 4 * D words (the queries, transposed), kbuf: 16 * D bfloat16. */
static void amx_group(const float *q, int64_t Hq, kv_head kp, key_map m, const int32_t *len, int64_t r0, int64_t nr,
                      int64_t G, int64_t D, float scale, int64_t lmax, const uint32_t *vt, float *st, uint32_t *pt,
                      uint32_t *qt, bf16 *kbuf, float *acc, float *sum) {
    const int64_t nk16 = (lmax + 15) / 16, nk32 = (lmax + 31) / 32;
    _Alignas(64) uint32_t qw[16 * 128];  /* rows' words: h's D / 2, then l's (D <= 128) */
    _Alignas(64) int32_t n[16];  /* each lane's keys (0: a padding row) */
    memset(qw, 0, sizeof qw);
    for (int64_t i = 0; i < 16; i++) {
        const int64_t r = r0 + i;
        n[i] = i < nr ? len[r / G] : 0;
        if (i < nr) bf_split_row(q + r / G * Hq * D + r % G * D, D, (word *)qw + i * D);
    }
    amx_queries_t(qw, D, qt);
    for (int64_t c = 0; c < nk16; c++)  /* scores */
        amx_chunk_scores(amx_rows16(kp, m, 16 * c, lmax, kbuf), qt, D, st + c * 256);
    const __m512i nv = _mm512_load_si512(n);
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t j = 0; j < lmax; j++) {  /* scaled; each lane's maximum over its keys */
        const __m512 s = _mm512_mul_ps(_mm512_load_ps(st + j * 16), sc);
        _mm512_store_ps(st + j * 16, s);
        mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(nv, _mm512_set1_epi32((int)j)), mx, s);
    }
    const __m512i keep = _mm512_set1_epi32((int)0xFFFF0000u), odd = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    for (int64_t j = 0; j < 32 * nk32; j += 2) {  /* weights rounded to bfloat16 (0 past a lane's keys), paired */
        __m512i wb[2];
        for (int e = 0; e < 2; e++) {
            const __mmask16 in = _mm512_cmpgt_epi32_mask(nv, _mm512_set1_epi32((int)(j + e)));
            __m512 x = _mm512_maskz_sub_ps(in, j + e < lmax ? _mm512_load_ps(st + (j + e) * 16) : _mm512_setzero_ps(), mx);
            v16 ex = fast_exp16((v16)x);
            x = _mm512_maskz_mov_ps(in, (__m512)ex);
            const __m512i u = _mm512_castps_si512(x);  /* to nearest even (no NaN here) */
            const __m512i r = _mm512_and_si512(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_and_si512(_mm512_srli_epi32(u, 16), odd)), half), keep);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(r));
            wb[e] = r;
        }
        _mm512_store_si512(pt + j / 2 * 16, _mm512_or_si512(_mm512_srli_epi32(wb[0], 16), wb[1]));
    }
    _mm512_storeu_ps(sum, total);
    for (int64_t half0 = 0; half0 < D / 16; half0 += 4) {  /* values, 64 of D at a time */
        const int64_t nb = D / 16 - half0 < 4 ? D / 16 - half0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < nk32; c++) {
            _tile_loadd(5, pt + c * 256, 64);
            const uint32_t *a = vt + (c * (D / 16) + half0) * 256;
            _tile_loadd(4, a, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) { _tile_loadd(4, a + 256, 64); _tile_dpbf16ps(1, 4, 5); }
            if (nb > 2) { _tile_loadd(4, a + 512, 64); _tile_dpbf16ps(2, 4, 5); }
            if (nb > 3) { _tile_loadd(4, a + 768, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _Alignas(64) float o[256], ot[256];  /* an O^T block: o[d * 16 + i]; ot[i * 16 + d] */
        for (int64_t b = 0; b < nb; b++) {
            if (b == 0) _tile_stored(0, o, 64);
            else if (b == 1) _tile_stored(1, o, 64);
            else if (b == 2) _tile_stored(2, o, 64);
            else _tile_stored(3, o, 64);
            transpose_words((const uint32_t *)o, 16, (uint32_t *)ot);
            for (int64_t i = 0; i < nr; i++) memcpy(acc + i * D + (half0 + b) * 16, ot + i * 16, 16 * sizeof(float));
        }
    }
}

/* attend_tile for prompt tokens on AMX tiles (D = 64 or 128, a bfloat16 pool, no window, no tree):
 * the item's rows 16 at a time (amx_group), each row's output divided by its weights' sum. */
static void attend_tile_amx(const float *q, int64_t Hq, kv_head kp, kv_head vp, key_map m, const int32_t *len,
                            int nq, int64_t G, int64_t D, float scale, float *acc) {
    const int64_t lmax = longest(len, nq), rows = nq * G, nk32 = (lmax + 31) / 32;
    uint32_t *vt = aligned_alloc(64, (size_t)(nk32 * (D / 16) * 256) * sizeof(uint32_t));
    float *st = aligned_alloc(64, (size_t)(nk32 * 2 * 256) * sizeof(float));
    uint32_t *pt = aligned_alloc(64, (size_t)(nk32 * 256) * sizeof(uint32_t));
    uint32_t *qt = aligned_alloc(64, (size_t)(4 * D) * 16 * sizeof(uint32_t));
    bf16 *kbuf = aligned_alloc(64, (size_t)(32 * D) * sizeof(bf16));
    amx_values_t(vp, m, lmax, D, nk32, vt, kbuf);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        _Alignas(64) float sum[16];
        amx_group(q, Hq, kp, m, len, r0, nr, G, D, scale, lmax, vt, st, pt, qt, kbuf, acc + r0 * D, sum);
        for (int64_t i = 0; i < nr; i++)
            for (int64_t d = 0; d < D; d++) acc[(r0 + i) * D + d] /= sum[i];
    }
    free(vt);
    free(st);
    free(pt);
    free(qt);
    free(kbuf);
}
#endif
#endif

/* 1 where a bfloat16 pool's attention takes bfloat16 products (above: a build with AVX512_BF16),
 * else 0 (float32 products on its values everywhere). */
int hs_attention_bf16_products(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* 1 where attention over a bfloat16 pool (D = 64 or 128, no window) runs on AMX tiles here
 * (attend_tile_amx for prompt tokens, attend_tile_steps for a step's: a build with AMX-BF16, and
 * Linux lets the process use the tiles), else 0. */
int hs_attention_amx(void) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return amx_permitted();
#else
    return 0;
#endif
}

/* Few (tile, KV head) items that the threads cannot share evenly (one sequence's verification
 * window: 1 tile x 3 KV heads on 2 threads, one thread doing two thirds): each tile of several
 * queries is cut in two, so that there are twice the items, each half the work. Each half reads
 * the KV head again (from the shared cache), but a window's attention is bound by its arithmetic
 * (4-5 queries over 300-800 positions: 0.88-0.93x the time). Float32 products only: with bfloat16
 * products a tile's keys are transposed once for all its queries, the work that halving doubles,
 * and whole tiles took 0.83-0.98x the time of halved ones for windows of 2-3 queries over 90-800
 * positions (4-7 queries: 0.83-1.06x, level on the whole; five interleaved runs of
 * scripts/bench-attention.py). A query's result does not depend on its tile, so the bits stay.
 * first[0 .. ntiles] -> the new tiles' (reallocated); returns their count. */
static int64_t halve_tiles(int64_t **first, int64_t ntiles, int64_t T) {
    int64_t *split = malloc((size_t)(2 * ntiles + 1) * sizeof(int64_t)), n = 0;
    if (!split) return ntiles;
    for (int64_t i = 0; i < ntiles; i++) {
        const int64_t t0 = (*first)[i], nq = (*first)[i + 1] - t0;
        split[n++] = t0;
        if (nq >= 2) split[n++] = t0 + (nq + 1) / 2;
    }
    split[n] = T;
    free(*first);
    *first = split;
    return n;
}

/* n floats rounded up to whole 64-byte lines (each part of an item's scratch starts on a line). */
static inline int64_t lines(int64_t n) {
    return (n + 15) / 16 * 16;
}

/* The floats of scratch that an item of ``rows`` rows over lmax keys takes, in this order: its
 * scores (rows of lmax), its outputs and their sums (rows * D, rows), then its path's own:
 * attend_tile_bf's query and weight words (rows of D + lmax / 2 + 1), attend_tile_steps' (its
 * queries', weights' and paired values' words: amx_step_scratch), or attend_tile's room for a
 * bfloat16 pool's rows converted (max(bs, 16) of D). Each thread allocates the largest item's once
 * per call instead of each item its own: at a decode step an item (one sequence's query heads of a
 * KV head) takes 0.5-9 us over 1-300 keys, of which the four allocations and frees took 0.15-0.45
 * (SmolLM2's heads over a bfloat16 pool, one thread, interleaved runs). */
static int64_t item_scratch(int64_t rows, int64_t lmax, int64_t D, int64_t bs, int kv_bf, int bf_products, int steps) {
    const int64_t n = lines(rows * lmax) + lines(rows * (D + 1));
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (steps) return n + amx_step_scratch(rows, lmax, D);
#endif
    (void)steps;
    if (bf_products) return n + lines(rows * (D + lmax / 2 + 1));
    return kv_bf ? n + lines((bs > 16 ? bs : 16) * D) : n;
}

/* Paged attention of T query tokens q[T, Hq, D]: token t belongs to sequence seq[t] (a row of
 * tables[B, max_blocks]) and sees that sequence's first len[t] positions (itself included).
 * Token trees: where tail_start is given and tail_start[t] >= 0, query t's keys from tail_start[t]
 * on are at slots tail[t * tail_width ..] instead (its ancestors and itself, in depth order), and
 * such a query is a tile of its own; a query's keys are taken in the same order and with the same
 * arithmetic either way, so a tree node's output has the bits of the same token decoded in a chain.
 * out[T, Hq, D] float32 or bfloat16. Work is split over (query tile, KV head) pairs, a tile being
 * up to QUERY_TILE consecutive tokens of one sequence, so each KV head's keys and values are read
 * from memory once per tile (at a decode step attention waits on those reads: splitting a KV
 * head's query heads over the threads instead, each reading the head's K/V, took 1.1-1.4x as long
 * with SmolLM2's 3 KV heads on 2 threads, at 230 and 1,000 positions). With fewer such pairs than
 * threads (one sequence, one KV head), over (tile, query head) ones, so that every thread has work
 * (each head's arithmetic is its own either way); with a few more that the threads cannot share
 * evenly, over halved tiles (halve_tiles). The pools [Hkv, S, D] are float32, or bfloat16
 * if kv_bf (the same arithmetic on the values they hold, or bfloat16 products: attend_tile_bf). */
void hs_paged_attention(const float *q, const void *kpool, const void *vpool, int kv_bf, const int32_t *tables,
                        int64_t max_blocks, const int32_t *seq, const int32_t *len, const int32_t *tail_start,
                        const int64_t *tail, int64_t tail_width, int64_t T, int64_t Hq, int64_t Hkv, int64_t S,
                        int64_t D, int64_t bs, float scale, void *out, int out_bf, int parallel) {
    hs_paged_attention_window(q, kpool, vpool, kv_bf, tables, max_blocks, seq, len, tail_start, tail, tail_width, T, Hq,
                              Hkv, S, D, bs, scale, out, out_bf, parallel, 0, 0);
}

/* Sliding windows (window > 0): token t sees the keys from lo[t] = len[t] - window on (positions
 * > p - window for its position p = len[t] - 1), as a one-token step does (first_key). ``prompt``:
 * the tokens are a prompt's (a prefill): over a bfloat16 pool without a window or a tree they may
 * take the tile unit's arithmetic (attend_tile_amx, where hs_attention_amx()). Every other query
 * over such a pool without a window (decode steps, verification windows, tree nodes) takes
 * attend_tile_steps' there: one arithmetic for all of a layer's steps, whatever the batch. */
void hs_paged_attention_window(const float *q, const void *kpool, const void *vpool, int kv_bf,
                               const int32_t *tables, int64_t max_blocks, const int32_t *seq, const int32_t *len,
                               const int32_t *tail_start, const int64_t *tail, int64_t tail_width, int64_t T,
                               int64_t Hq, int64_t Hkv, int64_t S, int64_t D, int64_t bs, float scale, void *out,
                               int out_bf, int parallel, int64_t window, int prompt) {
    int64_t G = Hq / Hkv, ntiles = 0;
    int64_t *first = malloc((size_t)(T + 1) * sizeof(int64_t));  /* first token of each tile */
    int32_t *lo = calloc((size_t)(T > 0 ? T : 1), sizeof(int32_t));  /* each token's first key */
    for (int64_t t = 0; window > 0 && t < T; t++) lo[t] = len[t] > window ? (int32_t)(len[t] - window) : 0;
#define IN_TREE(t) (tail_start != NULL && tail_start[t] >= 0)
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || seq[t] != seq[t - 1] || t - first[ntiles - 1] >= QUERY_TILE || IN_TREE(t) || IN_TREE(t - 1))
            first[ntiles++] = t;
    first[ntiles] = T;
#ifdef _OPENMP
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
#else
    const int64_t threads = 1;
#endif
#if defined(__AVX512BF16__)
    const int bf_products = kv_bf && (D == 64 || D == 128);  /* attend_tile_bf */
#else
    const int bf_products = 0;
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int amx = prompt && bf_products && window == 0 && tail_start == NULL && amx_permitted();  /* attend_tile_amx */
    const int steps = !amx && bf_products && window == 0 && amx_permitted();  /* attend_tile_steps */
#else
    const int steps = 0;
    (void)prompt;
#endif
    if (!bf_products && threads > 1 && ntiles * Hkv % threads && ntiles * Hkv < 4 * threads)
        ntiles = halve_tiles(&first, ntiles, T);
    int64_t parts = ntiles * Hkv < threads ? G : 1, hg = G / parts;  /* items per group, heads per item */
    int64_t room = 0;  /* floats of scratch: the largest item's */
    for (int64_t tile = 0; tile < ntiles; tile++) {
        const int64_t nq = first[tile + 1] - first[tile];
        const int64_t need = item_scratch(nq * hg, longest(len + first[tile], nq), D, bs, kv_bf, bf_products, steps);
        room = need > room ? need : room;
    }
#pragma omp parallel if (parallel)
    {
        float *scratch = aligned_alloc(64, (size_t)room * sizeof(float));  /* this thread's, for all its items */
        int tiles = 0;  /* the rows this thread's tiles are configured for (amx_rows; 0: none) */
#pragma omp for schedule(dynamic)
        for (int64_t p = 0; p < ntiles * Hkv * parts; p++) {
            int64_t tile = p / (Hkv * parts), kvh = p / parts % Hkv, h0 = kvh * G + p % parts * hg;  /* first head */
            int64_t t0 = first[tile], nq = first[tile + 1] - t0, rows = nq * hg, lmax = longest(len + t0, nq);
            float *scores = scratch, *acc = scores + lines(rows * lmax), *sum = acc + rows * D;
            float *own = acc + lines(rows * (D + 1));  /* the path's own part of the scratch (item_scratch) */
            kv_head kp = {kpool, kv_bf, kvh * S * D, D}, vp = {vpool, kv_bf, kvh * S * D, D};
            key_map m = {tables + (int64_t)seq[t0] * max_blocks, bs, IN_TREE(t0) ? tail_start[t0] : INT64_MAX,
                         IN_TREE(t0) ? tail + t0 * tail_width : NULL};
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (amx) {
                amx_rows(AMX_TILE_ROWS, &tiles);
                attend_tile_amx(q + (t0 * Hq + h0) * D, Hq, kp, vp, m, len + t0, (int)nq, hg, D, scale, acc);
            } else if (steps)
                attend_tile_steps(q + (t0 * Hq + h0) * D, Hq, kp, vp, m, len + t0, (int)nq, hg, D, scale, scores, acc,
                                  sum, (word *)own, &tiles);
            else
#endif
#if defined(__AVX512BF16__)
            if (bf_products)
                attend_tile_bf(q + (t0 * Hq + h0) * D, Hq, kp, vp, m, len + t0, lo + t0, (int)nq, hg, D, scale,
                               scores, acc, sum, (word *)own);
            else
#endif
            attend_tile(q + (t0 * Hq + h0) * D, Hq, kp, vp, m, len + t0, lo + t0, (int)nq, hg, D, scale, scores, acc,
                        sum, own);
            for (int64_t qi = 0; qi < nq; qi++)
                store_row(out, out_bf, ((t0 + qi) * Hq + h0) * D, hg * D, acc + qi * hg * D);
        }
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (tiles) _tile_release();
#endif
        (void)tiles;
        free(scratch);
    }
#undef IN_TREE
    free(first);
    free(lo);
}
