/* The small ops between a Llama layer's matmuls on CPU, fused: RMSNorm (with the residual add),
   SiLU(gate) * up, and rotary embedding of the queries and keys. float32, one thread.

   Built by actors/models/cpu_fused.py (gcc -O3 with -mavx2 -mfma where the CPU has them, and
   -ffp-contract=off: no multiply-add contraction, so every product rounds as PyTorch's eager ops
   round it) and called through ctypes, a few times per layer. Plain C: no torch headers.

   Why: in eager PyTorch these are about 25 ops a layer (RMSNorm alone is a cast, a square, a
   mean, an add, an rsqrt and two multiplies; rotary a slice, a negation, a concatenation, two
   multiplies and an add per tensor), each a dispatch from Python and, at prefill sizes, a pass
   over a tensor in memory. Here each is one call and one pass per row.

   Rounding against the PyTorch ops they replace (tests/actors/test_cpu_fused.py):
   - rotary: bit for bit (x*cos - x2*sin and x2*cos + x1*sin, each product rounded, then the sum);
   - RMSNorm: the residual add and the two scalings bit for bit; the mean of squares sums in
     another order than PyTorch's reduction (8 partial sums), so it may differ by a rounding;
   - SiLU: gate / (1 + exp(-gate)) with exp a Cephes-style polynomial (about 1 ulp, as PyTorch's
     vectorised exp is), then the product with up rounded. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FUSED_AVX2 1
#endif

#define LANES 8

/* ---- RMSNorm ------------------------------------------------------------------------------ */

/* out[t] = w * (s * inv), s = x[t] (+ res[t], stored to res_out[t]), inv = 1 / sqrt(mean(s^2) + eps).
   res and res_out may be NULL (no residual). Rows of n floats at the given row strides. */
int tidal_rms_norm(const float *x, const float *res, const float *w, float *out, float *res_out, int64_t rows,
                   int64_t n, int64_t sx, int64_t sr, int64_t so, int64_t sro, float eps) {
    if (n <= 0 || rows < 0) return 1;
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict xr = x + t * sx;
        const float *s = xr;
        if (res != NULL) {
            const float *restrict rr = res + t * sr;
            float *restrict ro = res_out + t * sro;
            for (int64_t d = 0; d < n; d++) ro[d] = xr[d] + rr[d];
            s = ro;
        }
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= n; d += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += s[d + j] * s[d + j];
        float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; d < n; d++) sum += s[d] * s[d];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        float *restrict o = out + t * so;
        for (d = 0; d < n; d++) o[d] = w[d] * (s[d] * inv);
    }
    return 0;
}

/* ---- SiLU(gate) * up ------------------------------------------------------------------------ */

/* exp(v) for any float v: clamped to [-87.3, 88] (exp(-87.3) is the least normal float's order;
   below it 1 + exp(-x) rounds to 1 anyway), range reduction by ln 2, Cephes' degree-5 polynomial. */
static inline float exp_poly(float v) {
    v = v < -87.3f ? -87.3f : (v > 88.0f ? 88.0f : v);
    float fk = floorf(v * 1.44269504088896341f + 0.5f);
    float r = v - fk * 0.693359375f;
    r = r - fk * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)fk + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef FUSED_AVX2
static inline __m256 exp_poly8(__m256 v) {  /* exp_poly on 8 lanes, the same operations in the same order */
    v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.3f));
    __m256 fk = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                              _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(fk, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fk, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fk), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* out[t, d] = silu(x[t, d]) * x[t, n + d] for d < n: the gate is the first half of each row. */
int tidal_silu_mul(const float *x, float *out, int64_t rows, int64_t n, int64_t sx, int64_t so) {
    if (n <= 0 || rows < 0) return 1;
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * sx;
        const float *u = g + n;
        float *o = out + t * so;
        int64_t d = 0;
#ifdef FUSED_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; d + LANES <= n; d += LANES) {
            __m256 gv = _mm256_loadu_ps(g + d);
            __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp_poly8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + d, _mm256_mul_ps(act, _mm256_loadu_ps(u + d)));
        }
#endif
        for (; d < n; d++) {
            float act = g[d] / (1.0f + exp_poly(-g[d]));
            o[d] = act * u[d];
        }
    }
    return 0;
}

/* ---- rotary embedding ------------------------------------------------------------------------ */

/* The half-split (GPT-NeoX / HF Llama) rotation of the first `heads + kv_heads` heads of each row
   of qkv (queries, then keys; the values after them are not read): queries to q [rows, heads, hd],
   keys to k [rows, kv_heads, hd], both contiguous. cos / sin rows of hd floats at stride scs. */
int tidal_rope_qk(const float *qkv, const float *cos_t, const float *sin_t, float *q, float *k, int64_t rows,
                  int64_t heads, int64_t kv_heads, int64_t hd, int64_t sqkv, int64_t scs) {
    if (hd <= 0 || hd % 2 || rows < 0 || heads < 0 || kv_heads < 0) return 1;
    const int64_t half = hd / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict c = cos_t + t * scs, *restrict s = sin_t + t * scs;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float *restrict x = qkv + t * sqkv + h * hd;
            float *restrict o = h < heads ? q + (t * heads + h) * hd : k + (t * kv_heads + (h - heads)) * hd;
            for (int64_t d = 0; d < half; d++) o[d] = x[d] * c[d] - x[half + d] * s[d];
            for (int64_t d = 0; d < half; d++) o[half + d] = x[half + d] * c[half + d] + x[d] * s[half + d];
        }
    }
    return 0;
}
