/* 8-bit-activation integer kernels for GGUF 4-bit (Q4_0, Q4_1, hispec's int4) and 8-bit (Q8_0)
 * block weights, as hispec stores them:
 *
 *   4-bit: qs uint8 [N, K / 2] (per block of 32: byte j holds q[j] in its low nibble and q[j + 16]
 *          in its high one, q in 0..15), d, m float16 [N, K / 32]:  W[n, k] = d[n, b] q[n, k] + m[n, b]
 *          (Q4_0 is m = -8 d).
 *   8-bit: q int8 [N, K], d float16 [N, K / 32]:                     W[n, k] = d[n, b] q[n, k]
 *   8-bit, group 16 (HS_Q8A_Q8G16; GGUF Q6_K in hispec's 8-bit form): q int8 [N, K], d float16
 *          [N, K / 16], a scale per 16 values:                       W[n, k] = d[n, k / 16] q[n, k]
 * The scales are float16 as in the GGUF blocks (their bits, uint16_t here), widened exactly to
 * float32 where used: at one row a step streams the weights from memory, and float32 scales were
 * a third of a 4-bit weight's bytes (8 of every 24 bytes a block).
 *
 * Activations x [T, K] float32 are quantized per block of 32 (hs_q8a_quantize):
 *   amax = max |x|, dx = amax / 127, codes = rint(x * (127 / amax)) in -127..127 (0 where amax is 0),
 *   sx = sum of the block's codes (int32), dxs = dx * (float)sx.
 * Each output is then, blocks in order (every product below is float32, rounded once):
 *   idot[b] = sum_j q[j] codes[j]                  exact in int32 (and exact as a float: < 2^24)
 *   acc     = fma((float)idot[b], d[n, b] * dx[t, b], acc)
 *   macc    = fma(m[n, b], dxs[t, b], macc)        (4-bit only: the offset times the block's x sum)
 *   y[t, n] = acc + macc                           (8-bit: acc)
 * Group 16: each block's sum taken as two halves of 16 codes, each times its own weight scale, the
 * low half first (the activations keep one scale per 32):
 *   acc = fma((float)idot_lo[b], d[n, 2b] * dx[t, b], acc); acc = fma((float)idot_hi[b], d[n, 2b + 1] * dx[t, b], acc)
 * (VNNI's 8-bit correction below then starts each half at -128 times that half's code sum: the kernel
 * takes the low half's from the codes while it lays them out, once per call, the high half's as
 * sx - that; hs_q8a_quantize's outputs are the same for every format.)
 * Every path (scalar, AVX2 maddubs, 256-bit VNNI, AVX-512 VNNI) computes these same operations, so
 * they give the same bits; a row's outputs depend on that row alone (not on T, the row tiling, the
 * thread split or the vector width).
 *
 * Weights are stored TILED (hs_q8a_tile, once at load): per tile of TILE = 16 output columns, per
 * block, per dword i of the block's bytes (4 for 4-bit, 8 for 8-bit), the 16 columns' dword i side
 * by side (64 bytes):  tiled[t * 16 * row_bytes + ((b * D + i) * 16 + c) * 4 + j]
 *                      = w[(16 t + c) * row_bytes + b * bytes + 4 i + j],       (D = bytes / 4)
 * and the scales d, m likewise [tile][block][16] (group 16: [tile][half-block][16], K / 16 of them). The last N % 16 columns stay as they are (rows),
 * at the same offsets. The tiled array is the same size as the file's and holds the same bytes.
 *
 * The SIMD paths put output columns in vector lanes: a tile's dword i is one 512-bit vector (two
 * 256-bit ones), a 32-bit lane holding 4 consecutive codes of one column, so a block is read as 4
 * (8) plain loads, nibbles split in registers: 8 vectors per block, vector v pairing with the
 * activation bytes 4v .. 4v+3, which are broadcast to every lane. The activations are quantized
 * into groups of RT rows interleaved by row, so that one pointer walks a group's rows; each group
 * runs against a tile block by block, reading the block's vectors from the tile itself (the first
 * group brings them into the cache while the next tile is prefetched into L2). The threads share
 * the tiles (a thread's tiles are contiguous in memory).
 *
 * Integer dot products: VNNI's dpbusd takes unsigned x signed bytes: 4-bit codes are unsigned as
 * they are; 8-bit codes are stored as q + 128 (q ^ 0x80) and each row's block sum starts at
 * -128 * sx. AVX2's maddubs (unsigned x signed -> saturating 16-bit pairs): 4-bit codes sum 8 of
 * them in 16 bits (8 pairs of 2 * 15 * 127 < 2^15) before widening; 8-bit codes use |q| and the
 * activations' sign flipped where q < 0 (pairs <= 2 * 128 * 127 < 2^15), widened each time.
 *
 * A fifth path, "emulated", is the 256-bit VNNI kernel with dpbusd made of AVX2 instructions, for
 * the tests to run that code on CPUs without VNNI (never chosen by hs_q8a_best_isa).
 *
 * This file includes itself once per instruction set (Q8A_BODY), with that set's vector operations
 * defined and its functions compiled for it (#pragma GCC target); the CPU's support is checked at
 * run time (hs_q8a_isa_supported), so one build serves every path the CPU has. */
#ifndef Q8A_BODY
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hispec_kernels.h" /* the formats (HS_Q8A_Q4, HS_Q8A_Q8) and paths (HS_Q8A_*) */
#include "simd.h"        /* hs_amx_tiles, amx_config */
#include "tiled.h"       /* BLOCK, TILE, the tiled layout, tile_pad */

/* rows -> tiled (untile = 0) or back (1): w [N, row bytes], d and m (NULL for 8-bit) [N, ns]: ns = nb
 * scales a column, 2 nb for HS_Q8A_Q8G16 (tiled as ns "blocks" of scales: [tile][s][16]). */
void hs_q8a_tile(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                 uint8_t *w_out, uint16_t *d_out, uint16_t *m_out, int untile) {
    const int64_t nb = K / BLOCK, ns = nb * block_scales(fmt);
    const int bytes = block_bytes(fmt);
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t r = n * nb + b;
            int step;
            const int64_t base = tiled_block(n, b, nb, bytes, N, &step);
            for (int j = 0; j < bytes; j++) {
                const int64_t tb = base + (j / 4) * step + (j & 3);
                if (untile) w_out[r * bytes + j] = w[tb]; else w_out[tb] = w[r * bytes + j];
            }
        }
        for (int64_t b = 0; b < ns; b++) {
            const int64_t r = n * ns + b, t = tiled_scale(n, b, ns, N);
            if (untile) d_out[r] = d[t]; else d_out[t] = d[r];
            if (m && untile) m_out[r] = m[t]; else if (m) m_out[t] = m[r];
        }
    }
}

/* A float16's bits -> its value as a float32 (exact: every float16 is a float32). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023;
    uint32_t bits;
    if (e == 31) bits = sign | 0x7F800000u | f << 13;  /* inf, NaN */
    else if (e) bits = sign | (e + 112) << 23 | f << 13;  /* normal: the exponent rebased, 127 - 15 */
    else {  /* zero or subnormal: f * 2^-24 */
        const float v = (float)f * 0x1p-24f;
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline int8_t clamp_code(float v) {  /* NaN -> 0 */
    return (int8_t)(v >= -127.0f && v <= 127.0f ? v : v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : 0.0f);
}

/* One block of 32 inputs: codes, and returns amax (the definition: plain C). */
static inline float quantize_block(const float *xb, int8_t *qb, int32_t *sum) {
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) {
        float a = fabsf(xb[j]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < BLOCK; j++) {
        qb[j] = clamp_code(nearbyintf(xb[j] * inv));
        s += qb[j];
    }
    *sum = s;
    return amax;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
/* The same block on AVX2 (the same bits: |x| and max are exact, x * inv is one IEEE product, and
 * cvtps rounds to nearest even as nearbyintf does in the default rounding mode; |x * inv| <= 127.0x
 * needs no clamp). A block holding a NaN or an infinity goes to quantize_block. */
static int quantize_block_avx2(const float *xb, int8_t *qb, int32_t *sum, float *amax_out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], a = _mm256_setzero_ps();
    __m256i special = _mm256_setzero_si256();
    const __m256i expmask = _mm256_set1_epi32(0x7f800000);
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        const __m256 av = _mm256_and_ps(v[i], absmask);
        special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(av), expmask), expmask));
        a = _mm256_max_ps(a, av);
    }
    if (!_mm256_testz_si256(special, special)) return 0;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* int32 -> int8, in order: packs interleave the 128-bit lanes, the permute puts them back */
    const __m256i p16 = _mm256_packs_epi32(c[0], c[1]), q16 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i p8 = _mm256_packs_epi16(p16, q16);
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *sum = _mm_cvtsi128_si32(s4);
    *amax_out = amax;
    return 1;
}
#pragma GCC pop_options

/* Blocks from which the quantization is split over the threads: a prompt chunk's (hundreds of rows;
 * on one thread it was 7% of a prefill's samples, the other thread waiting), not a decode step's
 * (a few dozen rows at most, ~20 ns a block: less than the threads' start). */
#define QUANTIZE_PARALLEL_BLOCKS 1024

/* Activations quantized row by row (hs_q8a_quantize's outputs), as hs_q8a_matmul takes them. */
typedef struct { int8_t *codes; float *dx; int32_t *sx; float *dxs; } q8a_scratch;

/* One block of 32 inputs xb: its codes into qb, its scale, code sum and their product into *dx, *sx,
 * *dxs. avx2: the CPU has AVX2 and FMA. */
static inline void quantize_one(const float *xb, int8_t *qb, float *dx, int32_t *sx, float *dxs, int avx2) {
    float amax;
    int32_t s;
    if (!(avx2 && quantize_block_avx2(xb, qb, &s, &amax))) amax = quantize_block(xb, qb, &s);
    const float d = amax / 127.0f;
    *dx = d;
    *sx = s;
    *dxs = d * (float)s;
}

static int cpu_avx2_fma(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

/* x [T, K] float32 -> codes int8 [T, K], dx float32 [T, K/32], sx int32 [T, K/32], dxs float32 [T, K/32].
 * Each block on its own: the same bits however the blocks are split. */
void hs_q8a_quantize(const float *x, int64_t T, int64_t K, int8_t *codes, float *dx, int32_t *sx, float *dxs) {
    const int64_t nb = K / BLOCK;
    const int avx2 = cpu_avx2_fma();
#pragma omp parallel for schedule(static) if (T * nb >= QUANTIZE_PARALLEL_BLOCKS)
    for (int64_t i = 0; i < T * nb; i++) quantize_one(x + i * BLOCK, codes + i * BLOCK, dx + i, sx + i, dxs + i, avx2);
}

/* ---- plain C: the definition of the arithmetic ---------------------------------------------- */
/* Not vectorized: GCC 12 at -O2/-O3 with -march=native on a CPU with AVX-512 VNNI (a Zen 4) turned the
 * signed x signed int8 dot product below into dpbusd, which takes one side unsigned: wrong sums for
 * negative 8-bit weights (seen 2026-12-04). This path is the definition; its speed does not matter. */
__attribute__((optimize("no-tree-vectorize"))) static void scalar_matmul(const uint8_t *w, const uint16_t *d, const uint16_t *m, const int fmt, const int8_t *codes,
                          const float *dx, const int32_t *sx, const float *dxs, int64_t T, int64_t N, int64_t K,
                          float *y, int parallel) {
    (void)sx;
    const int64_t nb = K / BLOCK, ns = nb * block_scales(fmt);
    const int bytes = block_bytes(fmt);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            float acc = 0.0f, macc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *xb = codes + t * K + b * BLOCK;
                uint8_t wb[32];  /* the block's bytes as the file has them */
                int step;
                const int64_t base = tiled_block(n, b, nb, bytes, N, &step);
                for (int j = 0; j < bytes; j++) wb[j] = w[base + (j / 4) * step + (j & 3)];
                int32_t s = 0;
                if (fmt == HS_Q8A_Q8G16) {  /* two halves, each times its own scale: the low one first */
                    for (int h = 0; h < 2; h++) {
                        int32_t sh = 0;
                        for (int j = 16 * h; j < 16 * h + 16; j++) sh += (int32_t)(int8_t)wb[j] * xb[j];
                        const float c = half_to_float(d[tiled_scale(n, 2 * b + h, ns, N)]) * dx[t * nb + b];
                        acc = fmaf((float)sh, c, acc);
                    }
                    continue;
                }
                if (fmt == HS_Q8A_Q8)
                    for (int j = 0; j < BLOCK; j++) s += (int32_t)(int8_t)wb[j] * xb[j];
                else
                    for (int j = 0; j < 16; j++) s += (wb[j] & 15) * xb[j] + (wb[j] >> 4) * xb[16 + j];
                const int64_t sc = tiled_scale(n, b, nb, N);
                const float c = half_to_float(d[sc]) * dx[t * nb + b];
                acc = fmaf((float)s, c, acc);
                if (fmt == HS_Q8A_Q4) macc = fmaf(half_to_float(m[sc]), dxs[t * nb + b], macc);
            }
            y[t * N + n] = fmt == HS_Q8A_Q4 ? acc + macc : acc;
        }
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, ISA_NAME)
#define Q8A_BODY

/* AVX2, maddubs */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ISA_NAME avx2
#define VW 8
#define TV 2
#define RT 4
#define DP_VNNI 0
#include __FILE__
#pragma GCC pop_options

/* 256-bit VNNI: AVX-VNNI (VEX) */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define ISA_NAME avxvnni
#define VW 8
#define TV 2
#define RT 4
#define DP_VNNI 1
#define DPBUSD256 _mm256_dpbusd_avx_epi32
#include __FILE__
#pragma GCC pop_options

/* 256-bit VNNI: AVX512-VL + AVX512-VNNI (EVEX), for AVX-512 CPUs without AVX-VNNI (Zen 4, Ice Lake) */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define ISA_NAME vl256
#define VW 8
#define TV 2
#define RT 4
#define DP_VNNI 1
#define DPBUSD256 _mm256_dpbusd_epi32
#include __FILE__
#pragma GCC pop_options

/* The 256-bit VNNI kernel on plain AVX2, dpbusd computed by other instructions (exact): for the
 * tests, to run that kernel's code on CPUs without VNNI. Never chosen by hs_q8a_best_isa. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline __attribute__((always_inline)) __m256i dpbusd_emulated(__m256i src, __m256i a, __m256i b) {
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i a_even = _mm256_and_si256(a, lo8), a_odd = _mm256_srli_epi16(a, 8);  /* unsigned bytes */
    const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(src, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}
#define ISA_NAME emulated
#define VW 8
#define TV 2
#define RT 4
#define DP_VNNI 1
#define DPBUSD256 dpbusd_emulated
#include __FILE__
#pragma GCC pop_options

/* AVX-512 VNNI */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define ISA_NAME avx512vnni
#define VW 16
#define TV 1
#define RT 8
#define DP_VNNI 1
#include __FILE__
#pragma GCC pop_options

/* ---- AMX: Intel's tile matrix unit (TMUL, int8) ----------------------------------------------
 * The same arithmetic as every other path, with each block's integer sums taken by one tile
 * product: for a group of 16 rows and a tile of 16 columns, block b's A tile is the rows' codes
 * [16, 32] (row-major, as hs_q8a_quantize writes them), its B tile the tile's block [8, 64]: row i is
 * dword i of the 16 columns side by side, which is the stored layout itself (8-bit; 4-bit: the
 * low nibbles of dwords 0-3 are rows 0-3, codes 0-15, the high ones rows 4-7, codes 16-31, unpacked
 * once per tile into a buffer). C[r][c] = sum_k A[r][k] B'[k][c] is idot exact in int32 (8-bit:
 * signed x signed, so no -128 sx correction is needed; 4-bit: signed codes x unsigned nibbles);
 * the float steps after it are the others' (c = d * dx, acc = fma(idot, c, acc); macc; the sum).
 * Group 16: each half-block's [16, 16] x [4, 64] product on its own, the low half first.
 * The rows are padded to a multiple of 16 with zero codes and scales (their outputs are not
 * stored). Linux hands a process the tile registers only when it asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM), which hs_q8a_isa_supported does once. */
#define AMX_ROWS 16  /* rows of an A (and C) tile */

/* 1 when the CPU has AMX-INT8 and this process may use the tiles (hs_amx_tiles); asked once (the
 * dispatch asks at every product of many rows, and CPUID traps to the hypervisor in a VM) */
static int amx_permitted(void) {
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    unsigned a, b, c, d;
    s = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1) && hs_amx_tiles();
    __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    return s;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-int8")

/* Tiles: 0, 3: A [16, 32] (blocks b, b + 1); 1, 4: B [8, 64]; 2, 5: C [16, 16 int32];
 * 6: a half-block's A [16, 16]; 7: its B [4, 64] (group 16, with C tiles 2 and 5). */
static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const uint16_t colsb[8] = {32, 64, 64, 32, 64, 64, 16, 64};
    const uint8_t rows[8] = {AMX_ROWS, 8, AMX_ROWS, AMX_ROWS, 8, AMX_ROWS, AMX_ROWS, 4};
    for (int i = 0; i < 8; i++) cfg.colsb[i] = colsb[i], cfg.rows[i] = rows[i];
    _tile_loadconfig(&cfg);
}

/* The 4-bit tile's blocks (tw) as B tiles: nb blocks of 8 rows x 64 bytes into wb */
static inline void amx_unpack4(const uint8_t *tw, int64_t nb, uint8_t *wb) {
    const __m512i lo = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < 4; i++) {
            const __m512i raw = _mm512_loadu_si512(tw + (b * 4 + i) * 64);
            _mm512_store_si512(wb + (b * 8 + i) * 64, _mm512_and_si512(raw, lo));
            _mm512_store_si512(wb + (b * 8 + 4 + i) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo));
        }
}

/* One block's float steps for R rows: acc[r] = fma(idot[r], d * dx[r], acc[r]); cb the C tile stored
 * [16][16] int32, dv the block's 16 weight scales, dxb the rows' dx (stride nb). */
static inline __attribute__((always_inline)) void amx_scale(__m512 *acc, const int32_t *cb, __m512 dv,
                                                            const float *dxb, int64_t nb, const int R) {
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const __m512 c = _mm512_mul_ps(dv, _mm512_set1_ps(dxb[r * nb]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + r * 16)), c, acc[r]);
    }
}

/* The integer sums of blocks b0 .. b0 + n - 1 (a row group xg [16, K] times a tile's B blocks wt) into
 * cb: [n][16 rows][16 columns] int32 (group 16: [2 n], a half-block each, the low half first). Two
 * blocks at a time on tiles 0-2 and 3-5, so that the second's loads run beside the first's product. */
static inline __attribute__((always_inline)) void amx_products(const uint8_t *wt, const int8_t *xg, int64_t K,
                                                               int64_t b0, int n, const int fmt, int32_t *cb) {
    if (fmt == HS_Q8A_Q8G16) {
        for (int j = 0; j < n; j++) {
            const int64_t b = b0 + j;
            _tile_loadd(6, xg + b * BLOCK, K);
            _tile_loadd(7, wt + b * 512, 64);
            _tile_zero(2);
            _tile_dpbssd(2, 6, 7);
            _tile_stored(2, cb + 2 * j * 256, 64);
            _tile_loadd(6, xg + b * BLOCK + 16, K);
            _tile_loadd(7, wt + b * 512 + 256, 64);
            _tile_zero(5);
            _tile_dpbssd(5, 6, 7);
            _tile_stored(5, cb + (2 * j + 1) * 256, 64);
        }
        return;
    }
    int j = 0;
    for (; j + 1 < n; j += 2) {
        const int64_t b = b0 + j;
        _tile_loadd(0, xg + b * BLOCK, K);
        _tile_loadd(1, wt + b * 512, 64);
        _tile_loadd(3, xg + (b + 1) * BLOCK, K);
        _tile_loadd(4, wt + (b + 1) * 512, 64);
        _tile_zero(2);
        _tile_zero(5);
        if (fmt == HS_Q8A_Q4) {
            _tile_dpbsud(2, 0, 1);
            _tile_dpbsud(5, 3, 4);
        } else {
            _tile_dpbssd(2, 0, 1);
            _tile_dpbssd(5, 3, 4);
        }
        _tile_stored(2, cb + j * 256, 64);
        _tile_stored(5, cb + (j + 1) * 256, 64);
    }
    if (j < n) {
        const int64_t b = b0 + j;
        _tile_loadd(0, xg + b * BLOCK, K);
        _tile_loadd(1, wt + b * 512, 64);
        _tile_zero(2);
        if (fmt == HS_Q8A_Q4) _tile_dpbsud(2, 0, 1); else _tile_dpbssd(2, 0, 1);
        _tile_stored(2, cb + j * 256, 64);
    }
}

#define AMX_CHUNK 8  /* blocks per batch of tile products (their sums: 8 KB, 16 KB for group 16) */

/* R rows (a constant, <= 16) of one row group times one tile of 16 columns -> y (row stride N; the
 * first live rows and ncols columns written). xg: the group's codes [16, K] (row-major), dxg/dxsg
 * [16, nb]; wt: the tile's B blocks (8-bit: the stored tile; 4-bit: unpacked, amx_unpack4); dt, mt:
 * its scales [blocks][16]. The blocks' products run a chunk ahead of their float steps (cbuf: two
 * chunks' sums), so the tile unit and the vector units work side by side and no load waits on the
 * tile store just before it. */
static inline __attribute__((always_inline)) void amx_rows(const uint8_t *wt, const uint16_t *dt, const uint16_t *mt,
                                                           const int8_t *xg, const float *dxg, const float *dxsg,
                                                           int64_t K, const int R, const int fmt, float *y, int64_t N,
                                                           int live, int ncols, int32_t *cbuf) {
    const int64_t nb = K / BLOCK, chunks = (nb + AMX_CHUNK - 1) / AMX_CHUNK;
    const int halves = fmt == HS_Q8A_Q8G16 ? 2 : 1;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    amx_products(wt, xg, K, 0, (int)(nb < AMX_CHUNK ? nb : AMX_CHUNK), fmt, cbuf);
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t b0 = ch * AMX_CHUNK, n = nb - b0 < AMX_CHUNK ? nb - b0 : AMX_CHUNK;
        if (ch + 1 < chunks) {
            const int64_t b1 = b0 + AMX_CHUNK, n1 = nb - b1 < AMX_CHUNK ? nb - b1 : AMX_CHUNK;
            amx_products(wt, xg, K, b1, (int)n1, fmt, cbuf + ((ch + 1) & 1) * AMX_CHUNK * 2 * 256);
        }
        const int32_t *cb = cbuf + (ch & 1) * AMX_CHUNK * 2 * 256;
        for (int64_t j = 0; j < n * halves; j++) {
            const int64_t b = b0 + j / halves;
            amx_scale(acc, cb + j * 256, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (b0 * halves + j) * 16))),
                      dxg + b, nb, R);
        }
    }
    if (fmt == HS_Q8A_Q4) {  /* the offsets' sums, a loop of their own (registers), then the sum */
        __m512 macc[AMX_ROWS];
        for (int r = 0; r < R; r++) macc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + b * 16)));
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) macc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(dxsg[r * nb + b]), macc[r]);
        }
        for (int r = 0; r < R; r++) acc[r] = _mm512_add_ps(acc[r], macc[r]);
    }
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < R && r < live; r++) _mm512_mask_storeu_ps(y + r * N, mask, acc[r]);
}

static int amx_run(const uint8_t *w, const uint16_t *d, const uint16_t *m, const int fmt, const float *x,
                   q8a_scratch q, int64_t T, int64_t N, int64_t K, float *y, int parallel) {
    const int64_t nb = K / BLOCK, row_bytes = nb * block_bytes(fmt), tiles = (N + TILE - 1) / TILE;
    const int64_t ns = nb * block_scales(fmt), Tp = (T + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int avx2 = x ? cpu_avx2_fma() : 0;
    /* the codes row-major [Tp, K], dx and dxs [Tp, nb]; the padding rows zero */
    int8_t *codes = aligned_alloc(64, (size_t)(Tp * K) + (size_t)(Tp * nb) * 2 * sizeof(float) + 64);
    if (!codes) return 0;
    float *dx = (float *)(codes + Tp * K), *dxs = dx + Tp * nb;
    memset(codes + T * K, 0, (size_t)((Tp - T) * K));
    memset(dx + T * nb, 0, (size_t)((Tp - T) * nb) * sizeof(float));
    memset(dxs + T * nb, 0, (size_t)((Tp - T) * nb) * sizeof(float));
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        int32_t sx_unused;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * nb; i++) {
            if (x)
                quantize_one(x + i * BLOCK, codes + i * BLOCK, dx + i, &sx_unused, dxs + i, avx2);
            else
                memcpy(codes + i * BLOCK, q.codes + i * BLOCK, BLOCK), dx[i] = q.dx[i], dxs[i] = q.dxs[i];
        }
        /* a thread's scratch: 4-bit B tiles, two C tiles, and the last tile's columns padded as in
         * the other paths */
        uint8_t *wb = fmt == HS_Q8A_Q4 ? aligned_alloc(64, (size_t)(nb * 512)) : NULL;
        int32_t *cbuf = aligned_alloc(64, 2 * AMX_CHUNK * 2 * 256 * sizeof(int32_t));
        const tile_pad pad = tile_pad_new(N, row_bytes, nb, ns);
        const int ok = cbuf && (fmt != HS_Q8A_Q4 || wb) && tile_pad_ok(pad, N);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        amx_configure();
#pragma omp for schedule(static) nowait
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (!ok) continue;
            const int64_t n0 = tile * TILE;
            const int ncols = (int)(N - n0 < TILE ? N - n0 : TILE);
            const uint8_t *tw = w + n0 * row_bytes;
            const uint16_t *dt = d + n0 * ns, *mt = fmt == HS_Q8A_Q4 ? m + n0 * nb : NULL;
            if (ncols < TILE) {  /* the last columns (stored as rows) placed as in a full tile, the rest zero */
                pad_last_tile(fmt, tw, dt, mt, ncols, nb, ns, pad);
                tw = pad.w, dt = pad.d, mt = fmt == HS_Q8A_Q4 ? pad.m : NULL;
            }
            if (fmt == HS_Q8A_Q4) amx_unpack4(tw, nb, wb);
            const uint8_t *wt = fmt == HS_Q8A_Q4 ? wb : tw;
            for (int64_t t0 = 0; t0 < T; t0 += AMX_ROWS) {
                const int8_t *xg = codes + t0 * K;
                const float *dxg = dx + t0 * nb, *dxsg = dxs + t0 * nb;
                float *yt = y + t0 * N + n0;
                const int64_t left = T - t0;
                /* constant row counts keep the sums in registers (4, 8, 12, 16: padding rows computed, not stored) */
#define AMX_CALL(R, F) amx_rows(wt, dt, mt, xg, dxg, dxsg, K, R, F, yt, N, (int)left, ncols, cbuf)
#define AMX_FMT(R)                                                               \
    if (fmt == HS_Q8A_Q4) AMX_CALL(R, HS_Q8A_Q4);                              \
    else if (fmt == HS_Q8A_Q8G16) AMX_CALL(R, HS_Q8A_Q8G16);                   \
    else AMX_CALL(R, HS_Q8A_Q8)
                if (left <= 4) { AMX_FMT(4); }
                else if (left <= 8) { AMX_FMT(8); }
                else if (left <= 12) { AMX_FMT(12); }
                else { AMX_FMT(16); }
#undef AMX_FMT
#undef AMX_CALL
            }
        }
        _tile_release();
        free(wb);
        free(cbuf);
        tile_pad_free(pad);
    }
    free(codes);
    return !failed;
}
#pragma GCC pop_options

/* ---- dispatch --------------------------------------------------------------------------------- */
int hs_q8a_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case HS_Q8A_SCALAR: return 1;
        case HS_Q8A_EMULATED:
        case HS_Q8A_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case HS_Q8A_VNNI256:
            return hs_q8a_isa_supported(HS_Q8A_AVX2) &&
                   (__builtin_cpu_supports("avxvnni") ||
                    (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")));
        case HS_Q8A_AVX512VNNI:
            return hs_q8a_isa_supported(HS_Q8A_AVX2) && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
        case HS_Q8A_AMX:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("f16c") && amx_permitted();
        default: return 0;
    }
}

/* Rows from which HS_Q8A_AUTO runs a product on AMX where the CPU has it (0: never); set from Python
 * (hs_q8a_set_amx_rows) by what was measured on this machine. */
static int amx_rows_from = 0;

void hs_q8a_set_amx_rows(int rows) { __atomic_store_n(&amx_rows_from, rows, __ATOMIC_RELAXED); }

int hs_q8a_amx_rows(void) { return __atomic_load_n(&amx_rows_from, __ATOMIC_RELAXED); }

int hs_q8a_best_isa(void) {
    for (int isa = HS_Q8A_AVX512VNNI; isa > HS_Q8A_SCALAR; isa--)
        if (hs_q8a_isa_supported(isa)) return isa;
    return HS_Q8A_SCALAR;
}

/* The scalar path on x [T, K] float32 (quantized here into row-major scratch) or on q (x NULL). */
static int scalar_run(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, q8a_scratch q,
                      int64_t T, int64_t N, int64_t K, float *y, int parallel) {
    const int64_t nb = K / BLOCK;
    int8_t *own = NULL;
    if (x) {
        own = malloc((size_t)(T * K) + (size_t)(T * nb) * (2 * sizeof(float) + sizeof(int32_t)));
        if (!own) return 0;
        q.codes = own, q.dx = (float *)(own + T * K), q.dxs = q.dx + T * nb, q.sx = (int32_t *)(q.dxs + T * nb);
        hs_q8a_quantize(x, T, K, q.codes, q.dx, q.sx, q.dxs);
    }
    scalar_matmul(w, d, m, fmt, q.codes, q.dx, q.sx, q.dxs, T, N, K, y, parallel);
    free(own);
    return 1;
}

/* hs_q8a_matmul on path isa, x [T, K] quantized first where x is given (the SIMD paths do it inside
 * their own parallel region, the threads sharing the blocks), else q read. */
static int q8a_dispatch(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, q8a_scratch q,
                        int64_t T, int64_t N, int64_t K, float *y, int isa, int parallel) {
    if (isa == HS_Q8A_AUTO) {
        const int from = hs_q8a_amx_rows();
        isa = from > 0 && T >= from && hs_q8a_isa_supported(HS_Q8A_AMX) ? HS_Q8A_AMX : hs_q8a_best_isa();
    }
    if (!hs_q8a_isa_supported(isa)) return -1;
    int done = 1;
    switch (isa) {
        case HS_Q8A_AMX: done = amx_run(w, d, m, fmt, x, q, T, N, K, y, parallel); break;
        case HS_Q8A_AVX512VNNI: done = matmul_avx512vnni(w, d, m, fmt, x, q, T, N, K, y, parallel); break;
        case HS_Q8A_VNNI256:
            if (__builtin_cpu_supports("avxvnni"))
                done = matmul_avxvnni(w, d, m, fmt, x, q, T, N, K, y, parallel);
            else
                done = matmul_vl256(w, d, m, fmt, x, q, T, N, K, y, parallel);
            break;
        case HS_Q8A_AVX2: done = matmul_avx2(w, d, m, fmt, x, q, T, N, K, y, parallel); break;
        case HS_Q8A_EMULATED: done = matmul_emulated(w, d, m, fmt, x, q, T, N, K, y, parallel); break;
        default: done = scalar_run(fmt, w, d, m, x, q, T, N, K, y, parallel); break;
    }
    return done ? isa : -1;
}

/* y [T, N] float32 = x @ W^T for W of format fmt (HS_Q8A_Q4: w = qs, d, m; HS_Q8A_Q8: w = q, d, m unused)
 * and x given quantized (hs_q8a_quantize). isa: HS_Q8A_AUTO (the best this CPU has) or one path.
 * Returns the path that ran, or -1 when the CPU lacks the one asked for (nothing written) or scratch
 * memory could not be allocated (y incomplete). */
int hs_q8a_matmul(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const int8_t *codes, const float *dx,
                  const int32_t *sx, const float *dxs, int64_t T, int64_t N, int64_t K, float *y, int isa,
                  int parallel) {
    const q8a_scratch q = {(int8_t *)codes, (float *)dx, (int32_t *)sx, (float *)dxs};  /* (read only: x is NULL) */
    return q8a_dispatch(fmt, w, d, m, NULL, q, T, N, K, y, isa, parallel);
}

/* The same with x float32 [T, K], quantized by the kernel (hs_q8a_quantize's bits). */
int hs_q8a_matmul_f32(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                      int64_t N, int64_t K, float *y, int isa, int parallel) {
    const q8a_scratch none = {NULL, NULL, NULL, NULL};
    return q8a_dispatch(fmt, w, d, m, x, none, T, N, K, y, isa, parallel);
}

/* The arguments of hs_q4_matmul and hs_q8_matmul (gguf.c), on the best path this CPU has, for tiled
 * weights with float16 scales: the C++ layer op runs these in their place. x_bf: x is bfloat16 (each
 * value widened exactly to float32 first). */
void hs_q8a_q4_matmul(const uint8_t *qs, const uint16_t *d, const uint16_t *m, const float *x, int64_t T, int64_t N,
                      int64_t K, float *y, int parallel) {
    hs_q8a_matmul_f32(HS_Q8A_Q4, qs, d, m, x, T, N, K, y, HS_Q8A_AUTO, parallel);
}

void hs_q8a_q8_group_matmul(const int8_t *q, const uint16_t *d, int group, const void *x, int x_bf, int64_t T,
                            int64_t N, int64_t K, float *y, int parallel) {
    const int fmt = group == 16 ? HS_Q8A_Q8G16 : HS_Q8A_Q8;
    if (!x_bf) {
        hs_q8a_matmul_f32(fmt, (const uint8_t *)q, d, NULL, (const float *)x, T, N, K, y, HS_Q8A_AUTO, parallel);
        return;
    }
    float *xf = malloc((size_t)(T * K) * sizeof(float));
    if (!xf) return;
    for (int64_t i = 0; i < T * K; i++) {
        const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
        memcpy(xf + i, &bits, sizeof bits);
    }
    hs_q8a_matmul_f32(fmt, (const uint8_t *)q, d, NULL, xf, T, N, K, y, HS_Q8A_AUTO, parallel);
    free(xf);
}

void hs_q8a_q8_matmul(const int8_t *q, const uint16_t *d, const void *x, int x_bf, int64_t T, int64_t N, int64_t K,
                      float *y, int parallel) {
    hs_q8a_q8_group_matmul(q, d, 32, x, x_bf, T, N, K, y, parallel);
}

/* The q4 kernel's prompt-chunk product (gguf.c's hs_q4_panel_matmul: float32 panels, the same bits)
 * on tiled 4-bit weights: the rows (and float32 scales) put back in a scratch copy first (one pass
 * over W, as the panels' rebuild is). */
void hs_q8a_q4_panel_matmul(const uint8_t *qs, const uint16_t *d, const uint16_t *m, const float *x, int64_t T,
                            int64_t N, int64_t K, float *y, int parallel) {
    const int64_t nb = K / BLOCK;
    uint8_t *rows = malloc((size_t)(N * nb * 16));
    uint16_t *hr = malloc((size_t)(2 * N * nb) * sizeof(uint16_t));
    float *dr = malloc((size_t)(2 * N * nb) * sizeof(float));
    if (rows && hr && dr) {
        hs_q8a_tile(HS_Q8A_Q4, qs, d, m, N, K, rows, hr, hr + N * nb, 1);
        for (int64_t i = 0; i < 2 * N * nb; i++) dr[i] = half_to_float(hr[i]);
        hs_q4_panel_matmul(rows, dr, dr + N * nb, x, T, N, K, y, parallel);
    }
    free(rows);
    free(hr);
    free(dr);
}

#else /* ---- Q8A_BODY: one instruction set's kernel (VW lanes, TV vectors per tile, RT rows per pass) ---- */

#define COLS (VW * TV)
#if VW == 8
#define vi __m256i
#define vf __m256
#define V_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_STOREI(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define V_AND _mm256_and_si256
#define V_XOR _mm256_xor_si256
#define V_SRLI16 _mm256_srli_epi16
#define V_SET1_8 _mm256_set1_epi8
#define V_SET1_16 _mm256_set1_epi16
#define V_SET1_32 _mm256_set1_epi32
#define V_ZEROI _mm256_setzero_si256
#define V_ADD16 _mm256_add_epi16
#define V_ADD32 _mm256_add_epi32
#define V_MADDUBS _mm256_maddubs_epi16
#define V_MADD16 _mm256_madd_epi16
#define V_SIGN8 _mm256_sign_epi8
#define V_ABS8 _mm256_abs_epi8
#define V_DPBUSD DPBUSD256
#define V_ZEROF _mm256_setzero_ps
#define V_SET1F _mm256_set1_ps
#define V_LOADF _mm256_loadu_ps
#define V_LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))  /* float16 -> float32 */
#define V_CVT _mm256_cvtepi32_ps
#define V_MUL _mm256_mul_ps
#define V_ADDF _mm256_add_ps
#define V_FMA _mm256_fmadd_ps
static inline __attribute__((always_inline)) void FN(store_cols)(float *y, vf v, int n) {
    if (n >= VW) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float tmp[VW];
    _mm256_storeu_ps(tmp, v);
    for (int i = 0; i < n; i++) y[i] = tmp[i];
}
#else
#define vi __m512i
#define vf __m512
#define V_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define V_STOREI(p, v) _mm512_storeu_si512((void *)(p), v)
#define V_AND _mm512_and_si512
#define V_XOR _mm512_xor_si512
#define V_SRLI16 _mm512_srli_epi16
#define V_SET1_8 _mm512_set1_epi8
#define V_SET1_16 _mm512_set1_epi16
#define V_SET1_32 _mm512_set1_epi32
#define V_ZEROI _mm512_setzero_si512
#define V_ADD32 _mm512_add_epi32
#define V_DPBUSD _mm512_dpbusd_epi32
#define V_ZEROF _mm512_setzero_ps
#define V_SET1F _mm512_set1_ps
#define V_LOADF _mm512_loadu_ps
#define V_LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))  /* float16 -> float32 */
#define V_CVT _mm512_cvtepi32_ps
#define V_MUL _mm512_mul_ps
#define V_ADDF _mm512_add_ps
#define V_FMA _mm512_fmadd_ps
static inline __attribute__((always_inline)) void FN(store_cols)(float *y, vf v, int n) {
    if (n >= VW)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}
#endif

static inline __attribute__((always_inline)) vi FN(bcast)(const int8_t *p) {  /* 4 bytes in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return V_SET1_32(v);
}

/* Where vector v of block b of a tile (tw: its tiled bytes), part tv, is read: 4-bit: dword v % 4
 * (its low nibbles are codes 4v.. for v < 4, its high ones codes 16 + 4(v - 4)..); 8-bit: dword v. */
static inline __attribute__((always_inline)) const uint8_t *FN(wptr)(const uint8_t *tw, int64_t b, int v, int tv,
                                                                      const int fmt) {
    if (fmt == HS_Q8A_Q4) return tw + b * 4 * TILE * 4 + ((v & 3) * TILE + tv * VW) * 4;
    return tw + b * 8 * TILE * 4 + (v * TILE + tv * VW) * 4;  /* 8-bit, either group */
}

/* Codes 4v .. 4v+3 of each column from that vector (raw), as the kernel multiplies them (VNNI:
 * unsigned; AVX2 8-bit: their magnitudes, the signs read again where used). */
static inline __attribute__((always_inline)) vi FN(wcodes)(vi raw, int v, const int fmt) {
    if (fmt == HS_Q8A_Q4) return V_AND(v < 4 ? raw : V_SRLI16(raw, 4), V_SET1_8(15));
#if DP_VNNI
    return V_XOR(raw, V_SET1_8((char)0x80));  /* q + 128, unsigned */
#else
    return V_ABS8(raw);
#endif
}

/* R (<= RT, a constant after inlining) rows of a row group times a tile -> y[t, n0 .. n0 + ncols).
 * The group's activations are interleaved by row (xg: block b's dword v of row r at (b * 8 + v) * R + r;
 * dxg, dxsg, sxg: block b of row r at b * R + r; sxlg, HS_Q8A_Q8G16 only: the sum of the block's first
 * 16 codes, likewise), so that one pointer walks them all. HS_Q8A_Q8G16 runs each block as two halves
 * of 16 codes (vectors 0-3, 4-7), each with its own sum and weight scale (dbuf: [2 b + h][COLS]). While the first
 * pass runs, the same block of the next tile (next, or NULL) is prefetched into L2: the weight stream
 * runs one tile ahead of the products, spread over them. wbuf (256-bit paths with several passes):
 * the tile's expanded vectors, written by the first pass, read by the others (wbuf_read). */
static inline __attribute__((always_inline)) void FN(rows)(const uint8_t *tw, const uint8_t *next, vi *wbuf,
                                                           int wbuf_read, const uint16_t *dbuf, const uint16_t *mbuf,
                                                           const int8_t *xg, const float *dxg, const int32_t *sxg,
                                                           const int32_t *sxlg, const float *dxsg, int64_t K,
                                                           const int R, const int fmt, float *y, int64_t N, int ncols) {
    (void)sxg;
    (void)sxlg;
    (void)wbuf;
    (void)wbuf_read;
    const int64_t nb = K / BLOCK, bbytes = (fmt == HS_Q8A_Q4 ? 4 : 8) * TILE * 4;  /* a block's bytes in a tile */
    const int halves = fmt == HS_Q8A_Q8G16 ? 2 : 1, vh = 8 / halves;  /* sums per block, vectors per sum */
    vf acc[RT][TV], macc[RT][TV];
    for (int r = 0; r < R; r++)
        for (int tv = 0; tv < TV; tv++) acc[r][tv] = macc[r][tv] = V_ZEROF();
    for (int64_t b = 0; b < nb; b++) {
        if (next)
            for (int i = 0; i < bbytes; i += 64) __builtin_prefetch(next + b * bbytes + i, 0, 2);
        const int8_t *xb = xg + b * BLOCK * R;
#if VW == 16  /* 32 registers: the block's vectors loaded together (a burst of cache lines) */
        vi raw[8];
        for (int i = 0; i < (fmt == HS_Q8A_Q4 ? 4 : 8); i++) raw[i] = V_LOADI(FN(wptr)(tw, b, i, 0, fmt));
#endif
        for (int h = 0; h < halves; h++) {  /* HS_Q8A_Q8G16: the block's two halves in turn, else once */
            vi s[RT][TV];  /* the exact block sums (int32; AVX2 4-bit: 16-bit pairs until widened) */
            for (int r = 0; r < R; r++) {
                /* VNNI 8-bit: the codes are q + 128, so the sum starts at -128 times the half's x codes */
                const int32_t sxh = fmt == HS_Q8A_Q8G16 ? (h ? sxg[b * R + r] - sxlg[b * R + r] : sxlg[b * R + r])
                                                        : fmt == HS_Q8A_Q8 ? sxg[b * R + r] : 0;
                for (int tv = 0; tv < TV; tv++) s[r][tv] = DP_VNNI && fmt != HS_Q8A_Q4 ? V_SET1_32(-128 * sxh) : V_ZEROI();
            }
#pragma GCC unroll 8
            for (int v = h * vh; v < h * vh + vh; v++) {
                vi wv[TV];
                for (int tv = 0; tv < TV; tv++) {
#if VW == 16
                    wv[tv] = FN(wcodes)(raw[fmt == HS_Q8A_Q4 ? v & 3 : v], v, fmt);
#else
                    vi *kept = wbuf ? wbuf + (b * 8 + v) * TV + tv : NULL;
                    if (kept && wbuf_read) {
                        wv[tv] = V_LOADI(kept);
                    } else {
                        wv[tv] = FN(wcodes)(V_LOADI(FN(wptr)(tw, b, v, tv, fmt)), v, fmt);
                        if (kept) V_STOREI(kept, wv[tv]);
                    }
#endif
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const vi xv = FN(bcast)(xb + (v * R + r) * 4);
                    for (int tv = 0; tv < TV; tv++) {
#if DP_VNNI
                        s[r][tv] = V_DPBUSD(s[r][tv], wv[tv], xv);
#else
                        if (fmt == HS_Q8A_Q4)
                            s[r][tv] = V_ADD16(s[r][tv], V_MADDUBS(wv[tv], xv));
                        else {  /* the signs from the tile again (L1; registers are short on AVX2) */
                            const vi sx8 = V_SIGN8(xv, V_LOADI(FN(wptr)(tw, b, v, tv, fmt)));
                            s[r][tv] = V_ADD32(s[r][tv], V_MADD16(V_MADDUBS(wv[tv], sx8), V_SET1_16(1)));
                        }
#endif
                    }
                }
            }
            for (int tv = 0; tv < TV; tv++) {
                const vf dv = V_LOADH(dbuf + (b * halves + h) * COLS + tv * VW);
#if VW == 16
                const vf mv = fmt == HS_Q8A_Q4 ? V_LOADH(mbuf + b * COLS + tv * VW) : V_ZEROF();
#endif
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
#if !DP_VNNI
                    if (fmt == HS_Q8A_Q4) s[r][tv] = V_MADD16(s[r][tv], V_SET1_16(1));
#endif
                    const vf c = V_MUL(dv, V_SET1F(dxg[b * R + r]));
                    acc[r][tv] = V_FMA(V_CVT(s[r][tv]), c, acc[r][tv]);
#if VW == 16  /* 32 registers: the offsets' sums beside the products' */
                    if (fmt == HS_Q8A_Q4) macc[r][tv] = V_FMA(mv, V_SET1F(dxsg[b * R + r]), macc[r][tv]);
#endif
                }
            }
        }
    }
#if VW != 16  /* 16 registers: the offsets' sums in a loop of their own */
    if (fmt == HS_Q8A_Q4)
        for (int64_t b = 0; b < nb; b++)
            for (int tv = 0; tv < TV; tv++) {
                const vf mv = V_LOADH(mbuf + b * COLS + tv * VW);
                for (int r = 0; r < R; r++) macc[r][tv] = V_FMA(mv, V_SET1F(dxsg[b * R + r]), macc[r][tv]);
            }
#endif
    for (int r = 0; r < R; r++)
        for (int tv = 0; tv < TV; tv++) {
            const int n = ncols - tv * VW;
            if (n <= 0) break;
            const vf out = fmt == HS_Q8A_Q4 ? V_ADDF(acc[r][tv], macc[r][tv]) : acc[r][tv];
            FN(store_cols)(y + r * N + tv * VW, out, n);
        }
}

static inline __attribute__((always_inline)) int FN(run)(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                                          const int fmt, const float *x, q8a_scratch q, int64_t T,
                                                          int64_t N, int64_t K, float *y, int parallel) {
    const int64_t nb = K / BLOCK, row_bytes = nb * block_bytes(fmt), tiles = (N + COLS - 1) / COLS;
    const int64_t ns = nb * block_scales(fmt);  /* weight scales a column */
    const int avx2 = x ? cpu_avx2_fma() : 0, g16 = fmt == HS_Q8A_Q8G16;
    /* the activations in row groups (FN(rows)); x given: quantized straight into them, else the
     * row-major codes of q put in place; HS_Q8A_Q8G16: also each block's first 16 codes' sum (sxl) */
    int8_t *codes = malloc((size_t)(T * K) + (size_t)(T * nb) * (2 * sizeof(float) + (1 + g16) * sizeof(int32_t)));
    if (!codes) return 0;
    float *dx = (float *)(codes + T * K), *dxs = dx + T * nb;  /* (T * K: a multiple of 32) */
    int32_t *sx = (int32_t *)(dxs + T * nb), *sxl = g16 ? sx + T * nb : NULL;
    int failed = 0;  /* a thread's scratch could not be allocated: its tiles are not computed */
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < (T + RT - 1) / RT * nb; u++) {  /* block b of group g, in the groups' order */
            const int64_t g = u / nb, b = u % nb, R = T - g * RT < RT ? T - g * RT : RT;
            for (int64_t r = 0; r < R; r++) {
                const int64_t i = g * RT * nb + b * R + r, src_i = (g * RT + r) * nb + b;  /* group, row-major */
                int8_t tmp[BLOCK];
                const int8_t *src = x ? tmp : q.codes + src_i * BLOCK;
                if (x)
                    quantize_one(x + src_i * BLOCK, tmp, dx + i, sx + i, dxs + i, avx2);
                else
                    dx[i] = q.dx[src_i], sx[i] = q.sx[src_i], dxs[i] = q.dxs[src_i];
                if (g16) {
                    int32_t lo = 0;
                    for (int j = 0; j < 16; j++) lo += src[j];
                    sxl[i] = lo;
                }
                for (int v = 0; v < 8; v++) memcpy(codes + (g * RT * K + ((b * 8 + v) * R + r) * 4), src + 4 * v, 4);
            }
        }
        /* the last tile, when N is not a multiple of COLS: its columns (stored as rows) tiled here,
         * the missing ones zero (zero codes and scales; their outputs are not stored) */
        const tile_pad pad = tile_pad_new(N, row_bytes, nb, ns);
        /* 16 registers (VW 8) and several passes of rows: the first keeps the tile's expanded vectors
         * here for the others (32 registers: the others expand them again, from the cache) */
        vi *wbuf = VW == 8 && T > RT ? aligned_alloc(64, (size_t)(nb * 8 * TV) * sizeof(vi)) : NULL;
        const int ok = tile_pad_ok(pad, N) && (VW != 8 || T <= RT || wbuf);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) nowait /* the region's end is the barrier */
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (!ok) continue;
            const int64_t n0 = tile * COLS;
            const int ncols = (int)(N - n0 < COLS ? N - n0 : COLS);
            const uint8_t *tw = w + n0 * row_bytes;
            const uint16_t *dbuf = d + n0 * ns, *mbuf = fmt == HS_Q8A_Q4 ? m + n0 * nb : NULL;
            if (ncols < COLS) {  /* the stored rows of the last ncols columns, placed as in a full tile */
                pad_last_tile(fmt, tw, dbuf, mbuf, ncols, nb, ns, pad);
                tw = pad.w, dbuf = pad.d, mbuf = fmt == HS_Q8A_Q4 ? pad.m : NULL;
            }
            const uint8_t *next = tile + 1 < N / COLS ? w + (n0 + COLS) * row_bytes : NULL;
            for (int64_t t0 = 0; t0 < T; t0 += RT) {
                const uint8_t *ahead = t0 ? NULL : next;  /* the first pass prefetches */
                const int8_t *xg = codes + t0 * K;
                const float *dxg = dx + t0 * nb, *dxsg = dxs + t0 * nb;
                const int32_t *sxg = sx + t0 * nb, *sxlg = g16 ? sxl + t0 * nb : NULL;
                float *yt = y + t0 * N + n0;
                /* constant row counts keep the sums in registers; a constant format keeps its branches out of
                 * the loops (fmt is a variable in the outlined OpenMP body) */
#define ROWS_CALL(R)                                                                                          \
    if (fmt == HS_Q8A_Q4)                                                                                     \
        FN(rows)(tw, ahead, wbuf, t0 > 0, dbuf, mbuf, xg, dxg, sxg, sxlg, dxsg, K, R, HS_Q8A_Q4, yt, N, ncols);  \
    else if (fmt == HS_Q8A_Q8G16)                                                                             \
        FN(rows)(tw, ahead, wbuf, t0 > 0, dbuf, mbuf, xg, dxg, sxg, sxlg, dxsg, K, R, HS_Q8A_Q8G16, yt, N, ncols); \
    else                                                                                                      \
        FN(rows)(tw, ahead, wbuf, t0 > 0, dbuf, mbuf, xg, dxg, sxg, sxlg, dxsg, K, R, HS_Q8A_Q8, yt, N, ncols)
                switch (T - t0 < RT ? T - t0 : RT) {
#define ROWS_CASE(R) case R: ROWS_CALL(R); break;
                    ROWS_CASE(1)
                    ROWS_CASE(2)
                    ROWS_CASE(3)
#if RT > 4
                    ROWS_CASE(4)
                    ROWS_CASE(5)
                    ROWS_CASE(6)
                    ROWS_CASE(7)
#endif
                    default: ROWS_CALL(RT); break;
#undef ROWS_CASE
#undef ROWS_CALL
                }
            }
        }
        tile_pad_free(pad);
        free(wbuf);
    }
    free(codes);
    return !failed;
}

/* 1, or 0 when scratch memory could not be allocated (y not fully written) */
static int FN(matmul)(const uint8_t *w, const uint16_t *d, const uint16_t *m, const int fmt, const float *x,
                      q8a_scratch q, int64_t T, int64_t N, int64_t K, float *y, int parallel) {
    if (fmt == HS_Q8A_Q4) return FN(run)(w, d, m, HS_Q8A_Q4, x, q, T, N, K, y, parallel);
    if (fmt == HS_Q8A_Q8G16) return FN(run)(w, d, m, HS_Q8A_Q8G16, x, q, T, N, K, y, parallel);
    return FN(run)(w, d, m, HS_Q8A_Q8, x, q, T, N, K, y, parallel);
}

#undef COLS
#undef vi
#undef vf
#undef V_LOADI
#undef V_STOREI
#undef V_AND
#undef V_XOR
#undef V_SRLI16
#undef V_SET1_8
#undef V_SET1_16
#undef V_SET1_32
#undef V_ZEROI
#undef V_ADD16
#undef V_ADD32
#undef V_MADDUBS
#undef V_MADD16
#undef V_SIGN8
#undef V_ABS8
#undef V_DPBUSD
#undef V_ZEROF
#undef V_SET1F
#undef V_LOADF
#undef V_LOADH
#undef V_CVT
#undef V_MUL
#undef V_ADDF
#undef V_FMA
/* this instruction set's parameters, set by the block that included this body */
#undef ISA_NAME
#undef VW
#undef TV
#undef RT
#undef DP_VNNI
#undef DPBUSD256
#endif
