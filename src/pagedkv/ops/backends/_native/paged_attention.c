/* pagedkv's paged attention on the CPU: fp32, AVX2 + FMA, over the HND cache layout
 * (pagedkv.ops.backends.hnd_layout):
 *
 *   k_cache, v_cache  fp32 [num_blocks, num_kv_heads, block_size, head_size]
 *   a token's slot s: block s / block_size, offset s % block_size
 *
 * pagedkv_write_kv copies a step's keys and values into their slots (slot -1: skipped).
 *
 * pagedkv_paged_attention computes causal attention of a step's queries over the cache (this
 * step's keys already written), varlen like vLLM's: request r owns query rows
 * [query_start_loc[r], query_start_loc[r + 1]) and seq_lens[r] tokens in the cache after the
 * write; its row i sits at position p = seq_lens[r] - q_len + i and attends keys
 * [max(0, p - window + 1), p] (window <= 0: [0, p]). Grouped-query attention: query head h
 * reads KV head h / (num_heads / num_kv_heads).
 *
 * Work is split over (request, chunk of up to CHUNK query rows, query head) units on OpenMP
 * threads; each unit walks the keys it needs block by block through the block table with an
 * online softmax (running max, running sum, rescaled accumulator: the FlashAttention
 * recurrence), so nothing is gathered and no score row of the whole context is stored.
 *
 * pagedkv_step_write_kv and pagedkv_step_attention are the same two with the step's
 * metadata in one struct (pagedkv_attention_step, filled once a step by the backend and
 * mirrored by ctypes in _native/__init__.py): what the Python backend calls, and the entry
 * points a model's own C code calls through function pointers (AttentionBackend.c_attention),
 * with no knowledge of the cache layout.
 *
 * All return 0, or -1 for arguments they do not take (the Python side checks everything
 * first; this is a last guard).
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 8
#define MAX_HEAD 512

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a . b over D floats, D a multiple of 8 */
static inline float dot(const float *a, const float *b, int D) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    if (d < D) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* acc = acc * c + p * v over D floats */
static inline void scale_add(float *acc, float c, float p, const float *v, int D) {
    const __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
    for (int d = 0; d < D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d),
                                                  _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d))));
}

int pagedkv_write_kv(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, float *k_cache, float *v_cache,
                     const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                     int head_size, int block_size) {
    if (num_tokens < 0 || num_kv_heads < 1 || head_size < 1 || block_size < 1) return -1;
    const size_t row = sizeof(float) * (size_t)head_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = ((block * num_kv_heads + h) * block_size + offset) * head_size;
            memcpy(k_cache + at, key + t * key_stride + (int64_t)h * head_size, row);
            memcpy(v_cache + at, value + t * value_stride + (int64_t)h * head_size, row);
        }
    }
    return 0;
}

/* One unit: rows [i0, i1) of request r (q_len rows, seq_len keys), query head h. */
static void attend(const float *q, int64_t q_stride, float *out, const float *k_cache,
                   const float *v_cache, const int32_t *block_table, int64_t row0, int i0,
                   int i1, int q_len, int seq_len, int h, int num_heads, int num_kv_heads, int D,
                   int block_size, float scale, int window) {
    const int kvh = h / (num_heads / num_kv_heads);
    const int rows = i1 - i0;
    float m[CHUNK], l[CHUNK];
    int lo[CHUNK], hi[CHUNK]; /* keys [lo, hi] per row */
    float acc[CHUNK][MAX_HEAD] __attribute__((aligned(32)));
    const float *qr[CHUNK];
    for (int i = 0; i < rows; i++) {
        const int p = seq_len - q_len + i0 + i;
        hi[i] = p;
        lo[i] = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(acc[i], 0, sizeof(float) * D);
        qr[i] = q + (row0 + i0 + i) * q_stride + (int64_t)h * D;
    }
    const int first = lo[0], last = hi[rows - 1];
    const int64_t head_stride = (int64_t)block_size * D;
    float s[CHUNK][64];
    for (int start = first - first % block_size; start <= last; start += block_size) {
        const int32_t block = block_table[start / block_size];
        const float *kb = k_cache + ((int64_t)block * num_kv_heads + kvh) * head_stride;
        const float *vb = v_cache + ((int64_t)block * num_kv_heads + kvh) * head_stride;
        const int end = start + block_size - 1 < last ? start + block_size - 1 : last;
        /* in pieces of 64 keys so that the score rows stay small */
        for (int j0 = start > first ? start : first; j0 <= end; j0 += 64) {
            const int j1 = j0 + 63 < end ? j0 + 63 : end;
            for (int i = 0; i < rows; i++) {
                const int a = j0 > lo[i] ? j0 : lo[i], b = j1 < hi[i] ? j1 : hi[i];
                if (a > b) continue;
                float mx = m[i];
                for (int j = a; j <= b; j++) {
                    const float x = dot(qr[i], kb + (int64_t)(j - start) * D, D) * scale;
                    s[i][j - j0] = x;
                    if (x > mx) mx = x;
                }
                const float c = expf(m[i] - mx); /* 0 on the first keys (m = -inf) */
                float sum = 0.0f;
                for (int j = a; j <= b; j++) {
                    const float pj = expf(s[i][j - j0] - mx);
                    sum += pj;
                    scale_add(acc[i], j == a ? c : 1.0f, pj, vb + (int64_t)(j - start) * D, D);
                }
                l[i] = l[i] * c + sum;
                m[i] = mx;
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        float *o = out + ((row0 + i0 + i) * num_heads + h) * (int64_t)D;
        const __m256 inv = _mm256_set1_ps(1.0f / l[i]);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(inv, _mm256_load_ps(acc[i] + d)));
    }
}

int pagedkv_paged_attention(const float *q, int64_t q_stride, float *out, const float *k_cache,
                            const float *v_cache, const int32_t *query_start_loc,
                            const int32_t *seq_lens, const int32_t *block_tables,
                            int64_t block_table_stride, int num_reqs, int num_heads,
                            int num_kv_heads, int head_size, int block_size, float scale,
                            int window, int num_threads) {
    if (num_reqs < 1 || num_kv_heads < 1 || num_heads % num_kv_heads || head_size % 8 ||
        head_size > MAX_HEAD || head_size < 8 || block_size < 1)
        return -1;
    /* units: (request, chunk) pairs in order, times heads; each thread finds the pair of its
     * next unit by walking forward over the requests (its units come in increasing order). */
    int64_t num_pairs = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int q_len = query_start_loc[r + 1] - query_start_loc[r];
        if (q_len < 1 || q_len > seq_lens[r]) return -1;
        num_pairs += (q_len + CHUNK - 1) / CHUNK;
    }
    const int64_t num_units = num_pairs * num_heads;
#pragma omp parallel num_threads(num_threads)
    {
        int r = 0;
        int64_t pair_base = 0; /* pairs before request r */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_units; u++) {
            const int64_t pair = u / num_heads;
            const int h = (int)(u % num_heads);
            /* units come in increasing order on each thread: move r forward */
            if (pair < pair_base) {
                r = 0;
                pair_base = 0;
            }
            for (;;) {
                const int q_len = query_start_loc[r + 1] - query_start_loc[r];
                const int64_t n = (q_len + CHUNK - 1) / CHUNK;
                if (pair < pair_base + n) break;
                pair_base += n;
                r++;
            }
            const int q_len = query_start_loc[r + 1] - query_start_loc[r];
            const int i0 = (int)(pair - pair_base) * CHUNK;
            const int i1 = i0 + CHUNK < q_len ? i0 + CHUNK : q_len;
            attend(q, q_stride, out, k_cache, v_cache, block_tables + r * block_table_stride,
                   query_start_loc[r], i0, i1, q_len, seq_lens[r], h, num_heads, num_kv_heads,
                   head_size, block_size, scale, window);
        }
    }
    return 0;
}

typedef struct {
    const int32_t *query_start_loc; /* [num_reqs + 1] */
    const int32_t *seq_lens;        /* [num_reqs] */
    const int32_t *block_tables;    /* [num_reqs, block_table_stride] */
    const int64_t *slot_mapping;    /* [num_tokens of the write] */
    int64_t block_table_stride;
    int32_t num_reqs;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_size;
    int32_t block_size;
    int32_t window; /* <= 0: none */
    float scale;
} pagedkv_attention_step;

int pagedkv_step_write_kv(const pagedkv_attention_step *s, float *k_cache, float *v_cache,
                          const float *key, int64_t key_stride, const float *value,
                          int64_t value_stride, int64_t num_tokens) {
    return pagedkv_write_kv(key, key_stride, value, value_stride, k_cache, v_cache,
                            s->slot_mapping, num_tokens, s->num_kv_heads, s->head_size,
                            s->block_size);
}

int pagedkv_step_attention(const pagedkv_attention_step *s, const float *k_cache,
                           const float *v_cache, const float *q, int64_t q_stride, float *out,
                           int num_threads) {
    return pagedkv_paged_attention(q, q_stride, out, k_cache, v_cache, s->query_start_loc,
                                   s->seq_lens, s->block_tables, s->block_table_stride,
                                   s->num_reqs, s->num_heads, s->num_kv_heads, s->head_size,
                                   s->block_size, s->scale, s->window, num_threads);
}
