"""How much GPU memory the KV cache may take: the arithmetic, and the profiled worst step.

Owns: `WorstStep` (the largest step the scheduler can send: its largest decode batch, every
sequence at full context, plus the largest prefill chunk that still fits the token budget, at
the deepest context it can have), `MemoryProfile` (what was measured before the cache exists:
weights, the worst step's activation peak, the CUDA-graph pool, the runtime's own memory
outside torch's allocator: CUDA context, cuBLAS workspaces, NCCL buffers), `kv_budget_bytes`
(the pure arithmetic, unit-tested on CPU) and `profile_memory` (GPU: runs the worst step over a
small throwaway cache and reads the allocator's peak reservation).

    KV = utilization x total - weights - worst-step peak - graph pool - runtime context

The worst step's block tables all point into a few throwaway blocks (contents do not matter
for memory), so the profile needs no full-size cache. The graph pool cannot be measured
before the cache it is bound to exists: it is estimated as the activation peak of the largest
decode bucket at full context run eagerly (a captured graph keeps those buffers), and the
estimate is checked against the real pool after capture (tests/gpu).

Must not import: ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class WorstStep:
    decodes: int  # sequences decoding, each at `decode_context` tokens of KV
    decode_context: int
    prefill_chunk: int  # tokens of one prefill chunk (0: none fits beside the decodes)
    prefill_context: int  # KV the chunk attends over before its own tokens

    @classmethod
    def for_limits(cls, max_batch_size: int, max_model_len: int, max_num_batched_tokens: int) -> WorstStep:
        for name, value in (("max_batch_size", max_batch_size), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1 to size the KV cache")
        decodes = min(max_batch_size, max_num_batched_tokens)
        chunk = min(max_num_batched_tokens - decodes, max_model_len)
        return cls(decodes, max_model_len, chunk, max_model_len - chunk if chunk else 0)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_chunk


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    weights_bytes: int  # allocated by torch after the model loaded
    worst_step_bytes: int  # activation peak of the worst step above the weights
    graph_pool_bytes: int  # CUDA-graph memory pool (0 without graphs)
    runtime_bytes: int  # used on the device outside torch's allocator (context, NCCL, cuBLAS)


def kv_budget_bytes(profile: MemoryProfile, utilization: float) -> int:
    """Bytes the KV cache may take; raises when nothing is left, naming what took the memory."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={utilization} must be in (0, 1]")
    parts = {"weights": profile.weights_bytes, "worst step": profile.worst_step_bytes,
             "graph pool": profile.graph_pool_bytes, "runtime context": profile.runtime_bytes}
    for name, value in parts.items():
        if value < 0:
            raise ValueError(f"{name} = {value} bytes: a memory figure cannot be negative")
    budget = int(profile.total_bytes * utilization) - sum(parts.values())
    if budget <= 0:
        used = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in parts.items())
        raise ValueError(f"no memory left for the KV cache: {utilization:.0%} of {profile.total_bytes / GIB:.2f} GiB "
                         f"minus {used}; raise gpu_memory_utilization or lower max_num_batched_tokens / "
                         f"max_batch_size / the CUDA-graph buckets")
    return budget


def _worst_step_inputs(step: WorstStep, block_size: int, pool_blocks: int, device: torch.device,
                       backend: str, group: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Model inputs of `step` whose tables all point into `pool_blocks` throwaway blocks."""
    from actors.models.attention import AttentionMetadata, PrefillSpan
    from actors.paged_attention import build_prefill

    d, n = step.decodes, step.prefill_chunk
    width = -(-step.decode_context // block_size)
    tables = torch.arange(d * width, device=device).remainder(pool_blocks).view(d, width) if d else None
    lens = torch.full((d,), step.decode_context, device=device) if d else None
    spans = []
    if n:
        ctx = step.prefill_context
        span_table = torch.arange(-(-(ctx + n) // block_size), device=device).remainder(pool_blocks)
        spans.append(PrefillSpan(d, n, ctx, span_table))
    tokens = d + n
    slots = torch.arange(tokens, device=device).remainder(pool_blocks * block_size)
    meta = AttentionMetadata(slots, d, tables, lens, spans, backend=backend)
    if backend == "triton" and spans:
        meta.triton_prefill = build_prefill(spans, pool_blocks, group, device)
    positions = torch.cat([torch.full((d,), step.decode_context - 1, device=device),
                           torch.arange(step.prefill_context, step.prefill_context + n, device=device)])
    return torch.zeros(tokens, dtype=torch.long, device=device), positions, meta


def _peak_of(model: Any, step: WorstStep, kv_spec: Any, device: torch.device, backend: str) -> int:
    """Memory the allocator reserved above what it held while running `step` (logits for every
    sampling row): reserved rather than allocated, so the allocator's rounding is counted too."""
    from actors.kv_cache import allocate_kv_cache

    pool_blocks = 8
    attn = model.layers[0].self_attn
    group = attn.shard.q_count // attn.shard.kv_count
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    caches = allocate_kv_cache(kv_spec, pool_blocks, device)
    ids, pos, meta = _worst_step_inputs(step, kv_spec.block_size, pool_blocks, device, backend, group)
    with torch.inference_mode():
        hidden = model(ids, pos, meta, caches)
        model.compute_logits(hidden[: step.decodes + (1 if step.prefill_chunk else 0)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base
    del caches, hidden
    return peak


def profile_memory(model: Any, kv_spec: Any, step: WorstStep, graph_batch: int, device: torch.device,
                   backend: str) -> MemoryProfile:
    """Measure everything but the cache: call after the weights are loaded, before the cache exists.
    CUDA only (tests/gpu); its control flow is tested on CPU with fake memory counters."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    worst = _peak_of(model, step, kv_spec, device, backend)
    pool = 0
    if graph_batch:
        pool = _peak_of(model, WorstStep(graph_batch, step.decode_context, 0, 0), kv_spec, device, backend)
    # After the steps ran, so lazily created workspaces (cuBLAS, Triton's modules) are counted.
    free, total = torch.cuda.mem_get_info(device)
    runtime = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    return MemoryProfile(total, weights, worst, pool, runtime)
