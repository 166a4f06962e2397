"""A replica group: the TP worker actors of one serving unit, placed together, run in lock step.

Owns: `ReplicaGroup` (placement group, worker start-up, `execute` with a deadline, health,
shutdown) and `WorkerFailure`, the one exception a driver sees when a worker dies or stalls.

Placement: one bundle per rank in a STRICT_PACK placement group (same node: the TP
collectives are intra-node) - `{"GPU": 1, "CPU": 1}` on GPU nodes, a fractional CPU bundle on
CPU so TP=2 fits a 2-CPU Ray cluster next to Serve. Every rank gets every plan; rank 0's
StepResult is returned. Transport: a Ray Compiled Graph (lower per-step overhead, see
benchmarks/control_plane.py; the default on CUDA), or, without one, a Unix socket per CPU worker
when every worker shares the unit's node (actors/step_socket.py: `step_socket`, on by default),
else plain actor calls. Start-up, health checks and the offline engine's `execute_blocking` are always
actor calls. Compiled-graph actors spin a core while the graph exists, so always call `shutdown()`.

The simulated GPU (Serve's "sim" backend) is not a replica group: it is
`calibration.simulated_replica.SimulatedReplica`, with the same interface and no Ray.

Must not import: serve_app, or the core beyond its plan dataclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine_spec import EngineInfo, EngineSpec
from actors.step_socket import ChannelError, StepChannel
from actors.tp_worker import TPWorker
from tidal_core.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A TP worker died, raised, or did not answer in time. The replica group is unusable."""


class ReplicaGroup:
    def __init__(self, spec: EngineSpec, *, step_timeout_s: float = 60.0, init_timeout_s: float = 600.0,
                 cpus_per_worker: float = 0.01, compiled_graph: bool | None = None,
                 name_prefix: str | None = None, step_socket: bool = True) -> None:
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.workers: list[Any] = []
        self.pg: Any = None
        self._dag: Any = None
        self._channel: StepChannel | None = None
        self._own_pg = False
        self.name_prefix = name_prefix  # workers are named `{prefix}-r{rank}` (operators, fault tests)
        try:
            self.info = self._start(init_timeout_s, cpus_per_worker)
            # Compiled-graph workers spin a core while waiting: a win next to a GPU, a loss on a
            # CPU box where the same cores run the model. None = on for CUDA only.
            if compiled_graph or (compiled_graph is None and spec.resolved_device() == "cuda"):
                self._dag = self._compile()
            elif step_socket and spec.resolved_device() == "cpu":  # GPU workers: not run on a GPU yet
                self._channel = self._open_channel(init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up --------------------------------------------------------------------------
    def _start(self, timeout_s: float, cpus_per_worker: float) -> EngineInfo:
        spec, tp = self.spec, self.spec.tp
        on_gpu = spec.resolved_device() == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": cpus_per_worker}
        first = self._place(tp, bundle, timeout_s)
        actor = ray.remote(TPWorker)
        cpus = [self.pg.bundle_specs[first + r].get("CPU", 0) for r in range(tp)]
        self.workers = [
            actor.options(num_cpus=cpus[r], num_gpus=bundle.get("GPU", 0),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.pg, placement_group_bundle_index=first + r),
                          max_concurrency=2,  # health checks answer while a step runs
                          **({"name": f"{self.name_prefix}-r{r}"} if self.name_prefix else {}))
            .remote(spec, r, tp)
            for r in range(tp)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote(), timeout=timeout_s)
        ray.get([w.init_distributed.remote(address, port, max(self.step_timeout_s, 30.0)) for w in self.workers],
                timeout=timeout_s)
        loaded = ray.get([w.load.remote() for w in self.workers], timeout=timeout_s)
        num_blocks = min(blocks for blocks, _ in loaded)
        buckets = ray.get([w.finish.remote(num_blocks) for w in self.workers], timeout=timeout_s)
        info: EngineInfo = loaded[0][1]
        return EngineInfo(num_blocks, info.block_size, info.max_model_len, info.eos_token_ids, info.model_path,
                          buckets[0])

    def _place(self, tp: int, bundle: dict[str, float], timeout_s: float) -> int:
        """The placement group for the workers and the bundle index of rank 0.

        Inside a Serve replica that reserved `placement_group_bundles` (configs/prod.yaml: one
        CPU bundle for the router, then one GPU bundle per rank), the workers go into that
        group's bundles 1..tp, so a unit never asks the cluster for its GPUs twice. Otherwise
        (local runs, tests) the group creates and owns a STRICT_PACK group of its own.
        """
        from ray.util import get_current_placement_group

        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= tp + 1:
            need_gpu = bundle.get("GPU", 0) > 0
            if all((spec.get("GPU", 0) >= 1) == need_gpu for spec in current.bundle_specs[1:tp + 1]):
                self.pg = current
                return 1
        self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK")
        self._own_pg = True
        ray.get(self.pg.ready(), timeout=timeout_s)
        return 0

    def _open_channel(self, timeout_s: float) -> StepChannel | None:
        """Unix sockets to the workers when all of them run on this process's node, else None
        (actor calls). A failure to open them is logged and leaves actor calls in place."""
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([w.node_id.remote() for w in self.workers], timeout=timeout_s)
        if any(node != here for node in nodes):
            return None
        try:
            return StepChannel(ray.get([w.open_step_socket.remote() for w in self.workers], timeout=timeout_s))
        except (OSError, RayError) as exc:
            log.warning("step sockets to the TP workers unavailable (%s): steps go through actor calls", exc)
            return None

    @property
    def transport(self) -> str:
        """How steps reach the workers: "compiled_graph", "socket" or "actor_calls"."""
        return "compiled_graph" if self._dag is not None else "socket" if self._channel is not None else "actor_calls"

    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
        return dag.experimental_compile(enable_asyncio=True)

    # ---- what the scheduler needs -------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.info.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def cuda_graph_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes with a captured graph: the scheduler's `cuda_graph_buckets`."""
        return self.info.cuda_graph_buckets

    @property
    def worker_names(self) -> tuple[str, ...]:
        """The workers' Ray actor names (`{prefix}-r{rank}`); () when they are unnamed."""
        if not self.name_prefix:
            return ()
        return tuple(f"{self.name_prefix}-r{r}" for r in range(len(self.workers)))

    # ---- steps ------------------------------------------------------------------------------
    async def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan on every rank; rank 0's result. Raises WorkerFailure, never hangs."""
        if self._channel is not None:
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    results = await self._channel.execute(plan)
            except TimeoutError as exc:
                raise self._failure(plan, exc) from exc
            except ChannelError as exc:
                raise WorkerFailure(f"step {plan.step_id}: {exc}") from exc
            return self._rank0(plan, results)
        try:
            if self._dag is not None:
                futures = await self._dag.execute_async(plan)
                results = await asyncio.wait_for(asyncio.gather(*futures), self.step_timeout_s)
            else:
                refs = [w.execute.remote(plan) for w in self.workers]
                results = await asyncio.wait_for(asyncio.gather(*refs), self.step_timeout_s)
        except (TimeoutError, RayError) as exc:
            raise self._failure(plan, exc) from exc
        return self._rank0(plan, results)

    def execute_blocking(self, plan: StepPlan) -> StepResult:
        """The synchronous form (offline engine); plain actor calls only."""
        if self._dag is not None:
            raise RuntimeError("a replica built with compiled_graph=True is driven through `await execute()`")
        refs = [w.execute.remote(plan) for w in self.workers]
        try:
            results = ray.get(refs, timeout=self.step_timeout_s)
        except (GetTimeoutError, RayError) as exc:
            raise self._failure(plan, exc) from exc
        return self._rank0(plan, results)

    def _failure(self, plan: StepPlan, exc: BaseException) -> WorkerFailure:
        """A step's timeout or a worker's death, as the one error the engine loop handles."""
        if isinstance(exc, TimeoutError | GetTimeoutError):
            return WorkerFailure(f"step {plan.step_id}: no answer from the TP workers within "
                                 f"{self.step_timeout_s:.0f} s")
        return WorkerFailure(f"step {plan.step_id}: a TP worker failed: {exc}")

    @staticmethod
    def _rank0(plan: StepPlan, results: list[Any]) -> StepResult:
        result = results[0]
        if not isinstance(result, StepResult):
            raise WorkerFailure(f"step {plan.step_id}: rank 0 returned {type(result).__name__}, not a StepResult")
        return result

    def blocking(self) -> BlockingReplica:
        return BlockingReplica(self)

    # ---- health and teardown ---------------------------------------------------------------
    def check_health(self, timeout_s: float = 10.0) -> None:
        try:
            ray.get([w.check_health.remote() for w in self.workers], timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayError) as exc:
            raise WorkerFailure(f"replica unhealthy: {exc}") from exc

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._dag is not None:
            with contextlib.suppress(Exception):
                self._dag.teardown()
            self._dag = None
        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(w)
        self.workers = []
        if self.pg is not None:
            if self._own_pg:  # a Serve-reserved group belongs to the replica, not to us
                with contextlib.suppress(Exception):
                    remove_placement_group(self.pg)
            self.pg = None


class BlockingReplica:
    """`Executor` adapter (execute(plan) -> StepResult) for the offline engine."""

    def __init__(self, group: ReplicaGroup) -> None:
        self.group = group

    def execute(self, plan: StepPlan) -> StepResult:
        return self.group.execute_blocking(plan)
