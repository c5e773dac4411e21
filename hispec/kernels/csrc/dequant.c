/* Rows of a GGUF tensor in the file's own blocks -> float32 (hispec_kernels.h: hs_dequant_rows).
 *
 * What a token embedding kept in its file needs: a step reads a handful of rows of a table whose
 * float32 copy would be 4-8x the file (Gemma 3 270M: 671 MB for a 178 MB Q8_0 table). Each value is
 * computed with the float32 operations, in the order, of the gguf package's numpy dequantization
 * (gguf/quants.py), so the rows are bit for bit what the float32 copy holds (the library is built
 * with -ffp-contract=off: no product is fused into a sum). Block layouts: gguf_weights.py. */
#include <string.h>

#include "hispec_kernels.h"

/* float16 -> float32, exact (subnormals too) */
static inline float f16_to_f32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
    uint32_t bits;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-8f;  /* man * 2^-24: exact */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7F800000u | man << 13 : sign | (exp + 112u) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(const uint8_t *p) {
    const uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 32 weights of the legacy nibble order: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4 */
static inline int nibble(const uint8_t *qs, int j) { return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4; }

static void q8_0(const uint8_t *b, float *w) {  /* d, qs[32] int8: x * d */
    const float d = f16_to_f32(b);
    for (int j = 0; j < 32; j++) w[j] = (float)(int8_t)b[2 + j] * d;
}

static void q4_0(const uint8_t *b, float *w) {  /* d, qs[16]: d * (q - 8) */
    const float d = f16_to_f32(b);
    for (int j = 0; j < 32; j++) w[j] = d * (float)(nibble(b + 2, j) - 8);
}

static void q4_1(const uint8_t *b, float *w) {  /* d, m, qs[16]: (d * q) + m */
    const float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    for (int j = 0; j < 32; j++) w[j] = d * (float)nibble(b + 4, j) + m;
}

static inline int high_bit(const uint8_t *qh, int j) {  /* bit j of qh[4] read as a little-endian uint32 */
    return qh[j >> 3] >> (j & 7) & 1;
}

static void q5_0(const uint8_t *b, float *w) {  /* d, qh[4], qs[16]: d * (q - 16) */
    const float d = f16_to_f32(b);
    for (int j = 0; j < 32; j++) w[j] = d * (float)((nibble(b + 6, j) | high_bit(b + 2, j) << 4) - 16);
}

static void q5_1(const uint8_t *b, float *w) {  /* d, m, qh[4], qs[16]: (d * q) + m */
    const float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    for (int j = 0; j < 32; j++) w[j] = d * (float)(nibble(b + 8, j) | high_bit(b + 4, j) << 4) + m;
}

/* Q4_K's 8 sub-blocks' 6-bit scales and mins from scales[12] */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

static void q4_k(const uint8_t *b, float *w) {  /* d, dmin, scales[12], qs[128]: (d * sc) * q - (dmin * mn) */
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const float dl = d * (float)sc, ml = dmin * (float)mn;
        const uint8_t *qs = b + 16 + 32 * (j / 2);  /* chunk j / 2: low nibbles sub-block 2c, high 2c + 1 */
        for (int l = 0; l < 32; l++) w[32 * j + l] = dl * (float)(j % 2 ? qs[l] >> 4 : qs[l] & 15) - ml;
    }
}

static void q6_k(const uint8_t *b, float *w) {  /* ql[128], qh[64], scales[16] int8, d: (d * sc) * (q - 32) */
    const float d = f16_to_f32(b + 208);
    for (int v = 0; v < 256; v++) {
        const int half = v / 128, r = v % 128 / 32, l = v % 32;
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        const int lo = r % 2 ? ql[32 + l] : ql[l];
        const int q = ((r < 2 ? lo & 15 : lo >> 4) | (qh[l] >> (2 * r) & 3) << 4) - 32;
        w[v] = d * (float)(int8_t)b[192 + v / 16] * (float)q;
    }
}

typedef void (*block_fn)(const uint8_t *, float *);

/* a type's blocks: values and bytes per block, and how to read one (NULL: a float type) */
static int block_of(int type, int *values, int *bytes, block_fn *fn) {
    switch (type) {
        case HS_GGML_Q8_0: *values = 32, *bytes = 34, *fn = q8_0; return 1;
        case HS_GGML_Q4_0: *values = 32, *bytes = 18, *fn = q4_0; return 1;
        case HS_GGML_Q4_1: *values = 32, *bytes = 20, *fn = q4_1; return 1;
        case HS_GGML_Q5_0: *values = 32, *bytes = 22, *fn = q5_0; return 1;
        case HS_GGML_Q5_1: *values = 32, *bytes = 24, *fn = q5_1; return 1;
        case HS_GGML_Q4_K: *values = 256, *bytes = 144, *fn = q4_k; return 1;
        case HS_GGML_Q6_K: *values = 256, *bytes = 210, *fn = q6_k; return 1;
        case HS_GGML_F32: *values = 1, *bytes = 4, *fn = NULL; return 1;
        case HS_GGML_F16: *values = 1, *bytes = 2, *fn = NULL; return 1;
        case HS_GGML_BF16: *values = 1, *bytes = 2, *fn = NULL; return 1;
        default: return 0;
    }
}

int64_t hs_dequant_row_bytes(int type, int64_t K) {
    int values, bytes;
    block_fn fn;
    if (!block_of(type, &values, &bytes, &fn) || K % values) return -1;
    return K / values * bytes;
}

int64_t hs_dequant_rows(int type, const uint8_t *rows, int64_t row_bytes, const int64_t *ids, int64_t n, int64_t K,
                        float scale, float *out) {
    int values, bytes;
    block_fn fn;
    if (!block_of(type, &values, &bytes, &fn) || K % values || K / values * bytes != row_bytes) return -1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rows + ids[i] * row_bytes;
        float *o = out + i * K;
        if (type == HS_GGML_F32) {
            memcpy(o, row, (size_t)K * 4);
        } else if (fn == NULL) {
            for (int64_t j = 0; j < K; j++) o[j] = type == HS_GGML_F16 ? f16_to_f32(row + 2 * j) : bf16_to_f32(row + 2 * j);
        } else {
            for (int64_t blk = 0; blk < K / values; blk++) fn(row + blk * bytes, o + blk * values);
        }
        if (scale != 1.0f) {
            for (int64_t j = 0; j < K; j++) o[j] = o[j] * scale;
        }
    }
    return 0;
}
