"""The engine loop carries each request's prefix-cache hit on its chunks (what the ingress puts in
`usage.prompt_tokens_details.cached_tokens`) and the unit's metrics count it: the real core
Scheduler with caching on, a fake executor."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from serve_app.engine_loop import EngineLoop
from serve_app.metrics import PREFIX_COUNTERS, UnitMetrics
from serve_app.unit_api import GenerateChunk, GenerateRequest
from tests.serve_app.test_engine_loop import CFG, AsyncFake
from tests.serve_app.test_prefix_metrics import Recorder
from tidal_core import SamplingParams, Scheduler, preset

SYSTEM = list(range(100, 141))  # 41 tokens: 10 full blocks of 4


def _gen(rid: str, tail: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, [*SYSTEM, *tail], SamplingParams(max_tokens=3), time.time())


async def _collect(loop: EngineLoop, req: GenerateRequest) -> list[GenerateChunk]:
    return [c async for c in loop.generate(req)]


def test_chunks_carry_the_cached_tokens_and_metrics_count_them() -> None:
    async def main(cache: bool) -> tuple[list[list[GenerateChunk]], dict[str, Recorder]]:
        metrics = UnitMetrics("u1")
        recorders = {defn.name: Recorder() for _, defn in PREFIX_COUNTERS}
        metrics._m.update(recorders)
        sched = Scheduler(preset("continuous", dataclasses.replace(CFG, enable_prefix_caching=cache)))
        loop = EngineLoop(sched, AsyncFake(), metrics)
        runs = [await _collect(loop, _gen(f"r{i}", [7, 8, 9 + i])) for i in range(3)]
        sched.check_integrity()
        await loop.stop()
        return runs, recorders

    runs, rec = asyncio.run(main(True))
    assert [{c.num_cached_tokens for c in chunks} for chunks in runs] == [{0}, {40}, {40}]
    assert all(c.num_prompt_tokens == 44 for chunks in runs for c in chunks)
    totals = {name: r.total for name, r in rec.items()}
    assert totals == {"tidal_prefix_cache_queried_tokens": 3 * 44, "tidal_prefix_cache_hit_tokens": 80,
                      "tidal_prefix_cache_queried_requests": 3, "tidal_prefix_cache_hit_requests": 2}
    runs, rec = asyncio.run(main(False))
    assert {c.num_cached_tokens for chunks in runs for c in chunks} == {0}
    assert all(r.total == 0 for r in rec.values())
