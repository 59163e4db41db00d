/* Products, dequantization and row lookup on GGUF tensors as the file stores them.
 *
 * A GGUF weight W [N, K] is N rows, each K / E consecutive blocks of B bytes (E elements per
 * block). Nothing is repacked: the functions here read those bytes (possibly a read-only mmap
 * of the file) and never write them. The block layouts, in pagedkv's words (f16 = IEEE half,
 * little-endian; "nibble" = 4 bits; element i of a block is weight K-index block_start + i):
 *
 *   F32   E 1, B 4     the float itself
 *   F16   E 1, B 2     a half
 *   BF16  E 1, B 2     the top 16 bits of a float (the rest zero)
 *   Q4_0  E 32, B 18   f16 d; 16 bytes: byte i holds element i in its low nibble, element
 *                      i + 16 in its high nibble                       w = d * (q - 8)
 *   Q4_1  E 32, B 20   f16 d, f16 m; 16 bytes of nibbles as Q4_0       w = d * q + m
 *   Q5_0  E 32, B 22   f16 d; 4 bytes qh (a little-endian word: bit i is the fifth bit of
 *                      element i); 16 bytes of nibbles as Q4_0         w = d * (q - 16)
 *   Q5_1  E 32, B 24   f16 d, f16 m; qh; 16 bytes of nibbles           w = d * q + m
 *   Q8_0  E 32, B 34   f16 d; 32 int8                                  w = d * q
 *   Q4_K  E 256, B 144 a super-block of 8 groups of 32: f16 d, f16 dmin; 12 bytes of eight
 *                      6-bit scales sc[j] and eight 6-bit mins m[j] (below); 128 bytes: bytes
 *                      32 c .. 32 c + 31 hold group 2 c in their low nibbles and group 2 c + 1
 *                      in their high ones                 w = (d * sc[j]) * q - (dmin * m[j])
 *   Q5_K  E 256, B 176 f16 d, f16 dmin; the 12 scale bytes; 32 bytes qh (bit j of byte i is
 *                      the fifth bit of element i of group j); 128 bytes of nibbles as Q4_K;
 *                      w as Q4_K
 *   Q6_K  E 256, B 210 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d. Two halves of 128
 *                      elements; element r of half h: its low 4 bits are the low (r < 64) or
 *                      high (r >= 64) nibble of ql[64 h + r % 64], its top 2 bits are bits
 *                      2 (r / 32) .. of qh[32 h + r % 32]; 16 elements share a scale:
 *                      w = (d * scale[e / 16]) * (q - 32), e = 128 h + r
 *
 * The 12 scale bytes of Q4_K / Q5_K, as three little-endian words w0, w1, w2: byte b of w0
 * holds sc[b] in its low 6 bits, byte b of w1 m[b]; sc[4 + b] is the low nibble of byte b of
 * w2 with the top 2 bits of byte b of w0 above it, m[4 + b] the high nibble of that byte of w2
 * with the top 2 bits of byte b of w1 above it.
 *
 * Each weight of the dequantized tensor is computed in fp32 in the order gguf.quants'
 * reference dequantizer computes it (a product rounded, then a sum rounded), so that
 * pagedkv_gguf_dequant and pagedkv_gguf_get_rows are bit-identical to it; the file is
 * compiled with floating-point contraction off so that the compiler does not fuse those into
 * one rounding. The products use explicit fused multiply-adds where they are faster (the
 * weight's own d * q + m, and the accumulation).
 *
 * The vector code is written once (gguf_blocks_isa.h) and compiled twice: an AVX2 + FMA +
 * F16C body (8 lanes) and an AVX-512 F/BW/VL/DQ one (16 lanes), each under a target pragma;
 * the product takes the caller's `isa`, dequantization and lookup always run the AVX2 body
 * (their results are exact, the same on both).
 */

#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemv.h"

#define MAX_M 8
#define ROW_BLOCK 16
/* software prefetch distance of the products' weight stream, in bytes */
#define PF_BYTES 1024
#define AI __attribute__((always_inline))
/* independent accumulator chains per activation row (see quant_gemv.c's CHAINS) */
#define CHAINS(M) ((M) == 1 ? 4 : (M) <= 4 ? 2 : 1)
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

enum {
    GGML_F32 = 0,
    GGML_F16 = 1,
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
    GGML_BF16 = 30,
};

int pagedkv_gguf_block(int type, int64_t *block_elems, int64_t *block_bytes) {
    int64_t e, b;
    switch (type) {
        case GGML_F32: e = 1, b = 4; break;
        case GGML_F16: e = 1, b = 2; break;
        case GGML_BF16: e = 1, b = 2; break;
        case GGML_Q4_0: e = 32, b = 18; break;
        case GGML_Q4_1: e = 32, b = 20; break;
        case GGML_Q5_0: e = 32, b = 22; break;
        case GGML_Q5_1: e = 32, b = 24; break;
        case GGML_Q8_0: e = 32, b = 34; break;
        case GGML_Q4_K: e = 256, b = 144; break;
        case GGML_Q5_K: e = 256, b = 176; break;
        case GGML_Q6_K: e = 256, b = 210; break;
        default: return -1;
    }
    if (block_elems != NULL) *block_elems = e;
    if (block_bytes != NULL) *block_bytes = b;
    return 0;
}

/* ---- scalar helpers and the super-blocks' scales (AVX2 + F16C, used by both bodies) ----- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline AI float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline AI float f32_at(const uint8_t *row, int64_t k) {
    float f;
    memcpy(&f, row + 4 * k, 4);
    return f;
}

static inline AI float f16_at(const uint8_t *row, int64_t k) { return f16_to_f32(row + 2 * k); }

static inline AI float bf16_at(const uint8_t *row, int64_t k) {
    uint16_t h;
    memcpy(&h, row + 2 * k, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* fp32 -> bf16 bits, rounded to nearest even (finite values; NaN is not special-cased) */
static inline AI uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Q4_K / Q5_K: D[j] = d * sc[j], DM[j] = dmin * m[j] (fp32 products, as gguf.quants). Stored
 * to memory: a group's broadcast of D[j] is then a load, not a shuffle (shuffles are what the
 * AVX-512 table lookups are short of). */
static inline AI void prep_q4_k(const uint8_t *blk, float *D, float *DM) {
    uint32_t w0, w1, w2;
    memcpy(&w0, blk + 4, 4);
    memcpy(&w1, blk + 8, 4);
    memcpy(&w2, blk + 12, 4);
    const uint32_t sc_lo = w0 & 0x3F3F3F3Fu, m_lo = w1 & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo)));
    _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(blk)), sc));
    _mm256_storeu_ps(DM, _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(blk + 2)), mn));
}

/* Q6_K: D[i] = d * scale[i] for the 16 int8 scales, D32[i] = 32 D[i] (exact) */
static inline AI void prep_q6_k(const uint8_t *blk, float *D, float *D32) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(blk + 208));
    const __m128i s = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256 d0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
    const __m256 d1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))));
    _mm256_storeu_ps(D, d0);
    _mm256_storeu_ps(D + 8, d1);
    _mm256_storeu_ps(D32, _mm256_mul_ps(d0, _mm256_set1_ps(32.0f)));
    _mm256_storeu_ps(D32 + 8, _mm256_mul_ps(d1, _mm256_set1_ps(32.0f)));
}

/* the sum of 32 floats (x's group sums of the Q4_K / Q5_K products) */
static float sum32(const float *x) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* ---- the AVX2 body -------------------------------------------------------------------- */
#define SFX(name) name##_avx2
#define VL 8
#define VF __m256
#define VI __m256i
#define ZERO() _mm256_setzero_ps()
#define SET1(f) _mm256_set1_ps(f)
#define LOADF(p) _mm256_loadu_ps(p)
#define STOREF(p, v) _mm256_storeu_ps((p), (v))
#define MUL(a, b) _mm256_mul_ps((a), (b))
#define ADD(a, b) _mm256_add_ps((a), (b))
#define SUB(a, b) _mm256_sub_ps((a), (b))
#define FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define FMSUB(a, b, c) _mm256_fmsub_ps((a), (b), (c))
#define CVT(i) _mm256_cvtepi32_ps(i)
#define U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define ANDI(a, c) _mm256_and_si256((a), _mm256_set1_epi32(c))
#define ORI(a, b) _mm256_or_si256((a), (b))
#define OR_AND(a, b, c) _mm256_or_si256((a), _mm256_and_si256((b), _mm256_set1_epi32(c)))
#define SUBI(a, c) _mm256_sub_epi32((a), _mm256_set1_epi32(c))
#define SRLI(a, n) _mm256_srli_epi32((a), (n))
#define SLLI(a, n) _mm256_slli_epi32((a), (n))
#define SRLV(a, n) _mm256_srl_epi32((a), _mm_cvtsi32_si128(n))
/* 16 in the lanes whose element (e0 + lane) has its bit set in qh, else 0 */
#define QH16(qh, e0)                                                                        \
    SLLI(ANDI(_mm256_srlv_epi32(_mm256_set1_epi32((int)(qh)),                               \
                                _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),  \
                                                 _mm256_set1_epi32(e0))),                  \
              1),                                                                           \
         4)
#define F16X(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define BF16X(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define HSUM(v) hsum8(v)
#define FNMADD8(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define NIBF(b, high) CVT((high) ? SRLI((b), 4) : ANDI((b), 0x0F))
#define STORE_BF16(p, v) store_bf16_8((p), (v))
#define DEQUANT_BODY 1

static inline AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 floats -> 8 bf16, rounded to nearest even */
static inline AI void store_bf16_8(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

#include "gguf_blocks_isa.h"

#undef SFX
#undef VL
#undef VF
#undef VI
#undef ZERO
#undef SET1
#undef LOADF
#undef STOREF
#undef MUL
#undef ADD
#undef SUB
#undef FMA
#undef FMSUB
#undef CVT
#undef U8
#undef I8
#undef ANDI
#undef ORI
#undef OR_AND
#undef SUBI
#undef SRLI
#undef SLLI
#undef SRLV
#undef QH16
#undef F16X
#undef BF16X
#undef HSUM
#undef FNMADD8
#undef NIBF
#undef STORE_BF16
#undef DEQUANT_BODY

#pragma GCC pop_options

/* ---- the AVX-512 body (products only) ------------------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

#define SFX(name) name##_avx512
#define VL 16
#define VF __m512
#define VI __m512i
#define ZERO() _mm512_setzero_ps()
#define SET1(f) _mm512_set1_ps(f)
#define LOADF(p) _mm512_loadu_ps(p)
#define STOREF(p, v) _mm512_storeu_ps((p), (v))
#define MUL(a, b) _mm512_mul_ps((a), (b))
#define ADD(a, b) _mm512_add_ps((a), (b))
#define SUB(a, b) _mm512_sub_ps((a), (b))
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define FMSUB(a, b, c) _mm512_fmsub_ps((a), (b), (c))
#define CVT(i) _mm512_cvtepi32_ps(i)
#define U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define ANDI(a, c) _mm512_and_si512((a), _mm512_set1_epi32(c))
#define ORI(a, b) _mm512_or_si512((a), (b))
/* a | (b & c) in one ternary-logic instruction */
#define OR_AND(a, b, c) _mm512_ternarylogic_epi32((a), (b), _mm512_set1_epi32(c), 0xF8)
#define SUBI(a, c) _mm512_sub_epi32((a), _mm512_set1_epi32(c))
#define SRLI(a, n) _mm512_srli_epi32((a), (n))
#define SLLI(a, n) _mm512_slli_epi32((a), (n))
#define SRLV(a, n) _mm512_srl_epi32((a), _mm_cvtsi32_si128(n))
#define QH16(qh, e0) _mm512_maskz_mov_epi32((__mmask16)((qh) >> (e0)), _mm512_set1_epi32(16))
#define F16X(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define BF16X(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define HSUM(v) _mm512_reduce_add_ps(v)
/* an 8-lane multiply-add into the low half of a 16-lane accumulator */
#define FNMADD8(a, b, c) \
    _mm512_fnmadd_ps(_mm512_zextps256_ps512(a), _mm512_zextps256_ps512(b), (c))
/* nibbles as floats by a lookup in 0..15 (the permute reads only the low 4 bits) */
#define NIBF(b, high) _mm512_permutexvar_ps((high) ? SRLI((b), 4) : (b), IOTA)
#define DEQUANT_BODY 0

#include "gguf_blocks_isa.h"

#pragma GCC pop_options

/* ---- entry points ---------------------------------------------------------------------- */

int pagedkv_gguf_gemm(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                      int64_t N, int64_t K, int num_threads, int isa) {
    return pagedkv_gguf_gemm_ld(type, x, w, out, M, N, K, N, num_threads, isa);
}

int pagedkv_gguf_gemm_ld(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                         int64_t N, int64_t K, int64_t ldo, int num_threads, int isa) {
    int64_t E, B;
    if (pagedkv_gguf_block(type, &E, &B)) return -1;
    if (M < 1 || M > MAX_M || K <= 0 || K % E != 0 || N < 0 || ldo < N) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512) return -1;
    /* Q4_K / Q5_K: the sums of x over each group of 32, [M, K / 32] */
    float *xsum = NULL;
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        const int64_t G = K / 32;
        xsum = (float *)malloc(sizeof(float) * M * G);
        if (xsum == NULL) return -1;
        for (int64_t i = 0; i < M * G; i++) xsum[i] = sum32(x + i * 32);
    }
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * ROW_BLOCK, n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        if (isa == PAGEDKV_ISA_AVX512)
            gemm_rows_avx512(type, (int)M, w, x, xsum, K, ldo, n0, n1, out);
        else
            gemm_rows_avx2(type, (int)M, w, x, xsum, K, ldo, n0, n1, out);
    }
    free(xsum);
    return 0;
}

int pagedkv_gguf_dequant(int type, const uint8_t *w, int64_t row_start, int64_t num_rows,
                         int64_t K, void *out, int out_bf16, int num_threads) {
    int64_t E, B;
    if (pagedkv_gguf_block(type, &E, &B)) return -1;
    if (K <= 0 || K % E != 0 || row_start < 0 || num_rows < 0) return -1;
    if (out_bf16 != 0 && out_bf16 != 1) return -1;
    const int64_t row_bytes = K / E * B, out_bytes = K * (out_bf16 ? 2 : 4);
    /* below about 64 K elements the threads cost more than they save */
    const int threads = num_rows * K >= 65536 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < num_rows; r++)
        dequant_row_avx2(type, w + (row_start + r) * row_bytes, K, (uint8_t *)out + r * out_bytes,
                         out_bf16);
    return 0;
}

int pagedkv_gguf_get_rows(int type, const uint8_t *w, const int64_t *ids, int64_t num_ids,
                          int64_t N, int64_t K, float *out) {
    int64_t E, B;
    if (pagedkv_gguf_block(type, &E, &B)) return -1;
    if (K <= 0 || K % E != 0 || num_ids < 0) return -1;
    for (int64_t i = 0; i < num_ids; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1; /* before anything is written */
    const int64_t row_bytes = K / E * B;
    for (int64_t i = 0; i < num_ids; i++)
        dequant_row_avx2(type, w + ids[i] * row_bytes, K, out + i * K, 0);
    return 0;
}
