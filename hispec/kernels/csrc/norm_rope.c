/* Norms, the gated activation, and RoPE with the KV cache write (hispec_kernels.h). */
#include "simd.h"

/* y = x * rsqrt(mean(x^2) + eps) * w for one row of n floats (y may alias x). */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * w[i];
}

/* Rows from which the per-row kernels below share them over the threads: a prompt chunk's (RoPE
 * with the cache write, one thread's, was 12% of a prefill of 16 held-out prompts on 2 Zen 4
 * cores, the norms 3%), not a decode step's or a verification window's (a few microseconds each,
 * about what the threads' start costs). Each row is computed alone either way: the same bits. */
#define ROWS_PARALLEL_MIN 64

/* out[T, D] = rms_norm(x[T, D]) * w */
typedef struct { const float *x, *w; int64_t D; float eps; void *out; int out_bf; } rms_args;

static void rms_rows(void *ctx, int64_t t0, int64_t t1) {
    const rms_args *a = ctx;
    float *y = malloc((size_t)a->D * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        rms_row(a->x + t * a->D, a->w, a->D, a->eps, y);
        store_row(a->out, a->out_bf, t * a->D, a->D, y);
    }
    free(y);
}

void hs_rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, void *out, int out_bf) {
    rms_args a = {x, w, D, eps, out, out_bf};
    for_rows(T, ROWS_PARALLEL_MIN, rms_rows, &a);
}

/* out[i] = h[i] + delta[off + i] for i < D (delta float32 or bfloat16, widened exactly; out may be h). */
static inline void add_row(float *out, const float *h, const void *delta, int delta_bf, int64_t off, int64_t D) {
    if (delta_bf) {
        const bf16 *d = (const bf16 *)delta + off;
        for (int64_t i = 0; i < D; i++) out[i] = h[i] + bf2f(d[i]);
    } else {
        const float *d = (const float *)delta + off;
        for (int64_t i = 0; i < D; i++) out[i] = h[i] + d[i];
    }
}

/* h_out = h + delta (delta float32 or bfloat16; with dw: h + rms_norm(delta) * dw, the norm of delta
 * widened to float32 first, as Gemma 3's norms of the attention's output); out = rms_norm(h_out) * w.
 * All [T, D]. */
typedef struct { const float *h; const void *delta; int delta_bf; const float *dw, *w; int64_t D; float eps;
                 float *h_out; void *out; int out_bf; } add_rms_args;

/* y = delta's row t, normed by dw (rms_row on it widened to float32), for add_row to add. */
static inline const float *normed_delta(const void *delta, int delta_bf, const float *dw, int64_t t, int64_t D,
                                        float eps, float *y) {
    load_row(delta, delta_bf, t * D, D, y);
    rms_row(y, dw, D, eps, y);
    return y;
}

static void add_rms_rows(void *ctx, int64_t t0, int64_t t1) {
    const add_rms_args *a = ctx;
    const int64_t D = a->D;
    float *y = malloc((size_t)(2 * D) * sizeof(float)), *nd = y + D;
    for (int64_t t = t0; t < t1; t++) {
        if (a->dw) add_row(a->h_out + t * D, a->h + t * D, normed_delta(a->delta, a->delta_bf, a->dw, t, D, a->eps, nd),
                           0, 0, D);
        else add_row(a->h_out + t * D, a->h + t * D, a->delta, a->delta_bf, t * D, D);
        rms_row(a->h_out + t * D, a->w, D, a->eps, y);
        store_row(a->out, a->out_bf, t * D, D, y);
    }
    free(y);
}

void hs_add_rms_norm(const float *h, const void *delta, int delta_bf, const float *w, int64_t T, int64_t D,
                     float eps, float *h_out, void *out, int out_bf) {
    add_rms_args a = {h, delta, delta_bf, NULL, w, D, eps, h_out, out, out_bf};
    for_rows(T, ROWS_PARALLEL_MIN, add_rms_rows, &a);
}

void hs_norm_add_rms_norm(const float *h, const void *delta, int delta_bf, const float *dw, const float *w, int64_t T,
                          int64_t D, float eps, float *h_out, void *out, int out_bf) {
    add_rms_args a = {h, delta, delta_bf, dw, w, D, eps, h_out, out, out_bf};
    for_rows(T, ROWS_PARALLEL_MIN, add_rms_rows, &a);
}

/* h[T, D] += delta[T, D], float32 adds as ATen's (its multiply-add by alpha = 1 is exact); rows
 * shared by the threads from ROWS_PARALLEL_MIN (a prompt chunk's residual on one thread, in the C++
 * op unvectorized, took ~80 us a layer of a 256-row chunk). */
typedef struct { float *h; const void *delta; int delta_bf; const float *dw; int64_t D; float eps; } add_args;

static void add_rows(void *ctx, int64_t t0, int64_t t1) {
    const add_args *a = ctx;
    if (a->dw) {  /* h += rms_norm(delta) * dw */
        float *nd = malloc((size_t)a->D * sizeof(float));
        for (int64_t t = t0; t < t1; t++)
            add_row(a->h + t * a->D, a->h + t * a->D, normed_delta(a->delta, a->delta_bf, a->dw, t, a->D, a->eps, nd),
                    0, 0, a->D);
        free(nd);
        return;
    }
    for (int64_t t = t0; t < t1; t++) add_row(a->h + t * a->D, a->h + t * a->D, a->delta, a->delta_bf, t * a->D, a->D);
}

void hs_add_into(float *h, const void *delta, int delta_bf, int64_t T, int64_t D) {
    add_args a = {h, delta, delta_bf, NULL, D, 0.0f};
    for_rows(T, ROWS_PARALLEL_MIN, add_rows, &a);
}

void hs_norm_add_into(float *h, const void *delta, int delta_bf, const float *dw, int64_t T, int64_t D, float eps) {
    add_args a = {h, delta, delta_bf, dw, D, eps};
    for_rows(T, ROWS_PARALLEL_MIN, add_rows, &a);
}

/* out[T, I] = silu(gate) * up for gate_up[T, 2I] = [gate | up]; rows shared by the threads from
 * SILU_PARALLEL_MIN outputs: one token's (SmolLM2: 1,536) are too few to pay for the hand-over, a
 * verification pass's 3-8 took 0.14-0.33 ms of a step on one thread and 0.11-0.22 on two. */
#define SILU_PARALLEL_MIN (1 << 12)
typedef struct { const void *gu; int in_bf; int64_t I; void *out; int out_bf; int gelu; } silu_args;

/* gelu with the tanh approximation, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), as
 * x / (1 + exp(-2u)) (0.5 (1 + tanh(u)) = sigmoid(2u)): silu's form with -2u in the exponent. */
#define GELU_C0 1.5957691216057308f /* 2 sqrt(2 / pi) */
#define GELU_C1 0.044715f

static void silu_rows(void *ctx, int64_t t0, int64_t t1) {
    const silu_args *a = ctx;
    const int64_t I = a->I;
    float *g = malloc((size_t)(2 * I) * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        load_row(a->gu, a->in_bf, t * 2 * I, 2 * I, g);
        int64_t i = 0;
        if (a->gelu) {  /* the same operations lane by lane, whatever the width */
#if defined(__AVX512F__)
            for (; i + 16 <= I; i += 16) {
                v16 x, u;
                memcpy(&x, g + i, sizeof x);
                memcpy(&u, g + I + i, sizeof u);
                x = x / (1.0f + fast_exp16(-(GELU_C0 * (x + GELU_C1 * (x * x * x))))) * u;
                memcpy(g + i, &x, sizeof x);
            }
#endif
            for (; i + 8 <= I; i += 8) {
                v8 x = load8(g + i), y = x / (1.0f + fast_exp8(-(GELU_C0 * (x + GELU_C1 * (x * x * x))))) * load8(g + I + i);
                memcpy(g + i, &y, sizeof y);
            }
            for (; i < I; i++) {
                const float x = g[i];
                g[i] = x / (1.0f + fast_exp(-(GELU_C0 * (x + GELU_C1 * (x * x * x))))) * g[I + i];
            }
            store_row(a->out, a->out_bf, t * I, I, g);
            continue;
        }
#if defined(__AVX512F__)  /* the scalar line below, 16 lanes at a time (the same operations lane by lane) */
        for (; i + 16 <= I; i += 16) {
            v16 x, u;
            memcpy(&x, g + i, sizeof x);
            memcpy(&u, g + I + i, sizeof u);
            x = x / (1.0f + fast_exp16(-x)) * u;
            memcpy(g + i, &x, sizeof x);
        }
#endif
        for (; i + 8 <= I; i += 8) {  /* the scalar line below, 8 lanes at a time */
            v8 x = load8(g + i), y = x / (1.0f + fast_exp8(-x)) * load8(g + I + i);
            memcpy(g + i, &y, sizeof y);
        }
        for (; i < I; i++) g[i] = g[i] / (1.0f + fast_exp(-g[i])) * g[I + i];
        store_row(a->out, a->out_bf, t * I, I, g);
    }
    free(g);
}

void hs_silu_mul(const void *gu, int in_bf, int64_t T, int64_t I, void *out, int out_bf) {
    silu_args a = {gu, in_bf, I, out, out_bf, 0};
    for_rows(T, (SILU_PARALLEL_MIN + I - 1) / I, silu_rows, &a);  /* T * I >= SILU_PARALLEL_MIN */
}

void hs_gelu_tanh_mul(const void *gu, int in_bf, int64_t T, int64_t I, void *out, int out_bf) {
    silu_args a = {gu, in_bf, I, out, out_bf, 1};
    for_rows(T, (SILU_PARALLEL_MIN + I - 1) / I, silu_rows, &a);
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
typedef struct { const void *qkv; int in_bf; const float *cos_, *ssin; const int64_t *slots; int64_t Hq, Hkv, D, S;
                 void *kpool, *vpool; int kv_bf; float *q_out; const float *q_norm, *k_norm; float eps; } rope_args;

static void rope_rows(void *ctx, int64_t t0, int64_t t1) {
    const rope_args *a = ctx;
    const int64_t Hq = a->Hq, Hkv = a->Hkv, D = a->D, width = (Hq + 2 * Hkv) * D, half = D / 2;
    float *row = malloc((size_t)(width + D) * sizeof(float)), *key = row + width;  /* key: a rotated key head */
    for (int64_t t = t0; t < t1; t++) {
        load_row(a->qkv, a->in_bf, t * width, width, row);
        const float *c = a->cos_ + t * D, *s = a->ssin + t * D;
        for (int64_t h = a->q_out ? 0 : Hq; h < Hq + Hkv; h++) {
            float *x = row + h * D;
            const float *norm = h < Hq ? a->q_norm : a->k_norm;
            if (norm) rms_row(x, norm, D, a->eps, x);  /* QK-norm: the head's RMSNorm, before RoPE */
            float *dst = h < Hq ? a->q_out + (t * Hq + h) * D : key;
            for (int64_t i = 0; i < half; i++) {
                dst[i] = x[i] * c[i] + x[i + half] * s[i];
                dst[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
            if (h >= Hq) store_row(a->kpool, a->kv_bf, kv_offset(a->slots[t], h - Hq, a->S, D), D, key);
        }
        for (int64_t h = 0; h < Hkv; h++)
            store_row(a->vpool, a->kv_bf, kv_offset(a->slots[t], h, a->S, D), D, row + (Hq + Hkv + h) * D);
    }
    free(row);
}

void hs_rope_write(const void *qkv, int in_bf, const float *cos_, const float *ssin, const int64_t *slots,
                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, void *kpool, void *vpool, int kv_bf,
                   float *q_out) {
    rope_args a = {qkv, in_bf, cos_, ssin, slots, Hq, Hkv, D, S, kpool, vpool, kv_bf, q_out, NULL, NULL, 0.0f};
    for_rows(T, ROWS_PARALLEL_MIN, rope_rows, &a);
}

/* hs_rope_write with each query head normed by q_norm[D] and each key head by k_norm[D] first
 * (RMSNorm, eps; NULL: not normed), as Qwen3 and Gemma 3 do. */
void hs_rope_write_qk(const void *qkv, int in_bf, const float *cos_, const float *ssin, const int64_t *slots,
                      int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, void *kpool, void *vpool, int kv_bf,
                      float *q_out, const float *q_norm, const float *k_norm, float eps) {
    rope_args a = {qkv, in_bf, cos_, ssin, slots, Hq, Hkv, D, S, kpool, vpool, kv_bf, q_out, q_norm, k_norm, eps};
    for_rows(T, ROWS_PARALLEL_MIN, rope_rows, &a);
}
