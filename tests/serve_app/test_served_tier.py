"""A response's `service_tier` names the tier that *served* it, as the unit reports it: the engine
loop puts the scheduler's verdict (batch, or interactive when `batch.enabled=false`) on its first
chunk, and the OpenAI server renders that, not the tier the request asked for. Through the real
engine loop and scheduler, and through the FastAPI app with the official `openai` client."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import openai
import pytest

from serve_app.engine_loop import EngineLoop
from serve_app.ingress import build_app
from serve_app.openai.server import OpenAIServer
from serve_app.unit_api import GenerateChunk, GenerateRequest
from tests.helpers import FakeExecutor
from tests.serve_app.openai_fakes import MODEL, FakeEngine
from tidal_core import SamplingParams, Scheduler, SchedulerConfig, StepPlan, StepResult, preset
from tidal_core.batch_config import BatchClassConfig
from tidal_core.service_class import ServiceClass

MESSAGES = [{"role": "user", "content": "Hi"}]
CFG = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_kv_blocks=128)


class _AsyncFake:
    def __init__(self) -> None:
        self.inner = FakeExecutor(token_fn=lambda rid: 42)

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0.001)
        return self.inner.execute(plan)


def _chunks(batch_enabled: bool, cls: ServiceClass) -> list[GenerateChunk]:
    cfg = dataclasses.replace(preset("adaptive", CFG), batch=BatchClassConfig(enabled=batch_enabled))

    async def main() -> list[GenerateChunk]:
        loop = EngineLoop(Scheduler(cfg), _AsyncFake())
        gen = GenerateRequest("r", list(range(1, 9)), SamplingParams(max_tokens=6), time.time(), service_class=cls)
        try:
            return [c async for c in loop.generate(gen)]
        finally:
            await loop.stop()

    return asyncio.run(main())


@pytest.mark.parametrize(("enabled", "asked", "served"), [
    (True, ServiceClass.BATCH, ServiceClass.BATCH), (False, ServiceClass.BATCH, ServiceClass.INTERACTIVE),
    (True, ServiceClass.INTERACTIVE, ServiceClass.INTERACTIVE)])
def test_the_engine_loop_reports_the_class_that_serves(enabled: bool, asked: ServiceClass,
                                                       served: ServiceClass) -> None:
    chunks = _chunks(enabled, asked)
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 6
    assert chunks[0].service_class is served
    assert all(c.service_class is None for c in chunks[1:])  # said once


def _client(tok: Any, **engine_kw: Any) -> openai.AsyncOpenAI:
    app = build_app(OpenAIServer(FakeEngine(tok, **engine_kw), tok))
    return openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))


@pytest.mark.anyio
@pytest.mark.parametrize(("batch_class", "flex_tier"), [(True, "flex"), (False, "default")])
async def test_flex_reports_the_tier_the_unit_served(tok: Any, batch_class: bool, flex_tier: str) -> None:
    client = _client(tok, batch_class=batch_class, tokens_per_chunk=2)
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                                service_tier="flex")
    assert chat.service_tier == flex_tier
    two = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,  # type: ignore[arg-type]
                                               service_tier="flex")
    assert two.service_tier == flex_tier and len(two.choices) == 2
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,  # type: ignore[arg-type]
                                                  service_tier="flex", stream=True)
    assert {chunk.service_tier async for chunk in stream} == {flex_tier}  # the role chunk too
    legacy = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True,
                                             extra_body={"service_tier": "flex"})
    assert legacy.service_tier == flex_tier
    plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert plain.service_tier == "default"
