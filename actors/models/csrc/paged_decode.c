/* Decode attention over a paged KV cache, read in place (no gather), float32, on one thread or
   shared by the kernels' pool (csrc/pool.c).

   Built by actors/models/cpu_attention.py (gcc -O3 -ffp-contract=fast, plus -mavx2 -mfma where
   the CPU has them) and called through ctypes, once per layer for the whole decode batch. Plain
   C: no torch headers.

   Layout: q and out [D, H, hd]; each cache [num_blocks, bs, kvh, hd]; block_tables [D, W] (int64,
   padded with anything: entries past a decode's length are never read); context_lens [D] (int64,
   the KV length including this step's token). Query head h*G + g (G = H / kvh) attends with KV
   head h, as in a GQA model. Per decode and KV head (the unit of work a thread takes): all its
   group's scores (one pass over its K rows, block by block, each query head of the group against
   the KV head's rows while they are in cache), a two-pass softmax per query head (max, then exp
   and sum), then one pass over its V rows; out = sum_t p_t v_t with p normalised first.

   Prefetch. A KV head's slice of a block is a few KB somewhere in the cache, so the hardware
   prefetcher, which follows a run of lines, starts afresh at every block and the pass waits on
   memory. While a block is worked on, the KV head's slice of the block PF_AHEAD places further
   along K then V is requested (__builtin_prefetch, spread over the group's query heads), into L2
   (PF_LOCALITY 2: prefetcht1 on x86) rather than L1, whose few outstanding misses a block's
   worth of requests would fill and stall on. Both are compile-time constants (-D to override;
   benchmarks/decode_attention_memory.py builds the kernel with the previous next-block-into-L1
   requests beside this one). Requests change no result.

   Two forms of the loops. With AVX and a head dim of 32, 64, 96 or 128: GCC vector extensions
   with the head dim a compile-time constant, so q and the output row stay in registers across
   a block, and 8 rows' dot products are reduced together. Otherwise plain loops that gcc
   vectorizes for the target without -ffast-math: fixed 8-lane partial sums. Either way the exp
   needs no libm call (range reduction by ln 2 and a degree-5 polynomial, Cephes' expf: about
   1 ulp for x <= 0), so the softmax loop vectorizes too. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

#ifndef PF_AHEAD
#define PF_AHEAD 2    /* blocks between the one worked on and the one requested */
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2 /* __builtin_prefetch's locality: 2 = into L2 */
#endif

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[d + j] * b[d + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

static inline float exp_nonpositive(float v) {  /* exp(v) for v <= 0 (v < -87 gives exp(-87)) */
    /* max(v, -87) on the bits, which gcc vectorizes (a float compare here it does not, without
       -ffinite-math-only): as unsigned ints, +0 and positive floats lie below every negative
       one, and a negative float's bits grow with its magnitude. */
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const uint32_t floor_bits = 0xC2AE0000u;  /* -87.0f */
    bits = bits < floor_bits ? bits : floor_bits;
    memcpy(&v, &bits, sizeof v);
    int32_t k = (int32_t)(v * 1.44269504088896341f - 0.5f); /* round(v / ln 2): truncation of v <= 0 */
    float fk = (float)k;
    float r = v - fk * 0.693359375f;
    r = r - fk * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t exponent = (k + 127) << 23;  /* 2^k, k >= -126 */
    float two;
    memcpy(&two, &exponent, sizeof two);
    return p * two;
}

static inline float row_max(const float *restrict x, int64_t n) {
    float acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = x[0];
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
    float m = acc[0];
    for (int j = 1; j < LANES; j++) m = acc[j] > m ? acc[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float row_sum(const float *restrict x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += x[i];
    return s;
}

/* In place: x = softmax(x). */
static void softmax(float *restrict x, int64_t n) {
    const float m = row_max(x, n);
    for (int64_t i = 0; i < n; i++) x[i] = exp_nonpositive(x[i] - m);
    const float inv = 1.0f / row_sum(x, n);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

/* Head dims that are a multiple of 8, up to 128: GCC vector extensions (one AVX register, or
   two SSE / NEON ones) with the head dim a compile-time constant, so a query head's q and
   output row stay in registers across a block's rows. */
typedef float v8 __attribute__((vector_size(32)));
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE float hsum8(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

#ifdef __clang__
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v8i __attribute__((vector_size(32)));
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Pairwise sums within 128-bit halves, as x86's vhaddps: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...]. */
ALWAYS_INLINE v8 hadd(v8 a, v8 b) {
    return SHUFFLE2(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE2(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The 8 horizontal sums of a[0..7], as one vector: a transpose-and-add instead of 8 reductions. */
ALWAYS_INLINE v8 hsum8x8(const v8 *a) {
    const v8 s0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  /* [a0..a3 of the low halves, a0..a3 high] */
    const v8 s1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
    return SHUFFLE2(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE2(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* q . k for one row, q pre-loaded (nv vectors). */
ALWAYS_INLINE v8 row_dot(const v8 *qv, const float *restrict k, const int nv) {
    v8 a = qv[0] * load8(k);
    for (int n = 1; n < nv; n++) a += qv[n] * load8(k + 8 * n);
    return a;
}

/* sc[s] = scale * q . k_s for the block's first `rows` rows (k_s at kb + s * row), 8 rows at a
   time (8 independent accumulators, reduced together). */
ALWAYS_INLINE void block_scores(const float *restrict q, const float *restrict kb, int64_t row, int64_t rows,
                                float scale, float *restrict sc, const int nv) {
    v8 qv[16];
    for (int n = 0; n < nv; n++) qv[n] = load8(q + 8 * n) * scale;
    int64_t s = 0;
    for (; s + 8 <= rows; s += 8) {
        v8 a[8];
        for (int u = 0; u < 8; u++) a[u] = row_dot(qv, kb + (s + u) * row, nv);
        store8(sc + s, hsum8x8(a));
    }
    for (; s < rows; s++) sc[s] = hsum8(row_dot(qv, kb + s * row, nv));
}

/* o (+)= sum_s p[s] v_s over the block's first `rows` rows; o is overwritten when `first`. */
ALWAYS_INLINE void block_values(const float *restrict p, const float *restrict vb, int64_t row, int64_t rows,
                                float *restrict o, int first, const int nv) {
    v8 acc[16];
    for (int n = 0; n < nv; n++) acc[n] = first ? (v8){0} : load8(o + 8 * n);
    for (int64_t s = 0; s < rows; s++) {
        const float *v = vb + s * row;
        const v8 ps = (v8){0} + p[s];
        for (int n = 0; n < nv; n++) acc[n] += ps * load8(v + 8 * n);
    }
    for (int n = 0; n < nv; n++) store8(o + 8 * n, acc[n]);
}

/* Ask for part `part` of `parts` of one KV head's slice (`head_dim` floats at `base`, then every
   `row` floats) of a block's first `rows` token rows, ahead of use: the hardware prefetcher
   follows a slice but cannot guess the next block in the table. Spread over the group's query
   heads, the requests do not queue up at once. */
ALWAYS_INLINE void prefetch_part(const float *base, int64_t rows, int64_t row, int64_t head_dim, int64_t part,
                                 int64_t parts) {
    const int64_t per = (rows + parts - 1) / parts, end = (part + 1) * per < rows ? (part + 1) * per : rows;
    for (int64_t s = part * per; s < end; s++)
        for (int64_t d = 0; d < head_dim; d += 16) __builtin_prefetch(base + s * row + d, 0, PF_LOCALITY);
}

/* One decode, one KV head h: its group's query heads' scores [G, len] -> softmax rows -> their rows
   of oi [H, hd]. nv = head_dim / 8, or 0: any head dim. Each query head's sums are the same, in the
   same order, whichever thread computes it and whatever else it computes. */
ALWAYS_INLINE void attend(const float *restrict qi, const float *restrict k_cache, const float *restrict v_cache,
                          const int64_t *restrict table, int64_t len, float *restrict oi, float *restrict scores,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t h, const int nv) {
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * head_dim;      /* floats per token in a cache block */
    const int64_t block = block_size * row;       /* floats per block */
    const int64_t off = h * head_dim;             /* this KV head's slice of a token row */
    const int64_t blocks = (len + block_size - 1) / block_size;
    /* Block j of the sequence the two passes read, K's blocks then V's (j < 2 * blocks): its
       KV head slice and its rows. */
#define AHEAD_BASE(j) (((j) < blocks ? k_cache : v_cache) + table[(j) % blocks] * block + off)
#define AHEAD_ROWS(j) ((j) % blocks < blocks - 1 ? block_size : len - (blocks - 1) * block_size)
    for (int64_t j = 1; j < PF_AHEAD && j < 2 * blocks; j++)  /* the first blocks after the one read now */
        prefetch_part(AHEAD_BASE(j), AHEAD_ROWS(j), row, head_dim, 0, 1);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *kb = k_cache + table[t0 / block_size] * block + off;
        const int64_t rows = len - t0 < block_size ? len - t0 : block_size;
        const int64_t ahead = t0 / block_size + PF_AHEAD;  /* a K block, or past the last one a V block */
        for (int64_t g = 0; g < group; g++) {
            const float *q = qi + (h * group + g) * head_dim;
            if (ahead < 2 * blocks) prefetch_part(AHEAD_BASE(ahead), AHEAD_ROWS(ahead), row, head_dim, g, group);
            if (nv) {
                block_scores(q, kb, row, rows, scale, scores + g * len + t0, nv);
            } else {
                for (int64_t s = 0; s < rows; s++) scores[g * len + t0 + s] = dot(q, kb + s * row, head_dim) * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * len, len);
    float *o = oi + h * group * head_dim;
    if (!nv) memset(o, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *vb = v_cache + table[t0 / block_size] * block + off;
        const int64_t rows = len - t0 < block_size ? len - t0 : block_size;
        const int64_t ahead = blocks + t0 / block_size + PF_AHEAD;  /* a V block */
        for (int64_t g = 0; g < group; g++) {
            if (ahead < 2 * blocks) prefetch_part(AHEAD_BASE(ahead), AHEAD_ROWS(ahead), row, head_dim, g, group);
            if (nv) {
                block_values(scores + g * len + t0, vb, row, rows, o + g * head_dim, t0 == 0, nv);
            } else {
                for (int64_t s = 0; s < rows; s++)
                    axpy(o + g * head_dim, scores[g * len + t0 + s], vb + s * row, head_dim);
            }
        }
    }
#undef AHEAD_BASE
#undef AHEAD_ROWS
}

/* ---- Threads: the pool of csrc/pool.c (its `tidal_pool_run`, whose address the caller passes).
   A chunk is one decode's one KV head, so every output row is computed by one thread. */

/* csrc/pool.c's signatures, written out here: a kernel's build is named by its own file alone
   (actors/models/ckernel.py), so the kernels share no header. */
typedef void (*pool_task)(void *ctx, int64_t chunk, void *scratch);
typedef int (*pool_runner)(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes, int threads);

#define POOL_MIN_MACS 65536  /* smaller calls are not worth waking a helper */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out;
    int64_t heads, kv_heads, head_dim, block_size, width;
    float scale;
} decode_job;

#define ATTEND(NV) attend(j->q + i * j->heads * j->head_dim, j->k_cache, j->v_cache, j->block_tables + i * j->width, \
                          j->context_lens[i], j->out + i * j->heads * j->head_dim, scores, j->heads, j->kv_heads, \
                          j->head_dim, j->block_size, j->scale, h, NV)

static void decode_chunk(void *ctx, int64_t chunk, void *scratch) {
    const decode_job *j = ctx;
    const int64_t i = chunk / j->kv_heads, h = chunk % j->kv_heads;
    float *scores = scratch;  /* [G, len] */
#if defined(__AVX__)
    switch (j->head_dim) {  /* 8-wide vectors are one or two registers: the register-blocked loops */
        case 64: ATTEND(8); break;
        case 128: ATTEND(16); break;
        case 32: ATTEND(4); break;
        case 96: ATTEND(12); break;
        default: ATTEND(0); break;
    }
#else
    ATTEND(0);  /* no AVX: the plain loops, which gcc vectorizes for the target (8-wide shuffles lower poorly to SSE2) */
#endif
}

/* Returns 0, or: 1 a length outside [1, W * bs], 2 a block id outside [0, num_blocks), 3 out of
   memory. `run`: csrc/pool.c's tidal_pool_run, shared over `threads` threads (NULL: this thread). */
int tidal_paged_decode(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                       const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                       float *restrict out, int64_t num_decodes, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t width, int64_t num_blocks, float scale, int threads,
                       pool_runner run) {
    int64_t max_len = 0, total = 0;
    for (int64_t i = 0; i < num_decodes; i++) {
        const int64_t len = context_lens[i];
        if (len < 1 || len > width * block_size) return 1;
        const int64_t *table = block_tables + i * width;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 2;
        if (len > max_len) max_len = len;
        total += len;
    }
    if (num_decodes == 0) return 0;
    decode_job job = {q, k_cache, v_cache, block_tables, context_lens, out, heads, kv_heads, head_dim, block_size,
                      width, scale};
    const int64_t chunks = num_decodes * kv_heads, bytes = (int64_t)sizeof(float) * (heads / kv_heads) * max_len;
    if (run != NULL && threads > 1 && 2 * total * heads * head_dim >= POOL_MIN_MACS)
        return run(decode_chunk, &job, chunks, bytes, threads) ? 3 : 0;
    float *scores = malloc((size_t)bytes);
    if (!scores) return 3;
    for (int64_t c = 0; c < chunks; c++) decode_chunk(&job, c, scores);
    free(scores);
    return 0;
}
