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
 * Products are quant_gemv.c's int4 kernel (fp32 activations, weights read as stored), each
 * its own OpenMP region; the elementwise work, a few thousand floats, runs on the calling
 * thread. Every value is fp32, computed in the order the torch ops compute it (norm: mean of
 * squares, reciprocal square root, times the weight; rotary x * cos + rotate(x) * sin), so the
 * two paths differ only by fp32 rounding (summation order).
 *
 * The weights of a layer come in one struct, filled once at load; the calls take only what
 * changes per step. Both return 0, or -1 for arguments they do not take (M outside 1..8,
 * an allocation failure, or a product's refusal).
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_gemv.h"

#define MAX_M 8

/* One int4 weight in quant_gemv.c's layout: qs uint8 [N, K / 32, 16], scale and min fp32
 * [N, K / 32] (min may be NULL). */
typedef struct {
    const uint8_t *qs;
    const float *scale;
    const float *min;
} pagedkv_int4_weight;

/* A layer's weights and shape (this struct's layout is mirrored by ctypes in cpu_quant.py). */
typedef struct {
    pagedkv_int4_weight qkv;      /* [(H + 2 KV) D, hidden] */
    const float *qkv_bias;        /* [(H + 2 KV) D] or NULL */
    pagedkv_int4_weight o;        /* [hidden, H D] */
    pagedkv_int4_weight gate_up;  /* [2 I, hidden]: gate rows, then up rows */
    pagedkv_int4_weight down;     /* [hidden, I] */
    const float *input_norm;      /* [hidden] */
    const float *post_norm;       /* [hidden] */
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    float eps;
    int32_t isa;                  /* the products' body: PAGEDKV_ISA_AVX2 or _AVX512 */
} pagedkv_llama_layer;

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

/* out[m] = h[m] / sqrt(mean(h[m]^2) + eps) * w   (Llama's RMSNorm, fp32) */
static void rms_norm(const float *h, const float *w, float eps, int64_t M, int64_t n, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = h + m * n;
        float rstd = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
        float *y = out + m * n;
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * rstd * w[i];
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
    if (M < 1 || M > MAX_M || L->head_dim > 512 || L->head_dim % 2) return -1;
    const int64_t hidden = L->hidden, D = L->head_dim;
    const int64_t heads = L->num_heads + 2 * L->num_kv_heads, width = heads * D;
    float *x = (float *)malloc(sizeof(float) * M * hidden);
    if (x == NULL) return -1;
    rms_norm(h, L->input_norm, L->eps, M, hidden, x);
    int rc = pagedkv_int4_gemm(x, L->qkv.qs, L->qkv.scale, L->qkv.min, qkv, M, width, hidden,
                               num_threads, L->isa);
    free(x);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * width;
        if (L->qkv_bias != NULL)
            for (int64_t i = 0; i < width; i++) row[i] += L->qkv_bias[i];
        for (int64_t j = 0; j < L->num_heads + L->num_kv_heads; j++)
            rotate(row + j * D, cos + m * D, sin + m * D, D);
    }
    return 0;
}

int pagedkv_llama_attn_out(const pagedkv_llama_layer *L, float *h, const float *attn, int64_t M,
                           int num_threads) {
    if (M < 1 || M > MAX_M) return -1;
    const int64_t hidden = L->hidden, I = L->intermediate;
    const int64_t attn_width = L->num_heads * L->head_dim;
    /* y: [M, max(hidden, 2 I)] product outputs; x: [M, max(hidden, I)] product inputs */
    const int64_t wide = 2 * I > hidden ? 2 * I : hidden;
    float *y = (float *)malloc(sizeof(float) * M * wide);
    float *x = (float *)malloc(sizeof(float) * M * (I > hidden ? I : hidden));
    int rc = -1;
    if (y == NULL || x == NULL) goto done;
    rc = pagedkv_int4_gemm(attn, L->o.qs, L->o.scale, L->o.min, y, M, hidden, attn_width,
                           num_threads, L->isa);
    if (rc) goto done;
    for (int64_t i = 0; i < M * hidden; i++) h[i] += y[i];
    rms_norm(h, L->post_norm, L->eps, M, hidden, x);
    rc = pagedkv_int4_gemm(x, L->gate_up.qs, L->gate_up.scale, L->gate_up.min, y, M, 2 * I,
                           hidden, num_threads, L->isa);
    if (rc) goto done;
    for (int64_t m = 0; m < M; m++) {
        const float *gate = y + m * 2 * I, *up = gate + I;
        float *a = x + m * I;
        for (int64_t i = 0; i < I; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    rc = pagedkv_int4_gemm(x, L->down.qs, L->down.scale, L->down.min, y, M, hidden, I,
                           num_threads, L->isa);
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
    if (M < 1 || M > MAX_M || num_layers < 1) return -1;
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
