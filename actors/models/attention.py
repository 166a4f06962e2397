"""Attention over a paged KV cache for a flattened batch that mixes decodes and prefill chunks.

Owns: `AttentionMetadata` (what the runner prepares once per step and every layer reads) and
`paged_attention` (write this step's K/V into the cache, then attend).

Layout. Each layer's cache is a pair of tensors `[num_blocks + 1, block_size, kv_heads,
head_dim]`; the extra last block is a scratch block that padded CUDA-graph slots write into.
Token `t` of a request lives in block `block_table[t // block_size]`, slot `t % block_size`,
so its flat slot is `block * block_size + t % block_size` (`slot_mapping`).

Paths:
- portable (CPU, and GPU without a kernel package): prefill chunks one SDPA call each, causal
  with the chunk's offset (a chunk starting at position 0 attends over its own fresh K/V). Decodes:
  - on CPU in float32 (`meta.cpu_decode`, the default there): actors/models/cpu_attention.py's C
    kernel, one call per layer for the whole decode batch, reads each decode's K/V rows in place
    through its block table (no gather, no mask; a table's padding is never read), the G query
    heads of a GQA group against their one KV head, a two-pass softmax in float32;
  - otherwise (GPU without Triton; `EngineSpec.cpu_attention=False`; no C compiler): batched SDPA
    calls over their gathered blocks with a length mask, one per run of similar lengths (decodes
    come sorted by length, so a short one never gathers a long one's padding); the G query heads
    of a GQA group act as G queries against one KV head, so no K/V repeat.
- triton (CUDA with Triton, the default there): actors/paged_attention.py's kernel reads the
  blocks in place for decodes and for prefill chunks with context (nothing gathered, no mask
  tensor); compiled on CUDA, checked on CPU under Triton's interpreter against a dense reference.

Must not import: ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.models.cpu_attention import paged_decode
from actors.paged_attention import TritonPrefill, triton_decode, triton_prefill

BACKENDS = ("portable", "triton")


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: tokens [start, start+length) of the flat batch at positions context..."""

    start: int
    length: int
    context: int
    block_table: torch.Tensor  # blocks covering context + length tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every scheduled token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, W] (padded with the scratch block)
    decode_context_lens: torch.Tensor | None  # [D] KV length including this step's token
    prefills: list[PrefillSpan] = field(default_factory=list)
    # (start, end, width): decodes sorted by length, each run attended up to its own widest table
    decode_groups: list[tuple[int, int, int]] | None = None
    backend: str = "portable"  # one of BACKENDS
    triton_prefill: TritonPrefill | None = None  # the triton backend's description of the chunks
    cpu_decode: bool = False  # portable backend: decodes through the in-place CPU kernel (cpu_attention.py)
    cpu_fused: bool = False  # portable backend on CPU: norms, SiLU and RoPE through the C kernels (cpu_fused.py)
    cpu_layers: bool = False  # with both: a decodes-only step's layers in one C call (cpu_decode_layers.py)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [D, H, hd] -> [D, H, hd]. Static shapes given the table width (CUDA-graph safe)."""
    num, heads, head_dim = q.shape
    width, block_size, kv_heads = block_tables.shape[1], k_cache.shape[1], k_cache.shape[2]
    # index_select copies whole blocks (contiguous rows): ~4x faster than advanced indexing on CPU.
    flat = block_tables.reshape(-1)
    length = width * block_size
    k = k_cache.index_select(0, flat).view(num, length, kv_heads, head_dim).transpose(1, 2)  # [D, Hkv, L, hd]
    v = v_cache.index_select(0, flat).view(num, length, kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(length, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    qg = q.view(num, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num, heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """One chunk: q/k/v [n, heads, hd] are this chunk's; earlier context comes from the cache."""
    n, ctx = span.length, span.context
    if ctx == 0:
        keys, values, mask, causal = k, v, None, True
    else:
        total = ctx + n
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.index_select(0, span.block_table).view(-1, kv_heads, head_dim)[:total]
        values = v_cache.index_select(0, span.block_table).view(-1, kv_heads, head_dim)[:total]
        rows = torch.arange(n, device=q.device).unsqueeze(1) + ctx
        mask, causal = torch.arange(total, device=q.device).unsqueeze(0) <= rows, False
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float, out: torch.Tensor) -> None:
    if meta.num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        triton_decode(q[:meta.num_decodes], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                      scale, out)
    if meta.prefills:
        assert meta.triton_prefill is not None, "triton backend: prefill chunks need their TritonPrefill"
        triton_prefill(q, k_cache, v_cache, meta.triton_prefill, scale, out)


def attend_in_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """The Triton backend's attention once this step's K/V are in the cache (written by
    actors/models/fused_ops.rope_and_cache, or by `write_kv`). q: [T, H, hd] -> [T, H, hd]."""
    out = torch.empty_like(q)
    _triton(q, k_cache, v_cache, meta, scale, out)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, hd], k/v: [T, Hkv, hd] for the flat batch (decodes first). Returns [T, H, hd]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.backend == "triton":
        return attend_in_cache(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None
        if meta.cpu_decode:
            paged_decode(q[:d], k_cache, v_cache, tables, lens, scale, out[:d])
        else:
            for s, e, w in meta.decode_groups or [(0, d, tables.shape[1])]:
                out[s:e] = decode_attention(q[s:e], k_cache, v_cache, tables[s:e, :w], lens[s:e], scale)
    for span in meta.prefills:
        s, e = span.start, span.start + span.length
        out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span, scale)
    return out
