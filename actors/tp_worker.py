"""One tensor-parallel rank of a replica group, as a Ray actor.

Owns: `TPWorker` (plain class; `actors/replica.py` wraps it with `ray.remote` and its
placement). Start-up is staged so the replica can coordinate the ranks: rendezvous address
-> `init_distributed` (gloo on CPU, NCCL on GPU, all ranks at once) -> `load` (weights and how
many KV blocks this rank could hold) -> `finish(n)` (the agreed minimum on every rank).
Every rank executes every plan (lock step); only rank 0 returns its StepResult.

torch and the model code are imported in the worker's own methods, not by this module: the
serving unit's process imports this class to start its workers and never needs torch itself.

Must not import: serve_app except the plan dataclasses; torch at module level.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

from actors.engine_spec import EngineInfo, EngineSpec
from tidal_core.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from actors.model_runner import ModelRunner
    from actors.step_socket import StepServer
    from actors.worker_setup import WorkerBuilder


class TPWorker:
    def __init__(self, spec: EngineSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.builder: WorkerBuilder | None = None
        self.runner: ModelRunner | None = None
        self.step_server: StepServer | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port for torch.distributed's TCP store."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, address: str, port: int, timeout_s: float) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        backend = "nccl" if self.spec.resolved_device() == "cuda" else "gloo"
        # The timeout bounds a collective whose peer died: the replica surfaces the error first.
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))

    def load(self) -> tuple[int, EngineInfo]:
        import torch.distributed as dist

        from actors.models import TPContext
        from actors.worker_setup import WorkerBuilder

        group = dist.group.WORLD if self.world_size > 1 else None
        self.builder = WorkerBuilder(self.spec, TPContext(self.rank, self.world_size, group))
        return self.builder.load()

    def finish(self, num_blocks: int) -> tuple[int, ...]:
        """Allocate KV (and capture CUDA graphs); returns the captured decode sizes."""
        assert self.builder is not None, "load() first"
        self.runner = self.builder.finish(num_blocks)
        self.builder = None
        return self.runner.graphs.captured_batches if self.runner.graphs is not None else ()

    def execute(self, plan: StepPlan) -> StepResult | None:
        assert self.runner is not None, "finish() first"
        result = self.runner.execute(plan)
        return result if self.rank == 0 else None

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def open_step_socket(self) -> str:
        """Take steps through a Unix socket as well (actors/step_socket.py); returns its address."""
        from actors.step_socket import StepServer

        if self.step_server is None:
            self.step_server = StepServer(self.execute)
        return self.step_server.address

    def check_health(self) -> int:
        return self.rank

    def num_requests(self) -> int:
        return self.runner.num_requests if self.runner is not None else 0

    def shutdown(self) -> None:
        if self.step_server is not None:
            self.step_server.close()
        self.runner = None
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
