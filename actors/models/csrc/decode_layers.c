/* A decode step's decoder layers in one call: every Llama layer of a float32 CPU model whose
   linears read GGUF blocks, for a batch of decodes (one new token each), then the final norm.

   Built by actors/models/cpu_decode_layers.py (gcc -O3, plus -mavx2 -mfma where the CPU has them)
   and called through ctypes once a decode step. Plain C: no torch headers. It computes nothing of
   its own but the KV cache write (a copy): each op is the function the layer-by-layer path calls,
   from its own library, through the pointers the caller hands over (csrc/block_gemm.c,
   csrc/paged_decode.c, csrc/fused_cpu.c, csrc/pool.c), with the same arguments in the same order.
   So the hidden states are the same float32 bits as actors/models/llama.py's forward with the CPU
   kernels on; what goes is the Python between the ops (the module calls, the tensor allocations,
   the ctypes marshalling of ~10 calls a layer).

   Per layer, as LlamaDecoderLayer.forward with `meta.cpu_fused`:
       h, res   = rms_norm(x, in_norm, residual)          (the first layer: no residual; res = x)
       qkv      = h Wqkv^T                               (block GEMM, on the pool)
       q, k     = rope(qkv)                               v = qkv's last kv columns
       cache[slot] = k, v                                 (index_copy_ of write_kv)
       att      = paged_decode(q, caches)                 (on the pool)
       h, res   = rms_norm(att Wo^T, post_norm, res)
       x        = (silu(h Wgu^T) * up) Wdown^T
   and after the last layer, out = rms_norm(x, final_norm, res). */

#include <stdint.h>
#include <string.h>

/* The signatures of the functions called, written out here: a kernel's build is named by its
   own file alone (actors/models/ckernel.py), so the kernels share no header. */
typedef void (*pool_task)(void *ctx, int64_t chunk, void *scratch);
typedef int (*pool_runner)(pool_task task, void *ctx, int64_t chunks, int64_t scratch_bytes, int threads);
typedef int (*gemm_fn)(const float *x, int64_t M, int64_t K, int kind, const uint8_t *qs, const float *scale,
                       const float *offset, int64_t N, float *y, int threads, pool_runner run);
typedef int (*attn_fn)(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                       const int64_t *context_lens, float *out, int64_t num_decodes, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t width, int64_t num_blocks,
                       float scale, int threads, pool_runner run);
typedef int (*rms_fn)(const float *x, const float *res, const float *w, float *out, float *res_out, int64_t rows,
                      int64_t n, int64_t sx, int64_t sr, int64_t so, int64_t sro, float eps);
typedef int (*silu_fn)(const float *x, float *out, int64_t rows, int64_t n, int64_t sx, int64_t so);
typedef int (*rope_fn)(const float *qkv, const float *cos_t, const float *sin_t, float *q, float *k, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t hd, int64_t sqkv, int64_t scs);

/* One weight matrix in its blocks (actors/models/block_gemm.py's BlockWeights). */
typedef struct {
    int64_t kind;
    const uint8_t *qs;
    const float *scale, *offset;
} blocks_t;

typedef struct {
    const float *in_norm, *post_norm;
    blocks_t qkv, o, gate_up, down;
    float *k_cache, *v_cache;  /* [num_blocks, block_size, kv_heads, head_dim] */
} layer_t;

typedef struct {
    gemm_fn gemm;
    attn_fn attn;
    rms_fn rms;
    silu_fn silu;
    rope_fn rope;
    pool_runner run;  /* NULL: the kernels on this thread alone */
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, num_blocks;
    float eps, scale;
    const float *final_norm;
} model_t;

/* Floats of scratch a call of `rows` decodes needs. */
int64_t tidal_decode_layers_scratch(const model_t *m, int64_t rows) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return rows * (5 * m->hidden + (q + 2 * kv) + q + kv + q + 3 * m->inter);
}

/* x [T, hidden]: the tokens' embeddings (read only); out [T, hidden]: the final norm's output.
   cos / sin: rows of head_dim floats at stride `scs`; slots [T]: each token's KV slot;
   block_tables [T, width] and context_lens [T] as csrc/paged_decode.c reads them. `work`: at least
   tidal_decode_layers_scratch(m, T) floats. Returns 0; 1 for bad sizes or a failed final norm; or,
   when an op refuses, 10 + op + 16 x the layer's index (op: 1 norm, 2 QKV, 3 rope, 4 a slot
   outside the cache, 5 attention, 6 O, 7 norm, 8 gate / up, 9 SiLU, 10 down). */
int tidal_decode_layers(const model_t *m, const layer_t *layers, const float *x, float *out, int64_t T,
                        const float *cos_t, const float *sin_t, int64_t scs, const int64_t *slots,
                        const int64_t *block_tables, int64_t width, const int64_t *context_lens, int threads,
                        float *work) {
    if (T <= 0 || m->num_layers <= 0 || m->hidden <= 0 || m->heads <= 0 || m->kv_heads <= 0) return 1;
    const int64_t H = m->hidden, q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int64_t qkv_n = q_size + 2 * kv_size, slots_in_cache = m->num_blocks * m->block_size;
    float *h = work, *res_a = h + T * H, *res_b = res_a + T * H, *mlp = res_b + T * H;
    float *qkv = mlp + T * H, *q = qkv + T * qkv_n, *k = q + T * q_size, *att = k + T * kv_size;
    float *o = att + T * q_size, *gu = o + T * H, *act = gu + T * 2 * m->inter;
    const float *cur = x, *residual = NULL;
#define CHECK(op, call) do { if (call) return 10 + (op) + 16 * (int)l; } while (0)
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer_t *L = layers + l;
        float *res_next = residual == res_a ? res_b : res_a;
        if (residual == NULL) {
            CHECK(1, m->rms(cur, NULL, L->in_norm, h, NULL, T, H, H, 0, H, 0, m->eps));
            residual = cur;
        } else {
            CHECK(1, m->rms(cur, residual, L->in_norm, h, res_next, T, H, H, H, H, H, m->eps));
            residual = res_next;
        }
        CHECK(2, m->gemm(h, T, H, (int)L->qkv.kind, L->qkv.qs, L->qkv.scale, L->qkv.offset, qkv_n, qkv, threads,
                         m->run));
        CHECK(3, m->rope(qkv, cos_t, sin_t, q, k, T, m->heads, m->kv_heads, m->head_dim, qkv_n, scs));
        for (int64_t t = 0; t < T; t++) {
            const int64_t s = slots[t];
            CHECK(4, s < 0 || s >= slots_in_cache);
            memcpy(L->k_cache + s * kv_size, k + t * kv_size, sizeof(float) * (size_t)kv_size);
            memcpy(L->v_cache + s * kv_size, qkv + t * qkv_n + q_size + kv_size, sizeof(float) * (size_t)kv_size);
        }
        CHECK(5, m->attn(q, L->k_cache, L->v_cache, block_tables, context_lens, att, T, m->heads, m->kv_heads,
                         m->head_dim, m->block_size, width, m->num_blocks, m->scale, threads, m->run));
        CHECK(6, m->gemm(att, T, q_size, (int)L->o.kind, L->o.qs, L->o.scale, L->o.offset, H, o, threads, m->run));
        res_next = residual == res_a ? res_b : res_a;
        CHECK(7, m->rms(o, residual, L->post_norm, h, res_next, T, H, H, H, H, H, m->eps));
        residual = res_next;
        CHECK(8, m->gemm(h, T, H, (int)L->gate_up.kind, L->gate_up.qs, L->gate_up.scale, L->gate_up.offset,
                         2 * m->inter, gu, threads, m->run));
        CHECK(9, m->silu(gu, act, T, m->inter, 2 * m->inter, m->inter));
        CHECK(10, m->gemm(act, T, m->inter, (int)L->down.kind, L->down.qs, L->down.scale, L->down.offset, H, mlp,
                          threads, m->run));
        cur = mlp;
    }
#undef CHECK
    float *res_next = residual == res_a ? res_b : res_a;
    return m->rms(cur, residual, m->final_norm, out, res_next, T, H, H, H, H, H, m->eps) ? 1 : 0;
}
