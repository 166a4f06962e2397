"""Building a worker's engine from an `EngineSpec`: model, weights, KV budget, graphs, runner.

Owns: the two phases of worker start-up, `WorkerBuilder.load()` (model + weights + how many KV
blocks this rank could hold) and `WorkerBuilder.finish(num_blocks)` (allocate the agreed number
on every rank, capture CUDA graphs, return the `ModelRunner`). TP ranks hold different numbers
of KV heads when shards are uneven, so the replica takes the minimum over ranks. `EngineSpec` and
`EngineInfo`, the plain data it builds from and reports, live in actors/engine_spec.py
(importable without torch) and are re-exported here.

Must not import: ray, serve_app (except the plan dataclasses through model_runner).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from actors import kv_budget, kv_cache, model_loader
from actors.cpus import available_cpus
from actors.cuda_graphs import CudaGraphRunner
from actors.engine_spec import EngineInfo, EngineSpec
from actors.model_runner import ModelRunner
from actors.models import LlamaForCausalLM, ModelConfig, TPContext, from_hf_config
from actors.models.block_gemm import MAX_ROWS, attach_blocks
from actors.models.cpu_gemm import prepare_cpu_gemm

__all__ = ["EngineInfo", "EngineSpec", "WorkerBuilder", "build_local_runner", "with_buckets"]

log = logging.getLogger(__name__)


def _random_hf_config(values: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig

    cls = MistralConfig if values.get("model_type") == "mistral" else LlamaConfig
    return cls(**{k: v for k, v in values.items() if k != "model_type"})


def default_torch_threads(cores: int, tp: int) -> int:
    """PyTorch threads per TP worker when `EngineSpec.torch_threads` is not set; `cores` is what the
    process may use (actors/cpus.py: its affinity, capped by a container's CPU quota).

    A box of more than two cores leaves one to the router, Ray and the ingress. A 2-core box gives
    the model both: the Serve processes need about a third of a core at the dev server's loads, and
    a second thread makes prefill 1.8x faster and a decode step of 4-16 rows 1.4-1.6x faster
    (the CPU kernels' pool), so `make serve` serves more tokens/s (12-23% before the pool); with a
    busy neighbour on one core it is within 4% of one thread (benchmarks/RESULTS.md, "Both cores of a 2-core box")."""
    spare = 1 if cores > 2 else 0
    return max(1, (cores - spare) // tp)


class WorkerBuilder:
    def __init__(self, spec: EngineSpec, tp: TPContext | None = None) -> None:
        self.spec = spec
        self.tp = tp or TPContext()
        self.device = torch.device(spec.resolved_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        threads = spec.torch_threads or default_torch_threads(available_cpus(), spec.tp)
        torch.set_num_threads(threads)
        self.path: Path | None = None
        self.model: LlamaForCausalLM | None = None
        self.cfg: ModelConfig | None = None
        self.max_model_len = 0
        self.memory: kv_budget.MemoryProfile | None = None  # GPU: what the KV budget was computed from

    def load(self) -> tuple[int, EngineInfo]:
        """Build and fill the model; return (KV blocks this rank can hold, engine info)."""
        spec = self.spec
        if spec.random_config is not None:
            cfg = from_hf_config(_random_hf_config(spec.random_config))
        else:
            self.path = model_loader.prepare(spec.model)
            cfg = model_loader.load_model_config(self.path)
        self.max_model_len = min(spec.max_model_len, cfg.max_position_embeddings)
        model_loader.check_servable(cfg, self.max_model_len)
        model = model_loader.build_model(cfg, self.tp, spec.resolved_dtype(), self.device, self.max_model_len)
        if self.path is None:
            model_loader.random_weights(model, seed=spec.seed or 0)
        else:
            model_loader.load_weights(model, self.path)
        if spec.cpu_gemm:
            source = model_loader.gguf_source(self.path) if spec.cpu_block_gemm and self.path else None
            prepare_cpu_gemm(model, transposed=source is None)
            if source is not None:
                t0 = time.perf_counter()
                count = attach_blocks(model, source)
                log.info("%d linears read %s's quantized blocks at <= %d rows (%.1f s)", count, source.name,
                         MAX_ROWS, time.perf_counter() - t0)
        self.model, self.cfg = model, cfg
        blocks = kv_cache.blocks_for_budget(self.kv_spec(), self._kv_budget_bytes(), spec.max_num_blocks)
        eos = model_loader.eos_token_ids(self.path, cfg) if self.path else cfg.eos_token_ids
        info = EngineInfo(blocks, spec.block_size, self.max_model_len, eos, str(self.path) if self.path else None)
        return blocks, info

    def kv_spec(self) -> kv_cache.KVCacheSpec:
        assert self.model is not None and self.cfg is not None
        return kv_cache.KVCacheSpec(self.cfg.num_layers, self.model.num_local_kv_heads, self.cfg.head_dim,
                                    self.spec.block_size, self.spec.resolved_dtype())

    def _kv_budget_bytes(self) -> float:
        if self.device.type != "cuda":
            return self.spec.kv_cache_gb * kv_cache.GIB
        self.memory = self.memory_profile()  # pragma: no cover
        return kv_budget.kv_budget_bytes(self.memory, self.spec.gpu_memory_utilization)  # pragma: no cover

    def _graph_buckets(self) -> list[int]:
        if self.device.type != "cuda" or self.spec.enforce_eager:
            return []
        return list(self.spec.cuda_graph_buckets)

    def memory_profile(self) -> kv_budget.MemoryProfile:  # pragma: no cover - CUDA only
        """Weights, the worst step, the graph pool and the runtime, measured before the cache exists."""
        assert self.model is not None
        spec = self.spec
        step = kv_budget.WorstStep.for_limits(spec.max_batch_size, self.max_model_len, spec.max_num_batched_tokens)
        graph_batch = max(self._graph_buckets(), default=0)
        return kv_budget.profile_memory(self.model, self.kv_spec(), step, graph_batch, self.device,
                                        spec.resolved_attention())

    def finish(self, num_blocks: int) -> ModelRunner:
        assert self.model is not None
        caches = kv_cache.allocate_kv_cache(self.kv_spec(), num_blocks, self.device)
        graphs = None
        backend = self.spec.resolved_attention()
        if self._graph_buckets():
            graphs = CudaGraphRunner(self.model, caches, self._graph_buckets(), self.max_model_len,  # pragma: no cover
                                     self.spec.block_size, num_blocks, backend, self.spec.cuda_graph_contexts)
            graphs.capture()  # pragma: no cover
        return ModelRunner(self.model, caches, self.spec.block_size, num_blocks, self.spec.seed, graphs, backend,
                           cpu_attention_kernel=self.spec.cpu_attention, cpu_fused_ops=self.spec.cpu_fused_ops,
                           cpu_decode_layers=self.spec.cpu_decode_layers)


def with_buckets(info: EngineInfo, runner: ModelRunner) -> EngineInfo:
    """The engine info plus the CUDA-graph sizes this runner captured (the scheduler pads to them)."""
    buckets = runner.graphs.captured_batches if runner.graphs is not None else ()
    return EngineInfo(info.num_kv_blocks, info.block_size, info.max_model_len, info.eos_token_ids, info.model_path,
                      buckets)


def build_local_runner(spec: EngineSpec) -> tuple[ModelRunner, EngineInfo]:
    """TP=1 in this process: load, size the KV cache, finish."""
    if spec.tp != 1:
        raise ValueError(f"tp={spec.tp}: an in-process runner is TP=1; use actors.replica.ReplicaGroup")
    builder = WorkerBuilder(spec)
    blocks, info = builder.load()
    runner = builder.finish(blocks)
    return runner, with_buckets(info, runner)

