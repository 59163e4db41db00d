/* Weight-only quantized products for small steps (M <= 8 rows of activations), AVX2 + FMA.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k]          x fp32 [M, K], out fp32 [M, N]
 *
 * int4, groups of 32 input features (the GGUF Q4_0 / Q4_1 / Q4_K form, pagedkv's
 * QuantizedWeight):
 *
 *   w[n, 32 g + j] = q[n, 32 g + j] * scale[n, g] + min[n, g],   q in [0, 16)
 *
 *   qs    uint8 [N, G, 16]  byte j of group g holds element j in its low nibble and element
 *                           j + 16 in its high nibble (GGUF's order)
 *   scale fp32  [N, G]
 *   min   fp32  [N, G] or NULL
 *
 * so out[m, n] = sum_g scale[n, g] * (q[n, g, :] . x[m, g, :]) + sum_g min[n, g] * xsum[m, g],
 * with xsum[m, g] the sum of group g of row m, computed once per call: the min term is one dot
 * over G per output.
 *
 * int8, one scale per output row (the LM head):  w[n, k] = q[n, k] * scale[n], q int8.
 *
 * Each weight block is read and unpacked once and used for all M rows; accumulation in fp32
 * (8 lanes per row, summed at the end). Output rows run in parallel on OpenMP threads in
 * static blocks of ROW_BLOCK rows. Linked with -fopenmp and loaded into a process that has
 * torch's libgomp.so.1, this library uses the same OpenMP runtime (same soname), so its
 * threads are torch's.
 *
 * Each product has two bodies: AVX2 + FMA (8 lanes), and AVX-512 (F/BW/VL/DQ, 16 lanes: one
 * zero-extending load unpacks a group's 16 bytes, half the instructions per weight of the AVX2
 * unpacking). The caller picks one with `isa` (PAGEDKV_ISA_AVX2 or PAGEDKV_ISA_AVX512) from
 * what the CPU has with pagedkv.cpu_caps' holds applied; the AVX-512 body is compiled with a
 * target pragma, so the library builds with -mavx2 and never runs it on a CPU without it.
 * Both bodies sum in the same order per group (q . x, then times the group's scale); they
 * differ only by fp32 rounding of the partial sums.
 *
 * Both functions return 0, or -1 for arguments they do not take (M outside 1..8, K not a
 * multiple of 32, an unknown isa).
 */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant_gemv.h"

#define MAX_M 8
#define ROW_BLOCK 16

/* Independent FMA chains per activation row: an FMA's latency is 4-5 cycles and two issue per
 * cycle, so one row needs several accumulators in flight; 8 rows already give 8 chains. */
#define CHAINS(M) ((M) == 1 ? 4 : (M) <= 4 ? 2 : 1)

/* acc[j % A] += w_j * x[8 j .. 8 j + 8) for the 32 elements of a block. */
#define FMA4(acc, A, w0, w1, w2, w3, xm)                                          \
    do {                                                                         \
        (acc)[0] = _mm256_fmadd_ps((w0), _mm256_loadu_ps((xm)), (acc)[0]);       \
        (acc)[1 % (A)] = _mm256_fmadd_ps((w1), _mm256_loadu_ps((xm) + 8), (acc)[1 % (A)]);  \
        (acc)[2 % (A)] = _mm256_fmadd_ps((w2), _mm256_loadu_ps((xm) + 16), (acc)[2 % (A)]); \
        (acc)[3 % (A)] = _mm256_fmadd_ps((w3), _mm256_loadu_ps((xm) + 24), (acc)[3 % (A)]); \
    } while (0)

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 nibbles of a group as 4 x 8 floats, element order: one 16-byte load broadcast to both
 * lanes, a byte shuffle that puts bytes 0-7 / 8-15 each in the low byte of a 32-bit lane, then
 * the low nibble (and 0x0F) or the high one (shift by 4) and an int-to-float conversion. */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *bytes,
                                                               __m256 q[4]) {
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1,
                                           -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1,
                                           7, -1, -1, -1);
    const __m256i second = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11,
                                            -1, -1, -1, 12, -1, -1, -1, 13, -1, -1, -1, 14, -1,
                                            -1, -1, 15, -1, -1, -1);
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    __m256i e0 = _mm256_shuffle_epi8(b, first);
    __m256i e1 = _mm256_shuffle_epi8(b, second);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(e0, low));  /* elements 0-7 */
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(e1, low));  /* 8-15 */
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4));   /* 16-23 */
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4));   /* 24-31 */
}

/* q . x over one group of 32 (two chains, then one add). */
static inline __attribute__((always_inline)) __m256 group_dot(const __m256 q[4], const float *x) {
    __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
    __m256 t1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(x + 8));
    t0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), t0);
    t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), t1);
    return _mm256_add_ps(t0, t1);
}

/* One output row of the int4 product: M is a constant at each call site (see int4_rows), so
 * the compiler keeps the accumulators in registers. Each group's q . x is scaled once
 * (acc += scale * (q . x)); with few rows, even and odd groups go to two accumulators so that
 * the FMA's latency does not bound the loop. */
static inline __attribute__((always_inline)) void int4_row(
    const int M, const uint8_t *qs, const float *scale, const float *min, const float *x,
    const float *xsum, int64_t K, int64_t G, int64_t N, int64_t n, float *out) {
    const int A = M <= 4 ? 2 : 1;
    __m256 acc[MAX_M][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const uint8_t *row = qs + n * G * 16;
    const float *srow = scale + n * G;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        __m256 q[4], r[4];
        unpack_group(row + g * 16, q);
        unpack_group(row + g * 16 + 16, r);
        __m256 s0 = _mm256_broadcast_ss(srow + g);
        __m256 s1 = _mm256_broadcast_ss(srow + g + 1);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K + g * 32;
            acc[m][0] = _mm256_fmadd_ps(s0, group_dot(q, xm), acc[m][0]);
            acc[m][A - 1] = _mm256_fmadd_ps(s1, group_dot(r, xm + 32), acc[m][A - 1]);
        }
    }
    if (g < G) {
        __m256 q[4];
        unpack_group(row + g * 16, q);
        __m256 s0 = _mm256_broadcast_ss(srow + g);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm256_fmadd_ps(s0, group_dot(q, x + m * K + g * 32), acc[m][0]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][1]);
    if (min != NULL) {
        /* sum_g min[n, g] * xsum[m, g], 8 groups at a time, then the rest */
        const float *mrow = min + n * G;
        g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 mv = _mm256_loadu_ps(mrow + g);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[m][0] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + m * G + g), acc[m][0]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            float tail = 0.0f;
            for (int64_t t = g; t < G; t++) tail += mrow[t] * xsum[m * G + t];
            out[m * N + n] = hsum(acc[m][0]) + tail;
        }
    } else {
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) out[m * N + n] = hsum(acc[m][0]);
    }
}

static void int4_rows(int M, const uint8_t *qs, const float *scale, const float *min,
                      const float *x, const float *xsum, int64_t K, int64_t N, int64_t n0,
                      int64_t n1, float *out) {
    const int64_t G = K / 32;
    FOR_ROWS(int4_row, M, qs, scale, min, x, xsum, K, G, N);
}

/* ---- AVX-512 bodies (F/BW/VL/DQ); see the header comment ------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

/* A group's 32 nibbles as 2 x 16 floats (elements 0-15 from the low nibbles, 16-31 from the
 * high ones): one zero-extending load of the 16 bytes, a mask, a shift, two conversions. */
static inline __attribute__((always_inline)) void unpack_group512(const uint8_t *bytes,
                                                                  __m512 q[2]) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(e, _mm512_set1_epi32(0x0F)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(e, 4));
}

static inline __attribute__((always_inline)) __m512 group_dot512(const __m512 q[2],
                                                                 const float *x) {
    return _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16),
                           _mm512_mul_ps(q[0], _mm512_loadu_ps(x)));
}

static inline __attribute__((always_inline)) void int4_row512(
    const int M, const uint8_t *qs, const float *scale, const float *min, const float *x,
    const float *xsum, int64_t K, int64_t G, int64_t N, int64_t n, float *out) {
    const int A = M <= 4 ? 2 : 1;
    __m512 acc[MAX_M][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint8_t *row = qs + n * G * 16;
    const float *srow = scale + n * G;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        __m512 q[2], r[2];
        unpack_group512(row + g * 16, q);
        unpack_group512(row + g * 16 + 16, r);
        const __m512 s0 = _mm512_set1_ps(srow[g]);
        const __m512 s1 = _mm512_set1_ps(srow[g + 1]);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K + g * 32;
            acc[m][0] = _mm512_fmadd_ps(s0, group_dot512(q, xm), acc[m][0]);
            acc[m][A - 1] = _mm512_fmadd_ps(s1, group_dot512(r, xm + 32), acc[m][A - 1]);
        }
    }
    if (g < G) {
        __m512 q[2];
        unpack_group512(row + g * 16, q);
        const __m512 s0 = _mm512_set1_ps(srow[g]);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_fmadd_ps(s0, group_dot512(q, x + m * K + g * 32), acc[m][0]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][1]);
    if (min != NULL) {
        /* sum_g min[n, g] * xsum[m, g]: 16 groups at a time, the rest under a mask */
        const float *mrow = min + n * G;
        for (g = 0; g < G; g += 16) {
            const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
            const __m512 mv = _mm512_maskz_loadu_ps(k, mrow + g);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[m][0] =
                    _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xsum + m * G + g), acc[m][0]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) out[m * N + n] = _mm512_reduce_add_ps(acc[m][0]);
}

static __attribute__((noinline)) void int4_rows512(int M, const uint8_t *qs, const float *scale,
                                                   const float *min, const float *x,
                                                   const float *xsum, int64_t K, int64_t N,
                                                   int64_t n0, int64_t n1, float *out) {
    const int64_t G = K / 32;
    FOR_ROWS(int4_row512, M, qs, scale, min, x, xsum, K, G, N);
}

static inline __attribute__((always_inline)) void int8_row512(
    const int M, const int8_t *q, const float *scale, const float *x, int64_t K, int64_t N,
    int64_t n, float *out) {
    const int A = M == 1 ? 4 : 2;
    __m512 acc[MAX_M][4];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
#pragma GCC unroll 8
        for (int a = 0; a < A; a++) acc[m][a] = _mm512_setzero_ps();
    const int8_t *row = q + n * K;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
            w[t] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16 * t))));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K + k;
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++)
                acc[m][t % A] = _mm512_fmadd_ps(w[t], _mm512_loadu_ps(xm + 16 * t), acc[m][t % A]);
        }
    }
    if (k < K) { /* K is a multiple of 32: one last half */
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k))));
        __m512 w1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16))));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc[m][0]);
            acc[m][1 % A] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc[m][1 % A]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
#pragma GCC unroll 8
        for (int a = 1; a < A; a++) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][a]);
        out[m * N + n] = _mm512_reduce_add_ps(acc[m][0]) * scale[n];
    }
}

static __attribute__((noinline)) void int8_rows512(int M, const int8_t *q, const float *scale,
                                                   const float *x, int64_t K, int64_t N,
                                                   int64_t n0, int64_t n1, float *out) {
    FOR_ROWS(int8_row512, M, q, scale, x, K, N);
}

#pragma GCC pop_options


int pagedkv_int4_gemm(const float *x, const uint8_t *qs, const float *scale, const float *min,
                      float *out, int64_t M, int64_t N, int64_t K, int num_threads, int isa) {
    return pagedkv_int4_gemm_ld(x, qs, scale, min, out, M, N, K, N, num_threads, isa);
}

int pagedkv_int4_gemm_ld(const float *x, const uint8_t *qs, const float *scale,
                         const float *min, float *out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int num_threads, int isa) {
    if (M < 1 || M > MAX_M || K % 32 != 0 || K <= 0 || N < 0 || ldo < N) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512) return -1;
    const int64_t G = K / 32;
    float *xsum = NULL;
    if (min != NULL) {
        xsum = (float *)malloc(sizeof(float) * M * G);
        if (xsum == NULL) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < G; g++) {
                const float *xg = x + m * K + g * 32;
                __m256 s = _mm256_add_ps(
                    _mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                    _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
                xsum[m * G + g] = hsum(s);
            }
    }
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * ROW_BLOCK;
        int64_t n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        /* the rows' "N" is only the output's row stride */
        if (isa == PAGEDKV_ISA_AVX512)
            int4_rows512((int)M, qs, scale, min, x, xsum, K, ldo, n0, n1, out);
        else
            int4_rows((int)M, qs, scale, min, x, xsum, K, ldo, n0, n1, out);
    }
    free(xsum);
    return 0;
}

static inline __attribute__((always_inline)) void int8_row(
    const int M, const int8_t *q, const float *scale, const float *x, int64_t K, int64_t N,
    int64_t n, float *out) {
    const int A = CHAINS(M);
    __m256 acc[MAX_M][4];
    #pragma GCC unroll 8
    for (int m = 0; m < M; m++)
        #pragma GCC unroll 8
        for (int a = 0; a < A; a++) acc[m][a] = _mm256_setzero_ps();
    const int8_t *row = q + n * K;
    for (int64_t k = 0; k < K; k += 32) {
        /* sign-extending loads of 8 bytes each (one load-and-widen instruction apiece) */
        const int8_t *b = row + k;
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b)));
        __m256 w1 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8))));
        __m256 w2 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16))));
        __m256 w3 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 24))));
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) FMA4(acc[m], A, w0, w1, w2, w3, x + m * K + k);
    }
    #pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        #pragma GCC unroll 8
        for (int a = 1; a < A; a++) acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][a]);
        out[m * N + n] = hsum(acc[m][0]) * scale[n];
    }
}

static void int8_rows(int M, const int8_t *q, const float *scale, const float *x, int64_t K,
                      int64_t N, int64_t n0, int64_t n1, float *out) {
    FOR_ROWS(int8_row, M, q, scale, x, K, N);
}

int pagedkv_int8_gemm(const float *x, const int8_t *q, const float *scale, float *out,
                      int64_t M, int64_t N, int64_t K, int num_threads, int isa) {
    if (M < 1 || M > MAX_M || K % 32 != 0 || K <= 0 || N < 0) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512) return -1;
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * ROW_BLOCK;
        int64_t n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        if (isa == PAGEDKV_ISA_AVX512)
            int8_rows512((int)M, q, scale, x, K, N, n0, n1, out);
        else
            int8_rows((int)M, q, scale, x, K, N, n0, n1, out);
    }
    return 0;
}
