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
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_gemv.h"

#define MAX_M 8
#define ROW_BLOCK 16
/* software prefetch distance of the products' weight stream, in bytes: 4096 read the weights
 * of a decode step's products from memory 5-10% faster than 1024 on a 2-core Zen 4 (M = 1,
 * weights on huge pages; 8192 the same as 4096), a 3B decode step 1-3% faster */
#define PF_BYTES 4096
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
    /* pagedkv's own layouts of a file's blocks, made at load (pagedkv_gguf_interleave) */
    GGML_Q4_0_X8 = 0x102,
    GGML_Q4_1_X8 = 0x103,
};

/* Whether a type is one of the 8-row interleaved layouts (see pagedkv_gguf_interleave) */
static inline int is_x8(int type) { return type == GGML_Q4_0_X8 || type == GGML_Q4_1_X8; }

int pagedkv_gguf_block(int type, int64_t *block_elems, int64_t *block_bytes) {
    int64_t e, b;
    switch (type) {
        case GGML_F32: e = 1, b = 4; break;
        case GGML_F16: e = 1, b = 2; break;
        case GGML_BF16: e = 1, b = 2; break;
        case GGML_Q4_0: e = 32, b = 18; break;
        case GGML_Q4_1: e = 32, b = 20; break;
        case GGML_Q4_0_X8: e = 32, b = 18; break;
        case GGML_Q4_1_X8: e = 32, b = 20; break;
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

/* This OpenMP thread's share of a scratch of `bytes` bytes a thread at base */
static inline uint8_t *thread_scratch(uint8_t *base, int64_t bytes) {
#ifdef _OPENMP
    return base + bytes * omp_get_thread_num();
#else
    (void)bytes;
    return base;
#endif
}

/* ---- the 8-row interleaved layouts' blocks in the file's layout ---------------------------- */
static inline const uint8_t *x8_group(int64_t n, int64_t g, int64_t row_bytes, int64_t BB,
                                         const uint8_t *w) {
    return w + (n / 8) * 8 * row_bytes + g * 8 * BB;
}

/* Row n's block g in the file's layout (BB bytes) into raw, from the interleaved w */
static inline void x8_raw_block(int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                                int64_t g, uint8_t *raw) {
    const int q41 = type == GGML_Q4_1_X8, BB = q41 ? 20 : 18, r = (int)(n % 8);
    const uint8_t *grp = x8_group(n, g, row_bytes, BB, w);
    memcpy(raw, grp + 128 + 2 * r, 2);
    if (q41) memcpy(raw + 2, grp + 144 + 2 * r, 2);
    uint8_t *q = raw + (q41 ? 4 : 2);
    for (int j = 0; j < 4; j++) memcpy(q + 4 * j, grp + 32 * j + 4 * r, 4);
}

/* Row n of the interleaved w in the file's layout (K / 32 blocks) into raw */
static void x8_raw_row(int type, const uint8_t *w, int64_t K, int64_t n, uint8_t *raw) {
    const int64_t BB = type == GGML_Q4_1_X8 ? 20 : 18, G = K / 32;
    for (int64_t g = 0; g < G; g++) x8_raw_block(type, w, G * BB, n, g, raw + g * BB);
}

/* Lay out the N rows of a Q4_0 / Q4_1 weight w [N, K / 32 * B bytes] in place as its
 * interleaved type (Q4_0_X8, Q4_1_X8; the layout above the X8 products below), a band of 8 rows
 * at a time through a scratch of one band. N must be a multiple of 8. Returns the new type, or
 * -1 (a type without such a layout, a bad size, or an allocation failure: w is then unchanged;
 * a failure past the first band cannot happen, the scratch is taken before). */
int pagedkv_gguf_interleave(int type, uint8_t *w, int64_t N, int64_t K, int num_threads) {
    if (type != GGML_Q4_0 && type != GGML_Q4_1) return -1;
    if (N < 0 || N % 8 != 0 || K <= 0 || K % 32 != 0) return -1;
    const int q41 = type == GGML_Q4_1, BB = q41 ? 20 : 18;
    const int64_t G = K / 32, row_bytes = G * BB, band_bytes = 8 * row_bytes, bands = N / 8;
    const int threads = bands < num_threads ? (int)(bands > 0 ? bands : 1) : num_threads;
    uint8_t *scratch = (uint8_t *)malloc((size_t)(band_bytes * threads));
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *tmp = thread_scratch(scratch, band_bytes);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < bands; t++) {
            uint8_t *band = w + t * band_bytes;
            memcpy(tmp, band, (size_t)band_bytes);
            for (int64_t g = 0; g < G; g++) {
                uint8_t *grp = band + g * 8 * BB;
                for (int r = 0; r < 8; r++) {
                    const uint8_t *raw = tmp + r * row_bytes + g * BB;
                    memcpy(grp + 128 + 2 * r, raw, 2);
                    if (q41) memcpy(grp + 144 + 2 * r, raw + 2, 2);
                    const uint8_t *q = raw + (q41 ? 4 : 2);
                    for (int j = 0; j < 4; j++) memcpy(grp + 32 * j + 4 * r, q + 4 * j, 4);
                }
            }
        }
    }
    free(scratch);
    return q41 ? GGML_Q4_1_X8 : GGML_Q4_0_X8;
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

/* Weight bytes of a product from which its row blocks are handed out guided (OpenMP's
 * schedule(guided): large chunks first, then smaller ones to whichever thread is free), so a
 * thread that lost its core for a while (another process, the server's event loop) is made up
 * by the other instead of the whole product waiting for it at the barrier; below, one chunk
 * per thread as schedule(static) (a small product's grabs cost more than they balance). Rows
 * are never split, so no result depends on which thread computes them. */
#define GUIDED_MIN_BYTES (1 << 20)

/* schedule(guided, row_chunk(...))'s minimum chunk for num_blocks blocks of `rows` rows of a
 * type's [N, K] weight: 1 block for a product of at least GUIDED_MIN_BYTES, else
 * num_blocks / num_threads (every chunk the static one) */
static inline int64_t row_chunk(int type, int64_t K, int64_t rows, int64_t num_blocks,
                                int num_threads) {
    int64_t E, B;
    if (num_threads <= 1 || pagedkv_gguf_block(type, &E, &B)) return 1;
    if (num_blocks * rows * (K / E * B) >= GUIDED_MIN_BYTES) return 1;
    return (num_blocks + num_threads - 1) / num_threads;
}

int pagedkv_gguf_gemm(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                      int64_t N, int64_t K, int num_threads, int isa) {
    return pagedkv_gguf_gemm_ld(type, x, w, out, M, N, K, N, num_threads, isa);
}

int pagedkv_gguf_gemm_ld(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                         int64_t N, int64_t K, int64_t ldo, int num_threads, int isa) {
    int64_t E, B;
    if (is_x8(type) || pagedkv_gguf_block(type, &E, &B)) return -1; /* x8: int8 products only */
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
    const int64_t chunk = row_chunk(type, K, ROW_BLOCK, num_blocks, num_threads);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
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
    if (is_x8(type)) { /* each row back in the file's layout, then as its type */
        const int base = type == GGML_Q4_1_X8 ? GGML_Q4_1 : GGML_Q4_0;
        uint8_t *raw = (uint8_t *)malloc((size_t)(row_bytes * threads));
        if (raw == NULL) return -1;
#pragma omp parallel num_threads(threads)
        {
            uint8_t *mine = thread_scratch(raw, row_bytes);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++) {
                x8_raw_row(type, w, K, row_start + r, mine);
                dequant_row_avx2(base, mine, K, (uint8_t *)out + r * out_bytes, out_bf16);
            }
        }
        free(raw);
        return 0;
    }
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
    if (is_x8(type)) {
        if (N % 8 != 0) return -1;
        const int base = type == GGML_Q4_1_X8 ? GGML_Q4_1 : GGML_Q4_0;
        uint8_t *raw = (uint8_t *)malloc((size_t)row_bytes);
        if (raw == NULL) return -1;
        for (int64_t i = 0; i < num_ids; i++) {
            x8_raw_row(type, w, K, ids[i], raw);
            dequant_row_avx2(base, raw, K, out + i * K, 0);
        }
        free(raw);
        return 0;
    }
    for (int64_t i = 0; i < num_ids; i++)
        dequant_row_avx2(type, w + ids[i] * row_bytes, K, out + i * K, 0);
    return 0;
}

/* ---- int8 activations: the products of every quantized type ------------------------------
 *
 * pagedkv_gguf_gemm above turns every weight into a float and multiplies it by an fp32
 * activation: a decode step is then bound by that arithmetic, not by the memory. Here (as
 * llama.cpp does) the activations are rounded to int8 once per call, in blocks of 32 along K
 * (the size of the weights' own groups), and a block of weights meets a block of activations
 * in exact integer arithmetic; only the block's integer result becomes a float.
 *
 * Activation block b of row m (elements 32 b .. 32 b + 31):
 *   xd[b] = max |x| / 127 (fp32), xq = round-to-nearest-even(x * (1 / xd[b])) in [-127, 127]
 *   (all zeros when the block is), xds[b] = xd[b] * sum(xq) (fp32), so x ~ xd[b] * xq: each
 *   activation is off by at most xd[b] / 2 (plus the fp32 rounding of x * (1 / xd)).
 *
 * The integer dot product of 32 weight values with 32 xq, in AVX2:
 *   _mm256_maddubs_epi16(u, s) multiplies 32 unsigned bytes u by 32 signed bytes s and adds
 *   neighbours into 16 signed 16-bit sums (saturating: every bound below stays under 32767);
 *   _mm256_madd_epi16(p, c) multiplies those 16 sums by 16-bit c and adds neighbours into 8
 *   int32 lanes. Lane i holds elements 4 i .. 4 i + 3 (of the 128-bit half's 16 bytes), so a
 *   c of one value per 128-bit half applies a separate integer scale to elements 0-15 and
 *   16-31 (Q6_K's sub-blocks of 16).
 *   An unsigned weight (Q4_1, Q5_1 q; Q4_K, Q5_K q) is the unsigned operand as it is.
 *   A signed weight (Q8_0, Q4_0 q - 8, Q5_0 q - 16, Q6_K q - 32) has no unsigned operand: |w|
 *   is one (128 for -128 as an unsigned byte, still right) and x with w's sign moved onto it
 *   the other (_mm256_sign_epi8(x, w): -x where w < 0, 0 where w = 0), so each byte product
 *   is |w| * sign(w) * x = w * x; x is never -128, so negating it cannot overflow.
 *   Bounds of a 16-bit pair sum: Q8_0 2 * 128 * 127 = 32512, Q6_K 2 * 32 * 127 = 8128, the
 *   5-bit types 2 * 31 * 127 = 7874, the 4-bit ones 2 * 15 * 127; an int32 lane after a
 *   multiplier of at most 128 is under 2^22, exact as a float.
 *
 * Each type's product, per output row (d, m, dmin = the block's fp32 scales as stored):
 *   Q8_0, Q4_0, Q5_0   sum_b (d_b * xd_b) * (w_b . xq_b)          w = the signed integer
 *   Q4_1, Q5_1         sum_b (d_b * xd_b) * (q_b . xq_b) + m_b * xds_b: the offset meets
 *                      the activation block's sum (w = d q + m, so w . x = d (q . x) + m sum x)
 *   Q6_K, Q4_K, Q5_K   on activation blocks of 256 (Q8_K-style, below: "K-quants on
 *                      activation blocks of 256"), one float step per super-block
 * The int32 lanes become floats once per group of 32 and meet the group's fp32 factor in one
 * fused multiply-add into 8 lanes per activation row, summed at the end of the row (on the
 * AVX2 body the factors of eight groups made together, and the offsets' m_b * xds_b summed in
 * 8 lanes, one per group of the eight; see Q8_ROW32). The
 * result differs from the fp32 product by the activations' rounding: at most
 * sum_k |w_k| * xd_block(k) / 2, plus fp32 summation (xd_block(k) the scale of k's activation
 * block: of 32, or the K-types' 256).
 * The large steps' kernels (af_* here, vl_* / vf_* on VNNI) still take every type, the
 * K-types included, on blocks of 32: vf_* and af_* serve pagedkv_gguf_gemm_q8_fast (the default
 * engine's prompts, not tied to the decode step's bits); vl_* the batch-invariant large
 * product of the 32-element types (the K-types' runs their row kernels, see gemm_q8k).
 *
 * Two bodies: this AVX2 one (maddubs / madd / sign), and an AVX-512 VNNI one below. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* Activation row x [K] -> xq int8 [K], xd and xds fp32 [K / 32] (see above). */
static void quantize_row_q8(const float *x, int64_t K, int8_t *xq, float *xd, float *xds) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    /* packs_epi32 then packs_epi16 leave the 4-byte runs in the order 0 4 1 5 2 6 3 7 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *p = x + 32 * b;
        const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        const __m256 a = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
            _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float scale = _mm_cvtss_f32(h) / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        /* cvtps rounds to nearest even (the default rounding mode) */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                                  _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(xq + 32 * b), _mm256_permutevar8x32_epi32(packed, order));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        xd[b] = scale;
        xds[b] = scale * (float)_mm_cvtsi128_si32(t);
    }
}

/* signed w . signed x, 32 bytes each, into 8 int32 lanes (each lane times c's 16-bit
 * multipliers, see above) */
static inline AI __m256i dot_signed(__m256i w, __m256i x, __m256i c) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), c);
}

/* unsigned w (0..31) . signed x, 32 bytes each, into 8 int32 lanes (times c, as above) */
static inline AI __m256i dot_unsigned(__m256i w, __m256i x, __m256i c) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), c);
}

/* 16 nibbles at p as 32 bytes in element order: the low nibbles (elements 0-15), then the
 * high ones (16-31) */
static inline AI __m256i nibbles32(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

/* The fifth bits of a Q5_0 / Q5_1 block (bit i of the little-endian word at p: element i) as
 * 32 bytes of 16 or 0: each byte picks its word byte (i / 8) and tests its bit (i % 8). */
static inline AI __m256i fifth_bits32(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* A 32-element block at b: its 32 integer weights in element order, signed (Q8_0 q, Q4_0
 * q - 8, Q5_0 q - 16) or unsigned (Q4_1 q in 0..15, Q5_1 q in 0..31) */
static inline AI __m256i q8w_q8_0(const uint8_t *b) {
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}

static inline AI __m256i q8w_q4_0(const uint8_t *b) {
    return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
}

static inline AI __m256i q8w_q4_1(const uint8_t *b) { return nibbles32(b + 4); }

static inline AI __m256i q8w_q5_0(const uint8_t *b) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2)),
                           _mm256_set1_epi8(16));
}

static inline AI __m256i q8w_q5_1(const uint8_t *b) {
    return _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4));
}

/* One 32-element block of a row for all M rows: acc[m] += (d * xd) * (w . xq) in 8 lanes;
 * a type with an offset m (MOFF its byte offset in the block, else -1) also adds
 * m * xds to the row's scalar sm[m]. */
#define Q8_BLOCK32(M, LOADW, SIGNED, MOFF, b, g, acc, sm)                                    \
    do {                                                                                     \
        const __m256i wv_ = LOADW(b);                                                        \
        const float d_ = f16_to_f32(b);                                                      \
        const float m_ = (MOFF) >= 0 ? f16_to_f32((b) + ((MOFF) > 0 ? (MOFF) : 0)) : 0.0f;  \
        _Pragma("GCC unroll 8") for (int m_i = 0; m_i < (M); m_i++) {                        \
            const __m256i xv_ = _mm256_loadu_si256((const __m256i *)(xq + m_i * K + 32 * (g))); \
            const __m256i p_ = (SIGNED) ? dot_signed(wv_, xv_, _mm256_set1_epi16(1))          \
                                        : dot_unsigned(wv_, xv_, _mm256_set1_epi16(1));       \
            (acc)[m_i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_),                             \
                                         _mm256_set1_ps(d_ * xd[m_i * G + (g)]), (acc)[m_i]); \
            if ((MOFF) >= 0) (sm)[m_i] += m_ * xds[m_i * G + (g)];                           \
        }                                                                                    \
    } while (0)

/* Eight consecutive blocks' f16 scales (BB bytes apart, the first at b) as fp32 lanes: *d
 * the f16 at byte 0 of each block, *m the one at byte 2 (the offset's, for the types with
 * one; unused by the others). Scalar loads into one vector each and one conversion (an AVX2
 * gather was slower on Zen 3). */
static inline AI void scales8(const uint8_t *b, const int BB, __m256 *d, __m256 *m) {
    uint16_t h[8], l[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
        memcpy(h + j, b + j * BB, 2);
        memcpy(l + j, b + j * BB + 2, 2);
    }
    *d = _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
    *m = _mm256_cvtph_ps(_mm_setr_epi16(l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]));
}

/* Block g of a group of eight whose factors (d * xd, for each activation row) are dx[m][0..7]:
 * element j broadcast from memory (a load, no arithmetic), where Q8_BLOCK32 converts and
 * multiplies d and xd as scalars and broadcasts; the same values, so the same bits in acc. */
#define Q8_BLOCK32_LANE(M, LOADW, SIGNED, b, g, j, acc, dx)                                  \
    do {                                                                                     \
        const __m256i wv_ = LOADW(b);                                                        \
        _Pragma("GCC unroll 8") for (int m_i = 0; m_i < (M); m_i++) {                        \
            const __m256i xv_ = _mm256_loadu_si256((const __m256i *)(xq + m_i * K + 32 * (g))); \
            const __m256i p_ = (SIGNED) ? dot_signed(wv_, xv_, _mm256_set1_epi16(1))          \
                                        : dot_unsigned(wv_, xv_, _mm256_set1_epi16(1));       \
            (acc)[m_i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_),                             \
                                         _mm256_broadcast_ss((dx)[m_i] + (j)), (acc)[m_i]);  \
        }                                                                                    \
    } while (0)

/* A row's product: blocks in groups of eight, their factors made together (scales8, then one
 * multiply by the eight xd of each activation row), where block by block each took two scalar
 * conversions, a multiply and a broadcast: on an AVX2 core these products are bound by
 * instructions, not memory (a Q4_1 row of K = 576 on one Zen 3 core: 2.2-2.3 ns a block at
 * any size of weight, 8-10 GB/s). The offsets' m_b * xds_b of a group in 8 lanes, one FMA.
 * Blocks alternate between two accumulators (even, odd) in order, as before the grouping, so
 * the types without an offset give the same bits as block by block; the rest of a row past
 * its last whole group goes block by block (Q8_BLOCK32). */
#define Q8_ROW32(T, BB, SIGNED, MOFF)                                                        \
    static inline AI void q8_row_##T(const int M, const uint8_t *w, const int8_t *xq,        \
                                     const float *xd, const float *xds, int64_t K,           \
                                     int64_t ldo, int64_t n, float *out) {                   \
        const int64_t G = K / 32;                                                            \
        const uint8_t *row = w + n * G * (BB);                                               \
        __m256 a0[MAX_M], a1[MAX_M], mo[MAX_M];                                              \
        float sm[MAX_M];                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                \
            a0[m] = a1[m] = mo[m] = _mm256_setzero_ps();                                     \
            sm[m] = 0.0f;                                                                    \
        }                                                                                    \
        int64_t g = 0;                                                                       \
        for (; g + 8 <= G; g += 8) {                                                         \
            const uint8_t *b = row + g * (BB);                                               \
            _Pragma("GCC unroll 8") for (int at = 0; at < 8 * (BB); at += 64)                \
                PREFETCH(b + PF_BYTES + at);                                                 \
            __m256 d8, m8;                                                                   \
            float dx[MAX_M][8] __attribute__((aligned(32)));                                 \
            scales8(b, (BB), &d8, &m8);                                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                            \
                _mm256_store_ps(dx[m], _mm256_mul_ps(d8, _mm256_loadu_ps(xd + m * G + g)));  \
                if ((MOFF) >= 0)                                                             \
                    mo[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xds + m * G + g), mo[m]);    \
            }                                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j += 2) {                         \
                Q8_BLOCK32_LANE(M, q8w_##T, SIGNED, b + j * (BB), g + j, j, a0, dx);         \
                Q8_BLOCK32_LANE(M, q8w_##T, SIGNED, b + (j + 1) * (BB), g + j + 1, j + 1, a1, \
                                dx);                                                         \
            }                                                                                \
        }                                                                                    \
        for (; g + 2 <= G; g += 2) {                                                         \
            const uint8_t *b = row + g * (BB);                                               \
            Q8_BLOCK32(M, q8w_##T, SIGNED, MOFF, b, g, a0, sm);                              \
            Q8_BLOCK32(M, q8w_##T, SIGNED, MOFF, b + (BB), g + 1, a1, sm);                   \
        }                                                                                    \
        if (g < G) Q8_BLOCK32(M, q8w_##T, SIGNED, MOFF, row + g * (BB), g, a0, sm);          \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            out[m * ldo + n] = hsum8(_mm256_add_ps(a0[m], a1[m])) + (hsum8(mo[m]) + sm[m]);  \
    }

Q8_ROW32(q8_0, 34, 1, -1)
Q8_ROW32(q4_0, 18, 1, -1)
Q8_ROW32(q4_1, 20, 0, 2)
Q8_ROW32(q5_0, 22, 1, -1)
Q8_ROW32(q5_1, 24, 0, 2)

/* rows n0..n1 of one type, M a constant at each call site */
#define Q8_ROWS(T)                                                                           \
    static __attribute__((noinline)) void q8_rows_##T(int M, const uint8_t *w,               \
                                                      const int8_t *xq, const float *xd,     \
                                                      const float *xds, int64_t K,           \
                                                      int64_t ldo, int64_t n0, int64_t n1,   \
                                                      float *out) {                          \
        FOR_ROWS(q8_row_##T, M, w, xq, xd, xds, K, ldo);                                 \
    }

Q8_ROWS(q8_0)
Q8_ROWS(q4_0)
Q8_ROWS(q4_1)
Q8_ROWS(q5_0)
Q8_ROWS(q5_1)

/* ---- 4-bit blocks interleaved by 8 rows (Q4_0_X8, Q4_1_X8): the AVX2 body's decode layout ---
 *
 * A decode step's product on the file's own layout (q8_row_*, one weight row at a time) spends
 * per block and activation row a maddubs, a madd, a conversion, a broadcast and an FMA, and per
 * weight row a horizontal sum: on an AVX2 core it is bound by those instructions, not by the
 * memory (a draft row of a verification step costs about a third of a one-row step). As
 * llama.cpp does on AVX2 (its repacked Q4_0 8x8 blocks), the loader lays out each band of 8
 * weight rows so that one vector holds 4 bytes of each of the 8 rows (the rows across the
 * lanes): an activation row's 4 bytes, broadcast, meet 8 weight rows in one maddubs, a block's
 * 8 maddubs are summed in int16 (8 * 2 * 15 * 127 < 2^15), and one madd, conversion, multiply
 * (the scales) and two FMAs (the product, the offset) finish the block for 8 weight rows at
 * once, with no horizontal sum.
 *
 * Band t (rows 8 t .. 8 t + 7) is 8 * row_bytes bytes, the rows' block g at g * 8 * B:
 *   bytes 0-127   vector j (j = 0..3) at 32 j: byte 4 r + e = row r's code byte 4 j + e (its low
 *                 nibble element 4 j + e, its high nibble element 16 + 4 j + e, as in the file)
 *   bytes 128-143 the 8 rows' f16 d
 *   bytes 144-159 (Q4_1) the 8 rows' f16 m
 * the same bytes as the file's blocks (B = 18, 20), moved. Row n's result, for any number of
 * activation rows M:
 *   acc = 0; for g: acc = fma(float(sum_j u_j x_j), d * xd_g, acc); acc = fma(m, xds_g, acc)
 * in fp32 (u the unsigned codes; Q4_0's m is -8 d, its codes' bias), so a row's bits do not
 * depend on M or on the other rows: a verification step's rows are a decode step's. */
/* Band of 8 weight rows at `band` (its K / 32 groups) against activation rows 0..M-1:
 * out[m * ldo + n0 + r] for r = 0..7 */
static inline AI void x8_band(const int M, const int q41, const uint8_t *band, const int8_t *xq,
                              const float *xd, const float *xds, int64_t K, int64_t ldo,
                              int64_t n0, float *out) {
    const int64_t G = K / 32, GB = q41 ? 160 : 144;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_M];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = band + g * GB;
        PREFETCH(b + PF_BYTES);
        PREFETCH(b + PF_BYTES + 64);
        PREFETCH(b + PF_BYTES + 128);
        __m256i st[8];
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 * j));
            st[j] = _mm256_and_si256(v, low);
            st[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 128)));
        const __m256 m8 = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 144)))
                              : _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const int8_t *x = xq + m * K + 32 * g;
            int32_t xv;
            memcpy(&xv, x, 4);
            __m256i i16 = _mm256_maddubs_epi16(st[0], _mm256_set1_epi32(xv));
            _Pragma("GCC unroll 8") for (int s = 1; s < 8; s++) {
                memcpy(&xv, x + 4 * s, 4);
                i16 = _mm256_add_epi16(i16, _mm256_maddubs_epi16(st[s], _mm256_set1_epi32(xv)));
            }
            const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(i16, ones));
            acc[m] = _mm256_fmadd_ps(f, _mm256_mul_ps(d8, _mm256_set1_ps(xd[m * G + g])), acc[m]);
            acc[m] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xds[m * G + g]), acc[m]);
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) _mm256_storeu_ps(out + m * ldo + n0, acc[m]);
}

/* rows n0..n1 (multiples of 8, or n1 = N, itself a multiple of 8) of an interleaved type */
#define X8_ROWS(T, Q41)                                                                      \
    static __attribute__((noinline)) void x8_rows_##T(int M, const uint8_t *w,              \
                                                      const int8_t *xq, const float *xd,     \
                                                      const float *xds, int64_t K,           \
                                                      int64_t ldo, int64_t n0, int64_t n1,   \
                                                      float *out) {                          \
        const int64_t band_bytes = 8 * (K / 32) * ((Q41) ? 20 : 18);                         \
        switch (M) {                                                                         \
            case 1: for (int64_t n = n0; n < n1; n += 8) x8_band(1, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 2: for (int64_t n = n0; n < n1; n += 8) x8_band(2, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 3: for (int64_t n = n0; n < n1; n += 8) x8_band(3, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 4: for (int64_t n = n0; n < n1; n += 8) x8_band(4, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 5: for (int64_t n = n0; n < n1; n += 8) x8_band(5, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 6: for (int64_t n = n0; n < n1; n += 8) x8_band(6, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 7: for (int64_t n = n0; n < n1; n += 8) x8_band(7, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
            case 8: for (int64_t n = n0; n < n1; n += 8) x8_band(8, Q41, w + n / 8 * band_bytes, xq, xd, xds, K, ldo, n, out); break; \
        }                                                                                    \
    }

X8_ROWS(q4_0_x8, 0)
X8_ROWS(q4_1_x8, 1)
#undef X8_ROWS

/* rows n0..n1 of any 32-element type (q8_rows_<type>); others do nothing (callers check) */
static void q8_rows_type(int type, int M, const uint8_t *w, const int8_t *xq, const float *xd,
                         const float *xds, int64_t K, int64_t ldo, int64_t n0, int64_t n1,
                         float *out) {
    switch (type) {
        case GGML_Q8_0: q8_rows_q8_0(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q4_0: q8_rows_q4_0(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q4_1: q8_rows_q4_1(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q5_0: q8_rows_q5_0(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q5_1: q8_rows_q5_1(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q4_0_X8: x8_rows_q4_0_x8(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
        case GGML_Q4_1_X8: x8_rows_q4_1_x8(M, w, xq, xd, xds, K, ldo, n0, n1, out); break;
    }
}

/* x fp32 [M, K] rounded by quantize_row_q8 into one new buffer: xd, xds fp32 [M, K / 32], then
 * xq int8 [M, K] (free it with free()); NULL if the allocation fails */
static float *q8_round_rows(const float *x, int64_t M, int64_t K) {
    const int64_t G = K / 32;
    float *xd = (float *)malloc(sizeof(float) * 2 * M * G + (size_t)(M * K));
    if (xd == NULL) return NULL;
    float *xds = xd + M * G;
    int8_t *xq = (int8_t *)(xds + M * G);
    for (int64_t m = 0; m < M; m++)
        quantize_row_q8(x + m * K, K, xq + m * K, xd + m * G, xds + m * G);
    return xd;
}

/* ---- K-quants on activation blocks of 256 (Q8_K-style) ----------------------------------
 *
 * The K-types (Q4_K, Q5_K, Q6_K) take their activations in blocks of 256, one per weight
 * super-block (quantize_row_q8k): xd[s] = max |x| / 127 over the 256 elements (fp32), xq as
 * above, and bsum[16 s + i] = the sum of xq over elements 16 i .. 16 i + 15 (int16, at most
 * 16 * 127). A super-block's integer dot then runs whole in int32 lanes, each group's (or
 * Q6_K sub-block's) integer scale applied as madd's 16-bit multiplier, and becomes a float
 * once: one fused multiply-add by d * xd[s] per super-block and activation row, not one per
 * group of 32. The offsets come from the bsums once per super-block, in integers:
 *   Q4_K, Q5_K   - dmin * xd[s] * sum_j m_j * (bsum[2 j] + bsum[2 j + 1])  (madd of the
 *                mins, each twice, with the 16 bsums)
 *   Q6_K         the codes q (0..63) are maddubs' unsigned operand as they are; the -32 of
 *                w = q - 32 is - 32 * sum_i scale_i * bsum[i], taken off the int32 lanes
 *                before the conversion.
 * Bounds: a 16-bit pair sum at most 2 * 63 * 127 = 16002 (Q6_K's codes), an int32 lane at
 * most 8 * 2 * 16002 * 128 plus the offset's 32 * 2 * 2032 * 128 (under 2^26: exact in int32,
 * the conversion to fp32 rounds only above 2^24, Q6_K's extremes, 2^-24 relative). Each
 * product is off the fp32 one by at most sum_k |w_k| * xd(k) / 2 with xd(k) the scale of k's
 * block of 256 (coarser than a block of 32's: the price of the fewer float steps), plus fp32
 * summation. */

/* Activation row x [K] (K a multiple of 256) -> xq int8 [K], xd fp32 [K / 256], bsum int16
 * [K / 16] (see above; the rounding of quantize_row_q8 with the scale of the block of 256). */
static void quantize_row_q8k(const float *x, int64_t K, int8_t *xq, float *xd, int16_t *bsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t s = 0; s < K / 256; s++) {
        const float *p = x + 256 * s;
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(p + 8 * i), absmask));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float scale = _mm_cvtss_f32(h) / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        for (int b = 0; b < 8; b++) {
            const float *q = p + 32 * b;
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q), inv));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + 8), inv));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + 16), inv));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(q + 24), inv));
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                                      _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(xq + 256 * s + 32 * b),
                                _mm256_permutevar8x32_epi32(packed, order));
            /* the sums of elements 0-15 and 16-31 */
            __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            t = _mm256_hadd_epi32(t, t);
            const __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            bsum[16 * s + 2 * b] = (int16_t)_mm_cvtsi128_si32(u);
            bsum[16 * s + 2 * b + 1] = (int16_t)_mm_extract_epi32(u, 1);
        }
        xd[s] = scale;
    }
}

/* The 6-bit scales and mins of a Q4_K / Q5_K super-block (layout in the header comment) as
 * 16 int16: lanes 0-7 the scales sc[j], 8-15 the mins m[j] */
static inline AI __m256i k_scales_mins16(const uint8_t *blk) {
    uint32_t w0, w1, w2;
    memcpy(&w0, blk + 4, 4);
    memcpy(&w1, blk + 8, 4);
    memcpy(&w2, blk + 12, 4);
    const uint32_t sc_lo = w0 & 0x3F3F3F3Fu, m_lo = w1 & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)m_hi, (int)m_lo, (int)sc_hi, (int)sc_lo));
}

/* mins m[j] (lanes 8-15 of sm16) each twice: lanes 2 j, 2 j + 1 = m[j], the multiplier that
 * madd meets the 16 bsums with (lane j of the result: m[j] times group j's activation sum) */
static inline AI __m256i k_mins_twice(__m256i sm16) {
    const __m128i mn = _mm256_extracti128_si256(sm16, 1);
    return _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
}

/* Q4_K (five = 0) / Q5_K (five = 1) row n on Q8_K activations (xd [M, K / 256], bsum
 * [M, K / 16]): per super-block 4 pairs of groups (a pair's 32 bytes hold group 2 c in the
 * low nibbles and 2 c + 1 in the high ones, element i in byte i; Q5_K's fifth bit of element
 * i of group j is bit j of qh[i]), each group's dot times its scale (madd) added into 8 int32
 * lanes per activation row, then one float step for the scales' part and one for the mins'. */
static inline AI void q8k_row_kq(const int M, const int five, const uint8_t *w, const int8_t *xq,
                                 const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                 int64_t n, float *out) {
    const int BB = five ? 176 : 144;
    const int64_t S = K / 256;
    const uint8_t *row = w + n * S * BB;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 a0[MAX_M], a1[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *blk = row + s * BB;
        PREFETCH(blk + PF_BYTES);
        PREFETCH(blk + PF_BYTES + 64);
        PREFETCH(blk + PF_BYTES + 128);
        const __m256i sm16 = k_scales_mins16(blk);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm16));
        const __m256i mins = k_mins_twice(sm16);
        const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : low4;
        __m256i sumi[MAX_M];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) sumi[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i qlo = _mm256_and_si256(bytes, low4);
            __m256i qhi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if (five) {
                const int j0 = 2 * c, j1 = 2 * c + 1;
                const __m256i b0 = _mm256_and_si256(qh, _mm256_set1_epi8((char)(1 << j0)));
                const __m256i b1 = _mm256_and_si256(qh, _mm256_set1_epi8((char)(1 << j1)));
                qlo = _mm256_or_si256(qlo, j0 <= 4 ? _mm256_slli_epi16(b0, 4 - j0)
                                                   : _mm256_srli_epi16(b0, j0 - 4));
                qhi = _mm256_or_si256(qhi, j1 <= 4 ? _mm256_slli_epi16(b1, 4 - j1)
                                                   : _mm256_srli_epi16(b1, j1 - 4));
            }
            /* scale 2 c (2 c + 1) in every 16-bit lane: its two bytes picked from `scales` */
            const __m256i clo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * c + 1) << 8 | (4 * c))));
            const __m256i chi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))));
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const int8_t *xm = xq + m * K + 256 * s + 64 * c;
                const __m256i plo = dot_unsigned(qlo, _mm256_loadu_si256((const __m256i *)xm), clo);
                const __m256i phi = dot_unsigned(qhi, _mm256_loadu_si256((const __m256i *)(xm + 32)), chi);
                sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(plo, phi));
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float f = xd[m * S + s];
            const __m256i pm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + m * (K / 16) + 16 * s)), mins);
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * f), a0[m]);
            a1[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * f), a1[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) out[m * ldo + n] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}

static inline AI void q8k_row_q4_k(const int M, const uint8_t *w, const int8_t *xq,
                                   const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                   int64_t n, float *out) {
    q8k_row_kq(M, 0, w, xq, xd, bsum, K, ldo, n, out);
}

static inline AI void q8k_row_q5_k(const int M, const uint8_t *w, const int8_t *xq,
                                   const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                   int64_t n, float *out) {
    q8k_row_kq(M, 1, w, xq, xd, bsum, K, ldo, n, out);
}

/* Q6_K row n on Q8_K activations: group g = 4 h + t of a super-block (half h, quarter t, see
 * the header comment): element i's low 4 bits are the low (t < 2) or high nibble of
 * ql[64 h + 32 (t & 1) + i], its top 2 bits bits 2 t, 2 t + 1 of qh[32 h + i]. The code q
 * (0..63) is maddubs' unsigned operand as it is; each half's 8 scales are widened once into
 * 16-bit pairs that a lane permute hands to each group (elements 0-15 take scale 2 g, 16-31
 * scale 2 g + 1) as madd's multiplier; the super-block's int32 lanes start at
 * - 32 * sum_i scale_i * bsum[i] (the - 32 of w = q - 32), then one float step. */
static inline AI void q8k_row_q6_k(const int M, const uint8_t *w, const int8_t *xq,
                                   const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                   int64_t n, float *out) {
    const int64_t S = K / 256;
    const uint8_t *row = w + n * S * 210;
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i pick[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                             _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                             _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 a0[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) a0[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *blk = row + s * 210;
        PREFETCH(blk + PF_BYTES);
        PREFETCH(blk + PF_BYTES + 64);
        PREFETCH(blk + PF_BYTES + 128);
        PREFETCH(blk + PF_BYTES + 192);
        const int8_t *scale = (const int8_t *)(blk + 192);
        /* - 32 * scale_i as 16 int16, met with the 16 bsums */
        const __m256i nsc32 = _mm256_slli_epi16(
            _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scale))), 5);
        __m256i sumi[MAX_M];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            sumi[m] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + m * (K / 16) + 16 * s)), nsc32);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(scale + 8 * h)));
            const __m256i pairs = _mm256_or_si256(_mm256_and_si256(s32, low16), _mm256_slli_epi32(s32, 16));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m256i ql = t & 1 ? ql1 : ql0;
                const __m256i nib = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
                const __m256i moved = t == 0   ? _mm256_slli_epi16(qh, 4)
                                      : t == 1 ? _mm256_slli_epi16(qh, 2)
                                      : t == 2 ? qh
                                               : _mm256_srli_epi16(qh, 2);
                const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(moved, top2));
                const __m256i c = _mm256_permutevar8x32_epi32(pairs, pick[t]);
                const int g = 4 * h + t;
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + 256 * s + 32 * g));
                    sumi[m] = _mm256_add_epi32(sumi[m], dot_unsigned(q, xv, c));
                }
            }
        }
        const float d = f16_to_f32(blk + 208);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * xd[m * S + s]), a0[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) out[m * ldo + n] = hsum8(a0[m]);
}

#define Q8K_ROWS(T)                                                                          \
    static __attribute__((noinline)) void q8k_rows_##T(int M, const uint8_t *w,              \
                                                       const int8_t *xq, const float *xd,    \
                                                       const int16_t *bsum, int64_t K,       \
                                                       int64_t ldo, int64_t n0, int64_t n1,  \
                                                       float *out) {                         \
        FOR_ROWS(q8k_row_##T, M, w, xq, xd, bsum, K, ldo);                               \
    }

Q8K_ROWS(q4_k)
Q8K_ROWS(q5_k)
Q8K_ROWS(q6_k)
#undef Q8K_ROWS

/* ---- the default engine's large steps held to AVX2: whole groups in integers ------------
 *
 * As the VNNI body's vf_tile_rows, for a CPU (or a hold) without VNNI: tiles of 8 weight rows
 * across the lanes, the codes unpacked once per tile into [group][step of 4 bytes][row][4]
 * (unsigned: the signed types with their bias b added), and per activation row and group
 * maddubs (4 bytes of 8 rows against the row's 4 bytes, broadcast) summed in int16 while no sum
 * can overflow (8 steps for 4-bit codes: 8 * 2 * 15 * 127 < 2^15; 4 for 5-bit, 2 for Q6_K's
 * 6-bit), then madd to int32, so a group of 32 (Q6_K: 16) takes one float step, not four. Not
 * the decode step's bits (the batch-invariant switch keeps pagedkv_gguf_gemm_q8_large). Q8_0's
 * 8-bit codes would overflow int16 in one maddubs: it keeps the other large products.
 * The dots start from -b times the sub-block's activation sum (af_act's xgs). */
#define AF_MB 4

typedef struct {
    uint8_t *wq; /* [G][8 steps][8 rows][4] */
    float *dsc;  /* [G][2][8]: the scale of steps 0-3 and 4-7 (equal but for Q6_K) */
    float *mn;   /* [G][8]: the offset per unit of the activations' xds (+m, -dmin m_j), or 0 */
} af_tile;

static inline AI int af_steps16(int type) {
    return type == GGML_Q6_K ? 2 : (type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q5_K) ? 4 : 8;
}

/* The 32 unsigned codes of a 32-element type's block b in one vector (nibbles32 and
 * fifth_bits32, as the decode step's q8w_* without their bias) */
static inline AI __m256i af_codes32(const int type, const uint8_t *b) {
    switch (type) {
        case GGML_Q4_0: return nibbles32(b + 2);
        case GGML_Q4_1: return nibbles32(b + 4);
        case GGML_Q5_0: return _mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2));
        default: return _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4)); /* Q5_1 */
    }
}

/* A K-type's group g (of 32) of a row: its 32 unsigned codes in one vector (the nibbles, and
 * Q5_K's fifth bits, Q6_K's two high bits, of 32 consecutive bytes by shifts and masks), its
 * two half scales in d2 (equal but for Q6_K's sub-blocks of 16) and its offset in *mo */
static inline AI __m256i af_codes_k(const int type, const uint8_t *row, int64_t g, float *d2,
                                    float *mo) {
    const int j = (int)(g & 7);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == GGML_Q6_K) {
        const int h = j >> 2, t = j & 3;
        const uint8_t *blk = row + (g >> 3) * 210;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)),
                                            _mm256_set1_epi8(3));
        const float d = f16_to_f32(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        d2[0] = d * (float)sc[2 * j];
        d2[1] = d * (float)sc[2 * j + 1];
        *mo = 0.0f;
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    const int five = type == GGML_Q5_K;
    const uint8_t *blk = row + (g >> 3) * (five ? 176 : 144);
    float D[8], DM[8];
    prep_q4_k(blk, D, DM);
    d2[0] = d2[1] = D[j];
    *mo = -DM[j];
    const uint8_t *q = blk + (five ? 48 : 16) + 32 * (j >> 1);
    const __m256i qs = _mm256_loadu_si256((const __m256i *)q);
    __m256i codes = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(qs, 4) : qs, low4);
    if (five) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                             _mm256_set1_epi8(1));
        codes = _mm256_or_si256(codes, _mm256_slli_epi16(bit, 4));
    }
    return codes;
}

/* A tile's 8 rows (n0.., nv of them real, the rest zeros) into T: each group's codes as
 * [step][row][4 bytes] (a transpose of the rows' [step][4]), its scales and offsets. The
 * codes of a group come from a few vector instructions (af_codes32, af_codes_k); unpacked
 * byte by byte, with 4-byte copies for the transpose, they had cost 85% of a product's time
 * at one activation row and half at 48 (SmolLM2's gate / up, 2-core Zen 3). */
static void af_pack(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int nv,
                    int64_t G, const af_tile *T) {
    int64_t E = 0, BB = 0;
    pagedkv_gguf_block(type, &E, &BB);
    const int b32 = E == 32; /* the K-types' blocks are of 256 */
    const int offset = type == GGML_Q4_1 || type == GGML_Q5_1;
    for (int64_t g = 0; g < G; g++) {
        float d2[8][2], mo[8];
        __m256i v[8], t[8];
        if (b32) {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                if (r < nv) {
                    const uint8_t *b = w + (n0 + r) * row_bytes + g * BB;
                    v[r] = af_codes32(type, b);
                    d2[r][0] = d2[r][1] = f16_to_f32(b);
                    mo[r] = offset ? f16_to_f32(b + 2) : 0.0f;
                } else {
                    v[r] = _mm256_setzero_si256();
                    d2[r][0] = d2[r][1] = mo[r] = 0.0f;
                }
            }
        } else {
            for (int r = 0; r < 8; r++) {
                if (r < nv) {
                    v[r] = af_codes_k(type, w + (n0 + r) * row_bytes, g, d2[r], &mo[r]);
                } else {
                    v[r] = _mm256_setzero_si256();
                    d2[r][0] = d2[r][1] = mo[r] = 0.0f;
                }
            }
        }
        /* [row][step][4] -> [step][row][4]: an 8 x 8 transpose of 4-byte elements */
#pragma GCC unroll 4
        for (int r = 0; r < 8; r += 2) {
            t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);     /* r0s0 r1s0 r0s1 r1s1 | s4 s5 */
            t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]); /* s2, s3 | s6, s7 */
        }
#pragma GCC unroll 2
        for (int r = 0; r < 8; r += 4) {
            v[r] = _mm256_unpacklo_epi64(t[r], t[r + 2]);     /* rows r..r+3 of s0 | s4 */
            v[r + 1] = _mm256_unpackhi_epi64(t[r], t[r + 2]); /* s1 | s5 */
            v[r + 2] = _mm256_unpacklo_epi64(t[r + 1], t[r + 3]); /* s2 | s6 */
            v[r + 3] = _mm256_unpackhi_epi64(t[r + 1], t[r + 3]); /* s3 | s7 */
        }
        uint8_t *dst = T->wq + g * 256;
#pragma GCC unroll 4
        for (int st = 0; st < 4; st++) {
            /* v[st]: rows 0-3 of steps st | st + 4; v[st + 4]: rows 4-7 of the same */
            _mm256_storeu_si256((__m256i *)(dst + st * 32),
                                _mm256_permute2x128_si256(v[st], v[st + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(dst + (st + 4) * 32),
                                _mm256_permute2x128_si256(v[st], v[st + 4], 0x31));
        }
        for (int r = 0; r < 8; r++) {
            T->dsc[g * 16 + r] = d2[r][0];
            T->dsc[g * 16 + 8 + r] = d2[r][1];
            T->mn[g * 8 + r] = mo[r];
        }
    }
}

/* steps a .. a + n - 1 of group g for AF_MB activation rows (xr: each row's bytes of the
 * group), added in int16, then to the int32 sums i32 */
static inline AI void af_steps(const uint8_t *wq, const int8_t *const xr[AF_MB], int a, int n,
                               __m256i i32[AF_MB]) {
    __m256i i16[AF_MB];
#pragma GCC unroll 8
    for (int st = a; st < a + n; st++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(wq + 32 * st));
#pragma GCC unroll 4
        for (int i = 0; i < AF_MB; i++) {
            int32_t xv;
            memcpy(&xv, xr[i] + 4 * st, 4);
            const __m256i p = _mm256_maddubs_epi16(wv, _mm256_set1_epi32(xv));
            i16[i] = st == a ? p : _mm256_add_epi16(i16[i], p);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < AF_MB; i++)
        i32[i] = _mm256_add_epi32(i32[i], _mm256_madd_epi16(i16[i], _mm256_set1_epi16(1)));
}

static inline AI void af_tile_rows(const int type, const uint8_t *w, int64_t row_bytes,
                                   const int8_t *xq, const float *xd, const float *xds,
                                   const int32_t *xgs, int64_t K, int64_t m0, int64_t m1,
                                   int64_t n0, int nv, const af_tile *T, float *out,
                                   int64_t ldo) {
    const int64_t G = K / 32;
    const int S16 = af_steps16(type), halves = type == GGML_Q6_K;
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
    af_pack(type, w, row_bytes, n0, nv, G, T);
    for (int64_t ma = m0; ma < m1; ma += AF_MB) {
        int64_t mr[AF_MB];
#pragma GCC unroll 4
        for (int i = 0; i < AF_MB; i++) mr[i] = ma + i < m1 ? ma + i : m1 - 1;
        __m256 acc[AF_MB];
#pragma GCC unroll 4
        for (int i = 0; i < AF_MB; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wq = T->wq + g * 256;
            const int8_t *xr[AF_MB];
#pragma GCC unroll 4
            for (int i = 0; i < AF_MB; i++) xr[i] = xq + mr[i] * K + 32 * g;
            if (halves) {
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++) {
                    __m256i i32[AF_MB];
#pragma GCC unroll 4
                    for (int i = 0; i < AF_MB; i++) i32[i] = _mm256_set1_epi32(xgs[mr[i] * 2 * G + 2 * g + hh]);
                    af_steps(wq, xr, 4 * hh, 2, i32);
                    af_steps(wq, xr, 4 * hh + 2, 2, i32);
                    const __m256 sc = _mm256_loadu_ps(T->dsc + g * 16 + 8 * hh);
#pragma GCC unroll 4
                    for (int i = 0; i < AF_MB; i++)
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[i]),
                                                 _mm256_mul_ps(sc, _mm256_set1_ps(xd[mr[i] * G + g])), acc[i]);
                }
            } else {
                __m256i i32[AF_MB];
#pragma GCC unroll 4
                for (int i = 0; i < AF_MB; i++)
                    i32[i] = xgs != NULL ? _mm256_set1_epi32(xgs[mr[i] * 2 * G + 2 * g] + xgs[mr[i] * 2 * G + 2 * g + 1])
                                         : _mm256_setzero_si256();
                for (int a = 0; a < 8; a += S16) af_steps(wq, xr, a, S16, i32);
                const __m256 sc = _mm256_loadu_ps(T->dsc + g * 16);
#pragma GCC unroll 4
                for (int i = 0; i < AF_MB; i++)
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[i]),
                                             _mm256_mul_ps(sc, _mm256_set1_ps(xd[mr[i] * G + g])), acc[i]);
            }
            if (mins) {
                const __m256 mn = _mm256_loadu_ps(T->mn + g * 8);
#pragma GCC unroll 4
                for (int i = 0; i < AF_MB; i++)
                    acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xds[mr[i] * G + g]), acc[i]);
            }
        }
        for (int i = 0; i < AF_MB && ma + i < m1; i++) {
            float r[8];
            _mm256_storeu_ps(r, acc[i]);
            memcpy(out + (ma + i) * ldo + n0, r, sizeof(float) * (size_t)nv);
        }
    }
}

#define AF_TYPE(T, TYPE)                                                                     \
    static __attribute__((noinline)) void af_tile_##T(                                        \
        const uint8_t *w, int64_t row_bytes, const int8_t *xq, const float *xd,               \
        const float *xds, const int32_t *xgs, int64_t K, int64_t m0, int64_t m1, int64_t n0,  \
        int nv, const af_tile *Tl, float *out, int64_t ldo) {                                 \
        af_tile_rows(TYPE, w, row_bytes, xq, xd, xds, xgs, K, m0, m1, n0, nv, Tl, out, ldo);  \
    }
AF_TYPE(q4_0, GGML_Q4_0)
AF_TYPE(q4_1, GGML_Q4_1)
AF_TYPE(q5_0, GGML_Q5_0)
AF_TYPE(q5_1, GGML_Q5_1)
AF_TYPE(q4_k, GGML_Q4_K)
AF_TYPE(q5_k, GGML_Q5_K)
AF_TYPE(q6_k, GGML_Q6_K)
#undef AF_TYPE

/* Row m's sub-block starts [2 G]: -bias times the sum of each 16 activation bytes */
static void af_act_row(const int8_t *xq, int64_t K, int bias, int32_t *xgs) {
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t s = 0;
        for (int k = 0; k < 16; k++) s += xq[16 * h + k];
        xgs[h] = -bias * s;
    }
}

/* The product (arguments checked by the caller; type one of af_tile_*'s). Returns 0, or -1
 * (an allocation failure). */
static int gemm_q8_avx2_fast(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                             int64_t N, int64_t K, int64_t ldo, int num_threads) {
    int64_t E, B;
    pagedkv_gguf_block(type, &E, &B);
    const int64_t G = K / 32, row_bytes = K / E * B, num_tiles = (N + 7) / 8;
    const int bias = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q6_K ? 32 : 0;
    /* xd, xds fp32 [M, G], xq int8 [M, K]; xgs int32 [M, 2 G] */
    float *xd = (float *)malloc(sizeof(float) * 2 * M * G + (size_t)(M * K));
    int32_t *xgs = (bias != 0 || type == GGML_Q6_K) ? (int32_t *)calloc((size_t)(M * 2 * G), sizeof(int32_t)) : NULL;
    const size_t tile_bytes = ((size_t)G * (256 + 64 + 32) + 63) & ~(size_t)63;
    const int threads = num_tiles < num_threads ? (int)(num_tiles > 0 ? num_tiles : 1) : num_threads;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, tile_bytes * (size_t)threads);
    if (xd == NULL || scratch == NULL || ((bias != 0 || type == GGML_Q6_K) && xgs == NULL)) {
        free(xd);
        free(xgs);
        free(scratch);
        return -1;
    }
    float *xds = xd + M * G;
    int8_t *xq = (int8_t *)(xds + M * G);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) {
        quantize_row_q8(x + m * K, K, xq + m * K, xd + m * G, xds + m * G);
        if (xgs != NULL) af_act_row(xq + m * K, K, bias, xgs + m * 2 * G);
    }
#pragma omp parallel num_threads(threads)
    {
        uint8_t *mine = thread_scratch(scratch, (int64_t)tile_bytes);
        const af_tile T = {mine, (float *)(mine + G * 256), (float *)(mine + G * (256 + 64))};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_tiles; b++) {
            const int64_t n0 = 8 * b;
            const int nv = (int)(N - n0 < 8 ? N - n0 : 8);
            switch (type) {
                case GGML_Q4_0: af_tile_q4_0(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                case GGML_Q4_1: af_tile_q4_1(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                case GGML_Q5_0: af_tile_q5_0(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                case GGML_Q5_1: af_tile_q5_1(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                case GGML_Q4_K: af_tile_q4_k(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                case GGML_Q5_K: af_tile_q5_k(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
                default: af_tile_q6_k(w, row_bytes, xq, xd, xds, xgs, K, 0, M, n0, nv, &T, out, ldo); break;
            }
        }
    }
    free(xd);
    free(xgs);
    free(scratch);
    return 0;
}

#undef Q8_BLOCK32
#undef Q8_BLOCK32_LANE
#undef Q8_ROW32
#undef Q8_ROWS

#pragma GCC pop_options

/* ---- the AVX-512 VNNI body of the int8 products ------------------------------------------
 *
 * _mm512_dpbusd_epi32(acc, u, s) adds to each of 16 int32 lanes the four products of its
 * unsigned bytes of u with the signed bytes of s, exactly (no 16-bit step, no saturation).
 * One instruction multiplies and sums 64 bytes, where the AVX2 body takes maddubs + madd for
 * 32: the 32-element types' one-row kernel (v_row_32) feeds it 4 bytes of each of 16 groups
 * (a group's codes transposed across the lanes), the large-step kernels 4 bytes of each of 16
 * weight rows, the K-types' vk_row_* 64 consecutive bytes of a row.
 *   The weights are taken as unsigned codes u (Q4_1, Q5_1, Q4_K, Q5_K as they are; Q8_0,
 * Q4_0, Q5_0 with their bias b = 128, 8, 16 added), xq is s: u . xq = w . xq + b sum(xq), and
 * b times the block's activation sum (kept once per call) is taken off the block's sum.
 * The 32-element types (v_row_32) gather each block's whole dot in one int32 lane (8 dpbusd)
 * before its one float step;
 * the K-types run vk_row_* below on the Q8_K-style activations (maddubs, then dpwssd). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

/* The activations as the VNNI body reads them: P = ceil(K / 64) pairs, rows Kp = 64 P apart;
 * Q = ceil(G / 16) groups of 16 blocks, block 16 q + L in lane L (v_row_32) */
typedef struct {
    const int8_t *xq;   /* [M, Kp] the rounded activations (zeros past K) */
    const float *xd;    /* [M, G] each block's scale */
    const float *xds;   /* [M, G] xd times the block's sum of xq */
    const float *xdl;   /* [M, Q, 16] xd by lane (0 past K) */
    const float *xsl;   /* [M, Q, 16] xds by lane (0 past K) */
    const int32_t *xcs; /* [M, Q, 16] the block's sum of xq by lane (0 past K) */
    const int32_t *xt;  /* [M, Q, 8, 16] dword j of block 16 q + L of xq in [.., j, L] (0 past K;
                         * a last group of one or two blocks, which v_group1 takes, not written) */
    int64_t G, P, Q, Kp;
} q8v_act;

/* 16 bytes of nibbles at p0 and at p1 as 64 bytes: block p0's 32 elements, then p1's */
static inline AI __m512i v_nib64(const uint8_t *p0, const uint8_t *p1) {
    const __m256i t = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
        _mm_loadu_si128((const __m128i *)p1), 1);
    __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                         _mm512_castsi256_si512(t));
    z = _mm512_mask_srli_epi16(z, (__mmask32)0xFF00FF00u, z, 4);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

/* the fifth bits of two Q5_0 / Q5_1 blocks (their qh words at p0, p1) as a byte mask */
static inline AI __mmask64 v_fifth64(const uint8_t *p0, const uint8_t *p1) {
    uint32_t a, b;
    memcpy(&a, p0, 4);
    memcpy(&b, p1, 4);
    return (__mmask64)a | ((__mmask64)b << 32);
}

/* two 32-element blocks b0, b1 -> their 64 integer weights (signedness as q8w_*) */
static inline AI __m512i v_w_q8_0(const uint8_t *b0, const uint8_t *b1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                              _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
}
static inline AI __m512i v_w_q4_0(const uint8_t *b0, const uint8_t *b1) {
    return _mm512_sub_epi8(v_nib64(b0 + 2, b1 + 2), _mm512_set1_epi8(8));
}
static inline AI __m512i v_w_q4_1(const uint8_t *b0, const uint8_t *b1) {
    return v_nib64(b0 + 4, b1 + 4);
}
static inline AI __m512i v_w_q5_0(const uint8_t *b0, const uint8_t *b1) {
    const __m512i nib = v_nib64(b0 + 6, b1 + 6);
    /* q - 16: nib where the fifth bit is set, nib - 16 where it is not */
    return _mm512_mask_sub_epi8(nib, ~v_fifth64(b0 + 2, b1 + 2), nib, _mm512_set1_epi8(16));
}
static inline AI __m512i v_w_q5_1(const uint8_t *b0, const uint8_t *b1) {
    const __m512i nib = v_nib64(b0 + 8, b1 + 8);
    return _mm512_mask_add_epi8(nib, v_fifth64(b0 + 4, b1 + 4), nib, _mm512_set1_epi8(16));
}

/* The block of lane L of group q (16 blocks) of a row of G blocks, or -1 past the row: block
 * 16 q + L, but in a row's last group when it has one or two blocks (18 blocks, K = 576, leave
 * two), whose blocks 16 q and 16 q + 1 take lanes 0 and 8 (v_group1) */
static inline int64_t v_lane_block(int64_t G, int64_t q, int L) {
    const int64_t b = G - 16 * q <= 2 ? (L == 0 ? 16 * q : L == 8 ? 16 * q + 1 : -1) : 16 * q + L;
    return b >= 0 && b < G ? b : -1;
}

static inline AI int v_block_bytes(const int type) {
    return type == GGML_Q8_0 ? 34 : type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : 24;
}

/* where a block's 16 (Q8_0: 32) bytes of codes start */
static inline AI int v_codes_at(const int type) {
    return type == GGML_Q8_0 || type == GGML_Q4_0 ? 2 : type == GGML_Q4_1 ? 4 : type == GGML_Q5_0 ? 6 : 8;
}

/* log2 of vl_bias (the signed types' bias: 128, 8, 16) */
static inline AI int v_bias_shift(const int type) {
    return type == GGML_Q8_0 ? 7 : type == GGML_Q4_0 ? 3 : 4;
}

/* Dwords 0-3 of 16 bytes at offset `at` of the group's blocks (block b from g0 + b * BB; the
 * blocks from `left` on read as zeros) transposed: V[j]'s lane L is dword j of block L's bytes.
 * Four blocks a vector (block 4 c + r in 128-bit lane c of X[r]), then a 4 x 4 dword transpose
 * within the 128-bit lanes. */
static inline AI void v_transpose16(const uint8_t *g0, const int BB, const int at, const int64_t left,
                                    __m512i V[4]) {
    __m512i X[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        X[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            if (4 * c + r < left)
                X[r] = _mm512_inserti32x4(X[r], _mm_loadu_si128((const __m128i *)(g0 + (4 * c + r) * BB + at)), c);
    }
    const __m512i a0 = _mm512_unpacklo_epi32(X[0], X[1]), a1 = _mm512_unpackhi_epi32(X[0], X[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(X[2], X[3]), a3 = _mm512_unpackhi_epi32(X[2], X[3]);
    V[0] = _mm512_unpacklo_epi64(a0, a2);
    V[1] = _mm512_unpackhi_epi64(a0, a2);
    V[2] = _mm512_unpacklo_epi64(a1, a3);
    V[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* The 4 bytes at offset `at` of each of the group's blocks (block L from g0 + L * BB) in lane
 * L, 0 from block `left` on (nothing read there) */
static inline AI __m512i v_group_dwords(const uint8_t *g0, const int BB, const int at, const int64_t left) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                       _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)left)),
                                       _mm512_mullo_epi32(lane, _mm512_set1_epi32(BB)), g0 + at, 1);
}

/* A group's codes as unsigned bytes (the signed types' with vl_bias added, as vl_unpack stores
 * them), across the lanes: W[j]'s lane L holds elements 4 j .. 4 j + 3 of block L, so that one
 * dpbusd per j with the activations laid out alike (q8v_act's xt) adds to lane L a quarter of
 * block L's integer dot, and 8 of them sum it whole, no reduction across lanes */
static inline AI void v_group_codes(const int type, const uint8_t *g0, const int64_t left, __m512i W[8]) {
    const int BB = v_block_bytes(type), at = v_codes_at(type);
    if (type == GGML_Q8_0) {
        v_transpose16(g0, BB, at, left, W);
        v_transpose16(g0, BB, at + 16, left, W + 4);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) W[j] = _mm512_xor_si512(W[j], _mm512_set1_epi8((char)0x80));
        return;
    }
    __m512i V[4];
    v_transpose16(g0, BB, at, left, V);
    /* byte i of a block's codes: element i in its low nibble, i + 16 in its high one */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        W[j] = _mm512_and_si512(V[j], _mm512_set1_epi8(0x0F));
        W[j + 4] = _mm512_and_si512(_mm512_srli_epi16(V[j], 4), _mm512_set1_epi8(0x0F));
    }
    if (type == GGML_Q5_0 || type == GGML_Q5_1) {
        /* the fifth bits: bit e of the block's qh word is element e's */
        const __m512i qh = v_group_dwords(g0, BB, type == GGML_Q5_0 ? 2 : 4, left);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            /* every byte of a lane: qh's byte j / 2 (elements 8 (j / 2) ..), tested for bit
             * 4 (j % 2) + k in byte k */
            const char s = (char)(j / 2);
            const __m512i bytes = _mm512_shuffle_epi8(
                qh, _mm512_broadcast_i32x4(_mm_setr_epi8(s, s, s, s, 4 + s, 4 + s, 4 + s, 4 + s, 8 + s, 8 + s,
                                                         8 + s, 8 + s, 12 + s, 12 + s, 12 + s, 12 + s)));
            const int sh = 4 * (j % 2);
            const __m512i bit = _mm512_set1_epi32((int)(1u << sh | 2u << (sh + 8) | 4u << (sh + 16) | 8u << (sh + 24)));
            W[j] = _mm512_mask_add_epi8(W[j], _mm512_test_epi8_mask(bytes, bit), W[j], _mm512_set1_epi8(16));
        }
    }
}

/* One group of weight row n (its blocks from g0, `left` of them: 16 but in a row's last group)
 * for activation rows 0..M-1: acc[m] += its 16 blocks' terms, block L in lane L (v_row_32) */
static inline AI void v_group(const int type, const int M, const uint8_t *g0, const int64_t left,
                              const q8v_act *A, int64_t q, __m512 *acc) {
    const int BB = v_block_bytes(type);
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1;
    /* the group's bytes (16 blocks: 288 for Q4_0 to 544 for Q8_0), PF_BYTES ahead, where
     * several activation rows make the group long: 1.2-1.35x at 8 rows from memory; at one row
     * the hardware's prefetch alone was as fast (Q4_1, Q5_0) or faster (Q8_0: 1.17-1.25x) */
    if (M > 1) {
#pragma GCC unroll 9
        for (int i = 0; i < (16 * BB + 63) / 64; i++) PREFETCH(g0 + PF_BYTES + 64 * i);
    }
    __m512i W[8];
    v_group_codes(type, g0, left, W);
    /* the blocks' first four bytes (d, and Q4_1 / Q5_1's m), 0 past the row */
    const __m512i head = v_group_dwords(g0, BB, 0, left);
    const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    const __m512 mv = mins ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                           : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const int32_t *xt = A->xt + (m * A->Q + q) * 128;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
            s0 = _mm512_dpbusd_epi32(s0, W[j], _mm512_loadu_si512(xt + 16 * j));
            s1 = _mm512_dpbusd_epi32(s1, W[j + 1], _mm512_loadu_si512(xt + 16 * j + 16));
        }
        __m512i s = _mm512_add_epi32(s0, s1);
        const int64_t f = (m * A->Q + q) * 16;
        if (!mins)
            s = _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_loadu_si512(A->xcs + f), v_bias_shift(type)));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_loadu_ps(A->xdl + f)), acc[m]);
        if (mins) acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(A->xsl + f), acc[m]);
    }
}

/* Two 32-element blocks b0, b1 -> their 64 codes as unsigned bytes, block b0's then b1's (the
 * signed types' with vl_bias added) */
static inline AI __m512i v_codes(const int type, const uint8_t *b0, const uint8_t *b1) {
    switch (type) {
        case GGML_Q8_0: return _mm512_xor_si512(v_w_q8_0(b0, b1), _mm512_set1_epi8((char)0x80));
        case GGML_Q4_0: return v_nib64(b0 + 2, b1 + 2);
        case GGML_Q4_1: return v_w_q4_1(b0, b1);
        case GGML_Q5_0: return _mm512_add_epi8(v_w_q5_0(b0, b1), _mm512_set1_epi8(16));
        default: return v_w_q5_1(b0, b1);
    }
}

/* A row's last group when it has one or two blocks (16 q and, where left is 2, 16 q + 1): the
 * transposed layout would still take 8 dpbusd per activation row, so here the two blocks' 64
 * codes in one vector, one dpbusd, and their lanes summed into lanes 0 and 8 by 6
 * instructions; the other lanes hold copies of those sums, whose terms are zero (their scales,
 * xd and xds 0) */
static inline AI void v_group1(const int type, const int M, const uint8_t *g0, const int64_t left,
                               const q8v_act *A, int64_t q, __m512 *acc) {
    const int BB = v_block_bytes(type);
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1;
    const __m512i W = left == 2 ? v_codes(type, g0, g0 + BB)
                                : _mm512_maskz_mov_epi8((__mmask64)0xFFFFFFFFull, v_codes(type, g0, g0));
    /* the scales in lanes 0 and 8 only (0 elsewhere: a non-finite scale times the other lanes'
     * zero xd would be NaN, where vl_groups, which skips those lanes, has none) */
    const float d1 = left == 2 ? f16_to_f32(g0 + BB) : 0.0f;
    const __m512 dv = _mm512_maskz_mov_ps((__mmask16)0x0101,
                                          _mm512_insertf32x8(_mm512_set1_ps(f16_to_f32(g0)), _mm256_set1_ps(d1), 1));
    __m512 mv = _mm512_setzero_ps();
    if (mins)
        mv = _mm512_maskz_mov_ps((__mmask16)0x0101,
                                 _mm512_insertf32x8(_mm512_set1_ps(f16_to_f32(g0 + 2)),
                                                    _mm256_set1_ps(left == 2 ? f16_to_f32(g0 + BB + 2) : 0.0f), 1));
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const __m512i D = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W,
                                              _mm512_loadu_si512(A->xq + m * A->Kp + 512 * q));
        __m512i s = _mm512_add_epi32(D, _mm512_shuffle_i32x4(D, D, 0xB1));
        s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0x4E));
        s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, (_MM_PERM_ENUM)0xB1));
        const int64_t f = (m * A->Q + q) * 16;
        if (!mins)
            s = _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_loadu_si512(A->xcs + f), v_bias_shift(type)));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_loadu_ps(A->xdl + f)), acc[m]);
        if (mins) acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(A->xsl + f), acc[m]);
    }
}

/* Weight row n of a 32-element type against activation rows 0..M-1. The row runs in groups of
 * 16 blocks, block L of a group in lane L of every vector (a last group of one or two blocks:
 * v_group1): its codes transposed across the lanes (v_group_codes), so that 8 dpbusd per
 * activation row leave each lane its block's whole integer dot (exact: the signed types' weights taken as unsigned codes, bias b added, and b
 * times the block's activation sum taken off). Each block then takes one float step, as
 * llama.cpp's do, and lane L is a chain of every 16th block:
 *   acc[L] = fma(cvt(block's integer dot), d_b * xd_b, acc[L])   then, Q4_1 / Q5_1,
 *   acc[L] = fma(m_b, xds_b, acc[L]),
 * groups in order; the row's result _mm512_reduce_add_ps(acc). So each (m, n) is the same
 * float operations in the same order whatever M: a row's bits do not depend on the step's
 * other rows, and vl_groups (the batch-invariant large steps) repeats them across 16 weight
 * rows. Blocks past the row are zero terms, fma(0, 0, acc) = acc. Against one float step per
 * pair and lane of four elements (this kernel before 2026-12-06: 16 conversions, multiplies
 * and two FMAs per pair and activation row, which bound the core), SmolLM2's 8-row products
 * run 3-5x faster and a verification step's extra rows cost about two thirds of what they did
 * (the rest of the step did not change). */
static inline AI void v_row_32(const int type, const int M, const uint8_t *w, const q8v_act *A,
                               int64_t ldo, int64_t n, float *out) {
    const int BB = v_block_bytes(type);
    const int64_t G = A->G, Q = A->Q;
    const uint8_t *row = w + n * G * BB;
    __m512 acc[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t q = 0;
    for (; 16 * q + 16 <= G; q++) v_group(type, M, row + 16 * q * BB, 16, A, q, acc);
    if (q < Q && G - 16 * q <= 2)
        v_group1(type, M, row + 16 * q * BB, G - 16 * q, A, q, acc);
    else if (q < Q)
        v_group(type, M, row + 16 * q * BB, G - 16 * q, A, q, acc);
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
}

#define V_ROWS(T, TYPE)                                                                      \
    static inline AI void v_row_##T(const int M, const uint8_t *w, const q8v_act *A,         \
                                    int64_t ldo, int64_t n, float *out) {                    \
        v_row_32(TYPE, M, w, A, ldo, n, out);                                                \
    }                                                                                        \
    static __attribute__((noinline)) void v_rows_##T(int M, const uint8_t *w, const q8v_act *A, \
                                                     int64_t ldo, int64_t n0, int64_t n1,    \
                                                     float *out) {                           \
        FOR_ROWS(v_row_##T, M, w, A, ldo);                                                   \
    }

V_ROWS(q8_0, GGML_Q8_0)
V_ROWS(q4_0, GGML_Q4_0)
V_ROWS(q4_1, GGML_Q4_1)
V_ROWS(q5_0, GGML_Q5_0)
V_ROWS(q5_1, GGML_Q5_1)

/* ---- K-quants on Q8_K activations, VNNI: maddubs into 16-bit pairs, then dpwssd ----------
 *
 * As the AVX2 body's q8k_row_* (the activations quantize_row_q8k's), 64 elements a vector:
 * _mm512_maddubs_epi16 forms the 16-bit pair sums (unsigned codes, signed xq) and
 * _mm512_dpwssd_epi32 multiplies them by the 16-bit scales and adds neighbours into the int32
 * lanes (madd and add in one instruction). A super-block's integer sum is the AVX2 body's, split
 * over 16 lanes instead of 8, so the two bodies' results differ in fp32 rounding (as before). */

/* Q4_K (five = 0) / Q5_K (five = 1) row n: pair c of a super-block is the 32 bytes of nibbles
 * qs[32 c ..]: group 2 c the low nibbles (bytes 0-31 of the vector), 2 c + 1 the high ones
 * (32-63), with scale 2 c in 16-bit lanes 0-15 and 2 c + 1 in 16-31 */
static inline AI void vk_row_kq(const int M, const int five, const uint8_t *w, const int8_t *xq,
                                const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                int64_t n, float *out) {
    const int BB = five ? 176 : 144;
    const int64_t S = K / 256;
    const uint8_t *row = w + n * S * BB;
    __m512 a0[MAX_M];
    __m256 a1[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        a0[m] = _mm512_setzero_ps();
        a1[m] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *blk = row + s * BB;
        PREFETCH(blk + PF_BYTES);
        PREFETCH(blk + PF_BYTES + 64);
        PREFETCH(blk + PF_BYTES + 128);
        const __m256i sm16 = k_scales_mins16(blk);
        const __m512i scales = _mm512_castsi256_si512(sm16);
        const __m256i mins = k_mins_twice(sm16);
        const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                                : _mm512_setzero_si512();
        __m512i sumi[MAX_M];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) sumi[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            __m512i wv = _mm512_and_si512(_mm512_mask_srli_epi16(bytes, (__mmask32)0xFFFF0000u, bytes, 4),
                                          _mm512_set1_epi8(0x0F));
            if (five) {
                const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                       _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                wv = _mm512_mask_add_epi8(wv, _mm512_test_epi8_mask(qh, bit), wv, _mm512_set1_epi8(16));
            }
            const __m512i sc = _mm512_permutexvar_epi16(
                _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1),
                scales);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const __m512i p = _mm512_maddubs_epi16(wv, _mm512_loadu_si512(xq + m * K + 256 * s + 64 * c));
                sumi[m] = _mm512_dpwssd_epi32(sumi[m], p, sc);
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float f = xd[m * S + s];
            const __m256i pm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + m * (K / 16) + 16 * s)), mins);
            a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[m]), _mm512_set1_ps(d * f), a0[m]);
            a1[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * f), a1[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
        out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], _mm512_zextps256_ps512(a1[m])));
}

static inline AI void vk_row_q4_k(const int M, const uint8_t *w, const int8_t *xq,
                                  const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                  int64_t n, float *out) {
    vk_row_kq(M, 0, w, xq, xd, bsum, K, ldo, n, out);
}

static inline AI void vk_row_q5_k(const int M, const uint8_t *w, const int8_t *xq,
                                  const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                  int64_t n, float *out) {
    vk_row_kq(M, 1, w, xq, xd, bsum, K, ldo, n, out);
}

/* Q6_K row n: pair p = 2 h + u of a super-block is groups 4 h + 2 u and 4 h + 2 u + 1: the
 * 64 bytes ql[64 h ..] (low nibbles for u = 0, high for u = 1) and the 32 bytes qh[32 h ..]
 * (bits 4 u, 4 u + 1 for the first group, 4 u + 2, 4 u + 3 for the second), the codes q
 * unsigned; its four sub-block scales 4 p .. 4 p + 3 in 16-bit lanes 0-7, 8-15, 16-23, 24-31;
 * the lanes started at - 32 * sum_i scale_i * bsum[i] */
static inline AI void vk_row_q6_k(const int M, const uint8_t *w, const int8_t *xq,
                                  const float *xd, const int16_t *bsum, int64_t K, int64_t ldo,
                                  int64_t n, float *out) {
    const int64_t S = K / 256;
    const uint8_t *row = w + n * S * 210;
    __m512 a0[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) a0[m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *blk = row + s * 210;
        PREFETCH(blk + PF_BYTES);
        PREFETCH(blk + PF_BYTES + 64);
        PREFETCH(blk + PF_BYTES + 128);
        PREFETCH(blk + PF_BYTES + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i nsc32 = _mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), sc16), 5);
        const __m512i scales = _mm512_castsi256_si512(sc16);
        __m512i sumi[MAX_M];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            sumi[m] = _mm512_zextsi256_si512(
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + m * (K / 16) + 16 * s)), nsc32));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
#pragma GCC unroll 2
            for (int u = 0; u < 2; u++) {
                const __m512i nib = _mm512_and_si512(u ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
                const __m512i top = u ? _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_setzero_si512(),
                                                                                 _mm256_set1_epi16(2), 1))
                                      : _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4),
                                                                                 _mm256_set1_epi16(2), 1));
                const __m512i q = _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi8(0x30), 0xF8);
                const int pp = 2 * h + u;
                const __m512i sc = _mm512_permutexvar_epi16(
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16((short)(4 * pp + 1)),
                                                                _mm_set1_epi16((short)(4 * pp)))),
                        _mm256_set_m128i(_mm_set1_epi16((short)(4 * pp + 3)), _mm_set1_epi16((short)(4 * pp + 2))), 1),
                    scales);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const __m512i p = _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq + m * K + 256 * s + 64 * pp));
                    sumi[m] = _mm512_dpwssd_epi32(sumi[m], p, sc);
                }
            }
        }
        const float d = f16_to_f32(blk + 208);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[m]), _mm512_set1_ps(d * xd[m * S + s]), a0[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(a0[m]);
}

#define VK_ROWS(T)                                                                           \
    static __attribute__((noinline)) void vk_rows_##T(int M, const uint8_t *w,               \
                                                      const int8_t *xq, const float *xd,     \
                                                      const int16_t *bsum, int64_t K,        \
                                                      int64_t ldo, int64_t n0, int64_t n1,   \
                                                      float *out) {                          \
        FOR_ROWS(vk_row_##T, M, w, xq, xd, bsum, K, ldo);                                \
    }

/* Q4_K rows n, n + 1 of a decode step (M = 1): vk_row_kq's operations for each row, in the
 * same order (each row's result bit for bit vk_row_q4_k's; the scale picked by an in-lane byte
 * shuffle of the scales broadcast to every 128-bit lane instead of a cross-lane word permute, the
 * same integers), the two rows' chains interleaved and each activation vector and scale pattern
 * loaded once for both. One row is too little work per super-block for the core to hide its
 * scale unpacking and its reduction: two rows read 7-10% more bytes a second at 16384 x 2048,
 * hot and from memory (bench_quant_kernels.py --gguf --types Q4_K --rows 1 --activations q8,
 * 2-core Zen 4; from memory 0-5% at K 8192, up to a third at 3072; four rows were slower
 * again: docs/perf.md, 2026-12-06 "Q4_K rows in pairs"). The two rows are 2 S super-blocks of
 * contiguous bytes, prefetched as one stream, a row pair and PF_BYTES / 2 ahead (a prefetch
 * per row, as vk_row_kq's, lost a third of the speed from memory). */
static inline AI void vk_row2_q4_k(const uint8_t *w, const int8_t *xq, const float *xd,
                                   const int16_t *bsum, int64_t K, int64_t n, float *out) {
    const int64_t S = K / 256;
    const uint8_t *row0 = w + n * S * 144;
    __m512 a0[2];
    __m256 a1[2];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) {
        a0[r] = _mm512_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < S; s++) {
        __m512i scales[2], sumi[2];
        __m256i mins[2];
        float d[2], dmin[2];
        const uint8_t *pf = row0 + 288 * S + PF_BYTES / 2 + 288 * s;
        PREFETCH(pf);
        PREFETCH(pf + 64);
        PREFETCH(pf + 128);
        PREFETCH(pf + 192);
        PREFETCH(pf + 256);
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            const uint8_t *blk = row0 + (r * S + s) * 144;
            const __m256i sm16 = k_scales_mins16(blk);
            scales[r] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm16));
            mins[r] = k_mins_twice(sm16);
            d[r] = f16_to_f32(blk);
            dmin[r] = f16_to_f32(blk + 2);
            sumi[r] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i xv = _mm512_loadu_si512(xq + 256 * s + 64 * c);
            /* scale 2 c's two bytes in every 16-bit lane of bytes 0-31, 2 c + 1's in 32-63 */
            const __m512i pick = _mm512_inserti64x4(
                _mm512_set1_epi16((short)((4 * c + 1) << 8 | (4 * c))),
                _mm256_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))), 1);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                const uint8_t *qs = row0 + (r * S + s) * 144 + 16;
                const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
                const __m512i wv = _mm512_and_si512(
                    _mm512_mask_srli_epi16(bytes, (__mmask32)0xFFFF0000u, bytes, 4), _mm512_set1_epi8(0x0F));
                const __m512i sc = _mm512_shuffle_epi8(scales[r], pick);
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(wv, xv), sc);
            }
        }
        const float f = xd[s];
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsum + 16 * s));
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            const __m256i pm = _mm256_madd_epi16(bs, mins[r]);
            a0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_set1_ps(d[r] * f), a0[r]);
            a1[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin[r] * f), a1[r]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
        out[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], _mm512_zextps256_ps512(a1[r])));
}

/* The longest rows (elements) taken in pairs: a Llama-3.1-8B step (down's rows of 14336, 8 KB)
 * was 2-3% slower with them in pairs than one at a time, and 0.5-4% faster with only rows of
 * up to 8192 in pairs (forward median / mean, the three alternated within one process) */
#define PAIR_MAX_K 8192

/* rows n0..n1 of Q4_K: a decode step's in pairs (vk_row2_q4_k) up to PAIR_MAX_K, else
 * vk_row_q4_k's M rows */
static __attribute__((noinline)) void vk_rows_q4_k(int M, const uint8_t *w, const int8_t *xq,
                                                   const float *xd, const int16_t *bsum,
                                                   int64_t K, int64_t ldo, int64_t n0, int64_t n1,
                                                   float *out) {
    if (M == 1 && K <= PAIR_MAX_K) {
        int64_t n = n0;
        for (; n + 1 < n1; n += 2) vk_row2_q4_k(w, xq, xd, bsum, K, n, out);
        if (n < n1) vk_row_q4_k(1, w, xq, xd, bsum, K, ldo, n, out);
        return;
    }
    FOR_ROWS(vk_row_q4_k, M, w, xq, xd, bsum, K, ldo);
}

VK_ROWS(q5_k)
VK_ROWS(q6_k)
#undef VK_ROWS

/* Rows n0..n1 of a type's product on the VNNI body */
static void v_rows(int type, int M, const uint8_t *w, const q8v_act *A, int64_t ldo, int64_t n0,
                   int64_t n1, float *out) {
    switch (type) {
        case GGML_Q8_0: v_rows_q8_0(M, w, A, ldo, n0, n1, out); break;
        case GGML_Q4_0: v_rows_q4_0(M, w, A, ldo, n0, n1, out); break;
        case GGML_Q4_1: v_rows_q4_1(M, w, A, ldo, n0, n1, out); break;
        case GGML_Q5_0: v_rows_q5_0(M, w, A, ldo, n0, n1, out); break;
        case GGML_Q5_1: v_rows_q5_1(M, w, A, ldo, n0, n1, out); break;
    }
}

/* ---- the large steps' VNNI kernel: output rows across the lanes -----------------------
 *
 * The one-row kernel above (v_row_32) keeps, per (activation row m, weight row n), 16 fp32
 * chains: chain L takes block L of each group of 16 (block 16 q + L), one fused
 * multiply-add of cvt(the block's exact integer dot) times (the weight block's scale * the
 * activation block's xd, one rounded product), then Q4_1 / Q5_1's fma(m, xds), group after
 * group; a row's result is the 16 chains summed in _mm512_reduce_add_ps's tree. Every chain is
 * its own sequence of scalar operations, so it may sit anywhere: here a vector holds chain L of
 * 16 weight rows (a tile), so
 *   - a block's integer dot is 8 dpbusd of the tile's unpacked lanes with the activations'
 *     four bytes broadcast, for all 16 rows;
 *   - the rounded product of scales is one multiply per block for 16 rows;
 *   - the weights are unpacked once per tile (into [pair][lane][row][4 bytes]) and read by
 *     every activation row;
 * and each (m, n, chain) does the same fused multiply-adds in the same order, its sums the
 * same tree (as 16 vertical adds), so its bits are the one-row kernel's.
 * The integer dot products are exact, so they are taken as (unsigned weights) . (signed
 * activations): the signed types' weights are stored with their bias b added (Q8_0 128,
 * Q4_0 8, Q5_0 16, Q6_K 32, i.e. their unsigned codes) and each block's dot starts from -b
 * times the sum of its activations (per activation row, once per call: vf_act_row).
 * Threads split the tiles; a tile's K runs in chunks of VL_KC pairs (VL_KC / 8 groups) over
 * groups of VL_MB activation rows, their accumulators kept in the tile's scratch between
 * chunks, so the chunk's unpacked weights stay in L1 while the group's rows meet them. */
#define VL_KC 16
#define VL_MB 8

typedef struct {
    uint8_t *wq; /* [P][16 lanes][16 rows][4] the unsigned codes */
    float *dsc;  /* [P][NS][16]: per half pair (Q6_K: quarter) the weights' scale, 0 past K */
    float *mn;   /* Q4_1 / Q5_1 [P][2][16] the block's m; Q4_K / Q5_K [S][8][16] dmin * m_j */
    float *acc;  /* [VL_MB][16][16] the accumulators between chunks */
} vl_tile;

static inline AI int vl_ns(int type) { return type == GGML_Q6_K ? 4 : 2; }

/* the bias added to a type's weights to make them unsigned codes (0: they are) */
static int vl_bias(int type) {
    switch (type) {
        case GGML_Q8_0: return 128;
        case GGML_Q4_0: return 8;
        case GGML_Q5_0: return 16;
        case GGML_Q6_K: return 32;
        default: return 0;
    }
}

/* 16 vectors r[row] of 16 dwords -> r[dword] of 16 rows */
static inline AI void vl_transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    /* b[4 i + j], 128-bit lane c: dword 4 c + j of rows 4 i .. 4 i + 3 */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i e0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44);
        const __m512i e1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i e2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i e3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(e0, e2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(e1, e3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
    }
}

/* Pair p of a row (type T, G groups) as 64 unsigned codes, and its scales into d[NS] (and
 * Q4_1 / Q5_1's m into mo[2]); Q4_K / Q5_K write dmin * m_j into mo[8] at each super-block's
 * first pair. The values are the one-row kernel's (the same conversions, the same rounded
 * products), so its lanes' factors are these times the activations' xd. */
static inline AI __m512i vl_unpack(const int type, const uint8_t *row, int64_t G, int64_t p,
                                   float *d, float *mo) {
    if (type == GGML_Q6_K) {
        const int pp = (int)(p & 3);
        const uint8_t *blk = row + (p >> 2) * 210;
        const int h = pp >> 1, u = pp & 1;
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        const __m512i nib = _mm512_and_si512(u ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
        const __m512i top = u ? _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_setzero_si512(),
                                                                         _mm256_set1_epi16(2), 1))
                              : _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4),
                                                                         _mm256_set1_epi16(2), 1));
        const float dd = f16_to_f32(blk + 208);
        for (int q = 0; q < 4; q++) d[q] = dd * (float)(int8_t)blk[192 + 4 * pp + q];
        return _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi8(0x30), 0xF8);
    }
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        const int five = type == GGML_Q5_K, c = (int)(p & 3);
        const uint8_t *blk = row + (p >> 2) * (five ? 176 : 144);
        float D[8], DM[8];
        prep_q4_k(blk, D, DM);
        d[0] = D[2 * c];
        d[1] = D[2 * c + 1];
        if (c == 0) memcpy(mo, DM, sizeof DM);
        const __m512i bytes = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * c)));
        __m512i wv = _mm512_and_si512(_mm512_mask_srli_epi16(bytes, (__mmask32)0xFFFF0000u, bytes, 4),
                                      _mm512_set1_epi8(0x0F));
        if (five) {
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                   _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
            wv = _mm512_mask_add_epi8(wv, _mm512_test_epi8_mask(qh, bit), wv, _mm512_set1_epi8(16));
        }
        return wv;
    }
    const int BB = v_block_bytes(type);
    const uint8_t *b0 = row + 2 * p * BB;
    const int last = 2 * p + 1 >= G; /* the row's last block alone */
    const uint8_t *b1 = last ? b0 : b0 + BB;
    __m512i w;
    switch (type) {
        case GGML_Q8_0: w = _mm512_xor_si512(v_w_q8_0(b0, b1), _mm512_set1_epi8((char)0x80)); break;
        case GGML_Q4_0: w = v_nib64(b0 + 2, b1 + 2); break;
        case GGML_Q4_1: w = v_w_q4_1(b0, b1); break;
        case GGML_Q5_0: w = _mm512_add_epi8(v_w_q5_0(b0, b1), _mm512_set1_epi8(16)); break;
        default: w = v_w_q5_1(b0, b1); break;
    }
    d[0] = f16_to_f32(b0);
    d[1] = last ? 0.0f : f16_to_f32(b1);
    if (type == GGML_Q4_1 || type == GGML_Q5_1) {
        mo[0] = f16_to_f32(b0 + 2);
        mo[1] = last ? 0.0f : f16_to_f32(b1 + 2);
    }
    return last ? _mm512_maskz_mov_epi8((__mmask64)0xFFFFFFFFull, w) : w;
}

/* Unpack weight rows n0 .. n0 + nv - 1 (nv <= 16; the other lanes zero) into T */
static inline AI void vl_pack(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                              int nv, int64_t G, int64_t P, const vl_tile *T) {
    const int NS = vl_ns(type);
    for (int64_t p = 0; p < P; p++) {
        __m512i r[16];
        float d[16][4], mo[16][8];
        for (int j = 0; j < 16; j++) {
            if (j < nv) {
                r[j] = vl_unpack(type, w + (n0 + j) * row_bytes, G, p, d[j], mo[j]);
            } else {
                r[j] = _mm512_setzero_si512();
                for (int q = 0; q < 4; q++) d[j][q] = 0.0f;
                for (int q = 0; q < 8; q++) mo[j][q] = 0.0f;
            }
        }
        vl_transpose16(r);
        for (int l = 0; l < 16; l++) _mm512_storeu_si512(T->wq + p * 1024 + 64 * l, r[l]);
        for (int q = 0; q < NS; q++)
            for (int j = 0; j < 16; j++) T->dsc[(p * NS + q) * 16 + j] = d[j][q];
        if (type == GGML_Q4_1 || type == GGML_Q5_1)
            for (int q = 0; q < 2; q++)
                for (int j = 0; j < 16; j++) T->mn[(p * 2 + q) * 16 + j] = mo[j][q];
        if ((type == GGML_Q4_K || type == GGML_Q5_K) && (p & 3) == 0)
            for (int q = 0; q < 8; q++)
                for (int j = 0; j < 16; j++) T->mn[((p >> 2) * 8 + q) * 16 + j] = mo[j][q];
    }
}

/* Activation row m against the tile's groups qa .. qb - 1 (16 blocks each): acc[L] += lane
 * L's terms, v_row_32's for each of the tile's 16 weight rows. A block's integer dot is its 8
 * lanes' dpbusd, started from its signed start; then the same float steps in the same order.
 * xq the row's bytes (A's layout); xd, xds, xgs [2 P] its blocks' xd, xds and (signed types;
 * else NULL) -bias times the block's activation sum, as vf_act_row lays them out. */
static inline AI void vl_groups(const int type, const vl_tile *T, const int8_t *xq,
                                const float *xd, const float *xds, const int32_t *xgs, int64_t G,
                                int64_t qa, int64_t qb, __m512 acc[16]) {
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1;
    for (int64_t q = qa; q < qb; q++) {
#pragma GCC unroll 16
        for (int L = 0; L < 16; L++) {
            const int64_t b = v_lane_block(G, q, L);
            if (b < 0) continue;
            const int64_t p = b >> 1, h = b & 1;
            const uint8_t *wq = T->wq + p * 1024 + 512 * h;
            __m512i dot = xgs != NULL ? _mm512_set1_epi32(xgs[b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                int32_t xv;
                memcpy(&xv, xq + 64 * p + 32 * h + 4 * j, 4);
                dot = _mm512_dpbusd_epi32(dot, _mm512_loadu_si512(wq + 64 * j), _mm512_set1_epi32(xv));
            }
            acc[L] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(_mm512_loadu_ps(T->dsc + (2 * p + h) * 16), _mm512_set1_ps(xd[b])),
                                     acc[L]);
            if (mins)
                acc[L] = _mm512_fmadd_ps(_mm512_loadu_ps(T->mn + (2 * p + h) * 16), _mm512_set1_ps(xds[b]), acc[L]);
        }
    }
}

/* The tile's 16 results of an activation row from its lanes' accumulators, summed in
 * _mm512_reduce_add_ps's tree as v_row_32 sums a row's lanes, stored to o[0 .. nv - 1]. */
static inline AI void vl_finish(__m512 acc[16], float *o, int nv) {
    __m512 t[8];
    /* _mm512_reduce_add_ps: (hi 8 + lo 8), (hi 4 + lo 4), (0 + 2, 1 + 3), (0 + 1) */
    for (int i = 0; i < 8; i++) t[i] = _mm512_add_ps(acc[8 + i], acc[i]);
    for (int i = 0; i < 4; i++) t[i] = _mm512_add_ps(t[4 + i], t[i]);
    const __m512 r = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
    _mm512_mask_storeu_ps(o, (__mmask16)((1u << nv) - 1u), r);
}

/* One tile (weight rows n0 .. n0 + nv - 1) against activation rows m0 .. m1 - 1 (xd, xds, xgs:
 * vf_act_row's [M, 2 P] per row; xgs NULL for the unsigned types) */
static inline AI void vl_tile_rows(const int type, const uint8_t *w, int64_t row_bytes,
                                   const q8v_act *A, const float *xd, const float *xds,
                                   const int32_t *xgs, int64_t m0, int64_t m1, int64_t n0, int nv,
                                   const vl_tile *T, float *out, int64_t ldo) {
    const int64_t P = A->P, Q = A->Q;
    vl_pack(type, w, row_bytes, n0, nv, A->G, P, T);
    for (int64_t ma = m0; ma < m1; ma += VL_MB) {
        const int64_t mb = ma + VL_MB < m1 ? ma + VL_MB : m1;
        for (int64_t qa = 0; qa < Q; qa += VL_KC / 8) {
            const int64_t qb = qa + VL_KC / 8 < Q ? qa + VL_KC / 8 : Q;
            for (int64_t m = ma; m < mb; m++) {
                __m512 acc[16];
                float *keep = T->acc + (m - ma) * 256;
#pragma GCC unroll 16
                for (int l = 0; l < 16; l++)
                    acc[l] = qa == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(keep + 16 * l);
                vl_groups(type, T, A->xq + m * A->Kp, xd + m * 2 * P, xds + m * 2 * P,
                          xgs != NULL ? xgs + m * 2 * P : NULL, A->G, qa, qb, acc);
                if (qb < Q) {
#pragma GCC unroll 16
                    for (int l = 0; l < 16; l++) _mm512_storeu_ps(keep + 16 * l, acc[l]);
                } else {
                    vl_finish(acc, out + m * ldo + n0, nv);
                }
            }
        }
    }
}

#define VL_TYPE(T, TYPE)                                                                     \
    static __attribute__((noinline)) void vl_tile_##T(                                        \
        const uint8_t *w, int64_t row_bytes, const q8v_act *A, const float *xd,               \
        const float *xds, const int32_t *xgs, int64_t m0, int64_t m1, int64_t n0, int nv,     \
        const vl_tile *Tl, float *out, int64_t ldo) {                                         \
        vl_tile_rows(TYPE, w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, Tl, out, ldo);      \
    }
VL_TYPE(q8_0, GGML_Q8_0)
VL_TYPE(q4_0, GGML_Q4_0)
VL_TYPE(q4_1, GGML_Q4_1)
VL_TYPE(q5_0, GGML_Q5_0)
VL_TYPE(q5_1, GGML_Q5_1)
#undef VL_TYPE

static void vl_tile_any(int type, const uint8_t *w, int64_t row_bytes, const q8v_act *A,
                        const float *xd, const float *xds, const int32_t *xgs, int64_t m0,
                        int64_t m1, int64_t n0, int nv, const vl_tile *T, float *out,
                        int64_t ldo) {
    switch (type) {
        case GGML_Q8_0: vl_tile_q8_0(w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q4_0: vl_tile_q4_0(w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q4_1: vl_tile_q4_1(w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q5_0: vl_tile_q5_0(w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q5_1: vl_tile_q5_1(w, row_bytes, A, xd, xds, xgs, m0, m1, n0, nv, T, out, ldo); break;
    }
}

/* ---- the default engine's large steps on VNNI: whole groups in int32 ------------------
 *
 * The tiles above keep the one-row kernel's 16 chains per output and their sum, so that a
 * row's bits are the decode step's (the batch-invariant switch needs that), at 16
 * accumulators per activation row kept in scratch. The default engine's large steps need no
 * such tie, so here a weight group's integer dot (32 elements; Q6_K 16) takes its float step
 * in one chain per output, in registers:
 * per group and activation row 16 / NS dpbusd, one cvt, one multiply (the weights' scales
 * times the row's xd) and one FMA (a second for Q4_1 / Q5_1's m and the K-types' min), for 16
 * weight rows at once (the tile's lanes: the rows' results land in one vector, no reduction).
 * VF_MB activation rows share each weight vector (a register), their broadcast bytes a memory
 * operand. The integer dots are exact, so the numbers are those of the decode step's product
 * up to the fp32 order of the groups' terms.
 *   Signed types (stored with their bias b added): a group's dot starts from -b times the sum
 * of its activation bytes (xgs [M, P * NS], once per call). */
#define VF_MB 8

static inline AI void vf_tile_rows(const int type, const uint8_t *w, int64_t row_bytes,
                                   const q8v_act *A, const float *xd, const float *xds2,
                                   const int32_t *xgs, int64_t m0, int64_t m1, int64_t n0, int nv,
                                   const vl_tile *T, float *out, int64_t ldo) {
    const int64_t P = A->P, Kp = A->Kp;
    const int NS = vl_ns(type), LG = 16 / NS;
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1, kmins = type == GGML_Q4_K || type == GGML_Q5_K;
    vl_pack(type, w, row_bytes, n0, nv, A->G, P, T);
    const __mmask16 keep = (__mmask16)((1u << nv) - 1u);
    for (int64_t ma = m0; ma < m1; ma += VF_MB) {
        /* rows past m1 repeat row m1 - 1 (computed, not stored) */
        int64_t mr[VF_MB];
#pragma GCC unroll 8
        for (int i = 0; i < VF_MB; i++) mr[i] = ma + i < m1 ? ma + i : m1 - 1;
        __m512 acc[VF_MB];
#pragma GCC unroll 8
        for (int i = 0; i < VF_MB; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *wq = T->wq + p * 1024;
#pragma GCC unroll 4
            for (int q = 0; q < NS; q++) {
                const int g2 = (int)(2 * p) + q * 2 / NS; /* the activations' block of 32 */
                __m512i ia[VF_MB];
#pragma GCC unroll 8
                for (int i = 0; i < VF_MB; i++)
                    ia[i] = xgs != NULL ? _mm512_set1_epi32(xgs[mr[i] * P * NS + p * NS + q])
                                        : _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int l = q * LG; l < (q + 1) * LG; l++) {
                    const __m512i wv = _mm512_loadu_si512(wq + 64 * l);
#pragma GCC unroll 8
                    for (int i = 0; i < VF_MB; i++) {
                        int32_t xv;
                        memcpy(&xv, A->xq + mr[i] * Kp + 64 * p + 4 * l, 4);
                        ia[i] = _mm512_dpbusd_epi32(ia[i], wv, _mm512_set1_epi32(xv));
                    }
                }
                const __m512 dsc = _mm512_loadu_ps(T->dsc + (p * NS + q) * 16);
#pragma GCC unroll 8
                for (int i = 0; i < VF_MB; i++)
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]),
                                             _mm512_mul_ps(dsc, _mm512_set1_ps(xd[mr[i] * 2 * P + g2])),
                                             acc[i]);
                if (mins) {
                    const __m512 mn = _mm512_loadu_ps(T->mn + (p * 2 + q) * 16);
#pragma GCC unroll 8
                    for (int i = 0; i < VF_MB; i++)
                        acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xds2[mr[i] * 2 * P + g2]), acc[i]);
                } else if (kmins) {
                    const __m512 mn = _mm512_loadu_ps(T->mn + ((p >> 2) * 8 + 2 * (p & 3) + q) * 16);
#pragma GCC unroll 8
                    for (int i = 0; i < VF_MB; i++)
                        acc[i] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xds2[mr[i] * 2 * P + g2]), acc[i]);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < VF_MB; i++)
            if (ma + i < m1) _mm512_mask_storeu_ps(out + (ma + i) * ldo + n0, keep, acc[i]);
    }
}

#define VF_TYPE(T, TYPE)                                                                     \
    static __attribute__((noinline)) void vf_tile_##T(                                        \
        const uint8_t *w, int64_t row_bytes, const q8v_act *A, const float *xd,               \
        const float *xds2, const int32_t *xgs, int64_t m0, int64_t m1, int64_t n0, int nv,    \
        const vl_tile *Tl, float *out, int64_t ldo) {                                         \
        vf_tile_rows(TYPE, w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, Tl, out, ldo);     \
    }
VF_TYPE(q8_0, GGML_Q8_0)
VF_TYPE(q4_0, GGML_Q4_0)
VF_TYPE(q4_1, GGML_Q4_1)
VF_TYPE(q5_0, GGML_Q5_0)
VF_TYPE(q5_1, GGML_Q5_1)
VF_TYPE(q4_k, GGML_Q4_K)
VF_TYPE(q5_k, GGML_Q5_K)
VF_TYPE(q6_k, GGML_Q6_K)
#undef VF_TYPE

static void vf_tile_any(int type, const uint8_t *w, int64_t row_bytes, const q8v_act *A,
                        const float *xd, const float *xds2, const int32_t *xgs, int64_t m0,
                        int64_t m1, int64_t n0, int nv, const vl_tile *T, float *out,
                        int64_t ldo) {
    switch (type) {
        case GGML_Q8_0: vf_tile_q8_0(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q4_0: vf_tile_q4_0(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q4_1: vf_tile_q4_1(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q5_0: vf_tile_q5_0(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q5_1: vf_tile_q5_1(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q4_K: vf_tile_q4_k(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q5_K: vf_tile_q5_k(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
        case GGML_Q6_K: vf_tile_q6_k(w, row_bytes, A, xd, xds2, xgs, m0, m1, n0, nv, T, out, ldo); break;
    }
}

/* Activation row m's extras for vf_tile_rows: xd and xds [2 P] (0 past K), and for a signed
 * type (bias > 0) each group's dot start [P * NS]: -bias times its activation bytes' sum */
static void vf_act_row(const q8v_act *A, int64_t m, int type, int bias, float *xd, float *xds2,
                       int32_t *xgs) {
    const int64_t P = A->P, G = A->G;
    const int NS = vl_ns(type), LG = 16 / NS;
    for (int64_t g = 0; g < 2 * P; g++) {
        xd[m * 2 * P + g] = g < G ? A->xd[m * G + g] : 0.0f;
        xds2[m * 2 * P + g] = g < G ? A->xds[m * G + g] : 0.0f;
    }
    if (bias == 0) return;
    const int8_t *xq = A->xq + m * A->Kp;
    for (int64_t p = 0; p < P; p++)
        for (int q = 0; q < NS; q++) {
            int32_t s = 0;
            for (int k = 0; k < 4 * LG; k++) s += xq[64 * p + 4 * LG * q + k];
            xgs[m * P * NS + p * NS + q] = -bias * s;
        }
}

/* The activations' layout (q8v_act) for M rows of K elements in one buffer at buf (NULL: only
 * its size); returns its size in bytes */
static size_t vnni_act_layout(int64_t M, int64_t K, void *buf, q8v_act *A) {
    const int64_t G = K / 32, P = (G + 1) / 2, Q = (G + 15) / 16, Kp = 64 * P;
    /* xd, xds fp32 [M, G]; xdl, xsl fp32 [M, Q, 16]; xcs int32 [M, Q, 16]; xt int32
     * [M, Q, 8, 16]; xq [M, Kp] */
    const size_t bytes = sizeof(float) * (size_t)(2 * M * G + 3 * M * Q * 16 + M * Q * 128) + (size_t)(M * Kp);
    if (buf == NULL) return bytes;
    float *xd = (float *)buf, *xds = xd + M * G, *xdl = xds + M * G, *xsl = xdl + M * Q * 16;
    int32_t *xcs = (int32_t *)(xsl + M * Q * 16), *xt = xcs + M * Q * 16;
    int8_t *xq = (int8_t *)(xt + M * Q * 128);
    const q8v_act a = {xq, xd, xds, xdl, xsl, xcs, xt, G, P, Q, Kp};
    *A = a;
    return bytes;
}

/* Row m of x [M, K] rounded (as quantize_row_q8 does: a row's layout does not depend on M) into
 * A's xq, xd, xds (vnni_act_layout's, over a writable buffer), and where `layout`, also laid out
 * for the one-row kernel (xt, xcs, xdl, xsl; the large steps read none of them) */
static void vnni_act_row(const float *x, int64_t K, int64_t m, const q8v_act *A, int layout) {
    const int64_t G = A->G, Q = A->Q, Kp = A->Kp;
    int8_t *xq = (int8_t *)A->xq;
    float *xd = (float *)A->xd, *xds = (float *)A->xds, *xdl = (float *)A->xdl, *xsl = (float *)A->xsl;
    int32_t *xcs = (int32_t *)A->xcs, *xt = (int32_t *)A->xt;
    int8_t *q = xq + m * Kp;
    quantize_row_q8(x + m * K, K, q, xd + m * G, xds + m * G);
    memset(q + K, 0, (size_t)(Kp - K));
    for (int64_t g = 0; layout && g < Q; g++) {
        const int64_t left = G - 16 * g < 16 ? G - 16 * g : 16, f = (m * Q + g) * 16;
        if (left <= 2) { /* v_group1's lanes 0 and 8 */
            for (int l = 0; l < 16; l++) {
                const int64_t b = v_lane_block(G, g, l);
                int32_t sum = 0;
                if (b >= 0)
                    for (int k = 0; k < 32; k++) sum += q[32 * b + k];
                xdl[f + l] = b >= 0 ? xd[m * G + b] : 0.0f;
                xsl[f + l] = b >= 0 ? xds[m * G + b] : 0.0f;
                xcs[f + l] = sum;
            }
            continue;
        }
        /* block 16 g + L in lane L: its dwords transposed as v_group_codes' codes */
        __m512i V[8];
        v_transpose16((const uint8_t *)(q + 512 * g), 32, 0, left, V);
        v_transpose16((const uint8_t *)(q + 512 * g), 32, 16, left, V + 4);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_si512(xt + (m * Q + g) * 128 + 16 * j, V[j]);
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), V[j]);
        }
        _mm512_storeu_si512(xcs + f, sum);
        const __mmask16 have = (__mmask16)((1u << left) - 1u);
        _mm512_storeu_ps(xdl + f, _mm512_maskz_loadu_ps(have, xd + m * G + 16 * g));
        _mm512_storeu_ps(xsl + f, _mm512_maskz_loadu_ps(have, xds + m * G + 16 * g));
    }
}

/* The activations of M rows rounded into q8v_act's xq, xd, xds (the large steps'; the rest of
 * the layout allocated, not written), in one buffer *buf (the caller frees it), the rows across
 * num_threads. Returns 0, or -1 (an allocation failure). */
static int vnni_act(const float *x, int64_t M, int64_t K, int num_threads, q8v_act *A,
                    float **buf) {
    float *b = (float *)malloc(vnni_act_layout(M, K, NULL, A));
    if (b == NULL) return -1;
    vnni_act_layout(M, K, b, A);
    const int threads = M > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; m++) vnni_act_row(x, K, m, A, 0);
    *buf = b;
    return 0;
}

#undef V_ROWS

#pragma GCC pop_options

/* The VNNI body's product (arguments checked by the caller): the activations rounded and
 * laid out as q8v_act says, once, then the rows in blocks across the threads. */
static int gemm_q8_vnni(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                        int64_t N, int64_t K, int64_t ldo, int num_threads) {
    q8v_act A;
    float *buf = (float *)malloc(vnni_act_layout(M, K, NULL, &A));
    if (buf == NULL) return -1;
    vnni_act_layout(M, K, buf, &A);
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t chunk = row_chunk(type, K, ROW_BLOCK, num_blocks, num_threads);
    /* one region: the rows rounded across the threads, then the weight rows */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) vnni_act_row(x, K, m, &A, 1);
#pragma omp for schedule(guided, chunk)
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t n0 = b * ROW_BLOCK, n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
            v_rows(type, (int)M, w, &A, ldo, n0, n1, out);
        }
    }
    free(buf);
    return 0;
}

/* The large steps' VNNI product (arguments checked by the caller): the activations rounded
 * and laid out once (with vf_act_row's extras), then, for each span of activation rows whose
 * bytes fit in VL_SPAN_BYTES (they stay in L2 while every tile meets them), tiles of 16 weight
 * rows across the threads, each unpacked into the thread's scratch and met by every row of the
 * span: vl_groups' lanes (each row the decode step's bits), or where `fast` vf_tile_rows' one
 * chain per row. Returns 0, or -1 (an allocation failure). */
#define VL_SPAN_BYTES (320 * 1024)
static int gemm_q8_vnni_large(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                              int64_t N, int64_t K, int64_t ldo, int num_threads, int fast) {
    int64_t E, B;
    pagedkv_gguf_block(type, &E, &B);
    q8v_act A;
    float *buf;
    if (vnni_act(x, M, K, num_threads, &A, &buf)) return -1;
    const int64_t P = A.P, row_bytes = K / E * B, num_tiles = (N + 15) / 16;
    const int bias = vl_bias(type), NS = type == GGML_Q6_K ? 4 : 2; /* vl_ns */
    /* per thread: wq P KiB, dsc P * 4 * 64 B, mn P * 128 B, acc VL_MB KiB */
    const size_t tile_bytes = (size_t)(P * (1024 + 256 + 128) + VL_MB * 1024 + 64) & ~(size_t)63;
    const int threads = num_tiles < num_threads ? (int)(num_tiles > 0 ? num_tiles : 1) : num_threads;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, tile_bytes * (size_t)threads);
    /* xd, xds2 [M, 2 P]; for a signed type xgs [M, P * NS] */
    float *xd = (float *)malloc(sizeof(float) * (size_t)(M * 2 * P * 2));
    int32_t *xgs = bias != 0 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * P * NS)) : NULL;
    if (scratch == NULL || xd == NULL || (bias != 0 && xgs == NULL)) {
        free(scratch);
        free(xd);
        free(xgs);
        free(buf);
        return -1;
    }
    float *xds2 = xd + M * 2 * P;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++) vf_act_row(&A, m, type, bias, xd, xds2, xgs);
    /* a span: the rows' bytes (xq, xd, xds2, xgs) in VL_SPAN_BYTES, a multiple of VL_MB rows */
    int64_t span = VL_SPAN_BYTES / (A.Kp + 16 * P + (bias != 0 ? 4 * P * NS : 0));
    span = span < VL_MB ? VL_MB : span / VL_MB * VL_MB;
    for (int64_t m0 = 0; m0 < M; m0 += span) {
        const int64_t m1 = m0 + span < M ? m0 + span : M;
#pragma omp parallel num_threads(threads)
        {
            uint8_t *mine = thread_scratch(scratch, (int64_t)tile_bytes);
            const vl_tile T = {mine, (float *)(mine + P * 1024), (float *)(mine + P * (1024 + 256)),
                               (float *)(mine + P * (1024 + 256 + 128))};
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_tiles; b++) {
                const int64_t n0 = 16 * b;
                const int nv = (int)(N - n0 < 16 ? N - n0 : 16);
                if (fast)
                    vf_tile_any(type, w, row_bytes, &A, xd, xds2, xgs, m0, m1, n0, nv, &T, out, ldo);
                else
                    vl_tile_any(type, w, row_bytes, &A, xd, xds2, xgs, m0, m1, n0, nv, &T, out, ldo);
            }
        }
    }
    free(scratch);
    free(xd);
    free(xgs);
    free(buf);
    return 0;
}

static int is_k_type(int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

/* Rows n0..n1 of a K-type's product for mc <= MAX_M activation rows (quantize_row_q8k's xq, xd,
 * bsum): q8k_rows_* on the AVX2 body, vk_rows_* on the VNNI one (`vnni`) */
static void k_rows(int type, int vnni, int mc, const uint8_t *w, const int8_t *xq,
                   const float *xd, const int16_t *bsum, int64_t K, int64_t ldo, int64_t n0,
                   int64_t n1, float *out) {
    if (vnni) {
        switch (type) {
            case GGML_Q4_K: vk_rows_q4_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
            case GGML_Q5_K: vk_rows_q5_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
            default: vk_rows_q6_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
        }
    } else {
        switch (type) {
            case GGML_Q4_K: q8k_rows_q4_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
            case GGML_Q5_K: q8k_rows_q5_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
            default: q8k_rows_q6_k(mc, w, xq, xd, bsum, K, ldo, n0, n1, out); break;
        }
    }
}

/* The K-types' int8 product (arguments checked by the caller; K a multiple of 256, any M >= 1):
 * every activation row rounded by quantize_row_q8k once (one buffer: xd fp32 [M, K / 256],
 * bsum int16 [M, K / 16], xq int8 [M, K]), then blocks of `rows` weight rows across the
 * threads, each met by the activation rows in groups of up to MAX_M (q8k_rows_* on the AVX2
 * body, vk_rows_* on the VNNI one, `vnni`). A row's result depends on neither M, the grouping,
 * `rows` nor the threads: the row kernels keep every activation row's sums apart, so each is
 * bit for bit that row's product alone. Returns 0, or -1 (an allocation failure). */
static int gemm_q8k(int type, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                    int64_t K, int64_t ldo, int num_threads, int vnni, int64_t rows) {
    const int64_t S = K / 256, H = K / 16;
    float *xd = (float *)malloc(sizeof(float) * M * S + sizeof(int16_t) * M * H + (size_t)(M * K));
    if (xd == NULL) return -1;
    int16_t *bsum = (int16_t *)(xd + M * S);
    int8_t *xq = (int8_t *)(bsum + M * H);
    /* no OpenMP region for a step's few rows */
    const int qthreads = M > MAX_M ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(qthreads) if (qthreads > 1)
    for (int64_t m = 0; m < M; m++) quantize_row_q8k(x + m * K, K, xq + m * K, xd + m * S, bsum + m * H);
    const int64_t num_blocks = (N + rows - 1) / rows;
    const int64_t chunk = row_chunk(type, K, rows, num_blocks, num_threads);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * rows, n1 = n0 + rows < N ? n0 + rows : N;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = (int)(M - m0 < MAX_M ? M - m0 : MAX_M);
            const int8_t *q = xq + m0 * K;
            const float *d = xd + m0 * S;
            const int16_t *bs = bsum + m0 * H;
            float *o = out + m0 * ldo;
            k_rows(type, vnni, mc, w, q, d, bs, K, ldo, n0, n1, o);
        }
    }
    free(xd);
    return 0;
}

/* A stacked product's parts (at most 8; K already checked a multiple of their blocks): part p's
 * first block of ROW_BLOCK rows in first_block[p] and first output column in col[p] (both
 * [num_parts + 1], the totals last), their weight bytes in *bytes. Returns 0, or -1 for a
 * negative row count, an unknown type or columns past ldo. */
static int parts_blocks(int num_parts, const int *types, const int64_t *rows, int64_t K,
                        int64_t ldo, int64_t *first_block, int64_t *col, int64_t *bytes) {
    first_block[0] = 0;
    col[0] = 0;
    *bytes = 0;
    for (int p = 0; p < num_parts; p++) {
        int64_t E = 0, B = 0;
        if (rows[p] < 0 || pagedkv_gguf_block(types[p], &E, &B)) return -1;
        first_block[p + 1] = first_block[p] + (rows[p] + ROW_BLOCK - 1) / ROW_BLOCK;
        col[p + 1] = col[p] + rows[p];
        *bytes += rows[p] * (K / E * B);
    }
    return col[num_parts] > ldo ? -1 : 0;
}

/* schedule(guided, chunk)'s minimum chunk for a stacked product's `total` blocks of `bytes`
 * weight bytes together: row_chunk's rule (single blocks from GUIDED_MIN_BYTES on, else a
 * static share per thread) */
static inline int64_t parts_chunk(int64_t total, int64_t bytes, int num_threads) {
    if (num_threads <= 1 || bytes >= GUIDED_MIN_BYTES) return 1;
    return (total + num_threads - 1) / num_threads;
}

/* Block b of a stacked product's parts (first_block from parts_blocks): its part in *p and
 * its rows n0..n1 of that part */
static inline int part_block(const int64_t *first_block, const int64_t *rows, int64_t b,
                             int64_t *n0, int64_t *n1) {
    int p = 0;
    while (b >= first_block[p + 1]) p++;
    *n0 = (b - first_block[p]) * ROW_BLOCK;
    *n1 = *n0 + ROW_BLOCK < rows[p] ? *n0 + ROW_BLOCK : rows[p];
    return p;
}

/* The K-type parts of a stacked product (q, k, v; gate, up) in one call: x rounded by
 * quantize_row_q8k once, then one OpenMP region over every part's blocks of ROW_BLOCK rows
 * (part p writes the output columns after those of parts 0..p-1), instead of one rounding and
 * one region (start, barrier) per part: at batch 1 a small part is read in microseconds (a 1B
 * model's k: 0.6 MB), and the threads wait at each part's end. Each row's result is
 * bit for bit gemm_q8k's (the same row kernels on the same rounded activations), whatever the
 * grouping. Arguments as pagedkv_gguf_gemm_q8_ld's, per part (types[p], ws[p] its rows[p]
 * rows). Returns 0; 1, having done nothing, where a part is not a K-type (the caller runs the
 * parts one by one); -1 for bad sizes or an allocation failure. */
int pagedkv_gguf_gemm_q8k_parts(int num_parts, const int *types, const uint8_t *const *ws,
                                const int64_t *rows, const float *x, float *out, int64_t M,
                                int64_t K, int64_t ldo, int num_threads, int isa) {
    if (num_parts < 1 || num_parts > 8) return -1;
    for (int p = 0; p < num_parts; p++)
        if (!is_k_type(types[p])) return 1;
    if (M < 1 || M > MAX_M || K <= 0 || K % 256 != 0) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512 && isa != PAGEDKV_ISA_AVX512_VNNI)
        return -1;
    int64_t first_block[9], col[9], bytes;
    if (parts_blocks(num_parts, types, rows, K, ldo, first_block, col, &bytes)) return -1;
    const int64_t total = first_block[num_parts];
    const int64_t S = K / 256, H = K / 16;
    float *xd = (float *)malloc(sizeof(float) * M * S + sizeof(int16_t) * M * H + (size_t)(M * K));
    if (xd == NULL) return -1;
    int16_t *bsum = (int16_t *)(xd + M * S);
    int8_t *xq = (int8_t *)(bsum + M * H);
    for (int64_t m = 0; m < M; m++) quantize_row_q8k(x + m * K, K, xq + m * K, xd + m * S, bsum + m * H);
    const int vnni = isa == PAGEDKV_ISA_AVX512_VNNI;
    const int64_t chunk = parts_chunk(total, bytes, num_threads);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
    for (int64_t b = 0; b < total; b++) {
        int64_t n0, n1;
        const int p = part_block(first_block, rows, b, &n0, &n1);
        k_rows(types[p], vnni, (int)M, ws[p], xq, xd, bsum, K, ldo, n0, n1, out + col[p]);
    }
    free(xd);
    return 0;
}

/* The 32-element parts (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of a stacked product in one call, as
 * pagedkv_gguf_gemm_q8k_parts does for the K-types: x rounded once (the VNNI body: and laid out,
 * vnni_act_row; the AVX2 body: quantize_row_q8) and one parallel region over every part's
 * blocks of ROW_BLOCK rows, instead of a rounding and a region per part (SmolLM2's q, k, v:
 * three; gate, up: two; at batch 1 its k and v are 69 KB each, read in microseconds, and each
 * region's start and end barrier cost about as much). Each row's result is bit for bit
 * pagedkv_gguf_gemm_q8_ld's on the same body (the same row kernels on the same rounded
 * activations), whatever the grouping. Arguments as pagedkv_gguf_gemm_q8k_parts' (isa
 * PAGEDKV_ISA_AVX512_VNNI the VNNI body; PAGEDKV_ISA_AVX2 or _AVX512 the AVX2 one, as
 * pagedkv_gguf_gemm_q8_ld). Returns 0; 1, having done nothing, where a part is not a
 * 32-element type; -1 for bad sizes, an unknown isa or an allocation failure. */
int pagedkv_gguf_gemm_q8v_parts(int num_parts, const int *types, const uint8_t *const *ws,
                                const int64_t *rows, const float *x, float *out, int64_t M,
                                int64_t K, int64_t ldo, int num_threads, int isa) {
    if (num_parts < 1 || num_parts > 8) return -1;
    for (int p = 0; p < num_parts; p++)
        if (!pagedkv_gguf_q8_takes(types[p]) || is_k_type(types[p])) return 1;
    if (M < 1 || M > MAX_M || K <= 0 || K % 32 != 0) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512 && isa != PAGEDKV_ISA_AVX512_VNNI)
        return -1;
    for (int p = 0; p < num_parts; p++)
        if (is_x8(types[p]) && rows[p] % 8 != 0) return -1;
    int64_t first_block[9], col[9], bytes;
    if (parts_blocks(num_parts, types, rows, K, ldo, first_block, col, &bytes)) return -1;
    const int64_t total = first_block[num_parts];
    const int64_t chunk = parts_chunk(total, bytes, num_threads);
    if (isa == PAGEDKV_ISA_AVX512_VNNI)
        for (int p = 0; p < num_parts; p++)
            if (is_x8(types[p])) return -1; /* the interleaved layouts are the AVX2 body's */
    if (isa != PAGEDKV_ISA_AVX512_VNNI) {
        /* the AVX2 body: pagedkv_gguf_gemm_q8_ld's rounding, once for every part */
        const int64_t G = K / 32;
        float *xd = q8_round_rows(x, M, K);
        if (xd == NULL) return -1;
        const float *xds = xd + M * G;
        const int8_t *xq = (const int8_t *)(xds + M * G);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
        for (int64_t b = 0; b < total; b++) {
            int64_t n0, n1;
            const int p = part_block(first_block, rows, b, &n0, &n1);
            q8_rows_type(types[p], (int)M, ws[p], xq, xd, xds, K, ldo, n0, n1, out + col[p]);
        }
        free(xd);
        return 0;
    }
    q8v_act A;
    float *buf = (float *)malloc(vnni_act_layout(M, K, NULL, &A));
    if (buf == NULL) return -1;
    vnni_act_layout(M, K, buf, &A);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) vnni_act_row(x, K, m, &A, 1);
#pragma omp for schedule(guided, chunk)
        for (int64_t b = 0; b < total; b++) {
            int64_t n0, n1;
            const int p = part_block(first_block, rows, b, &n0, &n1);
            v_rows(types[p], (int)M, ws[p], &A, ldo, n0, n1, out + col[p]);
        }
    }
    free(buf);
    return 0;
}

int pagedkv_gguf_q8_takes(int type) {
    return is_x8(type) || type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 ||
           type == GGML_Q8_0 || type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

int pagedkv_gguf_gemm_q8(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                         int64_t N, int64_t K, int num_threads, int isa) {
    return pagedkv_gguf_gemm_q8_ld(type, x, w, out, M, N, K, N, num_threads, isa);
}

/* Large steps (prompts, big batches) on the int8 products: every row of x rounded to int8 once,
 * then on the AVX2 body the weight rows in blocks of LARGE_N_BLOCK, each block's rows met by
 * every group of up to MAX_M activation rows while they are in the core's L2 (a Q4_K row of
 * K = 2048 is 1,152 bytes: 64 rows, 72 KiB); on the VNNI body gemm_q8_vnni_large (tiles of 16
 * weight rows unpacked once, their rows across the lanes), but for the K-types, which run
 * their row kernels (either body) over blocks of LARGE_N_BLOCK weight rows as the AVX2 body
 * does (gemm_q8k, activations in blocks of 256). The threads split the weight rows,
 * never K. The same integer block products and the same per-(row, output) summation as the
 * small steps on the same body (`isa`: PAGEDKV_ISA_AVX2 or _AVX512 the AVX2 body,
 * _AVX512_VNNI the VNNI one), so a row's result is bit for bit what pagedkv_gguf_gemm_q8_ld
 * gives it on that body, whatever M, the grouping or the threads.
 * x fp32 [M, K], out fp32 [M, ldo]; returns 0, or -1 for what it does not take (or an
 * allocation failure). */
#define LARGE_N_BLOCK 64
int pagedkv_gguf_gemm_q8_large(int type, const float *x, const uint8_t *w, float *out,
                               int64_t M, int64_t N, int64_t K, int64_t ldo, int num_threads,
                               int isa) {
    int64_t E, B;
    if (!pagedkv_gguf_q8_takes(type) || pagedkv_gguf_block(type, &E, &B)) return -1;
    if (M < 1 || K <= 0 || K % E != 0 || N < 0 || ldo < N) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512 && isa != PAGEDKV_ISA_AVX512_VNNI)
        return -1;
    if (is_k_type(type))
        return gemm_q8k(type, x, w, out, M, N, K, ldo, num_threads, isa == PAGEDKV_ISA_AVX512_VNNI,
                        LARGE_N_BLOCK);
    if (is_x8(type) && N % 8 != 0) return -1;
    const int64_t num_blocks = (N + LARGE_N_BLOCK - 1) / LARGE_N_BLOCK;
    if (isa == PAGEDKV_ISA_AVX512_VNNI)
        return is_x8(type) ? -1 : gemm_q8_vnni_large(type, x, w, out, M, N, K, ldo, num_threads, 0);
    const int64_t G = K / 32;
    float *xd = (float *)malloc(sizeof(float) * 2 * M * G + (size_t)(M * K));
    if (xd == NULL) return -1;
    float *xds = xd + M * G;
    int8_t *xq = (int8_t *)(xds + M * G);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        quantize_row_q8(x + m * K, K, xq + m * K, xd + m * G, xds + m * G);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * LARGE_N_BLOCK, n1 = n0 + LARGE_N_BLOCK < N ? n0 + LARGE_N_BLOCK : N;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = (int)(M - m0 < MAX_M ? M - m0 : MAX_M);
            const int8_t *q = xq + m0 * K;
            const float *d = xd + m0 * G, *ds = xds + m0 * G;
            float *o = out + m0 * ldo;
            q8_rows_type(type, mc, w, q, d, ds, K, ldo, n0, n1, o);
        }
    }
    free(xd);
    return 0;
}

/* The default engine's large steps on the VNNI body (vf_tile_rows): x fp32 [M, K], out fp32
 * [M, ldo]; each group's integer dot summed whole before its float step, so a row's result is
 * the q8 product's up to fp32 summation order, not the decode step's bits (the batch-invariant
 * switch keeps pagedkv_gguf_gemm_q8_large). The caller checks that the CPU has AVX-512 BW and
 * VNNI. Returns 0, or -1 for what it does not take (or an allocation failure). */
int pagedkv_gguf_gemm_q8_fast(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                              int64_t N, int64_t K, int64_t ldo, int num_threads, int isa) {
    int64_t E, B;
    if (!pagedkv_gguf_q8_takes(type) || pagedkv_gguf_block(type, &E, &B)) return -1;
    if (M < 1 || K <= 0 || K % E != 0 || N < 0 || ldo < N) return -1;
    if (is_x8(type)) /* its large steps are its small steps' products, 8 rows at a time */
        return isa == PAGEDKV_ISA_AVX512_VNNI
                   ? -1
                   : pagedkv_gguf_gemm_q8_large(type, x, w, out, M, N, K, ldo, num_threads, isa);
    if (isa == PAGEDKV_ISA_AVX512_VNNI) return gemm_q8_vnni_large(type, x, w, out, M, N, K, ldo, num_threads, 1);
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512) return -1;
    if (type == GGML_Q8_0) return -1; /* its codes overflow maddubs' int16 */
    return gemm_q8_avx2_fast(type, x, w, out, M, N, K, ldo, num_threads);
}

int pagedkv_gguf_gemm_q8_ld(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                            int64_t N, int64_t K, int64_t ldo, int num_threads, int isa) {
    int64_t E, B;
    if (!pagedkv_gguf_q8_takes(type) || pagedkv_gguf_block(type, &E, &B)) return -1;
    if (M < 1 || M > MAX_M || K <= 0 || K % E != 0 || N < 0 || ldo < N) return -1;
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512 && isa != PAGEDKV_ISA_AVX512_VNNI)
        return -1;
    if (is_k_type(type))
        return gemm_q8k(type, x, w, out, M, N, K, ldo, num_threads, isa == PAGEDKV_ISA_AVX512_VNNI,
                        ROW_BLOCK);
    if (isa == PAGEDKV_ISA_AVX512_VNNI)
        return is_x8(type) ? -1 : gemm_q8_vnni(type, x, w, out, M, N, K, ldo, num_threads);
    if (is_x8(type) && N % 8 != 0) return -1;
    const int64_t G = K / 32;
    float *xd = q8_round_rows(x, M, K);
    if (xd == NULL) return -1;
    const float *xds = xd + M * G;
    const int8_t *xq = (const int8_t *)(xds + M * G);
    const int64_t num_blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t chunk = row_chunk(type, K, ROW_BLOCK, num_blocks, num_threads);
#pragma omp parallel for schedule(guided, chunk) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * ROW_BLOCK, n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        q8_rows_type(type, (int)M, w, xq, xd, xds, K, ldo, n0, n1, out);
    }
    free(xd);
    return 0;
}


/* ---- batch-invariant products ------------------------------------------------------------
 *
 * Row m of the result is bit for bit what pagedkv_gguf_gemm (activations 0) or, for the types
 * of pagedkv_gguf_q8_takes, pagedkv_gguf_gemm_q8 (activations 1) gives that row alone (M = 1,
 * the decode step's product), whatever M, the other rows or num_threads:
 *   int8 activations: M <= 8 the small product (its rows are already independent of M), else
 *     pagedkv_gguf_gemm_q8_large on the same body;
 *   fp32 activations: each activation row through the M = 1 row kernel (CHAINS(1) chains;
 *     the M > 1 kernels sum in fewer chains, other bits), over blocks of weight rows that
 *     stay in the core's cache while every activation row meets them, so the weights are
 *     read from memory once per call, not once per row.
 * The threads split weight rows only (never K), so no sum depends on them. */

/* weight rows of an fp32-activation block: about INV_BLOCK_BYTES of them, 16 to 256 rows */
#define INV_BLOCK_BYTES (192 * 1024)

int pagedkv_gguf_gemm_invariant(int type, const float *x, const uint8_t *w, float *out,
                                int64_t M, int64_t N, int64_t K, int64_t ldo, int num_threads,
                                int isa, int q8_isa, int activations) {
    int64_t E, B;
    if (pagedkv_gguf_block(type, &E, &B)) return -1;
    if (M < 1 || K <= 0 || K % E != 0 || N < 0 || ldo < N) return -1;
    if (activations != 0 && activations != 1) return -1;
    if (activations == 0 && is_x8(type)) return -1; /* the interleaved layouts: int8 products only */
    if (isa != PAGEDKV_ISA_AVX2 && isa != PAGEDKV_ISA_AVX512) return -1;
    if (q8_isa != PAGEDKV_ISA_AVX2 && q8_isa != PAGEDKV_ISA_AVX512 && q8_isa != PAGEDKV_ISA_AVX512_VNNI)
        return -1;
    if (activations == 1 && pagedkv_gguf_q8_takes(type)) {
        if (M <= MAX_M) return pagedkv_gguf_gemm_q8_ld(type, x, w, out, M, N, K, ldo, num_threads, q8_isa);
        return pagedkv_gguf_gemm_q8_large(type, x, w, out, M, N, K, ldo, num_threads, q8_isa);
    }
    if (M == 1) return pagedkv_gguf_gemm_ld(type, x, w, out, 1, N, K, ldo, num_threads, isa);
    /* Q4_K / Q5_K: the sums of x over each group of 32, [M, K / 32] (per row, as M = 1's) */
    float *xsum = NULL;
    const int64_t G = K / 32;
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        xsum = (float *)malloc(sizeof(float) * M * G);
        if (xsum == NULL) return -1;
        for (int64_t i = 0; i < M * G; i++) xsum[i] = sum32(x + i * 32);
    }
    const int64_t row_bytes = K / E * B;
    int64_t rb = INV_BLOCK_BYTES / row_bytes;
    rb = rb < 16 ? 16 : rb > 256 ? 256 : rb;
    const int64_t num_blocks = (N + rb - 1) / rb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n0 = b * rb, n1 = n0 + rb < N ? n0 + rb : N;
        for (int64_t m = 0; m < M; m++) {
            const float *xs = xsum != NULL ? xsum + m * G : NULL;
            if (isa == PAGEDKV_ISA_AVX512)
                gemm_rows_avx512(type, 1, w, x + m * K, xs, K, ldo, n0, n1, out + m * ldo);
            else
                gemm_rows_avx2(type, 1, w, x + m * K, xs, K, ldo, n0, n1, out + m * ldo);
        }
    }
    free(xsum);
    return 0;
}

