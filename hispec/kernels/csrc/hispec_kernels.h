/* hispec's CPU kernels: every function the library exports, and the enums its users share.
 *
 * This header is the one place a kernel's signature is written: the C files implement it, the
 * torch op (decode_op.cpp) includes it and links the same library, and the ctypes bindings
 * (hispec/kernels/binding.py) are generated from the prototypes below. Keep each prototype on
 * its own statement, with parameter types among: int, int64_t, float and pointers.
 *
 * Every function computes each row (token) with the same code whatever the number of rows in
 * the call, so one-token decoding and batched verification agree bit for bit. Tensors are
 * contiguous, row-major; "bf" flags say a buffer holds bfloat16 (uint16) instead of float32.
 */
#ifndef HISPEC_KERNELS_H
#define HISPEC_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* How the torch op runs one matmul of a layer plan (hispec/kernels/plan.py) on x [T, K] -> [T, N]. */
enum hs_matmul_kind {
    HS_MM_FLOAT = 0,         /* float32 weight [N, K]: (W @ x.T).T, one row padded to two (matmul.linear) */
    HS_MM_INT4 = 1,          /* aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros) */
    HS_MM_INT8 = 2,          /* aten._weight_int8pack_mm(x, q, scales) */
    HS_MM_DENSE = 3,         /* x @ W.T with a dense weight in x's dtype (QuantLinear.dense, prompt chunks) */
    HS_MM_FLOAT_LINEAR = 4,  /* float32 weight [N, K]: x @ W.T (matmul.linear where that route wins) */
    HS_MM_Q4 = 5,            /* GGUF 4-bit nibbles [N, K / 2] and d, m [2, N, K / 32] on hs_q4_matmul */
    HS_MM_Q4_PANELS = 6,     /* the same weights rebuilt in float32 panels (hs_q4_panel_matmul: prompt chunks) */
    HS_MM_PANEL = 7,         /* float32 weight packed in panels (hs_panel_matmul); group = N */
    HS_MM_Q8 = 8,            /* GGUF Q8_0 q [N, K] int8 and d [N, K / group] float32 on hs_q8_matmul (group 16: Q6_K) */
    HS_MM_DENSE_BF16 = 9,    /* x (float32) cast to bfloat16 @ W.T, W dense bfloat16 (q4 layers' prompt chunks) */
    HS_MM_Q8A4 = 10,         /* HS_MM_Q4's weights tiled (hs_q8a_tile) on hs_q8a_q4_matmul: x rounded to 8 bits per block (q8a) */
    HS_MM_Q8A8 = 11,         /* HS_MM_Q8's weights tiled on hs_q8a_q8_matmul: x rounded to 8 bits per block (q8a8; group as Q8) */
    HS_MM_Q8A4_PANELS = 12,  /* HS_MM_Q8A4's tiled weights rebuilt in float32 panels (hs_q8a_q4_panel_matmul) */
    HS_MM_Q8A4_TILES = 13,   /* HS_MM_Q8A4's tiled weights on bfloat16 AMX tiles (hs_bf16_tiles_matmul: prompt chunks) */
    HS_MM_Q8A8_TILES = 14,   /* HS_MM_Q8A8's likewise (group as Q8) */
};

/* ---- norm_rope.c ---- */
/* out[T, D] = rms_norm(x[T, D]) * w, in float32 or bfloat16 (out_bf) */
void hs_rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, void *out, int out_bf);
/* h_out = h + delta (delta float32 or bfloat16); out = rms_norm(h_out) * w. All [T, D]. */
void hs_add_rms_norm(const float *h, const void *delta, int delta_bf, const float *w, int64_t T, int64_t D,
                     float eps, float *h_out, void *out, int out_bf);
/* hs_add_rms_norm with delta normed first: h_out = h + rms_norm(delta) * dw (Gemma 3's sandwich norms) */
void hs_norm_add_rms_norm(const float *h, const void *delta, int delta_bf, const float *dw, const float *w, int64_t T,
                          int64_t D, float eps, float *h_out, void *out, int out_bf);
/* h[T, D] += delta[T, D] (delta float32 or bfloat16, widened exactly): the residual after the MLP */
void hs_add_into(float *h, const void *delta, int delta_bf, int64_t T, int64_t D);
/* h[T, D] += rms_norm(delta) * dw (Gemma 3's norm of the MLP's output before its residual add) */
void hs_norm_add_into(float *h, const void *delta, int delta_bf, const float *dw, int64_t T, int64_t D, float eps);
/* out[T, I] = silu(gate) * up for gate_up[T, 2I] = [gate | up] */
void hs_silu_mul(const void *gu, int in_bf, int64_t T, int64_t I, void *out, int out_bf);
/* out[T, I] = gelu_tanh(gate) * up (GeGLU; gelu with the tanh approximation) */
void hs_gelu_tanh_mul(const void *gu, int in_bf, int64_t T, int64_t I, void *out, int out_bf);
/* RoPE on q and k of qkv[T, (Hq + 2 Hkv) * D]; K/V written at slots[T] of the pools [Hkv, S, D];
 * rotated queries to q_out[T, Hq, D] (NULL: K/V only) */
void hs_rope_write(const void *qkv, int in_bf, const float *cos_, const float *ssin, const int64_t *slots,
                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, void *kpool, void *vpool, int kv_bf,
                   float *q_out);
/* hs_rope_write with QK-norm: each query head RMSNormed by q_norm[D], each key head by k_norm[D]
 * (NULL: not normed) before RoPE */
void hs_rope_write_qk(const void *qkv, int in_bf, const float *cos_, const float *ssin, const int64_t *slots,
                      int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, void *kpool, void *vpool, int kv_bf,
                      float *q_out, const float *q_norm, const float *k_norm, float eps);

/* ---- attention.c ---- */
/* q[T, Hq, D] over the pools [Hkv, S, D] through block tables[B, max_blocks]: token t of sequence
 * seq[t] sees its first len[t] positions -> out[T, Hq * D]; token trees: tail_start[T] (NULL: none;
 * -1: none for that token) and tail[T, tail_width], the slots of a token's keys from tail_start[t] on */
void hs_paged_attention(const float *q, const void *kpool, const void *vpool, int kv_bf, const int32_t *tables,
                        int64_t max_blocks, const int32_t *seq, const int32_t *len, const int32_t *tail_start,
                        const int64_t *tail, int64_t tail_width, int64_t T, int64_t Hq, int64_t Hkv, int64_t S,
                        int64_t D, int64_t bs, float scale, void *out, int out_bf, int parallel);
/* hs_paged_attention over a sliding window: a token at position p (len[t] = p + 1) sees only the keys
 * at positions > p - window (window 0: all); prompt 1: the tokens are a prompt's (a prefill; they may
 * take another arithmetic, the same for every token of every prompt: hs_attention_amx) */
void hs_paged_attention_window(const float *q, const void *kpool, const void *vpool, int kv_bf,
                               const int32_t *tables, int64_t max_blocks, const int32_t *seq, const int32_t *len,
                               const int32_t *tail_start, const int64_t *tail, int64_t tail_width, int64_t T,
                               int64_t Hq, int64_t Hkv, int64_t S, int64_t D, int64_t bs, float scale, void *out,
                               int out_bf, int parallel, int64_t window, int prompt);
/* 1 where attention over a bfloat16 pool (D = 64 or 128, no window) runs on AMX tiles: prompt tokens'
 * wholly (attend_tile_amx), a step's queries' products (attend_tile_steps) */
int hs_attention_amx(void);
/* 1 where attention over a bfloat16 pool takes bfloat16 products (head sizes 64, 128; a build with
 * AVX512_BF16), else 0 (float32 products on the values it holds) */
int hs_attention_bf16_products(void);

/* ---- panel.c ---- */
/* output columns per panel of hs_panel_pack's layout on this build */
int64_t hs_panel_width(void);
/* w[N, K] -> out[ceil(N / P), K, P], zero-padded (P = hs_panel_width()) */
void hs_panel_pack(const float *w, int64_t N, int64_t K, float *out);
/* y[M, N] = x[M, K] W[N, K]^T for packed = hs_panel_pack(W) */
void hs_panel_matmul(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, float *y, int parallel);

/* ---- gguf.c ---- */
/* y[T, N] = x[T, K] (float32 or bfloat16) W^T, W = d * q a GGUF Q8_0 weight (q int8 [N, K], d [N, K / 32]) */
void hs_q8_matmul(const int8_t *q, const float *d, const void *x, int x_bf, int64_t T, int64_t N, int64_t K,
                  float *y, int parallel);
/* the same with a scale per group of 16 (d [N, K / 16]: GGUF Q6_K in the 8-bit form) or 32 values */
void hs_q8_group_matmul(const int8_t *q, const float *d, int group, const void *x, int x_bf, int64_t T, int64_t N,
                        int64_t K, float *y, int parallel);
/* y[T, N] = x[T, K] W^T, W = d * q + m a GGUF Q4_0 / Q4_1 weight (nibbles qs [N, K / 2], d, m [N, K / 32]);
 * 16-bit activations (decode steps) */
void hs_q4_matmul(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t T, int64_t N,
                  int64_t K, float *y, int parallel);
/* the same product on the weights rebuilt in float32 panels (prompt chunks) */
void hs_q4_panel_matmul(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t T, int64_t N,
                        int64_t K, float *y, int parallel);

/* ---- q8act.c: 8-bit-activation integer kernels (hispec/kernels/q8act.py) ---- */
/* Weight formats (fmt) and instruction-set paths (isa) of hs_q8a_matmul. */
enum hs_q8a_format {  /* the weights TILED (hs_q8a_tile): 16 columns' blocks side by side; d, m float16 bits */
    HS_Q8A_Q4 = 0,  /* 4-bit: nibbles w = qs [N, K / 2], d, m [N, K / 32]: W = d * q + m */
    HS_Q8A_Q8 = 1,  /* 8-bit: w = q int8 [N, K], d [N, K / 32]: W = d * q (m unused) */
    HS_Q8A_Q8G16 = 2,  /* 8-bit, a scale per 16 values (GGUF Q6_K): w = q int8 [N, K], d [N, K / 16] */
};
enum hs_q8a_isa {
    HS_Q8A_AUTO = 0,        /* the best this CPU has (hs_q8a_best_isa) */
    HS_Q8A_SCALAR = 1,
    HS_Q8A_AVX2 = 2,        /* maddubs */
    HS_Q8A_VNNI256 = 3,     /* AVX-VNNI or AVX-512 VNNI on 256-bit vectors */
    HS_Q8A_AVX512VNNI = 4,
    HS_Q8A_EMULATED = 5,    /* the 256-bit VNNI kernel with dpbusd made of AVX2 (tests; never chosen) */
    HS_Q8A_AMX = 6,         /* AMX tile products (many rows; HS_Q8A_AUTO from hs_q8a_amx_rows() rows) */
};
/* the file's rows [N, ...] -> the kernels' tiled layout (untile = 0), or back (untile = 1); m NULL for 8-bit */
void hs_q8a_tile(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                 uint8_t *w_out, uint16_t *d_out, uint16_t *m_out, int untile);
/* x [T, K] float32 -> per block of 32: codes int8 [T, K] = rint(x * 127 / amax), dx = amax / 127,
 * sx = the codes' sum (int32), dxs = dx * sx; all [T, K / 32] */
void hs_q8a_quantize(const float *x, int64_t T, int64_t K, int8_t *codes, float *dx, int32_t *sx, float *dxs);
/* 1 if this CPU can run path isa, else 0 */
int hs_q8a_isa_supported(int isa);
/* the fastest path this CPU has for a few rows (never HS_Q8A_EMULATED or HS_Q8A_AMX) */
int hs_q8a_best_isa(void);
/* HS_Q8A_AUTO runs products of at least this many rows on HS_Q8A_AMX where the CPU has it (0: never) */
void hs_q8a_set_amx_rows(int rows);
int hs_q8a_amx_rows(void);
/* y[T, N] = x W^T for activations already quantized (hs_q8a_quantize) on path isa; returns the path
 * that ran, or -1 (the CPU lacks it: nothing written; no scratch memory: y incomplete) */
int hs_q8a_matmul(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const int8_t *codes, const float *dx,
                  const int32_t *sx, const float *dxs, int64_t T, int64_t N, int64_t K, float *y, int isa,
                  int parallel);
/* the same from float32 x [T, K] (quantized here); returns the path that ran, or -1 */
int hs_q8a_matmul_f32(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                      int64_t N, int64_t K, float *y, int isa, int parallel);
/* hs_q4_matmul / hs_q8_matmul's arguments (scales float16) on the best path: 8-bit activations */
void hs_q8a_q4_matmul(const uint8_t *qs, const uint16_t *d, const uint16_t *m, const float *x, int64_t T, int64_t N,
                      int64_t K, float *y, int parallel);
void hs_q8a_q8_matmul(const int8_t *q, const uint16_t *d, const void *x, int x_bf, int64_t T, int64_t N, int64_t K,
                      float *y, int parallel);
/* the same with a scale per group of 16 (d [N, K / 16]) or 32 values */
void hs_q8a_q8_group_matmul(const int8_t *q, const uint16_t *d, int group, const void *x, int x_bf, int64_t T,
                            int64_t N, int64_t K, float *y, int parallel);
/* hs_q4_panel_matmul (prompt chunks: float32 panels, the same bits) on tiled 4-bit weights */
void hs_q8a_q4_panel_matmul(const uint8_t *qs, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                            int64_t N, int64_t K, float *y, int parallel);

/* ---- bf16_tiles.c: prompt chunks' products on bfloat16 AMX tiles, for q8a's tiled weights ---- */
/* 1 where hs_bf16_tiles_matmul runs here (a build with AMX-BF16, and Linux lets the process use the tiles) */
int hs_bf16_tiles(void);
/* y[T, N] = bf16(x) bf16(W)^T, products added in float32 on the tile unit; fmt, w, d, m as hs_q8a_matmul's
 * (tiled). Returns 1, or 0 where it cannot run (no AMX-BF16, no scratch memory: y incomplete). */
int hs_bf16_tiles_matmul(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                         int64_t N, int64_t K, float *y, int parallel);

/* ---- dequant.c: rows of a GGUF tensor in its file's blocks (a token embedding kept in its file) ---- */
/* GGML's tensor type ids (gguf's GGMLQuantizationType) of the types hs_dequant_rows reads */
enum hs_ggml_type {
    HS_GGML_F32 = 0,
    HS_GGML_F16 = 1,
    HS_GGML_Q4_0 = 2,
    HS_GGML_Q4_1 = 3,
    HS_GGML_Q5_0 = 6,
    HS_GGML_Q5_1 = 7,
    HS_GGML_Q8_0 = 8,
    HS_GGML_Q4_K = 12,
    HS_GGML_Q6_K = 14,
    HS_GGML_BF16 = 30,
};
/* the bytes of a row of K values of type (-1: a type it does not read, or K not a multiple of its block) */
int64_t hs_dequant_row_bytes(int type, int64_t K);
/* out[i, :K] = row ids[i] of rows (row_bytes each) as float32, each value as the gguf package's numpy
 * dequantization computes it, times scale where scale != 1 (rounded once more); 0, or -1 where type
 * or row_bytes does not fit */
int64_t hs_dequant_rows(int type, const uint8_t *rows, int64_t row_bytes, const int64_t *ids, int64_t n, int64_t K,
                        float scale, float *out);

/* ---- sample.c: sampling (hispec/sampling/sampler.py) ---- */
/* probs[T, V] = each row of logits[T, V] as a distribution: (logits - max) / temperature[t], the tokens below the
 * top_k[t]-th largest masked (0 or >= V: off), softmax, then the smallest set of largest tokens whose mass
 * reaches top_p[t] (>= 1: off; ties: lower token first), renormalised. Rows in parallel (OpenMP). */
void hs_sampling_probs(const float *logits, float *probs, int64_t T, int64_t V, const float *temperature,
                       const int64_t *top_k, const float *top_p);
/* out[t] = an exact sample of row t of probs[T, V] (unnormalised) drawn with u[t] (in [0, 1)): where at most
 * 1024 tokens have p > 0, the race argmin E_i / p[i] with E_i exponential from u[t]'s bits and i; elsewhere the
 * first token whose cumulative probability exceeds u[t] times the row's mass; 0 for a row of zeros. */
void hs_sample_pick(const float *probs, int64_t T, int64_t V, const double *u, int64_t *out);
/* the index of the largest of row[0 .. n) as torch.argmax picks it (the first of equal maxima; the
 * first NaN where there is one) */
int64_t hs_argmax(const float *row, int64_t n);

#ifdef __cplusplus
}
#endif

#endif
