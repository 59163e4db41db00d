/* The products of quant_gemv.c that decode_layer.c calls (see quant_gemv.c for the layouts). */
#ifndef PAGEDKV_QUANT_GEMV_H
#define PAGEDKV_QUANT_GEMV_H

#include <stdint.h>

/* `isa` of the products: which body runs (the caller checks that the CPU has it) */
#define PAGEDKV_ISA_AVX2 0
#define PAGEDKV_ISA_AVX512 1
/* the int8-activation GGUF products only: their AVX-512 VNNI body (needs AVX512BW and
 * AVX512_VNNI too); AVX2 and AVX512 run their AVX2 body */
#define PAGEDKV_ISA_AVX512_VNNI 2

/* Rows n0..n1 of a product (quant_gemv.c's and gguf_blocks.c's), ROW(c, ..., n, out) per row
 * with c = M as a compile-time constant (1..8) at each call site, so that the row's
 * accumulators stay in registers. */
#define FOR_ROWS(ROW, M, ...)                                                                \
    do {                                                                                     \
        switch (M) {                                                                         \
            case 1: for (int64_t n = n0; n < n1; n++) ROW(1, __VA_ARGS__, n, out); break;    \
            case 2: for (int64_t n = n0; n < n1; n++) ROW(2, __VA_ARGS__, n, out); break;    \
            case 3: for (int64_t n = n0; n < n1; n++) ROW(3, __VA_ARGS__, n, out); break;    \
            case 4: for (int64_t n = n0; n < n1; n++) ROW(4, __VA_ARGS__, n, out); break;    \
            case 5: for (int64_t n = n0; n < n1; n++) ROW(5, __VA_ARGS__, n, out); break;    \
            case 6: for (int64_t n = n0; n < n1; n++) ROW(6, __VA_ARGS__, n, out); break;    \
            case 7: for (int64_t n = n0; n < n1; n++) ROW(7, __VA_ARGS__, n, out); break;    \
            case 8: for (int64_t n = n0; n < n1; n++) ROW(8, __VA_ARGS__, n, out); break;    \
        }                                                                                    \
    } while (0)

int pagedkv_int4_gemm(const float *x, const uint8_t *qs, const float *scale, const float *min,
                      float *out, int64_t M, int64_t N, int64_t K, int num_threads, int isa);
/* pagedkv_int4_gemm with out's rows ldo >= N floats apart (out[m * ldo + n]) */
int pagedkv_int4_gemm_ld(const float *x, const uint8_t *qs, const float *scale,
                         const float *min, float *out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int num_threads, int isa);
int pagedkv_int8_gemm(const float *x, const int8_t *q, const float *scale, float *out,
                      int64_t M, int64_t N, int64_t K, int num_threads, int isa);

/* gguf_blocks.c: GGUF tensors as the file stores them (type = the GGML type id; see there).
 * pagedkv_gguf_block: a type's elements and bytes per block (-1: a type not taken).
 * pagedkv_gguf_gemm: out [M, N] = x [M, K] W^T, W the N rows of raw blocks, 1 <= M <= 8.
 * pagedkv_gguf_dequant: rows row_start .. + num_rows of W into out [num_rows, K], fp32 or bf16.
 * pagedkv_gguf_get_rows: rows ids (each in [0, N)) of W into out fp32 [num_ids, K].
 * Each returns 0, or -1 for arguments it does not take (and then writes nothing). */
int pagedkv_gguf_block(int type, int64_t *block_elems, int64_t *block_bytes);
/* A Q4_0 / Q4_1 weight [N, row_bytes], N a multiple of 8, laid out in place in 8-row bands for
 * the AVX2 body's int8 products (gguf_blocks.c, "4-bit blocks interleaved by 8 rows"): returns
 * the new type (0x102 Q4_0_X8, 0x103 Q4_1_X8; the same bytes per block), or -1, w unchanged.
 * The interleaved types run on the int8 products of the AVX2 body, dequantization and lookup
 * only; the others refuse them. */
int pagedkv_gguf_interleave(int type, uint8_t *w, int64_t N, int64_t K, int num_threads);
int pagedkv_gguf_gemm(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                      int64_t N, int64_t K, int num_threads, int isa);
/* pagedkv_gguf_gemm with out's rows ldo >= N floats apart (out[m * ldo + n]) */
int pagedkv_gguf_gemm_ld(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                         int64_t N, int64_t K, int64_t ldo, int num_threads, int isa);
/* int8 activations (gguf_blocks.c's last section): the product of a quantized type's weights
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with x rounded to int8 in blocks of 32 (one
 * fp32 scale each; the K-types in blocks of 256 with int16 sums of each 16, llama.cpp's Q8_K),
 * integer dot products per block (the K-types' per super-block). pagedkv_gguf_q8_takes: 1 for
 * those types, else 0 (the float types). The products take pagedkv_gguf_gemm(_ld)'s arguments
 * and return -1 for a type it does not take (or anything pagedkv_gguf_gemm refuses). */
int pagedkv_gguf_q8_takes(int type);
/* the K-type parts (Q4_K, Q5_K, Q6_K) of a stacked product, part p's rows[p] rows of blocks
 * ws[p] writing the output columns after parts 0..p-1's, in one call: pagedkv_gguf_gemm_q8_ld's
 * results (bit for bit), x rounded once and one parallel region; returns 1 (nothing done) where
 * a part is not a K-type */
int pagedkv_gguf_gemm_q8k_parts(int num_parts, const int *types, const uint8_t *const *ws,
                                const int64_t *rows, const float *x, float *out, int64_t M,
                                int64_t K, int64_t ldo, int num_threads, int isa);
/* the same for 32-element parts (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on the VNNI body (isa
 * PAGEDKV_ISA_AVX512_VNNI); returns 1 (nothing done) where a part is not one of them or isa is
 * another */
int pagedkv_gguf_gemm_q8v_parts(int num_parts, const int *types, const uint8_t *const *ws,
                                const int64_t *rows, const float *x, float *out, int64_t M,
                                int64_t K, int64_t ldo, int num_threads, int isa);
int pagedkv_gguf_gemm_q8(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                         int64_t N, int64_t K, int num_threads, int isa);
int pagedkv_gguf_gemm_q8_ld(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                            int64_t N, int64_t K, int64_t ldo, int num_threads, int isa);
/* pagedkv_gguf_gemm_q8_ld for any M >= 1 (prompts, large batches): the rows rounded once, the
 * weights in blocks kept in cache while many rows meet them (the VNNI body: tiles of 16 weight
 * rows unpacked once, one weight row per lane); `isa` picks the body as for
 * pagedkv_gguf_gemm_q8_ld, and each row's result is bit for bit that row's product there
 * (M = 1) on the same body. */
int pagedkv_gguf_gemm_q8_large(int type, const float *x, const uint8_t *w, float *out,
                               int64_t M, int64_t N, int64_t K, int64_t ldo, int num_threads,
                               int isa);
/* pagedkv_gguf_gemm_q8_large's arguments, for the default engine's large steps: each weight
 * group's integer dot summed whole, then one float step (as llama.cpp does), so rows are not
 * the decode step's bits (and the K-types' activations are rounded in blocks of 32 here, not
 * the decode step's 256). `isa` PAGEDKV_ISA_AVX512_VNNI: tiles of 16 weight rows on dpbusd
 * (every type of pagedkv_gguf_q8_takes but the interleaved ones: -1); PAGEDKV_ISA_AVX2 or
 * _AVX512: tiles of 8 on maddubs (every one but Q8_0: -1; the interleaved types: their
 * pagedkv_gguf_gemm_q8_large, the decode step's bits). The caller checks that the CPU has the
 * body. */
int pagedkv_gguf_gemm_q8_fast(int type, const float *x, const uint8_t *w, float *out, int64_t M,
                              int64_t N, int64_t K, int64_t ldo, int num_threads, int isa);
/* The batch-invariant product: out [M, ldo] = x [M, K] W^T for any M >= 1, row m bit for bit
 * what pagedkv_gguf_gemm (activations 0, or a type pagedkv_gguf_q8_takes refuses; body `isa`)
 * or pagedkv_gguf_gemm_q8 (activations 1; body `q8_isa`) gives row m alone, whatever M and
 * num_threads. Returns 0, or -1 for what it does not take. */
int pagedkv_gguf_gemm_invariant(int type, const float *x, const uint8_t *w, float *out,
                                int64_t M, int64_t N, int64_t K, int64_t ldo, int num_threads,
                                int isa, int q8_isa, int activations);
int pagedkv_gguf_dequant(int type, const uint8_t *w, int64_t row_start, int64_t num_rows,
                         int64_t K, void *out, int out_bf16, int num_threads);
int pagedkv_gguf_get_rows(int type, const uint8_t *w, const int64_t *ids, int64_t num_ids,
                          int64_t N, int64_t K, float *out);

#endif
