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
 * FMA). */
#define QUERY_TILE 8

/* One KV head of a pool [Hkv, S, D] (float32, or bfloat16 if bf), its rows from element ``head``
 * on, read as float32 rows: a float32 pool's rows are used where they lie, a bfloat16 pool's are
 * converted (exactly) into a buffer first, so the arithmetic on them is the same either way and a
 * bfloat16 cache only halves the bytes attention reads. The head's rows are contiguous: a
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
                                                               key_map m, const int32_t *len, int nq,
                                                               int64_t lmax, int64_t G, const int64_t D,
                                                               float scale, float *scores, float *buf) {
    static const float zeros[128];  /* the keys past the last: D <= 128 */
    const float *keys[16];
    for (int64_t j0 = 0; j0 < lmax; j0 += 16) {
        int64_t n = lmax - j0 < 16 ? lmax - j0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            int64_t j = j0 + i;
            keys[i] = i < n ? kv_row(kp, key_slot(m, j), buf + i * D) : zeros;
        }
        for (int qi = 0; qi < nq; qi++) {
            if (j0 >= len[qi]) continue;
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

/* scores[r * lmax + j] = (q_r . k_j) * scale for every row r of the tile and key j < len[qi]. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int64_t Hq, kv_head kp,
                                                             key_map m, const int32_t *len, int nq,
                                                             int64_t lmax, int64_t G, const int64_t D,
                                                             float scale, float *scores, float *buf) {
    for (int64_t j0 = 0, n; j0 < lmax; j0 += n) {  /* one run of consecutive slots (a block) at a time */
        int64_t stride, slot = key_run(m, j0, lmax, &n);  /* stride: between consecutive slots */
        const float *k = kv_rows(kp, slot, n, buf, &stride);
        for (int64_t j = j0; j < j0 + n; j++, k += stride)
            for (int qi = 0; qi < nq; qi++) {
                if (j >= len[qi]) continue;
                const float *qr = q + qi * Hq * D;
                for (int64_t g = 0; g < G; g++) scores[(qi * G + g) * lmax + j] = dot_fma(qr + g * D, k, D) * scale;
            }
    }
}

/* The largest of s[0 .. n-1]: 16 lanes' maxima, then theirs (a maximum is exact in any order). */
static inline float row_max(const float *s, int64_t n) {
    float m = s[0];  /* n >= 1: a row sees at least its own key */
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
static void tile_softmax(float *scores, const int32_t *len, int nq, int64_t G, int64_t lmax, float *sum) {
    for (int64_t r = 0; r < nq * G; r++) {
        float *s = scores + r * lmax;
        int64_t n = len[r / G];
        exp_shifted(s, n, row_max(s, n));
        sum[r] = row_sum(s, n);
    }
}

/* acc[r] += sum_j p_r[j] v_j, one block of the table at a time (its values stay in L1 for every
 * row); D a constant (64, 128) keeps a row's sums in registers within a block. */
static inline __attribute__((always_inline)) void tile_values(const float *scores, kv_head vp,
                                                             key_map m, const int32_t *len, int nq,
                                                             int64_t lmax, int64_t G, const int64_t D,
                                                             float *acc, float *buf) {
    memset(acc, 0, (size_t)(nq * G * D) * sizeof(float));
    for (int64_t j0 = 0, run; j0 < lmax; j0 += run) {
        int64_t stride, slot = key_run(m, j0, lmax, &run);
        const float *vb = kv_rows(vp, slot, run, buf, &stride);
        for (int64_t r = 0; r < nq * G; r++) {
            int64_t n = len[r / G] - j0;
            n = n < run ? n : run;
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
                        int nq, int64_t G, int64_t D, float scale, float *scores, float *acc, float *sum, float *buf) {
    int64_t lmax = 0;
    for (int qi = 0; qi < nq; qi++) lmax = len[qi] > lmax ? len[qi] : lmax;
#if defined(__AVX512F__)
    if (D == 64) tile_scores16(q, Hq, kp, m, len, nq, lmax, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores16(q, Hq, kp, m, len, nq, lmax, G, 128, scale, scores, buf);
#else
    if (D == 64) tile_scores(q, Hq, kp, m, len, nq, lmax, G, 64, scale, scores, buf);
    else if (D == 128) tile_scores(q, Hq, kp, m, len, nq, lmax, G, 128, scale, scores, buf);
#endif
    else tile_scores(q, Hq, kp, m, len, nq, lmax, G, D, scale, scores, buf);
    tile_softmax(scores, len, nq, G, lmax, sum);
    if (D == 64) tile_values(scores, vp, m, len, nq, lmax, G, 64, acc, buf);
    else if (D == 128) tile_values(scores, vp, m, len, nq, lmax, G, 128, acc, buf);
    else tile_values(scores, vp, m, len, nq, lmax, G, D, acc, buf);
    for (int64_t r = 0; r < nq * G; r++)
        for (int64_t d = 0; d < D; d++) acc[r * D + d] /= sum[r];
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
 * (each head's arithmetic is its own either way). The pools [Hkv, S, D] are float32, or bfloat16
 * if kv_bf (the same arithmetic on the values they hold). */
void hs_paged_attention(const float *q, const void *kpool, const void *vpool, int kv_bf, const int32_t *tables,
                        int64_t max_blocks, const int32_t *seq, const int32_t *len, const int32_t *tail_start,
                        const int64_t *tail, int64_t tail_width, int64_t T, int64_t Hq, int64_t Hkv, int64_t S,
                        int64_t D, int64_t bs, float scale, void *out, int out_bf, int parallel) {
    int64_t G = Hq / Hkv, ntiles = 0;
    int64_t *first = malloc((size_t)(T + 1) * sizeof(int64_t));  /* first token of each tile */
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
    int64_t parts = ntiles * Hkv < threads ? G : 1, hg = G / parts;  /* items per group, heads per item */
#pragma omp parallel for schedule(dynamic) if (parallel)
    for (int64_t p = 0; p < ntiles * Hkv * parts; p++) {
        int64_t tile = p / (Hkv * parts), kvh = p / parts % Hkv, h0 = kvh * G + p % parts * hg;  /* first head */
        int64_t t0 = first[tile], lmax = 0;
        int nq = (int)(first[tile + 1] - t0);
        for (int qi = 0; qi < nq; qi++) lmax = len[t0 + qi] > lmax ? len[t0 + qi] : lmax;
        float *scores = malloc((size_t)(nq * hg * lmax) * sizeof(float));
        float *acc = malloc((size_t)(nq * hg * (D + 1)) * sizeof(float)), *sum = acc + nq * hg * D;
        float *buf = kv_bf ? malloc((size_t)((bs > 16 ? bs : 16) * D) * sizeof(float)) : NULL;
        kv_head kp = {kpool, kv_bf, kvh * S * D, D}, vp = {vpool, kv_bf, kvh * S * D, D};
        key_map m = {tables + (int64_t)seq[t0] * max_blocks, bs, IN_TREE(t0) ? tail_start[t0] : INT64_MAX,
                     IN_TREE(t0) ? tail + t0 * tail_width : NULL};
        attend_tile(q + (t0 * Hq + h0) * D, Hq, kp, vp, m, len + t0, nq, hg, D, scale, scores, acc, sum, buf);
        for (int qi = 0; qi < nq; qi++)
            store_row(out, out_bf, ((t0 + qi) * Hq + h0) * D, hg * D, acc + qi * hg * D);
        free(scores);
        free(acc);
        free(buf);
    }
#undef IN_TREE
    free(first);
}
