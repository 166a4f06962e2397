"""CUDA graphs for pure-decode steps: one per (batch bucket x context bucket), pad, replay.

Owns: the context buckets (`context_widths`: the block-table widths captured, `pick_width`:
the narrowest captured width a step fits), `DecodeGraphBuffers` (the static input tensors a
graph reads, and how a decode batch of n <= bucket sequences is padded into them) and
`CudaGraphRunner` (capture every (batch, width) pair, largest first, sharing one memory pool;
replay; None where no graph fits, so the runner goes eager).

Padding rows are harmless by construction: token 0 at position 0, written to the scratch KV
block that no request owns, attending over that one slot (length 1, so no empty softmax).
A step's tables arrive as wide as its longest decode (built with one gather, actors/
block_tables.py); they are copied into the buffer's first `width` columns on the device, the
remaining columns of the chosen context bucket reset to the scratch block. The portable
attention gathers the bucket's whole width, so context buckets bound its padding; the Triton
kernel stops at each row's length, so for it the width only sizes the table. Padding is
counted (`batch_slots`, `kv_slots`): the scheduler's `padding waste` metric counts the batch
side; the context side is reported here. The buffer logic and bucket choice run on any
device and are unit-tested on CPU; capture and replay need CUDA (tests/gpu).

Must not import: ray, serve_app.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import torch

from actors.input_batch import StepInputs
from actors.models.attention import AttentionMetadata

DEFAULT_CONTEXT_STEP = 4  # each context bucket covers 4x the previous one's tokens
DEFAULT_FIRST_CONTEXT = 512


def context_widths(max_model_len: int, block_size: int, contexts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Ascending table widths (blocks) to capture; the last one always covers `max_model_len`.

    Default: 512 tokens, then x4 (2048, 8192, ...) below `max_model_len`, then `max_model_len`.
    """
    full = -(-max_model_len // block_size)
    if contexts is None:
        contexts, c = [], DEFAULT_FIRST_CONTEXT
        while c < max_model_len:
            contexts.append(c)
            c *= DEFAULT_CONTEXT_STEP
    if any(c < 1 for c in contexts):
        raise ValueError(f"context buckets {tuple(contexts)} must be positive token counts")
    return tuple(sorted({min(full, -(-c // block_size)) for c in contexts} | {full}))


def pick_width(widths: Sequence[int], need: int) -> int | None:
    """The narrowest captured width >= need, or None (run eager)."""
    i = bisect_left(widths, need)
    return widths[i] if i < len(widths) else None


class DecodeGraphBuffers:
    def __init__(self, max_batch: int, table_width: int, block_size: int, scratch_block: int,
                 device: torch.device | str, backend: str = "portable") -> None:
        self.max_batch = max_batch
        self.table_width = table_width
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.backend = backend
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_batch, table_width), scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.long, device=device)

    def load(self, inputs: StepInputs, bucket: int, width: int | None = None) -> None:
        """Copy a decode batch of n rows into the buffers and reset rows n..bucket to padding."""
        meta = inputs.meta
        n = meta.num_decodes
        width = self.table_width if width is None else width
        if meta.prefills or n == 0 or n > bucket or bucket > self.max_batch:
            raise ValueError(f"cannot pad a step of {n} decodes and {len(meta.prefills)} prefills to {bucket}")
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        used = meta.decode_block_tables.shape[1]
        if used > width or width > self.table_width:
            raise ValueError(f"block table width {used} exceeds the captured {min(width, self.table_width)}")
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :used].copy_(meta.decode_block_tables)
        self.block_tables[:n, used:width].fill_(self.scratch_block)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(self.scratch_slot)
        self.block_tables[n:bucket, :width].fill_(self.scratch_block)
        self.context_lens[n:bucket].fill_(1)

    def view(self, bucket: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The first `bucket` rows and `width` table columns as model inputs (views, read in place)."""
        width = self.table_width if width is None else width
        meta = AttentionMetadata(self.slot_mapping[:bucket], bucket, self.block_tables[:bucket, :width],
                                 self.context_lens[:bucket], backend=self.backend)
        return self.input_ids[:bucket], self.positions[:bucket], meta


class CudaGraphRunner:
    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buckets: list[int],
                 max_model_len: int, block_size: int, scratch_block: int, backend: str = "portable",
                 contexts: Sequence[int] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(buckets)
        self.widths = context_widths(max_model_len, block_size, contexts)
        device = kv_caches[0][0].device
        self.buffers = DecodeGraphBuffers(self.buckets[-1], self.widths[-1], block_size, scratch_block, device,
                                          backend)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool_bytes = 0  # memory the captures reserved (the graph pool), measured by capture()
        self.batch_slots = [0, 0]  # [useful, padded] rows of replayed steps
        self.kv_slots = [0, 0]  # [useful, padded] KV positions the captured tables span

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    @property
    def captured_batches(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self.graphs}))

    @torch.inference_mode()
    def capture(self) -> None:  # pragma: no cover - CUDA only (tests/gpu)
        """Largest first: the first capture sizes the shared pool, the smaller ones fit in it."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = None
        for bucket in reversed(self.buckets):
            for width in reversed(self.widths):
                ids, pos, meta = self.buffers.view(bucket, width)
                self.model(ids, pos, meta, self.kv_caches)  # warm-up: lazy inits outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket, width] = self.model(ids, pos, meta, self.kv_caches)
                pool = graph.pool()
                self.graphs[bucket, width] = graph
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before

    def can_run(self, bucket: int | None) -> bool:
        return bucket is not None and bucket in self.buckets and bool(self.graphs)

    def choose(self, inputs: StepInputs, bucket: int) -> int | None:
        """The context bucket (table width) this decode step replays at, or None (eager)."""
        tables = inputs.meta.decode_block_tables
        if tables is None or inputs.meta.prefills or bucket not in self.buckets:
            return None
        return pick_width(self.widths, tables.shape[1])

    def run(self, inputs: StepInputs, bucket: int, kv_tokens: int = 0) -> torch.Tensor | None:
        """Replay the (bucket, width) graph; None when the step fits no captured graph."""
        width = self.choose(inputs, bucket)
        if width is None or (bucket, width) not in self.graphs:
            return None
        self.buffers.load(inputs, bucket, width)
        n = inputs.meta.num_decodes
        self.batch_slots[0] += n
        self.batch_slots[1] += bucket - n
        spanned = n * width * self.buffers.block_size
        self.kv_slots[0] += min(kv_tokens, spanned)
        self.kv_slots[1] += max(0, spanned - kv_tokens)
        self.graphs[bucket, width].replay()
        return self.outputs[bucket, width][:n]

    def padding(self) -> dict[str, float]:
        """Fractions of replayed batch rows and of the real rows' table span that were padding."""
        def waste(pair: list[int]) -> float:
            return pair[1] / sum(pair) if sum(pair) else 0.0

        return {"batch_padding_waste": waste(self.batch_slots), "context_padding_waste": waste(self.kv_slots)}
