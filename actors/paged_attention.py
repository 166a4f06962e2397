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
# Decode launches: KV positions a loop iteration, warps, software-pipelining depth. Two stages beat
# Triton's default three by 8-9% on an H200 at batch 1 and 64, 1k and 4k context (and 256-token
# splits beat 512 and 1024 at batch 1): benchmarks/gpu_check.py times such alternatives.
DECODE_LAUNCH = {"BLOCK_KV": BLOCK_N, "num_warps": 4, "num_stages": 2}
PREFILL_LAUNCH = {"BLOCK_KV": BLOCK_N}  # Triton's default warps and stages
SPLIT_TOKENS = 256  # decode: KV positions per split (a multiple of BLOCK_N)
MAX_SPLITS = 64  # decode: past this many, the splits grow instead (a power of two: the merge's tile)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _paged_attention_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, tile_seq_ptr, tile_q0_ptr,
        part_ptr, part_ml_ptr, num_splits, split_share, num_heads,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_tab, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, BLOCK_KV: tl.constexpr, DECODE: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr):
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
    kv_begin = 0
    if SPLIT:  # flash-decoding: split s takes positions [s * share, (s + 1) * share), empty past the length
        split = tl.program_id(2)
        kv_begin = split * split_share
        kv_end = tl.minimum(seq_len, kv_begin + split_share)
    table = tables_ptr + seq * stride_tab
    for start in range(kv_begin, kv_end, BLOCK_KV):
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
    if SPLIT:  # the split's unnormalized sum and its (max, denominator); _merge_splits_kernel combines them
        # (a split past the row's length writes nothing: the merge never reads it)
        part_row = (seq * num_heads + head) * num_splits + split
        written = row_ok & (kv_begin < seq_len)
        tl.store(part_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], acc, mask=written[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=written)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=written)
    else:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _merge_splits_kernel(  # pragma: no cover - compiled by Triton (tests run it interpreted)
        part_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, num_splits, split_share, num_heads, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program per (sequence, query head): the row's non-empty splits rescaled to their common max
    and summed. The tile is always SPLITS_PAD (= MAX_SPLITS) rows, the splits past the row's length
    masked to zero, so the reduction has the same shape, and the same bits, whatever the table's width."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), split_share)
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < used
    rows = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + rows * 2, mask=ok, other=-1.0e38)
    den = tl.load(part_ml_ptr + rows * 2 + 1, mask=ok, other=0.0)
    weight = tl.where(ok, tl.exp(m - tl.max(m, 0)), 0.0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_ptr + rows[:, None] * HEAD_PAD + dims[None, :], mask=ok[:, None], other=0.0)
    total = tl.sum(acc * weight[:, None], 0) / tl.sum(den * weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, total.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


_JITTED: dict[Any, Any] = {}


def jitted(fn: Any, device: torch.device) -> Any:
    """`fn` jitted once. Under TRITON_INTERPRET=1 (set before Triton is imported) `triton.jit`
    gives Triton's interpreter, which runs the same source on CPU tensors."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"the Triton kernel {fn.__name__} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if fn not in _JITTED:
        _JITTED[fn] = triton.jit(fn)
    return _JITTED[fn]


def decode_splits(width_tokens: int) -> tuple[int, int]:
    """(splits, tokens per split) of a decode launch whose tables span `width_tokens` (flash-decoding).

    One program per (sequence, KV head) leaves most of a large GPU idle at small batches and walks
    a long context serially; split s instead takes positions [s * share, (s + 1) * share) of every
    row, and a second kernel merges the splits. The share is fixed (SPLIT_TOKENS) until the table
    is wider than MAX_SPLITS of them, so the partition of a row's context depends on its length
    alone, not on the batch nor (below that width) on the table: a CUDA graph's wider table only
    adds empty splits, and a replay computes what the eager step computes, bit for bit. Static
    given the launch's shapes, as a graph needs."""
    share = max(SPLIT_TOKENS, -(-width_tokens // (MAX_SPLITS * BLOCK_N)) * BLOCK_N)
    splits = -(-width_tokens // share)
    return (splits, share) if splits > 1 else (1, -(-width_tokens // BLOCK_N) * BLOCK_N)


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
            tile_q0: torch.Tensor, tiles: int, block_q: int, scale: float, decode: bool, splits: int = 1,
            share: int = 0) -> None:
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    group_pad = _next_pow2(group)
    head_pad = max(16, _next_pow2(head_dim))
    rows = max(16, _next_pow2(block_q * group_pad))  # tl.dot needs at least 16 rows
    split = decode and splits > 1
    if split:  # fp32 partial sums [D, H, splits, head_pad] and (max, denominator) pairs, merged below
        part = torch.empty(tiles * heads * splits * head_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tiles * heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part = part_ml = q  # unused without SPLIT
    launch = DECODE_LAUNCH if decode else PREFILL_LAUNCH
    jitted(_paged_attention_kernel, q.device)[(tiles, kv_heads, splits if split else 1)](
        q, k_cache, v_cache, out, tables, seq_lens, q_start, tile_seq, tile_q0, part, part_ml, splits, share, heads,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), tables.stride(0), k_cache.shape[1],
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_Q=block_q, ROWS=rows, DECODE=decode, SPLIT=split, IEEE=q.dtype == torch.float32, **launch)
    if split:
        jitted(_merge_splits_kernel, q.device)[(tiles, heads)](
            part, part_ml, out, seq_lens, splits, share, heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=MAX_SPLITS)


def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, out: torch.Tensor, share: int | None = None) -> None:
    """q [D, H, hd]: one token per sequence; context_lens include this step's token. Writes out[:D].

    `share`: KV positions per split (a multiple of BLOCK_N; at least the table width: one pass);
    None: `decode_splits` of the table's width."""
    n = q.shape[0]
    if n == 0:
        return
    width = block_tables.shape[1] * k_cache.shape[1]
    if share is None:
        splits, share = decode_splits(width)
    else:
        if share <= 0 or share % BLOCK_N:
            raise ValueError(f"share={share}: want a positive multiple of {BLOCK_N}")
        splits = -(-width // share)
    dummy = context_lens  # unused in DECODE mode; any int tensor keeps the signature
    _launch(q, k_cache, v_cache, out, block_tables, context_lens, dummy, dummy, dummy, n, 1, scale, True, splits,
            share)


def triton_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pre: TritonPrefill,
                   scale: float, out: torch.Tensor) -> None:
    """q/out are the whole flat batch [T, H, hd]; the chunks' rows are found through pre.q_start."""
    tiles = int(pre.tile_seq.numel())
    if tiles == 0:
        return
    _launch(q, k_cache, v_cache, out, pre.block_tables, pre.seq_lens, pre.q_start, pre.tile_seq, pre.tile_q0,
            tiles, pre.block_q, scale, False)
