/* One vector body of gguf_blocks.c, included there twice: once with the AVX2 macros (VL = 8
 * lanes), once with the AVX-512 ones (VL = 16). Everything here is written in terms of those
 * macros (VF / VI the float / int32 vector, LOADF, FMA, U8 = VL bytes zero-extended to int32
 * lanes, ...) and of SFX(name), which appends the body's suffix. Not a header of its own: it
 * only makes sense inside gguf_blocks.c (see the block layouts there). */

#define NV (32 / VL) /* vectors per group of 32 weights */

/* Fast (gemm) or exact (dequant) w = a * b + c: the exact form rounds the product, then the
 * sum, as gguf.quants' numpy code does; the fast one is one fused multiply-add. */
#define MULADD(exact, a, b, c) ((exact) ? ADD(MUL((a), (b)), (c)) : FMA((a), (b), (c)))
#define MULSUB(exact, a, b, c) ((exact) ? SUB(MUL((a), (b)), (c)) : FMSUB((a), (b), (c)))

/* Vector v of a group whose 32 nibbles sit in 16 bytes (Q4_0 / Q4_1 / Q5_0 / Q5_1): elements
 * 0-15 are the low nibbles of bytes 0-15, elements 16-31 the high nibbles. */
static inline AI VI SFX(nib16)(const uint8_t *qs, int v) {
    const VI b = U8(qs + (v * VL) % 16);
    return v * VL >= 16 ? SRLI(b, 4) : ANDI(b, 0x0F);
}

/* ---- the 32-element blocks: w[0..NV) = the block's 32 weights ----------------------------- */

#if VL == 16
/* AVX-512: the 4- and 5-bit types by table lookup. Each block (group) has at most 32 distinct
 * weights, one per q: the table of them (computed with the exact formula, so the looked-up
 * weights are bit-identical to dequantization) is one or two vectors, and one permute per 16
 * weights replaces the int-to-float conversion and the scaling (the permute reads only the
 * low 4 / 5 bits of each index, so the low nibble needs no mask for a 16-entry table). */
#define IOTA _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LUT16(idx, tab) _mm512_permutexvar_ps((idx), (tab))
#define LUT32(idx, lo, hi) _mm512_permutex2var_ps((lo), (idx), (hi))

static inline AI void SFX(dec_q4_0)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
    const VF tab = MUL(SET1(f16_to_f32(b)), SUB(IOTA, SET1(8.0f)));
    const VI bytes = U8(b + 2);
    w[0] = LUT16(bytes, tab);
    w[1] = LUT16(SRLI(bytes, 4), tab);
}

static inline AI void SFX(dec_q4_1)(const uint8_t *b, VF w[NV], const int exact) {
    const VF tab = MULADD(exact, SET1(f16_to_f32(b)), IOTA, SET1(f16_to_f32(b + 2)));
    const VI bytes = U8(b + 4);
    w[0] = LUT16(bytes, tab);
    w[1] = LUT16(SRLI(bytes, 4), tab);
}

static inline AI void SFX(dec_q5_0)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
    const VF d = SET1(f16_to_f32(b));
    const VF lo = MUL(d, SUB(IOTA, SET1(16.0f))), hi = MUL(d, IOTA);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const VI bytes = U8(b + 6);
    w[0] = LUT32(ORI(ANDI(bytes, 0x0F), QH16(qh, 0)), lo, hi);
    w[1] = LUT32(ORI(SRLI(bytes, 4), QH16(qh, 16)), lo, hi);
}

static inline AI void SFX(dec_q5_1)(const uint8_t *b, VF w[NV], const int exact) {
    const VF d = SET1(f16_to_f32(b)), m = SET1(f16_to_f32(b + 2));
    const VF lo = MULADD(exact, d, IOTA, m), hi = MULADD(exact, d, ADD(IOTA, SET1(16.0f)), m);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const VI bytes = U8(b + 8);
    w[0] = LUT32(ORI(ANDI(bytes, 0x0F), QH16(qh, 0)), lo, hi);
    w[1] = LUT32(ORI(SRLI(bytes, 4), QH16(qh, 16)), lo, hi);
}
#else
static inline AI void SFX(dec_q4_0)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
    const VF d = SET1(f16_to_f32(b));
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = MUL(d, CVT(SUBI(SFX(nib16)(b + 2, v), 8)));
}

static inline AI void SFX(dec_q4_1)(const uint8_t *b, VF w[NV], const int exact) {
    const VF d = SET1(f16_to_f32(b)), m = SET1(f16_to_f32(b + 2));
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = MULADD(exact, d, CVT(SFX(nib16)(b + 4, v)), m);
}

static inline AI void SFX(dec_q5_0)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
    const VF d = SET1(f16_to_f32(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
        w[v] = MUL(d, CVT(SUBI(ORI(SFX(nib16)(b + 6, v), QH16(qh, v * VL)), 16)));
}

static inline AI void SFX(dec_q5_1)(const uint8_t *b, VF w[NV], const int exact) {
    const VF d = SET1(f16_to_f32(b)), m = SET1(f16_to_f32(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
        w[v] = MULADD(exact, d, CVT(ORI(SFX(nib16)(b + 8, v), QH16(qh, v * VL))), m);
}

#endif

static inline AI void SFX(dec_q8_0)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
    const VF d = SET1(f16_to_f32(b));
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = MUL(CVT(I8(b + 2 + v * VL)), d);
}

/* 32 consecutive elements of the float types (a "block" of 32 of them). */
static inline AI void SFX(dec_f32)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = LOADF((const float *)b + v * VL);
}

static inline AI void SFX(dec_f16)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = F16X(b + 2 * v * VL);
}

static inline AI void SFX(dec_bf16)(const uint8_t *b, VF w[NV], const int exact) {
    (void)exact;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) w[v] = BF16X(b + 2 * v * VL);
}

/* ---- the 256-element super-blocks: prepared once (scales), then 8 groups of 32 ------------- */

#if VL == 16
/* AVX-512: Q4_K / Q5_K group j by table lookup (see the 32-element blocks above): the
 * group's 16 (32) weights D[j] * q - DM[j], then one permute per 16 weights. */
static inline AI void SFX(dec_q4_k_group)(const uint8_t *qs, int j, const float *D,
                                          const float *DM, VF w[NV], const int exact) {
    const VF tab = MULSUB(exact, SET1(D[j]), IOTA, SET1(DM[j]));
    const uint8_t *bytes = qs + 32 * (j / 2);
#pragma GCC unroll 2
    for (int v = 0; v < NV; v++) {
        const VI b = U8(bytes + v * VL);
        w[v] = LUT16(j & 1 ? SRLI(b, 4) : b, tab);
    }
}

static inline AI void SFX(dec_q5_k_group)(const uint8_t *qh, const uint8_t *qs, int j,
                                          const float *D, const float *DM, VF w[NV],
                                          const int exact) {
    const VF d = SET1(D[j]), dm = SET1(DM[j]);
    const VF lo = MULSUB(exact, d, IOTA, dm), hi = MULSUB(exact, d, ADD(IOTA, SET1(16.0f)), dm);
    const uint8_t *bytes = qs + 32 * (j / 2);
#pragma GCC unroll 2
    for (int v = 0; v < NV; v++) {
        const VI b = U8(bytes + v * VL);
        const VI high = ANDI(SRLV(U8(qh + v * VL), j), 1);
        const VI q = ORI(j & 1 ? SRLI(b, 4) : ANDI(b, 0x0F), SLLI(high, 4));
        w[v] = LUT32(q, lo, hi);
    }
}
#else
/* Q4_K / Q5_K group j (0..7): D[j] * q - DM[j] with q the nibble (Q5_K: plus bit j of qh). */
static inline AI void SFX(dec_q4_k_group)(const uint8_t *qs, int j, const float *D,
                                          const float *DM, VF w[NV], const int exact) {
    const VF d = SET1(D[j]), dm = SET1(DM[j]);
    const uint8_t *bytes = qs + 32 * (j / 2);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const VI b = U8(bytes + v * VL);
        w[v] = MULSUB(exact, d, CVT(j & 1 ? SRLI(b, 4) : ANDI(b, 0x0F)), dm);
    }
}

static inline AI void SFX(dec_q5_k_group)(const uint8_t *qh, const uint8_t *qs, int j,
                                          const float *D, const float *DM, VF w[NV],
                                          const int exact) {
    const VF d = SET1(D[j]), dm = SET1(DM[j]);
    const uint8_t *bytes = qs + 32 * (j / 2);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const VI b = U8(bytes + v * VL);
        const VI high = ANDI(SRLV(U8(qh + v * VL), j), 1);
        const VI q = ORI(j & 1 ? SRLI(b, 4) : ANDI(b, 0x0F), SLLI(high, 4));
        w[v] = MULSUB(exact, d, CVT(q), dm);
    }
}

#endif

/* Q6_K group g (0..7) of 32: half h = g / 4 (128 elements), quarter t = g % 4 of it. The
 * exact form (dequantization) is D[i] * (q - 32); the product's is D[i] * q - D32[i] with
 * D32 = 32 D (one fused operation instead of a subtraction and a multiplication). */
static inline AI void SFX(dec_q6_k_group)(const uint8_t *blk, int g, const float *D,
                                          const float *D32, VF w[NV], const int exact) {
    const int h = g / 4, t = g % 4;
    const uint8_t *lo = blk + 64 * h + 32 * (t & 1), *hi = blk + 128 + 32 * h;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        const VI b = U8(lo + v * VL), hb = U8(hi + v * VL);
        const VI nib = t >= 2 ? SRLI(b, 4) : ANDI(b, 0x0F);
        /* bits 2t, 2t + 1 of the qh byte moved to bits 4, 5 */
        const VI top = t == 3 ? SRLI(hb, 2) : t == 2 ? hb : SLLI(hb, 4 - 2 * t);
        const VI q = OR_AND(nib, top, 0x30);
        const int i = 2 * g + (v * VL) / 16;
        w[v] = exact ? MUL(SET1(D[i]), CVT(SUBI(q, 32))) : FMSUB(SET1(D[i]), CVT(q), SET1(D32[i]));
    }
}

/* ---- gemm: one output row for all M activation rows ----------------------------------- */

/* acc[m][(base + v) % C] += w[v] * x[m, off + v VL ..]: C independent chains per row. */
#define ACCUM(M, C, w, x, K, off, base, acc)                                                 \
    do {                                                                                     \
        _Pragma("GCC unroll 8") for (int m_ = 0; m_ < (M); m_++)                             \
            _Pragma("GCC unroll 4") for (int v_ = 0; v_ < NV; v_++)                          \
                (acc)[m_][((base) + v_) % (C)] = FMA(                                         \
                    (w)[v_], LOADF((x) + m_ * (K) + (off) + v_ * VL), (acc)[m_][((base) + v_) % (C)]); \
    } while (0)

/* Row n of a product over 32-element blocks of BB bytes (DEC one of the dec_* above). */
#define ROW32(T, BB, DEC)                                                                    \
    static inline AI void SFX(row_##T)(const int M, const uint8_t *w, const float *x,        \
                                       const float *xsum, int64_t K, int64_t N, int64_t n,   \
                                       float *out) {                                         \
        (void)xsum;                                                                          \
        const int C = CHAINS(M);                                                             \
        VF acc[MAX_M][4];                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[m][c] = ZERO();          \
        const int64_t G = K / 32;                                                            \
        const uint8_t *row = w + n * G * (BB);                                               \
        int64_t g = 0;                                                                       \
        for (; g + 2 <= G; g += 2) {                                                         \
            const uint8_t *b = row + g * (BB);                                               \
            for (int o = 0; o < 2 * (BB); o += 64) PREFETCH(b + PF_BYTES + o);               \
            VF w0[NV], w1[NV];                                                               \
            DEC(b, w0, 0);                                                                   \
            DEC(b + (BB), w1, 0);                                                            \
            ACCUM(M, C, w0, x, K, g * 32, 0, acc);                                           \
            ACCUM(M, C, w1, x, K, g * 32 + 32, NV, acc);                                     \
        }                                                                                    \
        if (g < G) {                                                                         \
            VF w0[NV];                                                                       \
            DEC(row + g * (BB), w0, 0);                                                      \
            ACCUM(M, C, w0, x, K, g * 32, 0, acc);                                           \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                \
            _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) acc[m][0] = ADD(acc[m][0], acc[m][c]); \
            out[m * N + n] = HSUM(acc[m][0]);                                                \
        }                                                                                    \
    }

ROW32(q4_0, 18, SFX(dec_q4_0))
ROW32(q4_1, 20, SFX(dec_q4_1))
ROW32(q5_0, 22, SFX(dec_q5_0))
ROW32(q5_1, 24, SFX(dec_q5_1))
ROW32(q8_0, 34, SFX(dec_q8_0))

/* The float types: K need not be a multiple of 32; the last K % 32 elements are summed in
 * scalar code (float_at gives element k of the row as fp32). */
#define ROWF(T, ES, DEC, AT)                                                                 \
    static inline AI void SFX(row_##T)(const int M, const uint8_t *w, const float *x,        \
                                       const float *xsum, int64_t K, int64_t N, int64_t n,   \
                                       float *out) {                                         \
        (void)xsum;                                                                          \
        const int C = CHAINS(M);                                                             \
        VF acc[MAX_M][4];                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[m][c] = ZERO();          \
        const uint8_t *row = w + n * K * (ES);                                               \
        int64_t k = 0;                                                                       \
        for (; k + 64 <= K; k += 64) {                                                       \
            const uint8_t *b = row + k * (ES);                                               \
            for (int o = 0; o < 64 * (ES); o += 64) PREFETCH(b + PF_BYTES + o);              \
            VF w0[NV], w1[NV];                                                               \
            DEC(b, w0, 0);                                                                   \
            DEC(b + 32 * (ES), w1, 0);                                                       \
            ACCUM(M, C, w0, x, K, k, 0, acc);                                                \
            ACCUM(M, C, w1, x, K, k + 32, NV, acc);                                          \
        }                                                                                    \
        for (; k + 32 <= K; k += 32) {                                                       \
            VF w0[NV];                                                                       \
            DEC(row + k * (ES), w0, 0);                                                      \
            ACCUM(M, C, w0, x, K, k, 0, acc);                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                \
            _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) acc[m][0] = ADD(acc[m][0], acc[m][c]); \
            float tail = 0.0f;                                                               \
            for (int64_t t = k; t < K; t++) tail += AT(row, t) * x[m * K + t];               \
            out[m * N + n] = HSUM(acc[m][0]) + tail;                                         \
        }                                                                                    \
    }

ROWF(f32, 4, SFX(dec_f32), f32_at)
ROWF(f16, 2, SFX(dec_f16), f16_at)
ROWF(bf16, 2, SFX(dec_bf16), bf16_at)

/* Q4_K / Q5_K / Q6_K rows: the super-block's scales decoded once, then its 8 groups. */
#define ROWK(T, BB, PREP, GROUP)                                                             \
    static inline AI void SFX(row_##T)(const int M, const uint8_t *w, const float *x,        \
                                       const float *xsum, int64_t K, int64_t N, int64_t n,   \
                                       float *out) {                                         \
        (void)xsum;                                                                          \
        const int C = CHAINS(M);                                                             \
        VF acc[MAX_M][4];                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[m][c] = ZERO();          \
        const int64_t S = K / 256;                                                           \
        const uint8_t *row = w + n * S * (BB);                                               \
        for (int64_t s = 0; s < S; s++) {                                                    \
            const uint8_t *blk = row + s * (BB);                                             \
            for (int o = 0; o < (BB); o += 64) PREFETCH(blk + PF_BYTES + o);                 \
            float D[16], DM[16];                                                              \
            PREP(blk, D, DM);                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                            \
                VF wj[NV];                                                                   \
                GROUP;                                                                       \
                ACCUM(M, C, wj, x, K, s * 256 + j * 32, (j * NV) % 4, acc);                  \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                \
            _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) acc[m][0] = ADD(acc[m][0], acc[m][c]); \
            out[m * N + n] = HSUM(acc[m][0]);                                                \
        }                                                                                    \
    }

/* Q4_K / Q5_K rows, factored: sum_j D[j] (q_j . x_j) - sum_j DM[j] xsum_j, with xsum [M, K/32]
 * the sums of x over each group of 32 (computed once per call). Per group: the q's as floats,
 * their dot with x, one multiply-add by D[j]; per super-block one multiply-add of the 8 DM's
 * with the 8 xsums. Fewer vector operations per weight than forming each weight. QF(v) gives
 * vector v of group j's q as floats. */
#define ROWKF(T, BB, QF)                                                                     \
    static inline AI void SFX(row_##T)(const int M, const uint8_t *w, const float *x,        \
                                       const float *xsum, int64_t K, int64_t N, int64_t n,   \
                                       float *out) {                                         \
        const int C = CHAINS(M);                                                             \
        VF acc[MAX_M][4];                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                  \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[m][c] = ZERO();          \
        const int64_t S = K / 256, G = K / 32;                                               \
        const uint8_t *row = w + n * S * (BB);                                               \
        for (int64_t s = 0; s < S; s++) {                                                    \
            const uint8_t *blk = row + s * (BB);                                             \
            for (int o = 0; o < (BB); o += 64) PREFETCH(blk + PF_BYTES + o);                 \
            float D[16], DM[16];                                                              \
            prep_q4_k(blk, D, DM);                                                           \
            const __m256 dm = _mm256_loadu_ps(DM);                                           \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                              \
                acc[m][1 % C] = FNMADD8(dm, _mm256_loadu_ps(xsum + m * G + s * 8), acc[m][1 % C]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                            \
                const uint8_t *qs = blk + (BB) - 128 + 32 * (j / 2);                         \
                VF q[NV];                                                                    \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) q[v] = QF(v);          \
                const VF d = SET1(D[j]);                                                     \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                        \
                    const float *xm = x + m * K + s * 256 + j * 32;                          \
                    VF t = MUL(q[0], LOADF(xm));                                             \
                    _Pragma("GCC unroll 4") for (int v = 1; v < NV; v++)                     \
                        t = FMA(q[v], LOADF(xm + v * VL), t);                                \
                    acc[m][j % C] = FMA(d, t, acc[m][j % C]);                                \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {                                \
            _Pragma("GCC unroll 4") for (int c = 1; c < C; c++) acc[m][0] = ADD(acc[m][0], acc[m][c]); \
            out[m * N + n] = HSUM(acc[m][0]);                                                \
        }                                                                                    \
    }

#define Q4K_Q(v) NIBF(U8(qs + (v) * VL), j & 1)
#define Q5K_Q(v)                                                                             \
    CVT(ORI(j & 1 ? SRLI(U8(qs + (v) * VL), 4) : ANDI(U8(qs + (v) * VL), 0x0F),                \
            SLLI(ANDI(SRLV(U8(blk + 16 + (v) * VL), j), 1), 4)))
ROWKF(q4_k, 144, Q4K_Q)
ROWKF(q5_k, 176, Q5K_Q)
#undef Q4K_Q
#undef Q5K_Q
ROWK(q6_k, 210, prep_q6_k, SFX(dec_q6_k_group)(blk, j, D, DM, wj, 0))

/* rows n0..n1 of one type, M a constant at each call site */
#define ROWS(T)                                                                              \
    static __attribute__((noinline)) void SFX(rows_##T)(int M, const uint8_t *w,             \
                                                        const float *x, const float *xsum,   \
                                                        int64_t K, int64_t N, int64_t n0,    \
                                                        int64_t n1, float *out) {            \
        FOR_ROWS(SFX(row_##T), M, w, x, xsum, K, N);                                     \
    }

ROWS(f32)
ROWS(f16)
ROWS(bf16)
ROWS(q4_0)
ROWS(q4_1)
ROWS(q5_0)
ROWS(q5_1)
ROWS(q8_0)
ROWS(q4_k)
ROWS(q5_k)
ROWS(q6_k)

/* Rows n0..n1 of the product of a type (a GGML_* id that gguf_blocks.c has checked). */
static void SFX(gemm_rows)(int type, int M, const uint8_t *w, const float *x,
                           const float *xsum, int64_t K, int64_t N, int64_t n0, int64_t n1,
                           float *out) {
    switch (type) {
        case GGML_F32: SFX(rows_f32)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_F16: SFX(rows_f16)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_BF16: SFX(rows_bf16)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q4_0: SFX(rows_q4_0)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q4_1: SFX(rows_q4_1)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q5_0: SFX(rows_q5_0)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q5_1: SFX(rows_q5_1)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q8_0: SFX(rows_q8_0)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q4_K: SFX(rows_q4_k)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q5_K: SFX(rows_q5_k)(M, w, x, xsum, K, N, n0, n1, out); break;
        case GGML_Q6_K: SFX(rows_q6_k)(M, w, x, xsum, K, N, n0, n1, out); break;
    }
}

#if DEQUANT_BODY
/* ---- dequant: one row, exact (the formulas of gguf.quants, in its rounding order) ------- */

/* Store 32 values: fp32, or bf16 rounded to nearest even. */
static inline AI void SFX(store32)(const VF w[NV], void *out, int64_t k, const int bf16) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        if (bf16)
            STORE_BF16((uint16_t *)out + k + v * VL, w[v]);
        else
            STOREF((float *)out + k + v * VL, w[v]);
    }
}

#define DEQ32(T, BB, DEC)                                                                    \
    static void SFX(deq_##T)(const uint8_t *row, int64_t K, void *out, const int bf16) {     \
        for (int64_t g = 0; g < K / 32; g++) {                                               \
            VF w0[NV];                                                                       \
            DEC(row + g * (BB), w0, 1);                                                      \
            SFX(store32)(w0, out, g * 32, bf16);                                             \
        }                                                                                    \
    }

DEQ32(q4_0, 18, SFX(dec_q4_0))
DEQ32(q4_1, 20, SFX(dec_q4_1))
DEQ32(q5_0, 22, SFX(dec_q5_0))
DEQ32(q5_1, 24, SFX(dec_q5_1))
DEQ32(q8_0, 34, SFX(dec_q8_0))

#define DEQF(T, ES, DEC, AT)                                                                 \
    static void SFX(deq_##T)(const uint8_t *row, int64_t K, void *out, const int bf16) {     \
        int64_t k = 0;                                                                       \
        for (; k + 32 <= K; k += 32) {                                                       \
            VF w0[NV];                                                                       \
            DEC(row + k * (ES), w0, 1);                                                      \
            SFX(store32)(w0, out, k, bf16);                                                  \
        }                                                                                    \
        for (; k < K; k++) {                                                                 \
            if (bf16)                                                                        \
                ((uint16_t *)out)[k] = f32_to_bf16(AT(row, k));                              \
            else                                                                             \
                ((float *)out)[k] = AT(row, k);                                              \
        }                                                                                    \
    }

DEQF(f32, 4, SFX(dec_f32), f32_at)
DEQF(f16, 2, SFX(dec_f16), f16_at)
DEQF(bf16, 2, SFX(dec_bf16), bf16_at)

#define DEQK(T, BB, PREP, GROUP)                                                             \
    static void SFX(deq_##T)(const uint8_t *row, int64_t K, void *out, const int bf16) {     \
        for (int64_t s = 0; s < K / 256; s++) {                                              \
            const uint8_t *blk = row + s * (BB);                                             \
            float D[16], DM[16];                                                              \
            PREP(blk, D, DM);                                                                \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                            \
                VF wj[NV];                                                                   \
                GROUP;                                                                       \
                SFX(store32)(wj, out, s * 256 + j * 32, bf16);                               \
            }                                                                                \
        }                                                                                    \
    }

DEQK(q4_k, 144, prep_q4_k, SFX(dec_q4_k_group)(blk + 16, j, D, DM, wj, 1))
DEQK(q5_k, 176, prep_q4_k, SFX(dec_q5_k_group)(blk + 16, blk + 48, j, D, DM, wj, 1))
DEQK(q6_k, 210, prep_q6_k, SFX(dec_q6_k_group)(blk, j, D, DM, wj, 1))

/* One row of a type (checked by the caller) into out [K] (fp32 or bf16). */
static void SFX(dequant_row)(int type, const uint8_t *row, int64_t K, void *out, int bf16) {
    switch (type) {
        case GGML_F32: SFX(deq_f32)(row, K, out, bf16); break;
        case GGML_F16: SFX(deq_f16)(row, K, out, bf16); break;
        case GGML_BF16: SFX(deq_bf16)(row, K, out, bf16); break;
        case GGML_Q4_0: SFX(deq_q4_0)(row, K, out, bf16); break;
        case GGML_Q4_1: SFX(deq_q4_1)(row, K, out, bf16); break;
        case GGML_Q5_0: SFX(deq_q5_0)(row, K, out, bf16); break;
        case GGML_Q5_1: SFX(deq_q5_1)(row, K, out, bf16); break;
        case GGML_Q8_0: SFX(deq_q8_0)(row, K, out, bf16); break;
        case GGML_Q4_K: SFX(deq_q4_k)(row, K, out, bf16); break;
        case GGML_Q5_K: SFX(deq_q5_k)(row, K, out, bf16); break;
        case GGML_Q6_K: SFX(deq_q6_k)(row, K, out, bf16); break;
    }
}
#endif

#undef NV
#undef MULADD
#undef MULSUB
#undef ACCUM
#undef ROW32
#undef ROWF
#undef ROWK
#undef ROWKF
#undef ROWS
#undef DEQ32
#undef DEQF
#undef DEQK
