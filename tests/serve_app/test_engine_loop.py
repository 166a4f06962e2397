"""The async engine loop with a fake executor: streaming, abort on cancel, rejection, failure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time

import pytest

from serve_app.engine_loop import EngineLoop, StreamCoalescing
from serve_app.unit_api import GenerateChunk, GenerateRequest
from tests.helpers import FakeExecutor
from tidal_core import (
    AdmissionConfig,
    BatchingConfig,
    RegimeConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    preset,
)

CFG = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=128)


class AsyncFake:
    def __init__(self, step_s: float = 0.001, fail_at_step: int | None = None) -> None:
        self.inner = FakeExecutor(token_fn=lambda rid: 42)
        self.step_s = step_s
        self.fail_at_step = fail_at_step
        self.steps = 0

    async def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("worker died")
        await asyncio.sleep(self.step_s)
        return self.inner.execute(plan)


def gen(rid: str, prompt: int = 8, max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), time.time())


async def collect(loop: EngineLoop, req: GenerateRequest) -> list[GenerateChunk]:
    return [c async for c in loop.generate(req)]


def test_concurrent_streams_complete_with_all_tokens() -> None:
    async def main() -> None:
        loop = EngineLoop(Scheduler(preset("continuous", CFG)), AsyncFake())
        results = await asyncio.gather(*(collect(loop, gen(f"r{i}", 4 + i, 3 + i)) for i in range(6)))
        for i, chunks in enumerate(results):
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == [42] * (3 + i)
            assert chunks[-1].finish_reason == "length" and all(c.error is None for c in chunks)
        assert loop.sched.blocks.num_free_blocks == loop.sched.blocks.num_blocks
        loop.sched.check_integrity()
        await loop.stop()

    asyncio.run(main())


def test_closing_a_stream_aborts_and_frees_kv() -> None:
    async def main() -> None:
        loop = EngineLoop(Scheduler(preset("continuous", CFG)), AsyncFake(step_s=0.002))
        stream = loop.generate(gen("long", 20, 200))
        first = await stream.__anext__()
        assert first.token_ids
        await stream.aclose()  # the client went away
        await asyncio.sleep(0.02)
        assert not loop.sched.has_unfinished
        assert loop.sched.stats.finished["abort"] == 1
        assert loop.sched.blocks.num_free_blocks == loop.sched.blocks.num_blocks
        loop.sched.check_integrity()
        await loop.stop()

    asyncio.run(main())


def test_admission_rejection_is_a_429_chunk() -> None:
    async def main() -> None:
        cfg = preset("adaptive", CFG, admission=AdmissionConfig(max_queue_len=1))
        loop = EngineLoop(Scheduler(cfg), AsyncFake(step_s=0.01))
        results = await asyncio.gather(*(collect(loop, gen(r, 8, 3)) for r in "abc"))
        errors = [c.error for chunks in results for c in chunks if c.error]
        completed = [chunks for chunks in results if chunks[-1].finish_reason == "length"]
        assert errors and len(errors) + len(completed) == 3
        assert all(e.status == 429 and e.code == "queue_full" and e.retry_after_s >= 1.0 for e in errors)
        await loop.stop()

    asyncio.run(main())


def test_executor_failure_errors_every_stream_quickly_and_marks_unhealthy() -> None:
    async def main() -> None:
        loop = EngineLoop(Scheduler(preset("continuous", CFG)), AsyncFake(fail_at_step=3))
        results = await asyncio.wait_for(asyncio.gather(*(collect(loop, gen(f"r{i}", 8, 50)) for i in range(4))), 5)
        for chunks in results:
            assert chunks[-1].error is not None and chunks[-1].error.status == 503
            # The cause is for operators (log, unit_state), not for clients.
            assert "worker died" not in chunks[-1].error.message
        assert not loop.healthy
        assert loop.failure == "RuntimeError: worker died"
        late = await collect(loop, gen("late"))
        assert late[0].error is not None and late[0].error.code == "engine_failed"
        assert "worker died" not in late[0].error.message
        assert not loop.sched.has_unfinished
        await loop.stop()

    asyncio.run(main())


def _coalescing_loop(coalescing: StreamCoalescing, fail_at_step: int | None = None) -> EngineLoop:
    """A unit of 4 ms steps under the `continuous` preset, streaming by `coalescing`."""
    return EngineLoop(Scheduler(preset("continuous", CFG)), AsyncFake(step_s=0.004, fail_at_step=fail_at_step),
                      coalescing=coalescing)


async def _timed(loop: EngineLoop, req: GenerateRequest) -> list[tuple[float, GenerateChunk]]:
    return [(time.monotonic(), c) async for c in loop.generate(req)]


def test_coalescing_holds_tokens_between_chunks_but_never_the_first() -> None:
    interval = 0.03

    async def main() -> None:
        loop = _coalescing_loop(StreamCoalescing(interval, min_streams=2))
        a, b = await asyncio.gather(_timed(loop, gen("a", 8, 40)), _timed(loop, gen("b", 8, 40)))
        for timed in (a, b):
            chunks = [c for _, c in timed]
            assert [t for c in chunks for t in c.token_ids] == [42] * 40
            assert len(chunks[0].token_ids) == 1  # the first token is never held (TTFT)
            assert len(chunks) < 20 and max(len(c.token_ids) for c in chunks) > 1
            assert chunks[-1].finish_reason == "length"
            # Chunks before the last are spaced by about the interval at least (timers fire late,
            # never early; the slack covers this test's own clock reads being preempted). Unheld,
            # they would come one 4 ms step apart.
            sent = [t for t, _ in timed[:-1]]
            assert all(later - earlier >= interval - 0.01 for earlier, later in itertools.pairwise(sent))
        await loop.stop()

    asyncio.run(main())


def test_a_quiet_unit_sends_every_token_as_it_is_made() -> None:
    async def main() -> None:
        loop = _coalescing_loop(StreamCoalescing(1.0, min_streams=2))
        chunks = await asyncio.wait_for(collect(loop, gen("alone", 8, 12)), 10)
        assert [len(c.token_ids) for c in chunks] == [1] * 12  # one open stream < min_streams
        await loop.stop()

    asyncio.run(main())


def test_the_end_and_an_error_are_never_held() -> None:
    async def main() -> None:
        # With a 30 s interval, a held chunk would only go out after 30 s: the end must wake it.
        slow = StreamCoalescing(30.0, min_streams=1)
        loop = _coalescing_loop(slow)
        chunks = await asyncio.wait_for(collect(loop, gen("short", 8, 6)), 10)
        assert [len(c.token_ids) for c in chunks] == [1, 5] and chunks[-1].finish_reason == "length"
        await loop.stop()

        failing = _coalescing_loop(slow, fail_at_step=5)
        chunks = await asyncio.wait_for(collect(failing, gen("doomed", 8, 50)), 10)
        assert chunks[0].token_ids == [42] and chunks[-1].error is not None and chunks[-1].error.status == 503
        assert not failing.sched.has_unfinished
        await failing.stop()

    asyncio.run(main())


def test_a_client_leaving_during_a_hold_aborts_its_request() -> None:
    async def main() -> None:
        loop = _coalescing_loop(StreamCoalescing(30.0, min_streams=1))
        stream = loop.generate(gen("leaver", 8, 200))
        assert (await stream.__anext__()).token_ids == [42]
        pending = asyncio.ensure_future(stream.__anext__())  # held: the interval is 30 s
        await asyncio.sleep(0.05)
        assert not pending.done()
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await stream.aclose()
        await asyncio.sleep(0.02)
        assert not loop.sched.has_unfinished and loop.sched.stats.finished["abort"] == 1
        assert loop.sched.blocks.num_free_blocks == loop.sched.blocks.num_blocks
        await loop.stop()

    asyncio.run(main())


def test_coalescing_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="interval_s >= 0"):
        StreamCoalescing(-0.1)
    with pytest.raises(ValueError, match="min_streams >= 1"):
        StreamCoalescing(0.05, min_streams=0)


class _TtftProbe:
    """An observer that keeps each first token's TTFT as the unit measures it."""

    def __init__(self) -> None:
        self.ttft: dict[str, float] = {}

    def on_arrival(self) -> None: ...
    def on_rejection(self, reason: str) -> None: ...
    def on_step(self, *args: object) -> None: ...
    def on_finish(self, *args: object) -> None: ...
    def on_engine_error(self, kind: str) -> None: ...

    def on_first_token(self, req: Request, now: float) -> None:
        self.ttft[req.request_id] = now - req.arrival_s


def test_time_spent_in_the_front_end_counts_and_an_implausible_one_is_ignored() -> None:
    async def main() -> None:
        probe = _TtftProbe()
        loop = EngineLoop(Scheduler(preset("continuous", CFG)), AsyncFake(), probe)
        sampling = SamplingParams(max_tokens=2)
        await collect(loop, GenerateRequest("front", [1, 2, 3], sampling, time.time() - 2.0))  # 2 s in the ingress
        await collect(loop, GenerateRequest("epoch", [1, 2, 3], sampling, 0.0))  # a clock that is off
        assert 2.0 <= probe.ttft["front"] < 30.0
        assert probe.ttft["epoch"] < 2.0
        await loop.stop()

    asyncio.run(main())


def test_the_microwait_runs_from_the_units_arrival_not_the_front_ends() -> None:
    # STEADY from the start (regimes off) and a micro-wait at any load, so the first request waits.
    cfg = preset("adaptive", dataclasses.replace(
        CFG, regime=RegimeConfig(enabled=False), batching=BatchingConfig(light_load=0.0, t_min_s=0.002,
                                                                         t_max_s=0.003)))

    async def main() -> None:
        probe = _TtftProbe()
        loop = EngineLoop(Scheduler(cfg), AsyncFake(), probe)
        sampling = SamplingParams(max_tokens=2)
        # 0.5 s in the front end: a deadline counted from there would long have expired.
        await collect(loop, GenerateRequest("front", [1, 2, 3], sampling, time.time() - 0.5))
        stats = loop.sched.stats
        assert stats.waits["microwait"] == 1 and stats.dispatch["microwait_expired"] == 1
        assert probe.ttft["front"] >= 0.5  # admission and TTFT still count from the front end
        await loop.stop()

    asyncio.run(main())


def test_the_next_step_is_dispatched_before_the_last_steps_tokens_go_out() -> None:
    # The workers should not sit idle while tokens are streamed: at each execute() after the first
    # two, the client has the tokens of all steps but the one that just ended (not yet fanned out).
    received: list[int] = []
    seen_at_dispatch: list[int] = []

    class Recording(AsyncFake):
        async def execute(self, plan: StepPlan) -> StepResult:
            seen_at_dispatch.append(len(received))
            return await super().execute(plan)

    async def main() -> None:
        loop = EngineLoop(Scheduler(preset("continuous", CFG)), Recording(step_s=0.002))
        async for chunk in loop.generate(gen("one", 8, 6)):
            received.extend(chunk.token_ids)
        assert received == [42] * 6
        # step 1 is the prefill (its token is the first); step k+1 starts before step k's token is out
        assert seen_at_dispatch == [0, 0, 1, 2, 3, 4]
        await loop.stop()

    asyncio.run(main())
