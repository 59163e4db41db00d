/* pagedkv's paged attention on the CPU: fp32 arithmetic, AVX2 + FMA, over the HND cache layout
 * (pagedkv.ops.backends.hnd_layout):
 *
 *   k_cache, v_cache  fp32 or bf16 [num_blocks, num_kv_heads, block_size, head_size]
 *   a token's slot s: block s / block_size, offset s % block_size
 *
 * Queries, keys and values handed in and the output are fp32 whatever the cache holds. A bf16
 * cache (kv_bf16 = 1) stores each key and value rounded to nearest even (torch's
 * float -> bfloat16 conversion, NaN as 0x7FC0) and is widened back to fp32 as it is read (a
 * shift: bf16 is the top half of an fp32), so the arithmetic is the fp32 kernel's.
 *
 * pagedkv_write_kv copies a step's keys and values into their slots (slot -1: skipped).
 *
 * pagedkv_paged_attention computes causal attention of a step's queries over the cache (this
 * step's keys already written), varlen like vLLM's: request r owns query rows
 * [query_start_loc[r], query_start_loc[r + 1]) and seq_lens[r] tokens in the cache after the
 * write; its row i sits at position p = seq_lens[r] - q_len + i and attends keys
 * [max(0, p - window + 1), p] (window <= 0: [0, p]). Grouped-query attention: query head h
 * reads KV head h / (num_heads / num_kv_heads). softcap > 0 (Gemma 2) caps each scaled score
 * s to softcap * tanh(s / softcap) before the softmax.
 *
 * Work is split over (request, chunk of query tokens, KV head, set of its query heads) units
 * on OpenMP threads, up to CHUNK rows (tokens x heads) a unit, so grouped-query heads read
 * their keys and values once (one head a unit when that leaves too few units for the
 * threads); each unit walks the keys it needs in pieces of up to PIECE keys (across blocks,
 * through the block table) with an online softmax (running max, running sum, rescaled
 * accumulator: the FlashAttention recurrence), so nothing is gathered and no score row of the
 * whole context is stored. Per piece, first every row's scores (8 keys per reduction, from
 * any blocks), then every row's softmax update and weighted value rows (accumulator in
 * registers): the piece's keys, then its values, stay in L1 while the chunk's rows reuse them,
 * and a long prompt's chunk of 32 rows reads each key and value once from the cache.
 *
 * A row's online softmax restarts at every SEGMENT (256) keys, at absolute multiples, and the
 * segments' states (maximum, sum, weighted values) are folded in order. That is what lets a
 * step with too few units for the threads (a decode row, or a short chunk, alone: 3 units
 * for 2 threads with SmolLM2's 3 KV heads) split each unit's keys over the threads, one
 * segment a task, its state kept in a scratch buffer and the fold done after them, as
 * flash-decoding splits the keys: each KV head is read once and every thread has work
 * (docs/ops.md: a 4096-token context's decode attention 1.3-1.7x faster on 2 threads than
 * with one query head a unit, which read each KV head three times).
 *
 * Batch invariance: a query row's output depends only on its own query, position, keys and
 * values, never on its chunk (decode row or row 200 of a prompt), the other rows and requests,
 * the block size, the physical blocks, the head grouping, the threads or whether its keys
 * were split: pieces start at absolute multiples of PIECE keys and segments at multiples of
 * SEGMENT (not at the unit's first key), every row's softmax runs over its own keys of each
 * piece, the segments fold in order whoever computed them, and a key scored alone (dot) gets
 * the bits lane j of dot8 gives it (the same accumulation chain and reduction tree).
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
#include <stdlib.h>
#include <string.h>

/* Built twice (pagedkv.ops.backends._native): with -mavx2 -mfma, and where the CPU has AVX-512
 * F/BW/VL with those flags too, which turns on 16-lane versions of the three inner loops (dot,
 * dot8, scale_add_rows); everything else is the same code. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDKV_WIDE 1
#else
#define PAGEDKV_WIDE 0
#endif

#define CHUNK 32 /* query rows per unit: a prompt's keys are read once per 32 rows */
#define MAX_HEAD 512
#define PIECE 64 /* keys scored at a time: a multiple of 8 */
/* keys of a segment: a row's softmax runs over each segment of SEGMENT keys (at absolute
 * multiples) on its own, and the segments' states are folded in order; a multiple of PIECE */
#define SEGMENT 256

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The sum of v's 8 lanes as dot8's reduction tree adds one key's lanes:
 * ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), so that dot gives a key the bits that
 * lane j of dot8 gives it (which keys are scored 8 at a time then changes nothing). */
static inline __attribute__((always_inline)) float reduce8(__m256 v) {
    const __m256 t = _mm256_hadd_ps(v, v);
    const __m256 u = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 cache elements from p (element i on) as fp32: a load, or for bf16 a zero-extending load
 * of 8 halves and a shift into the top of each lane. bf16 is a constant at every call site. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))),
            16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (torch's c10::BFloat16 conversion) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if PAGEDKV_WIDE
/* 16 cache elements from p (element i on) as fp32 (see load8) */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
            16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* the two 8-lane halves of v added */
static inline __m256 fold(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* a . b over D floats (b a cache row), D a multiple of 8: 16 lanes, an 8-lane tail; bit for
 * bit lane j of dot8 for the same key (the same chain, fold and reduction tree) */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int D,
                                                       int bf16) {
    __m512 s = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), load16(b, d, bf16), s);
    __m256 t = fold(s);
    if (d < D) t = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, bf16), t);
    return reduce8(t);
}

/* dot8 below with 16-lane accumulators, folded to 8 lanes before the same reduction tree */
static inline __attribute__((always_inline)) __m256 dot8(const float *q,
                                                        const void *const *k, int D, int bf16) {
    __m512 w[8];
    for (int j = 0; j < 8; j++) w[j] = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m512 x = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) w[j] = _mm512_fmadd_ps(x, load16(k[j], d, bf16), w[j]);
    }
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = fold(w[j]);
    if (d < D) {
        const __m256 x = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(x, load8(k[j], d, bf16), a[j]);
    }
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
/* a . b over D floats (b a cache row), D a multiple of 8: one accumulator chain and dot8's
 * reduction tree, so bit for bit lane j of dot8 for the same key */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int D,
                                                       int bf16) {
    __m256 s = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, bf16), s);
    return reduce8(s);
}

/* The 8 dot products of one query row q with 8 keys (cache rows k[0..7], anywhere: any
 * blocks), D a multiple of 8: eight accumulators, then a tree of horizontal adds that leaves
 * key j's sum in lane j. One reduction for 8 keys instead of one per key. */
static inline __attribute__((always_inline)) __m256 dot8(const float *q,
                                                        const void *const *k, int D, int bf16) {
    const void *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5],
               *k6 = k[6], *k7 = k[7];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, load8(k0, d, bf16), a0);
        a1 = _mm256_fmadd_ps(x, load8(k1, d, bf16), a1);
        a2 = _mm256_fmadd_ps(x, load8(k2, d, bf16), a2);
        a3 = _mm256_fmadd_ps(x, load8(k3, d, bf16), a3);
        a4 = _mm256_fmadd_ps(x, load8(k4, d, bf16), a4);
        a5 = _mm256_fmadd_ps(x, load8(k5, d, bf16), a5);
        a6 = _mm256_fmadd_ps(x, load8(k6, d, bf16), a6);
        a7 = _mm256_fmadd_ps(x, load8(k7, d, bf16), a7);
    }
    /* hadd pairs: lanes hold partial sums of keys (0,1,0,1 | ...), then (0,1,2,3 | 0,1,2,3) */
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = keys 0-3 (low half of d | high half), u1 = keys 4-7: add the halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

#endif /* PAGEDKV_WIDE */

/* e^x on 8 lanes for x <= 0 (softmax: a score minus the running maximum): 2^n * e^r with
 * n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] and a degree-6 polynomial for e^r
 * (Taylor coefficients, relative error under 2e-7 there); x is clamped to [-87, 0], so x below
 * -87 gives about 1e-38 and nothing overflows. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps());
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln 2 in two parts so that n * ln2_hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.0f / 720.0f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if PAGEDKV_WIDE
/* scale_add_rows below with 16-lane tiles: 64 floats of the accumulator in four registers,
 * then 16 at a time, then an 8-lane tail */
static inline __attribute__((always_inline)) void scale_add_rows(float *acc, float c,
                                                                const float *p,
                                                                const void *const *v, int n,
                                                                int D, int bf16) {
    const __m512 cv = _mm512_set1_ps(c);
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 x[4];
        for (int t = 0; t < 4; t++) x[t] = _mm512_mul_ps(cv, _mm512_loadu_ps(acc + d + 16 * t));
        for (int j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int t = 0; t < 4; t++)
                x[t] = _mm512_fmadd_ps(pj, load16(v[j], d + 16 * t, bf16), x[t]);
        }
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(acc + d + 16 * t, x[t]);
    }
    for (; d + 16 <= D; d += 16) {
        __m512 x = _mm512_mul_ps(cv, _mm512_loadu_ps(acc + d));
        for (int j = 0; j < n; j++)
            x = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load16(v[j], d, bf16), x);
        _mm512_storeu_ps(acc + d, x);
    }
    for (; d < D; d += 8) {
        __m256 x = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_load_ps(acc + d));
        for (int j = 0; j < n; j++)
            x = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v[j], d, bf16), x);
        _mm256_store_ps(acc + d, x);
    }
}
#else
/* acc[0:D] = acc * c + sum_j p[j] * v[j][0:D] over j < n: the accumulator in registers 64 floats
 * at a time (eight independent FMA chains), each value row read once per tile. */
static inline __attribute__((always_inline)) void scale_add_rows(float *acc, float c,
                                                                const float *p,
                                                                const void *const *v, int n,
                                                                int D, int bf16) {
    const __m256 cv = _mm256_set1_ps(c);
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 x[8];
        for (int t = 0; t < 8; t++) x[t] = _mm256_mul_ps(cv, _mm256_load_ps(acc + d + 8 * t));
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int t = 0; t < 8; t++)
                x[t] = _mm256_fmadd_ps(pj, load8(v[j], d + 8 * t, bf16), x[t]);
        }
        for (int t = 0; t < 8; t++) _mm256_store_ps(acc + d + 8 * t, x[t]);
    }
    for (; d < D; d += 8) {
        __m256 x = _mm256_mul_ps(cv, _mm256_load_ps(acc + d));
        for (int j = 0; j < n; j++)
            x = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v[j], d, bf16), x);
        _mm256_store_ps(acc + d, x);
    }
}
#endif /* PAGEDKV_WIDE */

int pagedkv_write_kv(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, void *k_cache, void *v_cache,
                     const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                     int head_size, int block_size, int kv_bf16) {
    if (num_tokens < 0 || num_kv_heads < 1 || head_size < 1 || block_size < 1) return -1;
    const size_t row = sizeof(float) * (size_t)head_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = ((block * num_kv_heads + h) * block_size + offset) * head_size;
            const float *k = key + t * key_stride + (int64_t)h * head_size;
            const float *v = value + t * value_stride + (int64_t)h * head_size;
            if (kv_bf16) {
                uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
                for (int d = 0; d < head_size; d++) {
                    kc[d] = to_bf16(k[d]);
                    vc[d] = to_bf16(v[d]);
                }
            } else {
                memcpy((float *)k_cache + at, k, row);
                memcpy((float *)v_cache + at, v, row);
            }
        }
    }
    return 0;
}

/* The rows of one unit: the step's tokens [i0, i1) of request r (q_len of them, seq_len keys)
 * times the query heads [h, h + nh), which share one KV head: (i1 - i0) * nh <= CHUNK rows,
 * token-major (row i is token i0 + i / nh, head h + i % nh), all reading the same keys and
 * values. */
typedef struct {
    int rows;
    int lo[CHUNK], hi[CHUNK]; /* keys [lo, hi] per row */
    const float *qr[CHUNK];   /* the rows' queries */
} unit_rows;

static inline void unit_rows_of(unit_rows *u, const float *q, int64_t q_stride, int64_t row0,
                                int i0, int i1, int q_len, int seq_len, int h, int nh,
                                int D, int window) {
    u->rows = (i1 - i0) * nh;
    for (int i = 0; i < u->rows; i++) {
        const int p = seq_len - q_len + i0 + i / nh;
        u->hi[i] = p;
        u->lo[i] = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        u->qr[i] = q + (row0 + i0 + i / nh) * q_stride + (int64_t)(h + i % nh) * D;
    }
}

/* The softmax state of the unit's rows over their keys inside segment [k0, k0 + SEGMENT)
 * (absolute key positions, k0 a multiple of SEGMENT): per row the running maximum m, the sum
 * l of e^(s - m) and acc (D floats, 32-byte aligned, row i at acc + i * D) = the values
 * weighted by e^(s - m), not yet divided by l. A row without keys there: m = -inf, l = 0.
 * bf16: the cache's element type (a constant in each of the two bodies below). */
static inline __attribute__((always_inline)) void attend_segment(
    const unit_rows *u, const void *k_cache, const void *v_cache, const int32_t *block_table,
    int kvh, int num_kv_heads, int D, int block_size, float scale, float softcap, int k0,
    float *m, float *l, float *acc0, const int bf16) {
    const int64_t esize = bf16 ? 2 : 4; /* bytes per cache element */
    const int rows = u->rows;
#define ACC(i) (acc0 + (int64_t)(i) * D)
    for (int i = 0; i < rows; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(ACC(i), 0, sizeof(float) * D);
    }
    const int k1 = k0 + SEGMENT - 1;
    const int first = u->lo[0] > k0 ? u->lo[0] : k0;
    const int last = u->hi[rows - 1] < k1 ? u->hi[rows - 1] : k1;
    const int64_t head_stride = (int64_t)block_size * D;
    float p[CHUNK][PIECE + 8]; /* the rows' scores of a piece, then their weights */
    const void *krow[PIECE], *vrow[PIECE]; /* the piece's key and value rows */
    memset(p, 0, sizeof(p[0]) * rows); /* lanes a group computes past its keys: never read */
    /* pieces of up to PIECE keys, across blocks: the rows' scores of a piece, one softmax
     * update per row and piece, then the weighted value rows */
    /* pieces start at multiples of PIECE: a row's pieces (so its softmax updates) depend only
     * on its own keys, not on the unit's first row (batch invariance) */
    for (int j0 = first - first % PIECE; j0 <= last; j0 += PIECE) {
        const int j1 = j0 + PIECE - 1 < last ? j0 + PIECE - 1 : last;
        /* the block table walked once per piece (no division per key) */
        int bi = j0 / block_size, off = j0 % block_size;
        int64_t base = ((int64_t)block_table[bi] * num_kv_heads + kvh) * head_stride;
        for (int t = 0; t <= j1 - j0; t++, off++) {
            if (off == block_size) {
                off = 0;
                base = ((int64_t)block_table[++bi] * num_kv_heads + kvh) * head_stride;
            }
            krow[t] = (const char *)k_cache + (base + (int64_t)off * D) * esize;
            vrow[t] = (const char *)v_cache + (base + (int64_t)off * D) * esize;
        }
        /* all rows' scores first, then all rows' value rows: the piece's keys (then values)
         * stay in L1 across the rows */
        int na[CHUNK], nn[CHUNK]; /* row i's keys of the piece: n[i] from index na[i] */
        const __m256 sc = _mm256_set1_ps(scale);
        for (int i = 0; i < rows; i++) {
            const int a = j0 > u->lo[i] ? j0 : u->lo[i], b = j1 < u->hi[i] ? j1 : u->hi[i];
            na[i] = a - j0;
            nn[i] = b - a + 1;
            const void *const *kr = krow + na[i];
            float *pi = p[i];
            /* 8 keys at a time wherever they lie (dot8 takes each key's row), the last n % 8
             * one by one: the same bits either way */
            int g = 0;
            for (; g + 8 <= nn[i]; g += 8)
                _mm256_storeu_ps(pi + g, _mm256_mul_ps(sc, dot8(u->qr[i], kr + g, D, bf16)));
            for (; g < nn[i]; g++) pi[g] = dot(u->qr[i], kr[g], D, bf16) * scale;
        }
        for (int i = 0; i < rows; i++) {
            const int n = nn[i];
            if (n < 1) continue;
            float *pi = p[i];
            int g;
            if (softcap > 0.0f) { /* logit soft-capping: s -> cap * tanh(s / cap) */
                const float inv_cap = 1.0f / softcap;
                for (g = 0; g < n; g++) pi[g] = softcap * tanhf(pi[g] * inv_cap);
            }
            __m256 mv = _mm256_set1_ps(m[i]);
            for (g = 0; g + 8 <= n; g += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(pi + g));
            float mx = hmax(mv);
            for (; g < n; g++) mx = pi[g] > mx ? pi[g] : mx;
            const float c = expf(m[i] - mx); /* 0 on the first keys (m = -inf) */
            mv = _mm256_set1_ps(mx);
            __m256 sv = _mm256_setzero_ps();
            for (g = 0; g + 8 <= n; g += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pi + g), mv));
                _mm256_storeu_ps(pi + g, e);
                sv = _mm256_add_ps(sv, e);
            }
            float sum = hsum(sv);
            if (g < n) {
                _mm256_storeu_ps(pi + g, exp8(_mm256_sub_ps(_mm256_loadu_ps(pi + g), mv)));
                for (; g < n; g++) sum += pi[g];
            }
            scale_add_rows(ACC(i), c, pi, vrow + na[i], n, D, bf16);
            l[i] = l[i] * c + sum;
            m[i] = mx;
        }
    }
#undef ACC
}

/* Fold a segment's state (ms, ls, accs) of `rows` rows into the running one (m, l, acc), in
 * segment order (one compiled copy, its multiply-adds explicit, so the whole units and the
 * split ones fold with the same instructions whatever the compiler contracts): a row without
 * keys in the segment keeps its state, a row without keys before takes the segment's, else
 * both are rescaled to the larger maximum M: acc = acc * e^(m - M) + accs * e^(ms - M) (the
 * same for l). */
static __attribute__((noinline)) void fold_segment(int rows, int D, float *m, float *l,
                                                   float *acc, const float *ms,
                                                   const float *ls, const float *accs) {
    for (int i = 0; i < rows; i++) {
        float *a = acc + (int64_t)i * D;
        const float *as = accs + (int64_t)i * D;
        if (ls[i] == 0.0f && ms[i] == -INFINITY) continue;
        if (l[i] == 0.0f && m[i] == -INFINITY) {
            m[i] = ms[i];
            l[i] = ls[i];
            memcpy(a, as, sizeof(float) * D);
            continue;
        }
        const float mx = ms[i] > m[i] ? ms[i] : m[i];
        const float c = expf(m[i] - mx), cs = expf(ms[i] - mx);
        const __m256 cv = _mm256_set1_ps(c), csv = _mm256_set1_ps(cs);
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(a + d, _mm256_fmadd_ps(_mm256_load_ps(as + d), csv,
                                                   _mm256_mul_ps(_mm256_load_ps(a + d), cv)));
        l[i] = fmaf(ls[i], cs, l[i] * c);
        m[i] = mx;
    }
}

/* The unit's output rows: acc / l, into out [tokens, num_heads, D] */
static inline void write_rows(const unit_rows *u, float *out, int64_t row0, int i0, int h, int nh,
                              int num_heads, int D, const float *l, const float *acc) {
    for (int i = 0; i < u->rows; i++) {
        float *o = out + ((row0 + i0 + i / nh) * num_heads + h + i % nh) * (int64_t)D;
        const __m256 inv = _mm256_set1_ps(1.0f / l[i]);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(inv, _mm256_load_ps(acc + (int64_t)i * D + d)));
    }
}

/* the two bodies: an fp32 cache, a bf16 one */
#define SEGMENT_ARGS                                                                          \
    const unit_rows *u, const void *k_cache, const void *v_cache, const int32_t *block_table, \
        int kvh, int num_kv_heads, int D, int block_size, float scale, float softcap, int k0, \
        float *m, float *l, float *acc0
#define SEGMENT_PASS                                                                          \
    u, k_cache, v_cache, block_table, kvh, num_kv_heads, D, block_size, scale, softcap, k0, m, \
        l, acc0
/* noinline: one compiled copy of each, which both the whole units and the split ones call */
static __attribute__((noinline)) void attend_segment_f32(SEGMENT_ARGS) {
    attend_segment(SEGMENT_PASS, 0);
}
static __attribute__((noinline)) void attend_segment_bf16(SEGMENT_ARGS) {
    attend_segment(SEGMENT_PASS, 1);
}
#undef SEGMENT_ARGS
#undef SEGMENT_PASS

/* A unit's rows over all their keys: segment by segment, each folded into the running state
 * in order (what the split units below compute across threads, bit for bit), then written to
 * out (the rows of tokens from row0 + i0, heads from h). */
static void attend(const unit_rows *u, float *out, const void *k_cache, const void *v_cache,
                   const int32_t *block_table, int64_t row0, int i0, int h, int nh,
                   int num_heads, int num_kv_heads, int D, int block_size, float scale,
                   float softcap, int bf16) {
    const int rows = u->rows;
    float m[CHUNK], l[CHUNK], ms[CHUNK], ls[CHUNK];
    /* the rows' accumulators, D floats each, 32-byte aligned (D is a multiple of 8): sized by
     * the unit, not by MAX_HEAD, so a unit's stack stays small on OpenMP's worker threads */
    float acc_store[2 * rows * D + 8];
    float *const acc = (float *)(((uintptr_t)acc_store + 31) & ~(uintptr_t)31);
    float *const accs = acc + (int64_t)rows * D;
    for (int i = 0; i < rows; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int kvh = h / (num_heads / num_kv_heads);
    for (int k0 = u->lo[0] - u->lo[0] % SEGMENT; k0 <= u->hi[rows - 1]; k0 += SEGMENT) {
        (bf16 ? attend_segment_bf16 : attend_segment_f32)(u, k_cache, v_cache, block_table, kvh,
                                                          num_kv_heads, D, block_size, scale,
                                                          softcap, k0, ms, ls, accs);
        fold_segment(rows, D, m, l, acc, ms, ls, accs);
    }
    write_rows(u, out, row0, i0, h, nh, num_heads, D, l, acc);
}

/* The work a step's units share: its queries, requests and how units map onto them */
typedef struct {
    const float *q;
    int64_t q_stride;
    const int32_t *query_start_loc, *seq_lens;
    int64_t per_pair; /* units per (request, chunk of tokens) pair */
    int sets, group, nh, tokens_per_unit, D, window;
} unit_map;

/* Unit u's request *r, first head *h, its number of heads *heads, first token *i0 and rows:
 * units in order of (request, chunk of tokens) pairs, then KV heads, then head sets; *r and
 * *pair_base walk forward (units come in increasing order on each thread), reset when u goes
 * back. */
static inline void unit_place(const unit_map *M, int64_t u, int *r, int64_t *pair_base, int *h,
                              int *heads, int *i0, unit_rows *rows) {
    const int64_t pair = u / M->per_pair;
    const int rem = (int)(u % M->per_pair);
    const int sets = M->sets, group = M->group, nh = M->nh, tpu = M->tokens_per_unit;
    const int32_t *qsl = M->query_start_loc;
    *h = (rem / sets) * group + (rem % sets) * nh; /* the unit's first head */
    *heads = group - (rem % sets) * nh < nh ? group - (rem % sets) * nh : nh;
    if (pair < *pair_base) {
        *r = 0;
        *pair_base = 0;
    }
    for (;;) {
        const int q_len = qsl[*r + 1] - qsl[*r];
        const int64_t n = (q_len + tpu - 1) / tpu;
        if (pair < *pair_base + n) break;
        *pair_base += n;
        (*r)++;
    }
    const int q_len = qsl[*r + 1] - qsl[*r];
    *i0 = (int)(pair - *pair_base) * tpu;
    const int i1 = *i0 + tpu < q_len ? *i0 + tpu : q_len;
    unit_rows_of(rows, M->q, M->q_stride, qsl[*r], *i0, i1, q_len, M->seq_lens[*r], *h, *heads,
                 M->D, M->window);
}

/* Scratch of the split units: at most this many bytes (else the units run whole) */
#define MAX_SPLIT_BYTES (8 << 20)

int pagedkv_paged_attention(const float *q, int64_t q_stride, float *out, const void *k_cache,
                            const void *v_cache, const int32_t *query_start_loc,
                            const int32_t *seq_lens, const int32_t *block_tables,
                            int64_t block_table_stride, int num_reqs, int num_heads,
                            int num_kv_heads, int head_size, int block_size, float scale,
                            int window, float softcap, int kv_bf16, int num_threads) {
    if (num_reqs < 1 || num_kv_heads < 1 || num_heads % num_kv_heads || head_size % 8 ||
        head_size > MAX_HEAD || head_size < 8 || block_size < 1 || num_threads < 1)
        return -1;
    const int group = num_heads / num_kv_heads;
    const int D = head_size;
    /* Units: (request, chunk of tokens) pairs in order, times KV heads, times sets of up to
     * CHUNK query heads of that KV head (GQA: the heads of a group read the same keys and
     * values, so one unit reads them once for all of its rows). With too few units to keep
     * the threads busy (batch 1 decode: one pair), each unit's keys are split into their
     * segments, each segment a unit of its own whose state is kept, and the states folded in
     * order after them (flash-decoding's split over the keys, with the segments the whole
     * units fold too: the same bits); where the scratch for that would be too large, or
     * with a single segment, one query head a unit instead. */
    int nh = group < CHUNK ? group : CHUNK;
    int64_t num_pairs = 0, head_pairs = 0; /* pairs with nh heads a unit, with one */
    int max_seq = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int q_len = query_start_loc[r + 1] - query_start_loc[r];
        if (q_len < 1 || q_len > seq_lens[r]) return -1;
        num_pairs += (q_len + CHUNK / nh - 1) / (CHUNK / nh);
        head_pairs += (q_len + CHUNK - 1) / CHUNK;
        max_seq = seq_lens[r] > max_seq ? seq_lens[r] : max_seq;
    }
    const int64_t few = 4 * (int64_t)num_threads;
    const int64_t grouped = num_pairs * num_kv_heads * ((group + nh - 1) / nh);
    const int num_segments = (max_seq + SEGMENT - 1) / SEGMENT;
    /* per whole unit and segment: CHUNK rows' m, l and D accumulators */
    const int64_t slot = (int64_t)CHUNK * (D + 2);
    float *scratch = NULL;
    if (num_threads > 1 && grouped < few && num_segments > 1 &&
        grouped * num_segments * slot * (int64_t)sizeof(float) <= MAX_SPLIT_BYTES)
        scratch = aligned_alloc(32, (size_t)(grouped * num_segments * slot) * sizeof(float));
    if (scratch == NULL && nh > 1 && grouped < few) {
        nh = 1;
        num_pairs = head_pairs;
    }
    const int tokens_per_unit = CHUNK / nh; /* a unit's rows: tokens_per_unit x nh heads */
    const int sets = (group + nh - 1) / nh; /* head sets per KV head */
    const int64_t per_pair = (int64_t)num_kv_heads * sets;
    const int64_t num_units = num_pairs * per_pair;
    const unit_map M = {q, q_stride, query_start_loc, seq_lens, per_pair, sets, group, nh,
                         tokens_per_unit, D, window};
#pragma omp parallel num_threads(num_threads)
    {
        int r = 0, h, heads, i0;
        int64_t pair_base = 0; /* pairs before request r */
        unit_rows rows;
        if (scratch == NULL) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < num_units; u++) {
                unit_place(&M, u, &r, &pair_base, &h, &heads, &i0, &rows);
                attend(&rows, out, k_cache, v_cache, block_tables + r * block_table_stride,
                       query_start_loc[r], i0, h, heads, num_heads, num_kv_heads, D, block_size,
                       scale, softcap, kv_bf16);
            }
        } else {
            /* each (unit, segment) into its slot: m [CHUNK], l [CHUNK], acc [CHUNK * D] */
#pragma omp for schedule(dynamic, 1)
            for (int64_t us = 0; us < num_units * num_segments; us++) {
                unit_place(&M, us / num_segments, &r, &pair_base, &h, &heads, &i0, &rows);
                float *m = scratch + us * slot, *l = m + CHUNK, *acc = l + CHUNK;
                /* a segment outside the rows' keys leaves them m = -inf, l = 0: folded as
                 * nothing, as the whole unit never visits it */
                (kv_bf16 ? attend_segment_bf16 : attend_segment_f32)(
                    &rows, k_cache, v_cache, block_tables + r * block_table_stride, h / group,
                    num_kv_heads, D, block_size, scale, softcap,
                    (int)(us % num_segments) * SEGMENT, m, l, acc);
            }
            /* the segments of each unit folded in order, then its rows written */
            r = 0;
            pair_base = 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < num_units; u++) {
                unit_place(&M, u, &r, &pair_base, &h, &heads, &i0, &rows);
                float m[CHUNK], l[CHUNK];
                float acc_store[rows.rows * D + 8];
                float *const acc = (float *)(((uintptr_t)acc_store + 31) & ~(uintptr_t)31);
                for (int i = 0; i < rows.rows; i++) {
                    m[i] = -INFINITY;
                    l[i] = 0.0f;
                }
                for (int s = 0; s < num_segments; s++) {
                    const float *ms = scratch + (u * num_segments + s) * slot;
                    fold_segment(rows.rows, D, m, l, acc, ms, ms + CHUNK, ms + 2 * CHUNK);
                }
                write_rows(&rows, out, query_start_loc[r], i0, h, heads, num_heads, D, l, acc);
            }
        }
    }
    free(scratch);
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
    int32_t kv_bf16; /* the cache's elements: 0 fp32, 1 bf16 */
    float softcap;   /* logit soft-cap; <= 0: none */
} pagedkv_attention_step;

int pagedkv_step_write_kv(const pagedkv_attention_step *s, void *k_cache, void *v_cache,
                          const float *key, int64_t key_stride, const float *value,
                          int64_t value_stride, int64_t num_tokens) {
    return pagedkv_write_kv(key, key_stride, value, value_stride, k_cache, v_cache,
                            s->slot_mapping, num_tokens, s->num_kv_heads, s->head_size,
                            s->block_size, s->kv_bf16);
}

int pagedkv_step_attention(const pagedkv_attention_step *s, const void *k_cache,
                           const void *v_cache, const float *q, int64_t q_stride, float *out,
                           int num_threads) {
    return pagedkv_paged_attention(q, q_stride, out, k_cache, v_cache, s->query_start_loc,
                                   s->seq_lens, s->block_tables, s->block_table_stride,
                                   s->num_reqs, s->num_heads, s->num_kv_heads, s->head_size,
                                   s->block_size, s->scale, s->window, s->softcap,
                                   s->kv_bf16, num_threads);
}
