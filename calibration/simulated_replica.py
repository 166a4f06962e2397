"""The simulated GPU behind a real Serve unit: a `SimExecutor` that takes its modelled time.

Owns: `SimulatedReplica`, what the ServingUnit drives for `engine.backend: sim`
(configs/sim.yaml). It offers the replica-group interface the unit and its engine loop use
(`execute` awaited by the engine loop, `execute_blocking` for a synchronous driver, the
scheduler's sizing properties, `check_health`, `worker_names`, `shutdown`), runs each plan
through the cost model's `SimExecutor` in-process (placeholder tokens), and sleeps the step's
modelled time on the wall clock, so the router's real scheduler meets a unit that behaves like
the calibrated GPU. The sleeps are arguments, so tests can run it on a virtual clock.

By default the whole modelled step is slept, host overhead included, so the unit behaves like
the calibrated one the simulator runs (the router's own loop overhead then shows as the gap
between Serve and the simulator). `include_host_time=False` sleeps only the device time, for a
router whose loop stands in for the engine's host work.

Nothing here can fail the way a TP worker can: there are no workers, and health always holds.

Must not import: ray, torch, serve_app, actors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from calibration.cost_model import CostModel
from calibration.sim_executor import SimExecutor
from tidal_core.plan import StepPlan, StepResult


class SimulatedReplica:
    """One simulated serving unit: `num_kv_blocks` of KV cache and the cost model's step times."""

    def __init__(self, executor: SimExecutor, num_kv_blocks: int, *, block_size: int, max_model_len: int,
                 cuda_graph_buckets: tuple[int, ...] = (),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 sleep_blocking: Callable[[float], None] = time.sleep) -> None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={num_kv_blocks} must be >= 1: the scheduler needs a KV pool")
        self.executor = executor
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.cuda_graph_buckets = tuple(cuda_graph_buckets)  # the scheduler pads to these; nothing is captured
        self._sleep = sleep
        self._sleep_blocking = sleep_blocking

    @classmethod
    def from_cost_model(cls, cost_model: CostModel | str | Path, num_kv_blocks: int, *, block_size: int = 16,
                        max_model_len: int = 2048, cuda_graph_buckets: tuple[int, ...] = (),
                        eos_token_id: int | None = None, placeholder_token_id: int = 1,
                        include_host_time: bool = True) -> SimulatedReplica:
        """A replica for a cost model given as a CostModel, a costmodels name or a YAML path."""
        model = cost_model if isinstance(cost_model, CostModel) else CostModel.load(cost_model)
        sim = SimExecutor(model if include_host_time else model.device_only(), eos_token_id=eos_token_id,
                          placeholder_token_id=placeholder_token_id)
        return cls(sim, num_kv_blocks, block_size=block_size, max_model_len=max_model_len,
                   cuda_graph_buckets=cuda_graph_buckets)

    # ---- what the scheduler needs -------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.executor.eos_token_id
        return (eos,) if eos is not None else ()

    @property
    def worker_names(self) -> tuple[str, ...]:
        """No worker actors: the simulated GPU runs inside the unit's own process."""
        return ()

    # ---- steps ------------------------------------------------------------------------------
    async def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan and sleep its modelled time (the engine loop's awaitable form)."""
        result = self.executor.execute(plan)
        await self._sleep(result.device_time_s)
        return result

    def execute_blocking(self, plan: StepPlan) -> StepResult:
        """The synchronous form: the same step, with a blocking sleep."""
        result = self.executor.execute(plan)
        self._sleep_blocking(result.device_time_s)
        return result

    # ---- health and teardown ---------------------------------------------------------------
    def check_health(self, timeout_s: float = 10.0) -> None:
        """Always healthy: there is no worker to lose (the signature matches a replica group's)."""

    def shutdown(self) -> None:
        """Nothing to release: no actors, no placement group."""
