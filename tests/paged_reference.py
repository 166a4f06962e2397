"""A dense reference for paged attention: each sequence's K/V gathered position by position
from its block table, then plain softmax attention in float64 (causal, bottom-right aligned).

Also builds random cases: a paged cache with shuffled blocks, sequences of uneven lengths,
decodes (one query token) and prefill chunks with earlier context, GQA head groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    q: torch.Tensor  # [T, H, hd] flat batch: decodes first, then chunks
    k_cache: torch.Tensor  # [NB + 1, bs, Hkv, hd]
    v_cache: torch.Tensor
    tables: list[list[int]]  # per sequence
    seq_lens: list[int]  # KV length after this step, per sequence
    q_lens: list[int]  # query tokens per sequence (1 for a decode)
    scale: float



def reference(case: Case) -> torch.Tensor:
    """On CPU in float64, returned in the case's dtype and device."""
    out = torch.empty(case.q.shape, dtype=torch.float64)
    bs, kvh = case.k_cache.shape[1], case.k_cache.shape[2]
    heads = case.q.shape[1]
    k_flat = case.k_cache.cpu().double().reshape(-1, kvh, case.k_cache.shape[3])
    v_flat = case.v_cache.cpu().double().reshape(-1, kvh, case.v_cache.shape[3])
    row = 0
    for table, length, n in zip(case.tables, case.seq_lens, case.q_lens, strict=True):
        slots = [table[p // bs] * bs + p % bs for p in range(length)]
        k = k_flat[slots]  # [L, Hkv, hd]
        v = v_flat[slots]
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
        q = case.q[row:row + n].cpu().double()  # [n, H, hd]
        s = torch.einsum("nhd,lhd->hnl", q, k) * case.scale
        pos = torch.arange(length - n, length).unsqueeze(1)
        s = s.masked_fill(torch.arange(length).unsqueeze(0) > pos, float("-inf"))
        out[row:row + n] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
        row += n
    return out.to(dtype=case.q.dtype, device=case.q.device)


def make_case(seq_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
              seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", spare_blocks: int = 7) -> Case:
    """Blocks are handed out in a shuffled order so a table is never a contiguous range."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    total = sum(need) + spare_blocks
    order = torch.randperm(total, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    shape = (total + 1, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    return Case(q, k_cache, v_cache, tables, seq_lens, q_lens, head_dim ** -0.5)
