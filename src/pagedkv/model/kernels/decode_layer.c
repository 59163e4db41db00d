/* A Llama decoder layer of a small step (M <= 8 tokens) in two calls, on int4 weights.
 *
 * The layer between the attention backend's two calls (write the step's K/V into the paged
 * cache, attend over the block tables) is elementwise work and four products. Run as torch
 * ops it costs about a dozen Python-level calls a layer, which at batch 1 took more time than
 * the products themselves (docs/perf.md). Here it is two C calls:
 *
 *   pagedkv_llama_attn_in    x = rms_norm(h) * input_norm
 *                            qkv = x W_qkv^T (+ bias)                  [M, (H + 2 KV) D]
 *                            q and k heads rotated (rotate-half RoPE, sin sign-folded)
 *   pagedkv_llama_attn_out   h += attn W_o^T
 *                            x = rms_norm(h) * post_attention_norm
 *                            gate, up = x W_gate_up^T
 *                            h += (silu(gate) * up) W_down^T
 *
 * Products are quant_gemv.c's int4 kernel or gguf_blocks.c's products on GGUF tensors as the
 * file stores them, per stacked part (a layer may mix them and GGUF types: q and k Q4_K with
 * v Q6_K), each part its own OpenMP region, but for stacked parts all of the K-types on int8
 * activations (a Q4_K_M file's q, k, v), or all of the 32-element types (SmolLM2's Q4_1 q, k,
 * v; gate, up), which share one rounding of the input and one region
 * (pagedkv_gguf_gemm_q8k_parts / _q8v_parts, the same bits) (weights read as stored; with
 * the layer's `activations` = 1, the default, the GGUF parts of the quantized types round the
 * product's input to int8 blocks of 32 (the K-types: of 256) and multiply in integers,
 * pagedkv_gguf_gemm_q8_ld on the layer's `q8_isa` body: the one exception to "fp32 rounding
 * only" below; `activations` = 0 keeps fp32 activations);
 * Qwen3's per-head q / k RMSNorm (optional) follows the bias, before the rotation; the elementwise work, a few thousand floats, runs on the calling
 * thread. Every value is fp32, computed in the order the torch ops compute it (norm: mean of
 * squares, reciprocal square root, times the weight; rotary x * cos + rotate(x) * sin), so the
 * two paths differ only by fp32 rounding (summation order).
 *
 * The weights of a layer come in one struct, filled once at load; the calls take only what
 * changes per step. Both return 0, or -1 for arguments they do not take (M outside 1..8,
 * an allocation failure, or a product's refusal).
 *
 * A layer with batch_invariant set (--batch-invariant) takes any M >= 1 and runs every product
 * as pagedkv_gguf_gemm_invariant: a row's bits are then those it gets alone (M = 1), whatever
 * else shares the step or how many threads run. The rest of the layer already works row by
 * row (norms, bias, rotation, SiLU, residual adds: no sum crosses rows). int4 parts have no
 * invariant product: such a layer is refused.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemv.h"

#define MAX_M 8

/* One part of a layer's product (its output rows, all of the input features):
 *   kind PAGEDKV_PART_INT4: quant_gemv.c's int4 layout, a = qs uint8 [rows, K / 32, 16],
 *       b = scale fp32 [rows, K / 32], c = min fp32 [rows, K / 32] or NULL; type unused
 *   kind PAGEDKV_PART_GGUF: a GGUF tensor as the file stores it (gguf_blocks.c), a = its
 *       blocks [rows, K / E * B bytes], type = its GGML type id; b and c unused */
#define PAGEDKV_PART_INT4 0
#define PAGEDKV_PART_GGUF 1
#define PAGEDKV_MAX_PARTS 3

typedef struct {
    int32_t kind;
    int32_t type;
    const void *a;
    const void *b;
    const void *c;
    int64_t rows;
} pagedkv_linear_part;

/* A product of stacked parts (q, k, v; gate, up; or one): part p writes the output columns
 * after those of parts 0..p-1. */
typedef struct {
    int64_t num_parts; /* 1..PAGEDKV_MAX_PARTS */
    pagedkv_linear_part parts[PAGEDKV_MAX_PARTS];
} pagedkv_linear;

/* A layer's weights and shape (this struct's layout is mirrored by ctypes in cpu_quant.py). */
typedef struct {
    pagedkv_linear qkv;           /* [(H + 2 KV) D, hidden] */
    const float *qkv_bias;        /* [(H + 2 KV) D] or NULL */
    pagedkv_linear o;             /* [hidden, H D] */
    pagedkv_linear gate_up;       /* [2 I, hidden]: gate rows, then up rows */
    pagedkv_linear down;          /* [hidden, I] */
    const float *input_norm;      /* [hidden] */
    const float *post_norm;       /* [hidden] */
    const float *q_norm;          /* [D]: RMSNorm of each q head (Qwen3), or NULL */
    const float *k_norm;          /* [D]: of each k head, or NULL */
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    float eps;
    int32_t isa;                  /* the products' body: PAGEDKV_ISA_AVX2 or _AVX512 */
    int32_t activations;          /* GGUF parts: 0 fp32 activations (exact), 1 int8 ones
                                     (pagedkv_gguf_gemm_q8_ld, for the types it takes) */
    int32_t q8_isa;               /* the int8 products' body: PAGEDKV_ISA_AVX2 or _AVX512_VNNI */
    int32_t batch_invariant;      /* 1: every product pagedkv_gguf_gemm_invariant (each row's
                                     bits those of the row alone; int4 parts refused), and
                                     the calls take any M >= 1; 0: the small-step products */
} pagedkv_llama_layer;

/* out [M, sum of the parts' rows] = x [M, K] W^T, one product (OpenMP region) per part, but
 * GGUF parts all of K-types on int8 activations in one (pagedkv_gguf_gemm_q8k_parts, the same
 * bits), and so all of the 32-element types (pagedkv_gguf_gemm_q8v_parts, either body);
 * with batch_invariant, every GGUF part's product is pagedkv_gguf_gemm_invariant (any M) and an
 * int4 part is refused. Returns 0, or -1 (a part of an unknown kind, no parts, or a product's
 * refusal). */
static int linear_gemm(const pagedkv_linear *W, const float *x, float *out, int64_t M,
                       int64_t K, int num_threads, int isa, int activations, int q8_isa,
                       int batch_invariant) {
    if (W->num_parts < 1 || W->num_parts > PAGEDKV_MAX_PARTS) return -1;
    int64_t total = 0;
    for (int64_t p = 0; p < W->num_parts; p++) total += W->parts[p].rows;
    if (W->num_parts > 1 && !batch_invariant && activations == 1) {
        /* GGUF parts all of K-types (a Q4_K_M file's q, k, v) or all of the 32-element types
         * (SmolLM2's Q4_1): one rounding, one region */
        int types[PAGEDKV_MAX_PARTS];
        const uint8_t *ws[PAGEDKV_MAX_PARTS];
        int64_t rows[PAGEDKV_MAX_PARTS];
        int gguf = 1;
        for (int64_t p = 0; p < W->num_parts; p++) {
            gguf &= W->parts[p].kind == PAGEDKV_PART_GGUF;
            types[p] = W->parts[p].type;
            ws[p] = (const uint8_t *)W->parts[p].a;
            rows[p] = W->parts[p].rows;
        }
        if (gguf) {
            int rc = pagedkv_gguf_gemm_q8k_parts((int)W->num_parts, types, ws, rows, x, out, M, K,
                                                 total, num_threads, q8_isa);
            if (rc == 1) /* not all K-types: all of the 32-element types? */
                rc = pagedkv_gguf_gemm_q8v_parts((int)W->num_parts, types, ws, rows, x, out, M, K,
                                                 total, num_threads, q8_isa);
            if (rc != 1) return rc;
        }
    }
    int64_t col = 0;
    for (int64_t p = 0; p < W->num_parts; p++) {
        const pagedkv_linear_part *P = W->parts + p;
        int rc;
        if (batch_invariant)
            rc = P->kind == PAGEDKV_PART_GGUF
                     ? pagedkv_gguf_gemm_invariant(P->type, x, (const uint8_t *)P->a, out + col, M,
                                                   P->rows, K, total, num_threads, isa, q8_isa,
                                                   activations)
                     : -1;
        else if (P->kind == PAGEDKV_PART_INT4)
            rc = pagedkv_int4_gemm_ld(x, (const uint8_t *)P->a, (const float *)P->b,
                                      (const float *)P->c, out + col, M, P->rows, K, total,
                                      num_threads, isa);
        else if (P->kind == PAGEDKV_PART_GGUF && activations == 1 && pagedkv_gguf_q8_takes(P->type))
            rc = pagedkv_gguf_gemm_q8_ld(P->type, x, (const uint8_t *)P->a, out + col, M,
                                         P->rows, K, total, num_threads, q8_isa);
        else if (P->kind == PAGEDKV_PART_GGUF)
            rc = pagedkv_gguf_gemm_ld(P->type, x, (const uint8_t *)P->a, out + col, M, P->rows,
                                      K, total, num_threads, isa);
        else
            rc = -1;
        if (rc) return rc;
        col += P->rows;
    }
    return 0;
}

static float sum_squares(const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += lanes[j];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out[m] = h[m] / sqrt(mean(h[m]^2) + eps) * w   (Llama's RMSNorm, fp32; each row on its own,
 * so a row's bits do not depend on the others) */
static void rms_norm(const float *h, const float *w, float eps, int64_t M, int64_t n, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = h + m * n;
        float rstd = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
        float *y = out + m * n;
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * rstd * w[i];
    }
}

/* The layers' RMSNorm, exported for the model's final norm: h, out fp32 [M, n], w fp32 [n]. */
void pagedkv_rms_norm(const float *h, const float *w, float eps, int64_t M, int64_t n, float *out) {
    rms_norm(h, w, eps, M, n, out);
}

/* the most rows a call takes: any number for a batch-invariant layer, else MAX_M */
static int rows_taken(const pagedkv_llama_layer *L, int64_t M) {
    return M >= 1 && (M <= MAX_M || L->batch_invariant);
}

/* e^x of 8 floats for swiglu: Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2 (ln2 in a
 * high part exact in float and a low part), e^r by its Taylor polynomial to degree 7
 * (truncation below 0.1 ulp), times 2^(n - 1) built in the exponent bits, times 2, so that
 * n = 128 overflows to +inf as expf does: within 1 ulp of expf from -86.5 up, +inf past
 * ln(FLT_MAX) (x is clamped to 88.8, past it). Below -86.5, x is taken as -86.5: e^x is
 * then under 3e-38, and 1 + e^x is 1 either way, which is all swiglu asks of it. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.5f)), _mm256_set1_ps(88.8f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* n in [-125, 128]: 2^(n - 1) is a normal float */
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_set1_ps(2.0f));
}

/* out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i] (fp32, torch's order of
 * operations), 8 at a time on exp8. With libm's expf, one element at a time, SmolLM2-135M's
 * 1,536 took 8-14 us a layer (0.25-0.4 ms of a 5-7 ms decode step, 2-core Zen 3), on the
 * calling thread while the other threads waited for the down product; 1 us now. */
static void swiglu(const float *gate, const float *up, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_xor_ps(g, sign));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Each of `heads` heads of D floats in place: RMSNorm over the head (as rms_norm) */
static void head_norm(float *x, const float *w, float eps, int64_t heads, int64_t D) {
    for (int64_t j = 0; j < heads; j++) {
        float *v = x + j * D;
        const float rstd = 1.0f / sqrtf(sum_squares(v, D) / (float)D + eps);
        for (int64_t i = 0; i < D; i++) v[i] = v[i] * rstd * w[i];
    }
}

/* Rotate-half RoPE of one head in place: x[d] * cos[d] + x[(d + D/2) mod D] * sin[d], with sin
 * sign-folded ([-sin, sin], pagedkv.model.rotary). */
static void rotate(float *x, const float *cos, const float *sin, int64_t D) {
    float tmp[512];
    const int64_t half = D / 2;
    memcpy(tmp, x, sizeof(float) * D);
    for (int64_t d = 0; d < half; d++) x[d] = tmp[d] * cos[d] + tmp[d + half] * sin[d];
    for (int64_t d = half; d < D; d++) x[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

int pagedkv_llama_attn_in(const pagedkv_llama_layer *L, const float *h, const float *cos,
                          const float *sin, float *qkv, int64_t M, int num_threads) {
    if (!rows_taken(L, M) || L->head_dim > 512 || L->head_dim % 2) return -1;
    const int64_t hidden = L->hidden, D = L->head_dim;
    const int64_t heads = L->num_heads + 2 * L->num_kv_heads, width = heads * D;
    float *x = (float *)malloc(sizeof(float) * M * hidden);
    if (x == NULL) return -1;
    rms_norm(h, L->input_norm, L->eps, M, hidden, x);
    int rc = linear_gemm(&L->qkv, x, qkv, M, hidden, num_threads, L->isa, L->activations, L->q8_isa,
                     L->batch_invariant);
    free(x);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * width;
        if (L->qkv_bias != NULL)
            for (int64_t i = 0; i < width; i++) row[i] += L->qkv_bias[i];
        if (L->q_norm != NULL) head_norm(row, L->q_norm, L->eps, L->num_heads, D);
        if (L->k_norm != NULL)
            head_norm(row + L->num_heads * D, L->k_norm, L->eps, L->num_kv_heads, D);
        for (int64_t j = 0; j < L->num_heads + L->num_kv_heads; j++)
            rotate(row + j * D, cos + m * D, sin + m * D, D);
    }
    return 0;
}

int pagedkv_llama_attn_out(const pagedkv_llama_layer *L, float *h, const float *attn, int64_t M,
                           int num_threads) {
    if (!rows_taken(L, M)) return -1;
    const int64_t hidden = L->hidden, I = L->intermediate;
    const int64_t attn_width = L->num_heads * L->head_dim;
    /* y: [M, max(hidden, 2 I)] product outputs; x: [M, max(hidden, I)] product inputs */
    const int64_t wide = 2 * I > hidden ? 2 * I : hidden;
    float *y = (float *)malloc(sizeof(float) * M * wide);
    float *x = (float *)malloc(sizeof(float) * M * (I > hidden ? I : hidden));
    int rc = -1;
    if (y == NULL || x == NULL) goto done;
    rc = linear_gemm(&L->o, attn, y, M, attn_width, num_threads, L->isa, L->activations, L->q8_isa,
                     L->batch_invariant);
    if (rc) goto done;
    for (int64_t i = 0; i < M * hidden; i++) h[i] += y[i];
    rms_norm(h, L->post_norm, L->eps, M, hidden, x);
    rc = linear_gemm(&L->gate_up, x, y, M, hidden, num_threads, L->isa, L->activations, L->q8_isa,
                     L->batch_invariant);
    if (rc) goto done;
    for (int64_t m = 0; m < M; m++) swiglu(y + m * 2 * I, y + m * 2 * I + I, I, x + m * I);
    rc = linear_gemm(&L->down, x, y, M, I, num_threads, L->isa, L->activations, L->q8_isa,
                     L->batch_invariant);
    if (rc) goto done;
    for (int64_t i = 0; i < M * hidden; i++) h[i] += y[i];
done:
    free(y);
    free(x);
    return rc;
}

/* The attention backend's C entry points for one layer (pagedkv.ops.backends.CAttention): the
 * model hands the step's q, k and v to them without knowing the cache layout. */
typedef int (*pagedkv_write_kv_fn)(const void *step, float *k_cache, float *v_cache,
                                   const float *key, int64_t key_stride, const float *value,
                                   int64_t value_stride, int64_t num_tokens);
typedef int (*pagedkv_attention_fn)(const void *step, const float *k_cache,
                                    const float *v_cache, const float *query,
                                    int64_t query_stride, float *out, int num_threads);

/* mirrored by ctypes in cpu_quant.py */
typedef struct {
    pagedkv_write_kv_fn write_kv;
    pagedkv_attention_fn attention;
    const void *step;
    float *k_cache;
    float *v_cache;
} pagedkv_layer_attention;

/* The decoder layers of a small step, all in one call: for each layer, attn_in, the
 * backend's write and attention, attn_out. h fp32 [M, hidden] is the residual stream (the
 * embeddings in, the last layer's output out), cos and sin fp32 [M, D]. Every layer must have
 * the first one's head shape. Returns 0, or -1 (M out of range, an allocation failure, or a
 * refusal of a product or of the backend). */
int pagedkv_llama_forward(const pagedkv_llama_layer *const *layers,
                          const pagedkv_layer_attention *attention, int64_t num_layers, float *h,
                          const float *cos, const float *sin, int64_t M, int num_threads) {
    if (num_layers < 1) return -1;
    for (int64_t i = 0; i < num_layers; i++) /* before anything is written */
        if (!rows_taken(layers[i], M)) return -1;
    const int64_t H = layers[0]->num_heads, KV = layers[0]->num_kv_heads;
    const int64_t D = layers[0]->head_dim, width = (H + 2 * KV) * D;
    float *qkv = (float *)malloc(sizeof(float) * M * width);
    float *out = (float *)malloc(sizeof(float) * M * H * D);
    int rc = -1;
    if (qkv == NULL || out == NULL) goto done;
    for (int64_t i = 0; i < num_layers; i++) {
        const pagedkv_llama_layer *L = layers[i];
        const pagedkv_layer_attention *A = attention + i;
        rc = -1;
        if (L->num_heads != H || L->num_kv_heads != KV || L->head_dim != D) goto done;
        rc = pagedkv_llama_attn_in(L, h, cos, sin, qkv, M, num_threads);
        if (rc) goto done;
        rc = A->write_kv(A->step, A->k_cache, A->v_cache, qkv + H * D, width,
                         qkv + (H + KV) * D, width, M);
        if (rc) goto done;
        rc = A->attention(A->step, A->k_cache, A->v_cache, qkv, width, out, num_threads);
        if (rc) goto done;
        rc = pagedkv_llama_attn_out(L, h, out, M, num_threads);
        if (rc) goto done;
    }
done:
    free(qkv);
    free(out);
    return rc;
}
