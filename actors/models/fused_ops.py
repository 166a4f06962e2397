"""Fused Triton kernels for the small ops between a layer's matmuls (the Triton backend's path).

Owns: `rms_norm` (optionally adding the residual first: the new residual and the normalized
rows in one pass), `silu_and_mul` (the MLP's gate), `rope_and_cache` (rotary embedding of the
queries and keys, and this step's K/V written into the paged cache, in one launch).

Why: a decode step's matmuls read the weights once; everything else is dozens of tiny kernels a
layer in eager PyTorch (RMSNorm alone is eight: cast, square, mean, add, rsqrt, multiply, cast,
scale), each a launch from Python and, inside a CUDA graph, still a few microseconds of device
time. These three bring a Llama layer to about nine launches. Each kernel rounds where the
eager PyTorch ops it replaces round: RoPE and the K/V write give PyTorch's bits in float32 (RoPE
is compiled without multiply-add contraction); the norm's sum and the SiLU's exponential differ
from PyTorch's by float32 rounding; in bf16 each agrees within a rounding
(tests/actors/test_fused_ops.py runs them under Triton's interpreter on CPU, compiled on a GPU).

Used when the model runs with the Triton backend (actors/models/llama.py: `meta.backend ==
"triton"`, CUDA with Triton); CPU serving in float32 has C versions of the same three
(actors/models/cpu_fused.py), and the portable path elsewhere keeps the PyTorch ops.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import torch

from actors.paged_attention import HAVE_TRITON, _next_pow2, jitted

if HAVE_TRITON:
    import triton.language as tl
else:  # pragma: no cover - depends on the machine
    tl = None  # the kernels below are only jitted where Triton exists

SILU_BLOCK = 1024  # columns of the gate per program


def _rms_norm_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, stride_x, stride_r, stride_o, stride_ro,
        BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # x + residual, rounded to the stream's dtype as PyTorch's add does; that is the new residual
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty)  # normalized, rounded, then scaled (as RMSNorm does)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def _silu_and_mul_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # silu rounds, then the product does
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=ok)


def _rope_and_cache_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        num_heads, num_kv_heads, stride_qkv, stride_cs, stride_qt, stride_qh, stride_cslot, stride_ch,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """One program per (token, head): query heads rotate into q_out; key heads rotate into the cache
    at the token's slot, and carry the matching value head there unrotated."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    dtype = q_out_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + tok * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * stride_cs + HALF + d, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_cs + HALF + d, mask=ok, other=0.0).to(tl.float32)
    src = qkv_ptr + tok * stride_qkv + head * (2 * HALF)  # q heads, then k heads, then v heads
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
    # x*cos + rotate_half(x)*sin, each product rounded as PyTorch rounds it, then the sum
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    if head < num_heads:
        dst = q_out_ptr + tok * stride_qt + head * stride_qh
        tl.store(dst + d, out1, mask=ok)
        tl.store(dst + HALF + d, out2, mask=ok)
    else:
        kv_head = head - num_heads
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        dst = k_cache_ptr + slot * stride_cslot + kv_head * stride_ch
        tl.store(dst + d, out1.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, out2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        vsrc = qkv_ptr + tok * stride_qkv + (num_heads + num_kv_heads + kv_head) * (2 * HALF)
        vdst = v_cache_ptr + slot * stride_cslot + kv_head * stride_ch
        tl.store(vdst + d, tl.load(vsrc + d, mask=ok, other=0.0), mask=ok)
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d, mask=ok, other=0.0), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of x [T, n] normalized and scaled; with `residual`, of x + residual, which is returned too."""
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if t:
        res = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        jitted(_rms_norm_kernel, x.device)[(t,)](
            x, res, weight, out, ro, n, eps, x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
            BLOCK=_next_pow2(n), HAS_RES=residual is not None)
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] (gate, then up) -> silu(gate) * up, [T, n]."""
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t:
        block = min(SILU_BLOCK, _next_pow2(n))
        jitted(_silu_and_mul_kernel, x.device)[(t, -(-n // block))](
            x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * hd] (the fused projection's rows); cos/sin [T, 1, hd] or [T, hd].
    Returns the rotated queries [T, H, hd]; the rotated keys and the values go to the cache slots."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        assert qkv.stride(1) == 1 and head_dim % 2 == 0
        cos, sin = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
        kc = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        vc = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        half = head_dim // 2
        jitted(_rope_and_cache_kernel, qkv.device)[(t, num_heads + num_kv_heads)](
            qkv, cos, sin, slot_mapping, q, kc, vc, num_heads, num_kv_heads, qkv.stride(0), cos.stride(0),
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), HALF=half, HALF_PAD=_next_pow2(half),
            enable_fp_fusion=False)  # no multiply-add contraction: each product rounds, as in PyTorch
    return q
