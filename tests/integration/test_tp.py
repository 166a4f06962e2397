"""Tensor parallelism through real Ray: TP=2 replica groups on this 2-CPU box.

TP=2 gives the same greedy tokens as TP=1 (tiny GQA model: even head split; SmolLM2: 3 KV
heads split 2+1), the asyncio and compiled-graph transports agree, and a dead worker surfaces
as WorkerFailure from `execute` instead of a hang.
"""

from __future__ import annotations

import asyncio
import os
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


def test_tp2_equals_tp1_tiny_and_dead_worker_fails_fast(ray_cluster: None, tiny_path: Path) -> None:
    import ray

    expected = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)
    group = _group(tiny_path, name_prefix="tidal-tp-test")
    try:
        assert _engine_tokens(group, PROMPTS) == expected
        group.check_health()
        assert group.worker_names == ("tidal-tp-test-r0", "tidal-tp-test-r1")
        assert ray.get_actor("tidal-tp-test-r1") == group.workers[1]  # the names operators kill by
        ray.kill(group.workers[1])
        new = NewRequestData("x", PROMPTS[0], 5, GREEDY, [0])
        plan = StepPlan(1, {"x": 5}, {"x": 0}, [new], {}, [], 0, 5, 0, None)
        with pytest.raises(WorkerFailure):
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


def test_compiled_graph_transport_matches(ray_cluster: None, tiny_path: Path) -> None:
    expected = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)

    async def run() -> list[list[int]]:
        group = _group(tiny_path, compiled_graph=True)  # compile inside the loop it binds to
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

