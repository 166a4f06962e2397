"""The CPU decode attention that reads KV blocks in place: a small C kernel, built once, called by ctypes.

Owns: `KERNEL` (`csrc/paged_decode.c` as a shared library; `load()` builds it first when
missing) and `paged_decode(...)`, one call per layer for a whole decode batch of the portable
backend on CPU in float32 (actors/models/attention.py).

Threads: as many as torch uses (`torch.get_num_threads()`), on the CPU kernels' pool
(actors/models/cpu_pool.py), one decode's one KV head at a time; every output is the same bits
on any number of threads.

Why: the portable decode path gathers every decode's blocks with `index_select` into a dense
tensor and runs SDPA with a length mask; on one core the copy and SDPA's passes over it cost
more than the one pass over K and one over V that reading the blocks in place needs.

Build: actors/models/ckernel.py (gcc at `make setup` or on first use, cached by source and flags).
No gcc, or a failed build: `load()` returns None after one log line, and the caller keeps the
gather + SDPA path.

    # build (or find) the library, print its path and the seconds it took (what `make setup` runs;
    # not `-m`: the package imports this module first)
    python -c 'import actors.models.cpu_attention as k; raise SystemExit(k.main())'

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes

import torch

from actors.models import cpu_pool
from actors.models.ckernel import CKernel

_ERRORS = {1: "a context length outside [1, table width x block size]", 2: "a block id outside the cache",
           3: "out of memory"}

_F32, _I64 = torch.float32, torch.int64


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_paged_decode
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ptr]
    fn.restype = ctypes.c_int


KERNEL = CKernel("paged_decode.c", _declare, "decodes use gather + SDPA")
load = KERNEL.load
available = KERNEL.available
main = KERNEL.main


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out[i] = attention of q[i] ([D, H, hd]) over the first context_lens[i] tokens of its
    block_tables[i] row, read from the caches in place. float32 CPU tensors; `out` and the caches
    must be contiguous (else ValueError); q, the tables and the lengths are made contiguous (and
    int64) when they are not. The kernel checks every length against the table width and every
    block id it reads against the cache (ValueError), so a bad table cannot read out of bounds.
    Called once per layer: the checks are plain attribute reads (about 10 us in all)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU decode attention kernel is not available")
    num, heads, head_dim = q.shape
    nb, block_size, kv_heads, cache_dim = k_cache.shape
    if not (q.dtype is _F32 and k_cache.dtype is _F32 and v_cache.dtype is _F32 and out.dtype is _F32
            and q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and out.is_cpu
            and block_tables.is_cpu and context_lens.is_cpu):
        raise ValueError("paged_decode: float32 CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("paged_decode: the caches and the output must be contiguous")
    if (v_cache.shape != k_cache.shape or cache_dim != head_dim or heads % kv_heads or out.shape != q.shape
            or block_tables.dim() != 2 or block_tables.shape[0] != num or context_lens.shape != (num,)):
        raise ValueError(f"paged_decode: shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, tables "
                         f"{tuple(block_tables.shape)}, lens {tuple(context_lens.shape)}, out {tuple(out.shape)}")
    if num == 0:
        return
    if not q.is_contiguous():
        q = q.contiguous()
    if block_tables.dtype is not _I64 or not block_tables.is_contiguous():
        block_tables = block_tables.to(_I64).contiguous()
    if context_lens.dtype is not _I64 or not context_lens.is_contiguous():
        context_lens = context_lens.to(_I64).contiguous()
    rc = lib.tidal_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                context_lens.data_ptr(), out.data_ptr(), num, heads, kv_heads, head_dim, block_size,
                                block_tables.shape[1], nb, scale, torch.get_num_threads(), cpu_pool.runner())
    if rc:
        raise ValueError(f"paged_decode: {_ERRORS.get(rc, f'error {rc}')}")
