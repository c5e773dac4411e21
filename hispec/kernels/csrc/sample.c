/* Sampling on the CPU (hispec_kernels.h): each sampled row's distribution after temperature, top-k and
 * top-p in one pass over its logits, and one token per row drawn with one uniform number (a race over
 * a small support, else the inverse of its cumulative distribution). hispec/sampling/sampler.py defines
 * both and calls these where the library is built; its PyTorch code is the same definition for other
 * devices and for CPUs without the library. */
#include "simd.h"

/* Below this a float32 exp underflows (exp(-87.34) is the smallest normal float): such a token's
 * probability is 0, where fast_exp would clamp it to exp(-87). */
#define EXP_FLOOR (-87.0f)

/* x[i] -> exp(x[i]) (0 below EXP_FLOOR, -inf included), returning their sum (16 lanes, fixed order). */
static float exp_in_place(float *x, int64_t n) {
    const v8 floor8 = (v8){0} + EXP_FLOOR, zero = {0};
    v8 lo = {0}, hi = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        v8 a = load8(x + i), b = load8(x + i + 8);
        a = pick(a < floor8, zero, fast_exp8(a));
        b = pick(b < floor8, zero, fast_exp8(b));
        memcpy(x + i, &a, sizeof a);
        memcpy(x + i + 8, &b, sizeof b);
        lo += a;
        hi += b;
    }
    float s = hsum16(lo, hi);
    for (; i < n; i++) {
        x[i] = x[i] < EXP_FLOOR ? 0.0f : fast_exp(x[i]);
        s += x[i];
    }
    return s;
}

/* The k-th largest of x[0 .. n - 1] (1 <= k <= n), reordering x (quickselect, middle pivot). */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;  /* want: its index in descending order */
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                float t = x[i];
                x[i++] = x[j];
                x[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want];  /* between j and i: equal to the pivot */
    }
    return x[want];
}

/* How many of s[0 .. n - 1] are >= floor (branch-free). */
static int64_t count_at_least(const float *s, int64_t n, float floor) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) count += s[i] >= floor;
    return count;
}

/* The k-th largest of the scaled logits s[0 .. V - 1] (max 0; 1 <= k < V): selected among the values
 * above the smallest of a few floors that holds k of them (a quickselect over the whole row would
 * mispredict a branch on half its elements), in buf. */
static float kth_scaled(const float *s, int64_t V, int64_t k, float *buf) {
    float floor = -INFINITY;
    for (float f = -2.0f; f >= -64.0f; f *= 2.0f)
        if (count_at_least(s, V, f) >= k) {
            floor = f;
            break;
        }
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++)
        if (s[i] >= floor) buf[n++] = s[i];
    return kth_largest(buf, n, k);
}

/* A candidate token as one sortable key: its probability's bits (a positive float's bits order as
 * the float does) above its complemented index, so that descending keys give larger probabilities
 * first and, among equal ones, the lower token first. */
typedef uint64_t candidate;

static inline candidate key_of(float p, int64_t i) {
    uint32_t bits;
    memcpy(&bits, &p, 4);
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)i;
}

static inline float p_of(candidate c) {
    uint32_t bits = (uint32_t)(c >> 32);
    float p;
    memcpy(&p, &bits, 4);
    return p;
}

static inline int64_t token_of(candidate c) { return (int64_t)(uint32_t)~(uint32_t)c; }

/* c[0 .. n - 1] in descending order (quicksort, insertion sort below 16). */
static void sort_descending(candidate *c, int64_t n) {
    while (n > 16) {
        candidate pivot = c[n / 2];
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (c[i] > pivot) i++;
            while (c[j] < pivot) j--;
            if (i <= j) {
                candidate t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (j + 1 < n - i) {  /* recurse into the smaller side, loop on the larger */
            sort_descending(c, j + 1);
            c += i;
            n -= i;
        } else {
            sort_descending(c + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {
        candidate x = c[i];
        int64_t j = i;
        for (; j > 0 && c[j - 1] < x; j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Keep the smallest set of p's largest tokens whose mass reaches top_p (ties: lower token first),
 * renormalised; the rest 0. Sorts only the tokens at or above a threshold whose set, in sorted
 * order, reaches top_p (the largest tokens come first in any order of the whole row), lowering the
 * threshold 8x at a time until it does (to 0: every token p > 0). */
static void nucleus(float *p, int64_t V, float top_p, candidate *c) {
    for (float tau = 1e-3f;; tau = tau < 1e-30f ? 0.0f : tau * 0.125f) {
        int64_t n = 0;
        for (int64_t i = 0; i < V; i++)
            if (p[i] >= tau && p[i] > 0.0f) c[n++] = key_of(p[i], i);
        sort_descending(c, n);
        float before = 0.0f;  /* the mass strictly before candidate j */
        int64_t kept = 0;
        while (kept < n && (kept == 0 || before < top_p)) before += p_of(c[kept++]);
        if (kept < n || before >= top_p || tau == 0.0f) {
            float mass = 0.0f;
            for (int64_t j = 0; j < kept; j++) mass += p_of(c[j]);
            memset(p, 0, (size_t)V * sizeof *p);
            for (int64_t j = 0; j < kept; j++) p[token_of(c[j])] = p_of(c[j]) / mass;
            return;
        }
    }
}

typedef struct { const float *logits; float *probs; int64_t V; const float *temperature; const int64_t *top_k;
                 const float *top_p; } probs_args;

static void probs_rows(void *ctx, int64_t t0, int64_t t1) {
    const probs_args *a = ctx;
    const int64_t V = a->V;
    candidate *c = malloc((size_t)V * sizeof *c);  /* also the top-k copy (V floats) */
    for (int64_t t = t0; t < t1; t++) {
        const float *l = a->logits + t * V;
        float *p = a->probs + t * V, m = row_max(l, V), temp = a->temperature[t];
        for (int64_t i = 0; i < V; i++) p[i] = (l[i] - m) / temp;
        if (a->top_k[t] > 0 && a->top_k[t] < V) {
            float kth = kth_scaled(p, V, a->top_k[t], (float *)c);
            for (int64_t i = 0; i < V; i++) p[i] = p[i] < kth ? -INFINITY : p[i];
        }
        float sum = exp_in_place(p, V);
        for (int64_t i = 0; i < V; i++) p[i] = p[i] / sum;
        if (a->top_p[t] < 1.0f) nucleus(p, V, a->top_p[t], c);
    }
    free(c);
}

void hs_sampling_probs(const float *logits, float *probs, int64_t T, int64_t V, const float *temperature,
                       const int64_t *top_k, const float *top_p) {
    probs_args a = {logits, probs, V, temperature, top_k, top_p};
    for_rows(T, 2, probs_rows, &a);  /* one row on the calling thread */
}

#define PICK_BLOCK 256

/* The first token whose cumulative mass in p[0 .. V - 1] exceeds u times the row's mass (block masses:
 * 16 float lanes each, then double sums, in block[]), the last token with p > 0 where rounding
 * reaches the end, 0 for a row of zeros. */
static int64_t pick_row(const float *p, int64_t V, double u, double *block) {
    int64_t nb = (V + PICK_BLOCK - 1) / PICK_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t i = b * PICK_BLOCK, end = i + PICK_BLOCK < V ? i + PICK_BLOCK : V;
        v8 lo = {0}, hi = {0};
        for (; i + LANES <= end; i += LANES) {
            lo += load8(p + i);
            hi += load8(p + i + 8);
        }
        float s = hsum16(lo, hi);
        for (; i < end; i++) s += p[i];
        block[b] = s;
        total += s;
    }
    double target = u * total, cum = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        if (cum + block[b] <= target) {
            cum += block[b];
            continue;
        }
        int64_t end = (b + 1) * PICK_BLOCK < V ? (b + 1) * PICK_BLOCK : V;
        for (int64_t i = b * PICK_BLOCK; i < end; i++)  /* the block's own sum may round otherwise */
            if (p[i] > 0.0f && (cum += p[i]) > target) return i;
    }
    for (int64_t i = V - 1; i >= 0; i--)  /* rounding at the end: the last token it can take */
        if (p[i] > 0.0f) return i;
    return 0;
}

/* A row with at most this many tokens of p > 0 (top-k, top-p) is drawn by a race instead. */
#define RACE_MAX 1024

/* SplitMix64's output function (sampler._mix64). */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The race over the n tokens of p > 0: argmin over them of E_i / p[i] (the lower token on ties), with
 * E_i = -log U_i exponential, U_i in (0, 1] from the 53 top bits of mix64(bits of u + (i + 1) * golden):
 * token i wins with probability p[i] / sum p, and two rows drawn with one u draw alike as often as a
 * coupling of their distributions can (near 1 - TV). */
static int64_t race_row(const float *p, int64_t V, double u) {
    uint64_t key;
    memcpy(&key, &u, 8);
    int64_t best = 0;
    double best_r = INFINITY;
    for (int64_t i0 = 0; i0 < V; i0 += LANES) {
        int64_t end = i0 + LANES < V ? i0 + LANES : V;
        if (end - i0 == LANES && hsum16(load8(p + i0), load8(p + i0 + 8)) == 0.0f) continue;  /* no p > 0 here */
        for (int64_t i = i0; i < end; i++) {
            if (!(p[i] > 0.0f)) continue;
            double U = (double)((mix64(key + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull) >> 11) + 1) * 0x1p-53;
            double r = -log(U) / (double)p[i];
            if (r < best_r) {
                best_r = r;
                best = i;
            }
        }
    }
    return best;
}

void hs_sample_pick(const float *probs, int64_t T, int64_t V, const double *u, int64_t *out) {
    double *block = malloc((size_t)((V + PICK_BLOCK - 1) / PICK_BLOCK) * sizeof *block);
    for (int64_t t = 0; t < T; t++) {
        const float *p = probs + t * V;
        int64_t n = 0;
        for (int64_t i = 0; i < V; i++) n += p[i] > 0.0f;  /* (vectorised) */
        out[t] = n <= RACE_MAX ? race_row(p, V, u[t]) : pick_row(p, V, u[t], block);
    }
    free(block);
}

/* The index of the largest of row[0 .. n), as torch.argmax picks it: the first of equal maxima
 * (-0 and +0 equal), the first NaN where there is one (NaN counts as the largest). Two passes of
 * vector compares, no arithmetic: the largest non-NaN value (and whether a NaN occurs), then the
 * first element equal to it; a 262,144-token vocabulary (Gemma 3) took ~0.3-0.7 ms a step in the
 * scalar loop (decode_op.cpp's greedy steps). */
int64_t hs_argmax(const float *row, int64_t n) {
    if (n <= 0) return 0;
    int64_t j = 0;
    float top = -INFINITY;
    int nan = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(row + j);
        bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);  /* (a NaN lane is caught by bad: then m is not read) */
    }
    nan = bad != 0;
    if (!nan) top = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    int bad = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(row + j);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    nan = bad != 0;
    if (!nan) {
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    }
#endif
    for (; j < n && !nan; j++) {
        nan = row[j] != row[j];
        top = row[j] > top ? row[j] : top;
    }
    if (nan) {
        for (j = 0; j < n; j++)
            if (row[j] != row[j]) return j;
    }
    j = 0;
#if defined(__AVX512F__)
    const __m512 t = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), t, _CMP_EQ_OQ);
        if (eq) return j + __builtin_ctz((unsigned)eq);
    }
#elif defined(__AVX2__)
    const __m256 t = _mm256_set1_ps(top);
    for (; j + 8 <= n; j += 8) {
        int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), t, _CMP_EQ_OQ));
        if (eq) return j + __builtin_ctz((unsigned)eq);
    }
#endif
    for (; j < n; j++)
        if (row[j] == top) return j;
    return 0;
}
