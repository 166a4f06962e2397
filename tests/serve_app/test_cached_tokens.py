"""`usage.prompt_tokens_details.cached_tokens`: the prefix-cache hit the unit reports on its chunks,
in chat and completion responses, the final stream chunk (`stream_options.include_usage`) and the
merged usage of `n` > 1, read back through the official `openai` client (in-process ASGI app,
scripted engine; the unit's side is tests/serve_app/test_engine_loop.py's)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.serve_app.openai_fakes import MODEL, make_app

pytestmark = pytest.mark.anyio
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 8}
MESSAGES = [SYSTEM, {"role": "user", "content": "Hi"}]


def _client(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))


def _cached(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens)


async def test_chat_and_completion_report_the_cached_prompt_tokens(tok: Any) -> None:
    app, engine = make_app(tok, reply="Sure.", cached_tokens=32)
    oai = _client(app)
    chat = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(engine.requests[0].prompt_token_ids) > 32
    assert _cached(chat.usage) == 32
    comp = await oai.completions.create(model=MODEL, prompt="word " * 50, max_tokens=3)
    assert _cached(comp.usage) == 32


async def test_final_stream_chunk_reports_them(tok: Any) -> None:
    app, _ = make_app(tok, reply="Streaming works", cached_tokens=48)
    oai = _client(app)
    stream = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                               stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and _cached(chunks[-1].usage) == 48
    comp = await oai.completions.create(model=MODEL, prompt="word " * 60, max_tokens=4, stream=True,
                                        stream_options={"include_usage": True})
    last = [c async for c in comp][-1]
    assert _cached(last.usage) == 48


async def test_no_hit_is_zero_and_n_choices_count_the_prompt_once(tok: Any) -> None:
    app, _ = make_app(tok, reply="Hello")
    oai = _client(app)
    chat = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3)  # type: ignore[arg-type]
    assert _cached(chat.usage) == 0
    app, engine = make_app(tok, reply="Hello", cached_tokens=16)
    many = await _client(app).chat.completions.create(model=MODEL, messages=MESSAGES, n=3,  # type: ignore[arg-type]
                                                      max_completion_tokens=3)
    assert len(engine.requests) == 3 and len(many.choices) == 3
    assert _cached(many.usage) == 16


async def test_a_stop_string_ending_the_stream_early_keeps_the_report(tok: Any) -> None:
    app, engine = make_app(tok, reply="one two three four", cached_tokens=24)
    oai = _client(app)
    comp = await oai.completions.create(model=MODEL, prompt="word " * 40, max_tokens=10, stop=[" three"])
    assert comp.choices[0].text == "one two" and engine.closed_early
    assert _cached(comp.usage) == 24
