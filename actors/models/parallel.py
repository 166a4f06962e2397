"""Tensor-parallel building blocks: how weights are split over ranks, and the collectives.

Owns: `TPContext` (rank, size, process group), the partition arithmetic (`split_evenly`,
`head_partition`), and the column/row-parallel linears and vocab-parallel embedding/head.
Shards may be uneven (SmolLM2 has 3 KV heads; TP=2 gives ranks 2 and 1): a row-parallel
all-reduce only needs every rank's *output* to have the same shape, never its shard.

Must not import: ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from actors.models.cpu_gemm import CpuWeights, linear


@dataclass(frozen=True, slots=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None
    # False: build and run one rank's shard alone, collectives skipped (the profiler measures a
    # TP-N shard on one device; the all-reduce is costed separately).
    collectives: bool = True

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and self.collectives:
            dist.all_reduce(x, group=self.group)
        return x


def split_evenly(n: int, parts: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s share of `n` items; the first `n % parts` ranks get one more."""
    base, rem = divmod(n, parts)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)


@dataclass(frozen=True, slots=True)
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_partition(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Which query and KV heads a rank owns, keeping each GQA group on one rank.

    tp <= KV heads: whole groups are split (possibly unevenly). tp > KV heads: each KV head
    is replicated on tp/num_kv_heads ranks and the query heads are split evenly (vLLM's rule).
    """
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_count = split_evenly(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(f"tp={tp_size} must divide num_heads={num_heads} and be a multiple of "
                         f"num_kv_heads={num_kv_heads} when it exceeds the KV heads")
    q_count = num_heads // tp_size
    return HeadShard(rank * q_count, q_count, rank // (tp_size // num_kv_heads), 1)


class ColumnParallelLinear(nn.Module):
    """y = x W_shard^T: each rank computes its slice of the output features; no communication."""

    def __init__(self, in_features: int, out_local: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_local, dtype=dtype), requires_grad=False) if bias else None
        self.cpu_layouts: CpuWeights | None = None  # set by cpu_gemm.prepare_cpu_gemm after loading

    def cpu_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_layouts)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_shard W_shard^T: partial products, then one all-reduce."""

    def __init__(self, in_local: int, out_features: int, tp: TPContext, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype), requires_grad=False)
        self.cpu_layouts: CpuWeights | None = None

    def cpu_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, None, self.cpu_layouts))


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous vocabulary slice; ids outside it embed to zero, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.count = split_evenly(vocab_size, tp.size, tp.rank)
        self.padded = -(-vocab_size // tp.size)  # same shard shape on every rank, for gather
        self.weight = nn.Parameter(torch.zeros(self.padded, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        if not self.tp.collectives:
            return F.embedding(ids.remainder(self.count), self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.count)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out.mul_(inside.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits of the rank's vocabulary slice, gathered on rank 0 (the only rank that samples)."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, hidden: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embedding = embedding
        self.tp = embedding.tp
        self.tied = tied
        if not tied:
            self.weight = nn.Parameter(torch.zeros(embedding.padded, hidden, dtype=dtype), requires_grad=False)
        self.cpu_layouts: CpuWeights | None = None

    def cpu_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.shard_weight(), None

    def shard_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.shard_weight(), None, self.cpu_layouts)
        vocab = self.embedding.vocab_size
        if self.tp.size == 1:
            return logits[:, :vocab] if logits.shape[1] != vocab else logits
        if not self.tp.collectives:
            return logits  # a lone shard: its own slice stands in for the whole vocabulary
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)] if self.tp.is_driver else None
        dist.gather(logits.contiguous(), parts, group=self.tp.group, group_dst=0)
        if parts is None:
            return None
        pieces = [p[:, : split_evenly(vocab, self.tp.size, r)[1]] for r, p in enumerate(parts)]
        return torch.cat(pieces, dim=1)
