"""Paged attention that reads the KV cache in place: one Triton kernel for decodes and chunks.

Owns: `HAVE_TRITON`, the kernel (`_paged_attention_kernel`, online softmax over the blocks of
one sequence), `TritonPrefill` (the varlen description of a step's prefill chunks: block
tables, KV lengths, query starts and the query tiles) and the two launches, `triton_decode`
and `triton_prefill`. Nothing is gathered: each program walks its sequence's block table and
loads K/V straight from the cache tensors `[num_blocks + 1, block_size, kv_heads, head_dim]`.

One program handles one KV head of a tile of query tokens: its rows are (token, query head of
that KV head's GQA group), so a GQA group shares every K/V load. A decode is a tile of one
token; a prefill chunk is cut into tiles of `BLOCK_Q` tokens. Query token `i` of a sequence
whose KV length is `L` after this step (this step's K/V already written) sits at position
`L - n_q + i` and attends to positions `<= ` that one (causal, bottom-right aligned). The loop
bound is read from the sequence lengths on the device, so a decode launch has static shapes
given the batch and table width: it can be captured in a CUDA graph, and a short sequence in
a wide table costs nothing for the table's padding.

The kernel is compiled for CUDA. On CPU it runs under Triton's interpreter,
which is how tests check it against a dense reference without a GPU (when Triton is installed,
with TRITON_INTERPRET=1 set before it is imported: tests/actors/conftest.py does that on CPU);
serving on CPU never uses it (actors/models/attention.py's portable path does).

Must not import: ray, serve_app.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

BLOCK_N = 64  # KV positions per loop iteration (spans several cache blocks)
PREFILL_ROWS = 64  # rows (token x group head) per prefill program


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _paged_attention_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, tile_seq_ptr, tile_q0_ptr,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_tab, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, BLOCK_KV: tl.constexpr, DECODE: tl.constexpr,
        IEEE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # one tile per sequence, one token each: row t of the flat batch is sequence t
        seq = tile
        q0 = 0
        q_begin = tile
        n_q = 1
    else:
        seq = tl.load(tile_seq_ptr + tile)
        q0 = tl.load(tile_q0_ptr + tile)
        q_begin = tl.load(q_start_ptr + seq)
        n_q = tl.load(q_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - n_q

    rows = tl.arange(0, ROWS)
    tok = rows // GROUP_PAD  # token of the tile
    grp = rows % GROUP_PAD  # query head within the GQA group
    row_ok = (tok < BLOCK_Q) & (q0 + tok < n_q) & (grp < GROUP)
    head = kv_head * GROUP + grp
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = q_begin + q0 + tok
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context + q0 + tok  # each row's absolute position

    m_i = tl.full([ROWS], -1.0e38, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context + q0 + BLOCK_Q)  # the tile's last row sees no further
    table = tables_ptr + seq * stride_tab
    for start in range(0, kv_end, BLOCK_KV):
        pos = start + tl.arange(0, BLOCK_KV)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)  # no int32 overflow
        slot = pos % block_size
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        keep = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


_KERNEL: list[Any] = []


def _kernel(device: torch.device) -> Any:
    """The kernel, jitted once. Under TRITON_INTERPRET=1 (set before Triton is imported) `triton.jit`
    gives Triton's interpreter, which runs the same source on CPU tensors."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise RuntimeError("the Triton paged-attention kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if not _KERNEL:
        _KERNEL.append(triton.jit(_paged_attention_kernel))
    return _KERNEL[0]


@dataclass(slots=True)
class TritonPrefill:
    """A step's prefill chunks for the kernel: one row per chunk, one entry per query tile."""

    block_tables: torch.Tensor  # [P, W] int32, padded with the scratch block
    seq_lens: torch.Tensor  # [P] int32: context + chunk length (KV after this step)
    q_start: torch.Tensor  # [P + 1] int32: flat row of each chunk's first token, then the end
    tile_seq: torch.Tensor  # [tiles] int32: the chunk each tile belongs to
    tile_q0: torch.Tensor  # [tiles] int32: the tile's first token within its chunk
    block_q: int


def prefill_block_q(group: int) -> int:
    """Tokens per prefill tile: PREFILL_ROWS rows shared by the GQA group's heads."""
    return max(1, PREFILL_ROWS // _next_pow2(group))


def build_prefill(spans: list[Any], scratch_block: int, group: int, device: torch.device) -> TritonPrefill:
    """From the runner's PrefillSpans (start, length, context, block_table); few per step."""
    block_q = prefill_block_q(group)
    width = max(int(s.block_table.numel()) for s in spans)
    tables = torch.full((len(spans), width), scratch_block, dtype=torch.int32, device=device)
    tile_seq: list[int] = []
    tile_q0: list[int] = []
    for i, s in enumerate(spans):
        tables[i, :s.block_table.numel()] = s.block_table
        n_tiles = -(-s.length // block_q)
        tile_seq.extend([i] * n_tiles)
        tile_q0.extend(range(0, n_tiles * block_q, block_q))
    starts = [s.start for s in spans] + [spans[-1].start + spans[-1].length]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return TritonPrefill(tables, ints([s.context + s.length for s in spans]), ints(starts), ints(tile_seq),
                         ints(tile_q0), block_q)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            tables: torch.Tensor, seq_lens: torch.Tensor, q_start: torch.Tensor, tile_seq: torch.Tensor,
            tile_q0: torch.Tensor, tiles: int, block_q: int, scale: float, decode: bool) -> None:
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    group_pad = _next_pow2(group)
    rows = max(16, _next_pow2(block_q * group_pad))  # tl.dot needs at least 16 rows
    _kernel(q.device)[(tiles, kv_heads)](
        q, k_cache, v_cache, out, tables, seq_lens, q_start, tile_seq, tile_q0, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), tables.stride(0), k_cache.shape[1],
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_Q=block_q, ROWS=rows, BLOCK_KV=BLOCK_N, DECODE=decode, IEEE=q.dtype == torch.float32)


def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """q [D, H, hd]: one token per sequence; context_lens include this step's token. Writes out[:D]."""
    n = q.shape[0]
    if n == 0:
        return
    dummy = context_lens  # unused in DECODE mode; any int tensor keeps the signature
    _launch(q, k_cache, v_cache, out, block_tables, context_lens, dummy, dummy, dummy, n, 1, scale, True)


def triton_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pre: TritonPrefill,
                   scale: float, out: torch.Tensor) -> None:
    """q/out are the whole flat batch [T, H, hd]; the chunks' rows are found through pre.q_start."""
    tiles = int(pre.tile_seq.numel())
    if tiles == 0:
        return
    _launch(q, k_cache, v_cache, out, pre.block_tables, pre.seq_lens, pre.q_start, pre.tile_seq, pre.tile_q0,
            tiles, pre.block_q, scale, False)
