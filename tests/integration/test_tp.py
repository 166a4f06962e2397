"""Tensor parallelism through real Ray: TP=2 replica groups on this 2-CPU box.

TP=2 gives the same greedy tokens as TP=1 (tiny GQA model: even head split; SmolLM2: 3 KV
heads split 2+1), the step-socket, actor-call and compiled-graph transports agree, and a dead
worker, or a step that raises, surfaces as WorkerFailure from `execute` instead of a hang.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.replica import ReplicaGroup, WorkerFailure
from tests.model_helpers import (
    GREEDY,
    generate_ids,
    local_executor,
    local_spec,
    make_engine,
    save_tiny_checkpoint,
    smollm2_path,
)
from tidal_core.plan import NewRequestData, Run, StepPlan

pytestmark = pytest.mark.ray
PROMPTS = [[1, 17, 33, 5, 9], list(range(3, 45)), [1, 200, 7]]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    if ray.is_initialized():
        # The session's Serve cluster (tests/integration/conftest.py) is up: one Ray start-up
        # is enough, and these groups are placed beside its units.
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), seed=2)


def _group(model: Path, **kw: object) -> ReplicaGroup:
    spec = local_spec(model, tp=2)
    return ReplicaGroup(spec, step_timeout_s=30.0, init_timeout_s=120.0, **kw)  # type: ignore[arg-type]


def _engine_tokens(group: ReplicaGroup, prompts: list[list[int]]) -> list[list[int]]:
    engine = make_engine(group.blocking(), group.info)
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


def _async_tokens(group: ReplicaGroup, prompts: list[list[int]]) -> list[list[int]]:
    """The router's loop: schedule, await the replica's `execute`, apply."""
    async def run() -> list[list[int]]:
        engine = make_engine(group.blocking(), group.info)
        rids = [engine.add_request(p, GREEDY) for p in prompts]
        sched, done = engine.scheduler, {}
        while sched.has_unfinished:
            decision = sched.schedule(0.0)
            assert isinstance(decision, Run)
            outputs = sched.on_step_done(decision.plan, await group.execute(decision.plan), 0.0)
            done.update({r.request_id: list(r.output_token_ids) for r in outputs.finished})
        return [done[r] for r in rids]

    return asyncio.run(run())


def _wait_dead(actor: object, pid: int) -> None:
    """`ray.kill` returns before the process is gone; a step sent before then may still be served.
    Ray calls the actor dead a moment before its process exits (and its step socket closes), so
    this waits for both: the actor's calls failing, then the process (`pid`, on this node) gone
    or a zombie."""
    import ray
    from ray.exceptions import RayActorError

    for _ in range(300):
        try:
            ray.get(actor.check_health.remote(), timeout=5)  # type: ignore[attr-defined]
        except RayActorError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed worker still answers")
    for _ in range(300):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):  # exited, not yet reaped: its sockets are closed
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed worker's process {pid} is still running")


def test_tp2_equals_tp1_tiny_and_dead_worker_fails_fast(ray_cluster: None, tiny_path: Path) -> None:
    import ray

    expected = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)
    group = _group(tiny_path, name_prefix="tidal-tp-test")
    try:
        assert group.transport == "socket"  # every rank on this node: steps through Unix sockets
        assert _engine_tokens(group, PROMPTS) == expected  # the offline engine's actor calls
        assert _async_tokens(group, PROMPTS) == expected  # the sockets
        group.check_health()
        assert group.worker_names == ("tidal-tp-test-r0", "tidal-tp-test-r1")
        assert ray.get_actor("tidal-tp-test-r1") == group.workers[1]  # the names operators kill by
        pid = ray.get(group.workers[1].__ray_call__.remote(lambda _: os.getpid()))
        ray.kill(group.workers[1])
        _wait_dead(group.workers[1], pid)
        new = NewRequestData("x", PROMPTS[0], 5, GREEDY, [0])
        plan = StepPlan(1, {"x": 5}, {"x": 0}, [new], {}, [], 0, 5, 0, None)
        with pytest.raises(WorkerFailure, match="socket closed"):  # the closed socket, not the step timeout
            asyncio.run(group.execute(plan))
        with pytest.raises(WorkerFailure):
            group.check_health(timeout_s=5.0)
    finally:
        group.shutdown()


def test_tp2_equals_tp1_smollm2_uneven_heads(ray_cluster: None) -> None:
    path = smollm2_path()
    prompts = [[1, 504, 3458, 282, 4649], list(range(1000, 1030))]
    expected = generate_ids(local_executor(path), prompts, GREEDY)
    group = _group(path)
    try:
        assert _engine_tokens(group, prompts) == expected
    finally:
        group.shutdown()


def test_actor_calls_match_and_a_failed_step_fails_the_group(ray_cluster: None, tiny_path: Path) -> None:
    """`step_socket=False` (actor calls) gives the same tokens; a step a worker raises on (blocks for
    a request it never saw) comes back as WorkerFailure naming the error, through either transport."""
    expected = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)
    bad = StepPlan(1, {}, {}, [], {"nobody": [3]}, [], 0, 0, 0, None)
    for socket in (False, True):
        group = _group(tiny_path, step_socket=socket)
        try:
            assert group.transport == ("socket" if socket else "actor_calls")
            assert _async_tokens(group, PROMPTS) == expected
            with pytest.raises(WorkerFailure, match="blocks for unknown request nobody"):
                asyncio.run(group.execute(bad))
        finally:
            group.shutdown()


def test_compiled_graph_transport_matches(ray_cluster: None, tiny_path: Path) -> None:
    expected = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)

    async def run() -> list[list[int]]:
        group = _group(tiny_path, compiled_graph=True)  # compile inside the loop it binds to
        assert group.transport == "compiled_graph"
        try:
            engine = make_engine(group.blocking(), group.info)
            rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
            sched, done = engine.scheduler, {}
            while sched.has_unfinished:  # the router's loop: schedule, await the replica, apply
                decision = sched.schedule(0.0)
                assert isinstance(decision, Run)
                outputs = sched.on_step_done(decision.plan, await group.execute(decision.plan), 0.0)
                done.update({r.request_id: list(r.output_token_ids) for r in outputs.finished})
            return [done[r] for r in rids]
        finally:
            group.shutdown()

    assert asyncio.run(run()) == expected

