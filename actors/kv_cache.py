"""The paged KV cache: its memory layout, its size from a memory budget, its allocation.

Owns: `KVCacheSpec` (bytes per block for this rank), `blocks_for_budget` (blocks from a byte
budget; the GPU budget itself is actors/kv_budget.py's) and `allocate_kv_cache`.

Layout: per layer a (K, V) pair of `[num_blocks + 1, block_size, local_kv_heads, head_dim]`
tensors. The block ids are the scheduler's (core/kv_blocks.py); block `num_blocks` is a
scratch block no request owns, used by padded CUDA-graph slots. With tensor parallelism
every rank holds the same block ids for its own KV heads, so one block table serves all.

Must not import: ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def blocks_for_budget(spec: KVCacheSpec, budget_bytes: float, max_blocks: int | None = None) -> int:
    """How many blocks fit in `budget_bytes` (one is kept back as the scratch block)."""
    n = int(budget_bytes // spec.bytes_per_block) - 1
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n < 1:
        raise ValueError(f"a KV budget of {budget_bytes / GIB:.3f} GiB holds no block of "
                         f"{spec.bytes_per_block} bytes; raise kv_cache_gb / gpu_memory_utilization")
    return n


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)]
