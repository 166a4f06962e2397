/* y = x W^T with W kept in its quantized blocks (GGUF Q4_0, Q4_1, Q8_0), float32 math, on one thread or
   shared by the kernels' pool (csrc/pool.c).

   Built by actors/models/block_gemm.py (gcc -O3 -ffp-contract=fast, plus -mavx2 -mfma where the
   CPU has them) and called through ctypes for the linears of a decode-sized step. Plain C: no
   torch headers.

   Layout: x [M, K] and y [M, N] float32, row-major. W has N rows of K weights, in blocks of 32
   along K: qs [N, K/32, B] bytes (B = 16 for 4-bit kinds, 32 for Q8_0), scale and offset
   [N, K/32] float32 (the block's float16 d and m, widened; exact). A weight is
       Q4_1: scale * q + offset, q = the nibble (byte j holds q_j low, q_{j+16} high)
       Q4_0: the same with offset = -8 * scale
       Q8_0: scale * q, q the signed byte
   computed as one fused multiply-add. The product scale * q is exact in float32 (an 11-bit
   significand times a 4- or 8-bit integer), so the weight is the same float32 value the
   checkpoint's dequantized copy holds (bit for bit for Q4_1 and Q8_0; Q4_0 may give +0 where
   the copy has -0); only the order of the sums differs from a float32 GEMM's.

   Per three rows of W: they are widened into a scratch buffer (K floats each, in L1 or L2), then
   every row of x is dotted with them, four x rows at a time (12 accumulators: three W rows x
   four x rows, 7 loads per 12 FMAs; a lone x row takes four accumulators of its own instead). The weights are read from memory once per call, at 0.6 (4-bit)
   or 1.06 (8-bit) bytes each instead of 4: at the few rows of a decode step the float32 product
   is bound by that read. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCK_GEMM_AVX2 1
#endif

#define QK 32
enum { KIND_Q4_0 = 2, KIND_Q4_1 = 3, KIND_Q8_0 = 8 };

static void dequant_row(int kind, const uint8_t *restrict qs, const float *restrict scale,
                        const float *restrict offset, int64_t nb, float *restrict w) {
    int64_t bytes = kind == KIND_Q8_0 ? 32 : 16;
    for (int64_t b = 0; b < nb; b++, qs += bytes, w += QK) {
        float d = scale[b], m = offset[b];
#ifdef BLOCK_GEMM_AVX2
        __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        if (kind == KIND_Q8_0) {
            for (int j = 0; j < 4; j++) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j)));
                _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)));
            }
        } else {
            __m128i raw = _mm_loadu_si128((const __m128i *)qs);
            __m128i mask = _mm_set1_epi8(0x0F);
            __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int j = 0; j < 4; j++) {
                __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
                _mm256_storeu_ps(w + 8 * j, _mm256_fmadd_ps(vd, q, vm));
            }
        }
#else
        if (kind == KIND_Q8_0) {
            for (int j = 0; j < QK; j++) w[j] = d * (float)(int8_t)qs[j];
        } else {
            for (int j = 0; j < 16; j++) {
                w[j] = d * (float)(qs[j] & 0x0F) + m;
                w[j + 16] = d * (float)(qs[j] >> 4) + m;
            }
        }
#endif
    }
}

#ifdef BLOCK_GEMM_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r][c] for R rows of x (R <= 4) and C rows of W (C <= 3, w [C, K]); K a multiple of 32. */
static inline void tile(const float *restrict x, int64_t K, int R, const float *restrict w, int C,
                        float *restrict y, int64_t ldy) {
    __m256 acc[4][3];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 a = _mm256_loadu_ps(w + k);
        __m256 b = C > 1 ? _mm256_loadu_ps(w + K + k) : a;
        __m256 e = C > 2 ? _mm256_loadu_ps(w + 2 * K + k) : a;
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xv, a, acc[r][0]);
            if (C > 1) acc[r][1] = _mm256_fmadd_ps(xv, b, acc[r][1]);
            if (C > 2) acc[r][2] = _mm256_fmadd_ps(xv, e, acc[r][2]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]);
}

/* One x row against one W row, four accumulators (a lone decode: no chain of dependent FMAs). */
static inline float dot1(const float *restrict x, const float *restrict w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#else
static inline float dot1(const float *restrict x, const float *restrict w, int64_t K) {
    float acc[8] = {0};
    for (int64_t k = 0; k < K; k += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[k + j] * w[k + j];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}
#endif

/* W rows [n0, n1) of y = x W^T (n0 a multiple of 3); w: scratch of 3 K floats. Each y value is
   the same sums in the same order whatever range it falls in, so how the rows are split between
   threads never changes a bit of the result. */
static void gemm_rows(const float *x, int64_t M, int64_t K, int kind, const uint8_t *qs, const float *scale,
                      const float *offset, int64_t N, float *y, int64_t n0, int64_t n1, float *w) {
    int64_t nb = K / QK, bytes = kind == KIND_Q8_0 ? 32 : 16;
    for (int64_t n = n0; n < n1; n += 3) {
        int C = n1 - n >= 3 ? 3 : (int)(n1 - n);
        for (int c = 0; c < C; c++)
            dequant_row(kind, qs + (n + c) * nb * bytes, scale + (n + c) * nb, offset + (n + c) * nb, nb, w + c * K);
        int64_t i = 0;
#ifdef BLOCK_GEMM_AVX2
        /* x rows in tiles of at most 4, as even as they come (6 = 3 + 3, not 4 + 2) */
        for (int64_t tiles = (M + 3) / 4; M > 1 && i < M; tiles--) {
            int R = (int)((M - i + tiles - 1) / tiles);
            if (R == 4) tile(x + i * K, K, 4, w, C, y + i * N + n, N);
            else if (R == 3) tile(x + i * K, K, 3, w, C, y + i * N + n, N);
            else tile(x + i * K, K, 2, w, C, y + i * N + n, N);  /* M > 1: an even split never leaves 1 */
            i += R;
        }
#endif
        for (; i < M; i++)
            for (int c = 0; c < C; c++) y[i * N + n + c] = dot1(x + i * K, w + c * K, K);
    }
}

static int bad_args(int64_t M, int64_t K, int kind, int64_t N) {
    return M < 0 || N < 0 || K <= 0 || K % QK || (kind != KIND_Q4_0 && kind != KIND_Q4_1 && kind != KIND_Q8_0);
}

/* ---- Threads: the pool of csrc/pool.c (its `tidal_pool_run`, whose address the caller passes).
   A chunk is a run of W rows (a multiple of 3), so every y value is computed by one thread, in
   the same order as on one thread. */

/* csrc/pool.c's signatures, written out here: a kernel's build is named by its own file alone
   (actors/models/ckernel.py), so the kernels share no header. */
typedef void (*pool_task)(void *ctx, int64_t chunk, void *scratch);
typedef int (*pool_runner)(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes, int threads);

#define CHUNKS_PER_THREAD 8
#define POOL_MIN_MACS 65536  /* smaller calls are not worth waking a helper */

typedef struct {
    const float *x, *scale, *offset;
    const uint8_t *qs;
    float *y;
    int64_t M, K, N, rows;  /* rows: W rows per chunk, a multiple of 3 */
    int kind;
} gemm_job;

static void gemm_chunk(void *ctx, int64_t chunk, void *scratch) {
    const gemm_job *j = ctx;
    int64_t n0 = chunk * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
    gemm_rows(j->x, j->M, j->K, j->kind, j->qs, j->scale, j->offset, j->N, j->y, n0, n1, scratch);
}

/* y = x W^T on `threads` threads through `run` (csrc/pool.c's tidal_pool_run; NULL: this thread
   alone, as for one thread or a small call). Returns 0, or 1 for a bad shape or kind, 3 when a
   scratch buffer cannot be allocated. */
int tidal_block_gemm(const float *x, int64_t M, int64_t K, int kind, const uint8_t *qs, const float *scale,
                     const float *offset, int64_t N, float *y, int threads, pool_runner run) {
    if (bad_args(M, K, kind, N)) return 1;
    if (M == 0 || N == 0) return 0;
    int64_t triples = (N + 2) / 3, per = triples;
    if (run != NULL && threads > 1 && N >= 6 && M * N * K >= POOL_MIN_MACS) {
        int64_t want = (int64_t)threads * CHUNKS_PER_THREAD;
        per = (triples + want - 1) / want;
    } else {
        threads = 1;
    }
    gemm_job job = {x, scale, offset, qs, y, M, K, N, 3 * per, kind};
    int64_t chunks = (triples + per - 1) / per, bytes = 3 * K * (int64_t)sizeof(float);
    if (threads == 1) {  /* one chunk: every row */
        float *w = aligned_alloc(64, (size_t)bytes);
        if (w == NULL) return 3;
        gemm_chunk(&job, 0, w);
        free(w);
        return 0;
    }
    return run(gemm_chunk, &job, chunks, bytes, threads);
}

/* The first row whose widened blocks differ from w [N, K] in value, or -1 when none does (-2: a
   bad shape or kind, -3: no memory). How a loader proves the blocks are the same weights. Value,
   not bits: Q4_0's zero weights come out +0 here where a converter's d * (q - 8) gives -0 for a
   negative d, which no sum can tell apart except in the sign of a zero result. */
int64_t tidal_block_mismatch(int kind, const uint8_t *qs, const float *scale, const float *offset, int64_t N,
                             int64_t K, const float *w) {
    if (N < 0 || K <= 0 || K % QK || (kind != KIND_Q4_0 && kind != KIND_Q4_1 && kind != KIND_Q8_0)) return -2;
    int64_t nb = K / QK, bytes = kind == KIND_Q8_0 ? 32 : 16;
    float *row = aligned_alloc(64, (size_t)K * sizeof(float));
    if (row == NULL) return -3;
    int64_t bad = -1;
    for (int64_t n = 0; n < N && bad < 0; n++) {
        dequant_row(kind, qs + n * nb * bytes, scale + n * nb, offset + n * nb, nb, row);
        for (int64_t k = 0; k < K; k++)
            if (row[k] != w[n * K + k]) {
                bad = n;
                break;
            }
    }
    free(row);
    return bad;
}
