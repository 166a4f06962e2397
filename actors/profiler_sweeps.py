"""Timed sweeps of step shapes on the real runner (random weights of the real shapes).

Owns: the measurements the profiler fits: per-layer non-attention ops vs tokens, per-layer
attention (prefill chunks at a context, batched decodes at a context), and whole engine steps
(`ModelRunner.execute` on synthesized StepPlans: prefill of one prompt, decode of a batch).
Times are medians of repeats: the per-layer sweeps time their ops' device work (replayed from a
CUDA graph on GPU), the whole steps their wall time (ending on a device synchronisation).

Must not import: ray, serve_app except the plan dataclasses.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.model_runner import ModelRunner
from actors.models.attention import AttentionMetadata, PrefillSpan, paged_attention
from actors.paged_attention import build_prefill
from tidal_core import SamplingParams
from tidal_core.buckets import CudaGraphBuckets
from tidal_core.plan import NewRequestData, StepPlan

_GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Sweep:
    linear_tokens: tuple[int, ...]
    prefill_attention: tuple[tuple[int, int], ...]  # (chunk tokens, context)
    decode_attention: tuple[tuple[int, int], ...]  # (batch, context per sequence)
    prefill_prompts: tuple[int, ...]  # whole-step prefill of one prompt
    decode_batches: tuple[int, ...]  # whole-step decode of a batch
    decode_prompt: int
    repeats: int
    max_step_tokens: int = 8192  # prefill steps of the decode setup stay within this many tokens


QUICK = Sweep((1, 4, 16, 64, 256), ((16, 0), (64, 0), (256, 0), (64, 128), (16, 256)),
              ((16, 64), (16, 256), (32, 128), (32, 256), (64, 64)), (32, 64, 128, 256), (1, 2, 4, 8, 16, 32),
              64, 3)
FULL = Sweep((1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
             tuple(itertools.product((128, 512, 1024, 2048, 4096), (0, 2048))),
             tuple(itertools.product((16, 32, 64, 128, 256), (512, 1024, 2048, 4096))),
             (128, 256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8, 16, 32, 64, 128, 256), 512, 5)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of `fn` after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def device_timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of the device work of `fn`. On CUDA: `fn` captured once in a CUDA graph and
    replayed between CUDA events, so a per-layer op sweep measures the device and not the Python
    that launches its kernels one by one (the cost model's host terms are fitted on whole steps
    instead); where capture fails, `timed`. Elsewhere: `timed`."""
    if device.type != "cuda":
        return timed(fn, repeats, device)
    fn()  # warm-up: lazy initialisation and Triton's compilation stay outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:  # pragma: no cover - an op that cannot be captured
        return timed(fn, repeats, device)
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    del graph
    torch.cuda.empty_cache()  # the graph's private pool back to the device, not left to crowd the steps after
    return statistics.median(samples)


def linear_curve(runner: ModelRunner, sweep: Sweep) -> list[tuple[int, float]]:
    """Per-layer ms of everything but attention (norms, QKV, RoPE-free projections, MLP)."""
    layer = runner.model.layers[0]
    attn = layer.self_attn
    hidden = runner.model.cfg.hidden_size
    fused = runner.attention_backend == "triton"  # the layer's ops as serving runs them (llama.py)
    out = []
    for t in sweep.linear_tokens:
        x = torch.randn(t, hidden, device=runner.device, dtype=runner.model.dtype)
        att = torch.randn(t, attn.q_size, device=runner.device, dtype=runner.model.dtype)

        def ops(x: torch.Tensor = x, att: torch.Tensor = att) -> None:
            if fused:
                h, res = layer.input_layernorm.fused(x, x)
                attn.qkv_proj(h)
                h, _ = layer.post_attention_layernorm.fused(attn.o_proj(att), res)
                layer.mlp(h, fused=True)
                return
            attn.qkv_proj(layer.input_layernorm(x))
            h = x + attn.o_proj(att)
            layer.mlp(layer.post_attention_layernorm(h))

        with torch.inference_mode():
            out.append((t, device_timed(ops, sweep.repeats, runner.device)))
    return out


def _attention_ms(runner: ModelRunner, n: int, ctx: int, batch: int, repeats: int) -> float:
    """One layer's paged attention: a prefill chunk of n at ctx (batch=0) or `batch` decodes at ctx."""
    attn = runner.model.layers[0].self_attn
    dev, dt, bs = runner.device, runner.model.dtype, runner.block_size
    k_cache, v_cache = runner.kv_caches[0]
    hd, kvh = attn.head_dim, attn.shard.kv_count
    per_seq = -(-(ctx + max(n, 1)) // bs)
    seqs = max(batch, 1)
    tables = torch.arange(seqs * per_seq, device=dev).remainder(runner.num_blocks).view(seqs, per_seq)
    tokens = n if batch == 0 else batch
    q = torch.randn(tokens, attn.shard.q_count, hd, device=dev, dtype=dt)
    k = torch.randn(tokens, kvh, hd, device=dev, dtype=dt)
    v = torch.randn_like(k)
    backend = runner.attention_backend  # what the runner's steps use (the Triton kernel on CUDA)
    if batch == 0:
        slots = tables[0].repeat_interleave(bs)[ctx:ctx + n] * bs + torch.arange(ctx, ctx + n, device=dev) % bs
        meta = AttentionMetadata(slots, 0, None, None, [PrefillSpan(0, n, ctx, tables[0])], backend=backend)
        if backend == "triton":
            meta.triton_prefill = build_prefill(meta.prefills, runner.scratch_block, attn.shard.q_count // kvh, dev)
    else:
        lens = torch.full((batch,), ctx + 1, device=dev)
        slots = tables[:, ctx // bs] * bs + ctx % bs
        meta = AttentionMetadata(slots, batch, tables, lens, backend=backend)
    with torch.inference_mode():
        return device_timed(lambda: paged_attention(q, k, v, k_cache, v_cache, meta, attn.scale), repeats, dev)


Rows = list[tuple[int, int, float]]


def attention_rows(runner: ModelRunner, sweep: Sweep) -> tuple[Rows, Rows]:
    prefill = [(n, c, _attention_ms(runner, n, c, 0, sweep.repeats)) for n, c in sweep.prefill_attention]
    decode = [(b, c, _attention_ms(runner, 1, c, b, sweep.repeats)) for b, c in sweep.decode_attention]
    return prefill, decode


class _PlanMaker:
    """Synthesizes StepPlans for a runner with a simple block allocator (no scheduler needed)."""

    def __init__(self, runner: ModelRunner, vocab: int) -> None:
        self.runner, self.vocab = runner, vocab
        self.ids = itertools.count()
        self.next_block = 0

    def _blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // self.runner.block_size)
        if self.next_block + n > self.runner.num_blocks:
            self.next_block = 0  # blocks are reused: the contents do not matter for timing
        start, self.next_block = self.next_block, self.next_block + n
        return list(range(start, start + n))

    def prefill(self, prompts: list[int], extra: int) -> StepPlan:
        new, sched = [], {}
        for length in prompts:
            rid = f"p{next(self.ids)}"
            toks = torch.randint(3, self.vocab, (length,)).tolist()
            new.append(NewRequestData(rid, toks, length, _GREEDY, self._blocks(length + extra)))
            sched[rid] = length
        return StepPlan(next(self.ids), sched, dict.fromkeys(sched, 0), new, {}, [], 0, sum(prompts), 0, None)

    def prefill_many(self, prompts: list[int], extra: int, max_tokens: int) -> list[str]:
        """Prefill the prompts through the runner, several a step, at most `max_tokens` a step
        (the largest step the runner's memory was profiled for); returns their ids."""
        rids: list[str] = []
        group: list[int] = []
        for length in [*prompts, 0]:
            if group and (not length or sum(group) + length > max_tokens):
                plan = self.prefill(group, extra)
                self.runner.execute(plan)
                rids.extend(plan.num_scheduled_tokens)
                group = []
            if length:
                group.append(length)
        return rids

    def decode(self, rids: list[str], finished: list[str] | None = None, padded: int | None = None) -> StepPlan:
        """A decode step of `rids`; `padded`: the CUDA-graph bucket it replays at (None: eager)."""
        ctx = sum(self.runner.context_len(r) for r in rids)
        return StepPlan(next(self.ids), dict.fromkeys(rids, 1), {}, [], {}, finished or [], len(rids), 0, ctx, padded)

    def graph_bucket(self, batch: int) -> int | None:
        """The captured batch a decode of `batch` pads to, as the scheduler would; None: eager."""
        graphs = self.runner.graphs
        return CudaGraphBuckets(graphs.captured_batches if graphs is not None else ()).bucket_for(batch)


def step_points(runner: ModelRunner, sweep: Sweep, vocab: int) -> list[tuple[str, int, int, float]]:
    """(kind, prompt, batch, ms) of whole engine steps through `ModelRunner.execute`."""
    maker = _PlanMaker(runner, vocab)
    rows: list[tuple[str, int, int, float]] = []
    for prompt in sweep.prefill_prompts:
        def run(prompt: int = prompt) -> None:
            plan = maker.prefill([prompt], 0)
            runner.execute(plan)
            runner.execute(maker.decode([], finished=list(plan.num_scheduled_tokens)))

        rows.append(("prefill", prompt, 1, timed(run, sweep.repeats, runner.device)))
    # Decodes at the context the cost model's decode points assume: prompt + half the outputs.
    from calibration.measured import DECODE_OUTPUT_TOKENS

    context = sweep.decode_prompt + DECODE_OUTPUT_TOKENS // 2
    for batch in sweep.decode_batches:
        rids = maker.prefill_many([context - 1] * batch, sweep.repeats + 2, sweep.max_step_tokens)
        bucket = maker.graph_bucket(batch)
        rows.append(("decode", sweep.decode_prompt, batch,
                     timed(lambda rids=rids, b=bucket: runner.execute(maker.decode(rids, padded=b)), sweep.repeats,
                           runner.device)))
        runner.execute(maker.decode([], finished=rids))
    return rows
