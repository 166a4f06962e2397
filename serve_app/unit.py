"""The ServingUnit deployment: one serving unit = one core Scheduler + one replica group.

Owns: `ServingUnit` (Serve deployment glue around `EngineLoop`) and `build_replica_group`:
builds the unit's executor (a `ReplicaGroup` of TP workers running the model, or the simulated
GPU, `calibration.simulated_replica.SimulatedReplica`), sizes the scheduler from it, streams tokens
to the ingress, reports routing and autoscaling stats, and fails its health check when the
engine died so Serve rebuilds the unit. No policy decision is made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ray import serve

from serve_app.config_loader import AppArgs, EngineArgs, scheduler_config
from serve_app.engine_loop import EngineLoop, StreamCoalescing
from serve_app.memory_trim import jemalloc_stats, start_trimming
from serve_app.metrics import UnitMetrics, prefix_cache_counters
from serve_app.unit_api import GenerateChunk, GenerateRequest, ModelInfo
from tidal_core import Scheduler, UnitLoad
from tidal_core.config import AdmissionConfig, ServicePrior
from tidal_core.front_admission import DoorRefusal

if TYPE_CHECKING:
    from actors.replica import ReplicaGroup
    from calibration.simulated_replica import SimulatedReplica

log = logging.getLogger("tidalserve.unit")

SIM_PLACEHOLDER_TOKEN = 260
"""What the simulated GPU 'generates': a plain word piece (" the" in the Llama/SmolLM2
vocabularies), so streamed text is visible and TTFT is measurable by any client."""


def build_replica_group(engine: EngineArgs, max_num_batched_tokens: int, buckets: tuple[int, ...],
                        name_prefix: str | None = None, max_batch_size: int = 64,
                        ) -> tuple[ReplicaGroup | SimulatedReplica, ServicePrior | None]:
    """The executor of one unit and the service prior for its scheduler.

    `backend: sim` gets a `SimulatedReplica` (the cost model in this process, no Ray workers, and
    the cost model's own service prior); `backend: hf` a Ray `ReplicaGroup` of `tp` workers
    running the model (the scheduler's default prior).
    """
    if engine.backend == "sim":
        from calibration.cost_model import CostModel
        from calibration.simulated_replica import SimulatedReplica
        from calibration.unit_sizing import pool_blocks

        assert engine.cost_model is not None
        cost = CostModel.load(engine.cost_model)
        num_blocks = engine.sim_num_kv_blocks or pool_blocks(cost, block_size=engine.block_size)
        sim = SimulatedReplica.from_cost_model(cost, num_blocks, block_size=engine.block_size,
                                               max_model_len=engine.max_model_len, cuda_graph_buckets=buckets,
                                               placeholder_token_id=SIM_PLACEHOLDER_TOKEN)
        return sim, cost.service_prior()
    from actors.engine_spec import EngineSpec
    from actors.replica import ReplicaGroup  # the workers import torch; this process does not

    spec = EngineSpec(model=engine.model, tp=engine.tp, device=engine.device, dtype=engine.dtype,
                      block_size=engine.block_size, max_model_len=engine.max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, kv_cache_gb=engine.kv_cache_gb,
                      gpu_memory_utilization=engine.gpu_memory_utilization, cuda_graph_buckets=buckets,
                      enforce_eager=engine.enforce_eager, max_batch_size=max_batch_size,
                      cpu_gemm=engine.cpu_gemm, cpu_attention=engine.cpu_attention,
                      cpu_block_gemm=engine.cpu_block_gemm, cpu_fused_ops=engine.cpu_fused_ops,
                      cpu_decode_layers=engine.cpu_decode_layers,
                      torch_threads=engine.torch_threads)
    group = ReplicaGroup(spec, step_timeout_s=engine.step_timeout_s, compiled_graph=engine.compiled_graph,
                         name_prefix=name_prefix, step_socket=engine.step_socket)
    return group, None


@serve.deployment
class ServingUnit:
    async def __init__(self, args: dict[str, Any]) -> None:
        app = AppArgs.model_validate(args)
        self.args = app
        ctx = serve.get_replica_context()
        self.unit = ctx.replica_id.unique_id if ctx is not None else "local"
        # Starting TP workers blocks on Ray for up to minutes (weights load): off the event loop.
        self.group, prior = await asyncio.to_thread(
            build_replica_group, app.engine, app.scheduler.max_num_batched_tokens,
            tuple(app.scheduler.cuda_graph_buckets), f"tidal-tp-{self.unit}", app.scheduler.max_batch_size)
        cfg = scheduler_config(app.scheduler, num_kv_blocks=self.group.num_kv_blocks,
                               block_size=self.group.block_size, max_model_len=self.group.max_model_len,
                               service_prior=prior or ServicePrior())
        # Pad only to the decode sizes the workers actually captured (none on CPU: all eager).
        cfg = dataclasses.replace(cfg, cuda_graph_buckets=tuple(self.group.cuda_graph_buckets))
        self.scheduler = Scheduler(cfg, now=time.monotonic())
        self.metrics = UnitMetrics(self.unit)
        self.loop = EngineLoop(self.scheduler, self.group, self.metrics,
                               coalescing=StreamCoalescing(app.streaming.interval_s, app.streaming.min_streams),
                               unit_id=self.unit)
        self.info = ModelInfo(app.engine.model_id, self.group.max_model_len, tuple(self.group.eos_token_ids),
                              app.engine.backend, hash_scheme=self.loop.hash_scheme)
        self._gauge_task: asyncio.Task[None] | None = None
        self._memory_baseline: Any = None
        if os.environ.get("TIDAL_TRACEMALLOC"):  # memory diagnosis (benchmarks/soak.py --tracemalloc)
            import tracemalloc

            tracemalloc.start(int(os.environ["TIDAL_TRACEMALLOC"]))
        # Start at once, not on the first request: a new idle unit must already report its
        # gauges (dashboards, the unit-down alert) and its stats (routing, autoscaling).
        self._trim_task = start_trimming()  # freed heap back to the OS (serve_app/memory_trim.py)
        self._ensure_background()
        log.info("unit %s ready: policy %s, %d KV blocks of %d, max_model_len %d", self.unit, cfg.policy,
                 cfg.num_kv_blocks, cfg.block_size, cfg.max_model_len)

    def _ensure_background(self) -> None:
        self.loop.start()
        if self._gauge_task is None:
            self._gauge_task = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:  # keeps gauges true while idle (the step hook only runs when steps run)
            self.metrics.refresh_gauges(self.scheduler, time.monotonic())
            await asyncio.sleep(1.0)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._ensure_background()
        async for chunk in self.loop.generate(request):
            yield chunk

    async def model_info(self) -> ModelInfo:
        return self.info

    async def admission_config(self) -> AdmissionConfig:
        """The unit's admission rules: the ingress's front gate applies the same to its snapshots."""
        return self.scheduler.config.admission

    async def health(self) -> bool:
        return self.loop.healthy

    def check_health(self) -> None:
        """Serve's periodic probe: a failed engine or a dead worker restarts this unit."""
        if not self.loop.healthy:
            raise RuntimeError(f"engine failed: {self.loop.failure}")
        self.group.check_health()

    def _stats(self) -> dict[str, float]:
        return self.loop.load(time.monotonic()).to_stats()

    async def load_stats(self, refused_at_door: Sequence[DoorRefusal] = ()) -> UnitLoad:
        """This unit's published snapshot: what the front gates poll (cheap). A poll passes on the
        requests its gate refused since the last one, one (prompt estimate, reason) each, which count
        in this unit's load, refusals, regime and `costly_prompt` sample (tidal_core/front_admission.py
        `absorb_door_refusals`)."""
        return self.loop.load(time.monotonic(), refused_at_door)

    async def unit_state(self, check: bool = False) -> dict[str, Any]:
        """Operator view of the unit (and, with `check`, the scheduler's integrity check):
        what the reliability tests read to prove nothing leaked."""
        if check:
            self.scheduler.check_integrity()
        s = self.scheduler
        workers = list(self.group.worker_names)
        return {**self._stats(), "unit": self.unit, "healthy": self.loop.healthy, "failure": self.loop.failure,
                "pid": os.getpid(), "workers": workers,
                "num_free_blocks": s.blocks.num_free_blocks, "num_blocks": s.blocks.num_blocks,
                "num_streams": len(self.loop.streams), "num_requests": len(s.requests),
                "regime_name": s.current_regime.value, "policy": s.config.policy,
                "finished": dict(s.stats.finished), "rejected": dict(s.stats.rejected),
                "preempted": dict(s.stats.preempted), "num_steps": s.stats.num_steps,
                "num_arrived": s.stats.num_arrived, "prefix_cache": prefix_cache_counters(s.stats)}

    async def memory_growth(self, baseline: bool = False, top: int = 12) -> list[str]:
        """Where this process's Python memory grew since the baseline (`baseline=True` takes it),
        biggest first, with tracebacks; [] unless the process runs with TIDAL_TRACEMALLOC=<frames>."""
        import gc
        import tracemalloc

        if not tracemalloc.is_tracing():
            return []
        gc.collect()
        snap = tracemalloc.take_snapshot()
        if baseline or self._memory_baseline is None:
            self._memory_baseline = snap
            return []
        stats = snap.compare_to(self._memory_baseline, "traceback")
        return [f"{s.size_diff / 2**10:+.1f} KiB in {s.count_diff:+d} blocks\n" + "\n".join(s.traceback.format())
                for s in stats[:top]]

    async def allocator_stats(self) -> dict[str, int] | None:
        """The allocator's live and resident bytes when this replica runs on jemalloc, else None
        (serve_app/memory_trim.py; benchmarks/soak.py --allocator jemalloc)."""
        return jemalloc_stats()

    def record_routing_stats(self) -> dict[str, float]:
        return self._stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self._stats()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.group.shutdown()
