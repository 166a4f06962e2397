"""Control-plane overhead of one engine step: router -> TP workers -> router, no model.

Measures p50/p99 microseconds per step for N no-op workers (TP=2 and an 8-way fan-out) with
(a) plain Ray actor calls (`ray.get` of N `.remote()` refs, and the asyncio form the router
uses), (b) a Ray Compiled Graph (`InputNode` -> N `execute` -> `MultiOutputNode`,
`experimental_compile`, sync and asyncio) and (c) driver broadcast: one Ray call to rank 0,
which broadcasts the plan to the other ranks over gloo (`broadcast_object_list`) while they
wait in a blocking loop. The payload is a realistic StepPlan (64 running
decodes). Workers are `num_cpus=0` actors so 8 fit on a 2-CPU box; compiled-graph workers
spin a core while the graph exists, so each graph is torn down before the next case.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/control_plane.py [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray

from tidal_core.plan import StepPlan, StepResult


class NoopWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute(self, plan: StepPlan) -> StepResult | None:
        if self.rank:
            return None
        return StepResult(plan.step_id, dict.fromkeys(plan.num_scheduled_tokens, 7), 0.0)


class BroadcastWorker:
    """Rank 0 takes the plan from the router and broadcasts it over gloo; the others wait in a
    blocking loop (no spinning) and do nothing with it. One Ray call per step, whatever the TP."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def address(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def init(self, host: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world)

    def execute(self, plan: StepPlan) -> StepResult:
        import torch.distributed as dist

        dist.broadcast_object_list([plan], src=0)
        if plan is None:
            return StepResult(-1, {}, 0.0)
        return StepResult(plan.step_id, dict.fromkeys(plan.num_scheduled_tokens, 7), 0.0)

    def follow(self) -> int:
        import torch.distributed as dist

        steps = 0
        while True:
            box: list[StepPlan | None] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return steps
            steps += 1


def bench_broadcast(n: int, steps: int, warmup: int) -> dict[str, float]:
    actor = ray.remote(BroadcastWorker).options(num_cpus=0, max_concurrency=2)
    workers = [actor.remote(r, n) for r in range(n)]
    host, port = ray.get(workers[0].address.remote())
    ray.get([w.init.remote(host, port) for w in workers])
    loops = [w.follow.remote() for w in workers[1:]]
    try:
        return _time_sync(lambda p: ray.get(workers[0].execute.remote(p)), steps, warmup)
    finally:
        ray.get(workers[0].execute.remote(None))  # type: ignore[arg-type]  # None ends the follower loops
        ray.get(loops)
        for w in workers:
            ray.kill(w)


def make_plan(step: int, batch: int = 64) -> StepPlan:
    sched = {f"req-{i}": 1 for i in range(batch)}
    return StepPlan(step, sched, {}, [], {}, [], batch, 0, batch * 600, 64)


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {"p50_us": round(statistics.median(us), 1), "p99_us": round(us[int(0.99 * (len(us) - 1))], 1)}


def _time_sync(call: Callable[[StepPlan], Any], steps: int, warmup: int) -> dict[str, float]:
    samples = []
    for i in range(warmup + steps):
        plan = make_plan(i)
        t0 = time.perf_counter()
        call(plan)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return _percentiles(samples)


def _time_async(call: Callable[[StepPlan], Any], steps: int, warmup: int) -> dict[str, float]:
    async def run() -> list[float]:
        samples = []
        for i in range(warmup + steps):
            plan = make_plan(i)
            t0 = time.perf_counter()
            await call(plan)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return samples

    return _percentiles(asyncio.run(run()))


def bench_plain(n: int, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    workers = [ray.remote(NoopWorker).options(num_cpus=0).remote(r) for r in range(n)]
    ray.get([w.execute.remote(make_plan(0)) for w in workers])

    async def call_async(plan: StepPlan) -> Any:
        return await asyncio.gather(*[w.execute.remote(plan) for w in workers])

    out = {"plain_sync": _time_sync(lambda p: ray.get([w.execute.remote(p) for w in workers]), steps, warmup),
           "plain_async": _time_async(call_async, steps, warmup)}
    for w in workers:
        ray.kill(w)
    return out


def _compiled_dag(workers: list[Any], use_asyncio: bool) -> Any:
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        dag = MultiOutputNode([w.execute.bind(inp) for w in workers])
    return dag.experimental_compile(enable_asyncio=use_asyncio)


def bench_compiled(n: int, steps: int, warmup: int, use_asyncio: bool) -> dict[str, float]:
    workers = [ray.remote(NoopWorker).options(num_cpus=0).remote(r) for r in range(n)]
    try:
        if not use_asyncio:
            compiled = _compiled_dag(workers, False)
            try:
                return _time_sync(lambda p: ray.get(compiled.execute(p)), steps, warmup)
            finally:
                compiled.teardown()

        async def run() -> list[float]:
            # An asyncio compiled graph binds to the running loop: compile, step and tear down in it.
            compiled = _compiled_dag(workers, True)
            try:
                samples = []
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    await asyncio.gather(*await compiled.execute_async(make_plan(i)))
                    if i >= warmup:
                        samples.append(time.perf_counter() - t0)
                return samples
            finally:
                compiled.teardown()

        return _percentiles(asyncio.run(run()))
    finally:
        for w in workers:
            ray.kill(w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--fanout", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {}
    try:
        for n in args.fanout:
            row = bench_plain(n, args.steps, args.warmup)
            row["broadcast_sync"] = bench_broadcast(n, args.steps, args.warmup)
            for key, use_asyncio in (("compiled_sync", False), ("compiled_async", True)):
                try:
                    row[key] = bench_compiled(n, args.steps, args.warmup, use_asyncio)
                except Exception as exc:  # e.g. spinning graph workers starving a small box
                    row[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            results[f"{n}-way"] = row
            print(f"{n}-way: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        ray.shutdown()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
