"""The ops between a Llama layer's matmuls on CPU, fused in one small C kernel each, called by ctypes.

Owns: `KERNEL` (`csrc/fused_cpu.c`, built by actors/models/ckernel.py with `-ffp-contract=off`),
`rms_norm` (optionally adding the residual first: the new residual and the normalized rows in one
pass), `silu_and_mul` (the MLP's gate) and `rope_qk` (rotary embedding of the queries and keys of
the fused QKV projection's rows). The same calls as actors/models/fused_ops.py's Triton kernels
(rope aside: the CPU path's K/V write stays in actors/models/attention.py), so the model picks
one set or the other (actors/models/llama.py).

Why: in eager PyTorch these are about 25 ops a layer, each a dispatch from Python and, at
prefill sizes, a pass over a tensor in memory: about 6% of a SmolLM2 prefill step's CPU
(benchmarks/decode_profile.py --prefill --no-fused) and 2-3 ms of dispatch in every decode step
(benchmarks/cpu_gemm.py --flag cpu_fused_ops measures the gain).

Rounding (tests/actors/test_cpu_fused.py): rotary gives PyTorch's bits; RMSNorm's residual add and
scalings too, its mean of squares may differ by a rounding (another summation order); SiLU's
exponential is a ~1 ulp polynomial, as PyTorch's vectorised one is.

Used on the portable backend on CPU in float32 when `EngineSpec.cpu_fused_ops` is on (the
default): actors/model_runner.py sets `AttentionMetadata.cpu_fused`. No gcc, or a failed build:
one log line, and the model keeps the PyTorch ops.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes

import torch

from actors.models.ckernel import CKernel

_F32 = torch.float32


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tidal_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.tidal_silu_mul.argtypes = [ptr, ptr, i64, i64, i64, i64]
    lib.tidal_rope_qk.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    for fn in (lib.tidal_rms_norm, lib.tidal_silu_mul, lib.tidal_rope_qk):
        fn.restype = ctypes.c_int


KERNEL = CKernel("fused_cpu.c", _declare, "the model keeps PyTorch's ops between its matmuls",
                 extra_flags=("-ffp-contract=off",))
load = KERNEL.load
available = KERNEL.available
main = KERNEL.main


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU fused-ops kernel is not available")
    return lib


def _rows(name: str, *tensors: torch.Tensor) -> None:
    """float32 CPU matrices whose rows are contiguous (any row stride): what the kernels read and write."""
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name}: float32 CPU matrices with contiguous rows only, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of x [T, n] normalized and scaled by `weight` [n]; with `residual`, of x + residual,
    which is returned too (as `fused_ops.rms_norm`)."""
    _rows("rms_norm", x, *(() if residual is None else (residual,)))
    t, n = x.shape
    if weight.shape != (n,) or weight.dtype is not _F32 or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} for rows of {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
    out = torch.empty(t, n, dtype=_F32)
    res_out = torch.empty(t, n, dtype=_F32) if residual is not None else None
    if t:
        res = residual.data_ptr() if residual is not None else None
        ro = res_out.data_ptr() if res_out is not None else None
        rc = _lib().tidal_rms_norm(x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), ro, t, n, x.stride(0),
                                   residual.stride(0) if residual is not None else 0, n, n, eps)
        if rc:
            raise ValueError(f"rms_norm: bad shape {tuple(x.shape)}")
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] (gate, then up) -> silu(gate) * up, [T, n]."""
    _rows("silu_and_mul", x)
    t, n = x.shape[0], x.shape[1] // 2
    if x.shape[1] != 2 * n or n == 0:
        raise ValueError(f"silu_and_mul: rows of an even, non-zero width, got {tuple(x.shape)}")
    out = torch.empty(t, n, dtype=_F32)
    if t and _lib().tidal_silu_mul(x.data_ptr(), out.data_ptr(), t, n, x.stride(0), n):
        raise ValueError(f"silu_and_mul: bad shape {tuple(x.shape)}")
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) * hd] (queries, keys, values); cos / sin [T, hd] or [T, 1, hd]. Returns the
    rotated queries [T, H, hd] and keys [T, Hkv, hd], contiguous (as `rope.apply_rotary` gives them)."""
    t = qkv.shape[0]
    cos, sin = cos.reshape(t, cos.shape[-1]), sin.reshape(t, sin.shape[-1])
    _rows("rope_qk", qkv, cos, sin)
    if (head_dim <= 0 or head_dim % 2 or cos.shape != (t, head_dim) or sin.stride() != cos.stride()
            or sin.shape != cos.shape or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim):
        raise ValueError(f"rope_qk: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, "
                         f"{num_heads} + {num_kv_heads} heads of {head_dim}")
    q = torch.empty(t, num_heads, head_dim, dtype=_F32)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=_F32)
    if t and _lib().tidal_rope_qk(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), t,
                                  num_heads, num_kv_heads, head_dim, qkv.stride(0), cos.stride(0)):
        raise ValueError(f"rope_qk: bad shape {tuple(qkv.shape)}")
    return q, k
