"""CUDA graphs for pure-decode steps: capture once per bucket size, pad, replay.

Owns: `DecodeGraphBuffers` (the static input tensors a graph reads, and how a decode batch of
n <= bucket sequences is padded into them) and `CudaGraphRunner` (capture at every bucket,
largest first, sharing one memory pool; replay; eager above the largest bucket).

Padding rows are harmless by construction: token 0 at position 0, written to the scratch KV
block that no request owns, attending over that one slot (length 1, so no empty softmax).
The decode attention reads a fixed-width block table (max_model_len / block_size blocks)
inside the graph, so shapes never change between replays. The buffer logic runs on any
device and is unit-tested on CPU; capture and replay need CUDA (tests/gpu).

Must not import: ray, serve_app.
"""

from __future__ import annotations

from typing import Any

import torch

from actors.input_batch import StepInputs
from actors.models.attention import AttentionMetadata


class DecodeGraphBuffers:
    def __init__(self, max_batch: int, table_width: int, block_size: int, scratch_block: int,
                 device: torch.device | str) -> None:
        self.max_batch = max_batch
        self.table_width = table_width
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_batch, table_width), scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.long, device=device)

    def load(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a decode batch of n rows into the buffers and reset rows n..bucket to padding."""
        meta = inputs.meta
        n = meta.num_decodes
        if meta.prefills or n == 0 or n > bucket or bucket > self.max_batch:
            raise ValueError(f"cannot pad a step of {n} decodes and {len(meta.prefills)} prefills to {bucket}")
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        width = meta.decode_block_tables.shape[1]
        if width > self.table_width:
            raise ValueError(f"block table width {width} exceeds the captured {self.table_width}")
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(self.scratch_slot)
        self.block_tables[n:bucket].fill_(self.scratch_block)
        self.context_lens[n:bucket].fill_(1)

    def view(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The first `bucket` rows as model inputs (views: a graph reads them in place)."""
        meta = AttentionMetadata(self.slot_mapping[:bucket], bucket, self.block_tables[:bucket],
                                 self.context_lens[:bucket])
        return self.input_ids[:bucket], self.positions[:bucket], meta


class CudaGraphRunner:  # pragma: no cover - capture and replay need CUDA (tests/gpu)
    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], buckets: list[int],
                 max_model_len: int, block_size: int, scratch_block: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(buckets)
        device = kv_caches[0][0].device
        self.buffers = DecodeGraphBuffers(self.buckets[-1], -(-max_model_len // block_size), block_size,
                                          scratch_block, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first: the first capture sizes the shared pool, the smaller ones fit in it."""
        pool = None
        for bucket in reversed(self.buckets):
            ids, pos, meta = self.buffers.view(bucket)
            self.model(ids, pos, meta, self.kv_caches)  # warm-up: lazy inits outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(ids, pos, meta, self.kv_caches)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def can_run(self, bucket: int | None) -> bool:
        return bucket is not None and bucket in self.graphs

    def run(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        self.buffers.load(inputs, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: inputs.meta.num_decodes]
