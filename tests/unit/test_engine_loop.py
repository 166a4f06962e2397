"""The async engine loop with a fake executor: streaming, abort on cancel, rejection, failure."""

from __future__ import annotations

import asyncio

from serve_app.core import AdmissionConfig, SamplingParams, Scheduler, SchedulerConfig, StepPlan, StepResult, preset
from serve_app.engine_api import GenerateChunk, GenerateRequest
from serve_app.engine_loop import EngineLoop
from tests.helpers import FakeExecutor

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
    return GenerateRequest(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


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
