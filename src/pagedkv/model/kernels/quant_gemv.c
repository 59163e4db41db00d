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
 * Both functions return 0, or -1 for arguments they do not take (M outside 1..8, K not a
 * multiple of 32).
 */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_M 8
#define ROW_BLOCK 16

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One output row of the int4 product: M is a constant at each call site (see int4_rows), so
 * the compiler keeps the M accumulators in registers. */
static inline __attribute__((always_inline)) void int4_row(
    const int M, const uint8_t *qs, const float *scale, const float *min, const float *x,
    const float *xsum, int64_t K, int64_t G, int64_t N, int64_t n, float *out) {
    __m256 acc[MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    const uint8_t *row = qs + n * G * 16;
    const float *srow = scale + n * G;
    for (int64_t g = 0; g < G; g++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(row + g * 16));
        __m128i lo = _mm_and_si128(bytes, mask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        __m256 s = _mm256_broadcast_ss(srow + g);
        __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s);
        __m256 w1 = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s);
        __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s);
        __m256 w3 = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s);
        const float *xg = x + g * 32;
        for (int m = 0; m < M; m++) {
            const float *xm = xg + m * K;
            acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m]);
            acc[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m]);
            acc[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m]);
            acc[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m]);
        }
    }
    if (min != NULL) {
        /* sum_g min[n, g] * xsum[m, g], 8 groups at a time, then the rest */
        const float *mrow = min + n * G;
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 mv = _mm256_loadu_ps(mrow + g);
            for (int m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + m * G + g), acc[m]);
        }
        for (int m = 0; m < M; m++) {
            float tail = 0.0f;
            for (int64_t t = g; t < G; t++) tail += mrow[t] * xsum[m * G + t];
            out[m * N + n] = hsum(acc[m]) + tail;
        }
    } else {
        for (int m = 0; m < M; m++) out[m * N + n] = hsum(acc[m]);
    }
}

static void int4_rows(int M, const uint8_t *qs, const float *scale, const float *min,
                      const float *x, const float *xsum, int64_t K, int64_t N, int64_t n0,
                      int64_t n1, float *out) {
    const int64_t G = K / 32;
#define INT4_CASE(c)                                                                  \
    case c:                                                                           \
        for (int64_t n = n0; n < n1; n++)                                             \
            int4_row(c, qs, scale, min, x, xsum, K, G, N, n, out);                    \
        break;
    switch (M) {
        INT4_CASE(1)
        INT4_CASE(2)
        INT4_CASE(3)
        INT4_CASE(4)
        INT4_CASE(5)
        INT4_CASE(6)
        INT4_CASE(7)
        INT4_CASE(8)
    }
#undef INT4_CASE
}

int pagedkv_int4_gemm(const float *x, const uint8_t *qs, const float *scale, const float *min,
                      float *out, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_M || K % 32 != 0 || K <= 0 || N < 0) return -1;
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
        int4_rows((int)M, qs, scale, min, x, xsum, K, N, n0, n1, out);
    }
    free(xsum);
    return 0;
}

static inline __attribute__((always_inline)) void int8_row(
    const int M, const int8_t *q, const float *scale, const float *x, int64_t K, int64_t N,
    int64_t n, float *out) {
    __m256 acc[MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    const int8_t *row = q + n * K;
    for (int64_t k = 0; k < K; k += 32) {
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + k));
        __m128i b0 = _mm256_castsi256_si128(bytes);
        __m128i b1 = _mm256_extracti128_si256(bytes, 1);
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K + k;
            acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m]);
            acc[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m]);
            acc[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m]);
            acc[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m * N + n] = hsum(acc[m]) * scale[n];
}

static void int8_rows(int M, const int8_t *q, const float *scale, const float *x, int64_t K,
                      int64_t N, int64_t n0, int64_t n1, float *out) {
#define INT8_CASE(c)                                                                  \
    case c:                                                                           \
        for (int64_t n = n0; n < n1; n++) int8_row(c, q, scale, x, K, N, n, out);     \
        break;
    switch (M) {
        INT8_CASE(1)
        INT8_CASE(2)
        INT8_CASE(3)
        INT8_CASE(4)
        INT8_CASE(5)
        INT8_CASE(6)
        INT8_CASE(7)
        INT8_CASE(8)
    }
#undef INT8_CASE
}

int pagedkv_int8_gemm(const float *x, const int8_t *q, const float *scale, float *out,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_M || K % 32 != 0 || K <= 0 || N < 0) return -1;
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t n0 = b * ROW_BLOCK;
        int64_t n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        int8_rows((int)M, q, scale, x, K, N, n0, n1, out);
    }
    return 0;
}
