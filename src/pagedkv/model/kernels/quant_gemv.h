/* The products of quant_gemv.c that decode_layer.c calls (see quant_gemv.c for the layouts). */
#ifndef PAGEDKV_QUANT_GEMV_H
#define PAGEDKV_QUANT_GEMV_H

#include <stdint.h>

/* `isa` of the products: which body runs (the caller checks that the CPU has it) */
#define PAGEDKV_ISA_AVX2 0
#define PAGEDKV_ISA_AVX512 1

int pagedkv_int4_gemm(const float *x, const uint8_t *qs, const float *scale, const float *min,
                      float *out, int64_t M, int64_t N, int64_t K, int num_threads, int isa);
int pagedkv_int8_gemm(const float *x, const int8_t *q, const float *scale, float *out,
                      int64_t M, int64_t N, int64_t K, int num_threads, int isa);

#endif
