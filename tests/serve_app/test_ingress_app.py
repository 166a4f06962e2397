"""The FastAPI app in-process (httpx ASGITransport, no Ray), when things go right: models, health
and the OpenAPI schema, SSE framing byte for byte, the official `openai` client against our
responses, and client disconnects cancelling the engine request. The error answers are in
test_ingress_errors.py. (Fixtures `tok` and `anyio_backend`: tests/conftest.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from serve_app.unit_api import EngineError
from tests.serve_app.openai_fakes import CHAT, MODEL, client, make_app

pytestmark = pytest.mark.anyio


# ---- models, health, schema -----------------------------------------------------------------


async def test_models_and_health(tok: Any) -> None:
    app, engine = make_app(tok)
    async with client(app) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL, "smol"]
        assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 2048
        ok = await c.get("/health")
        assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
        engine.healthy = False
        down = await c.get("/health")
        assert (down.status_code, down.json()) == (503, {"status": "unavailable"})


async def test_openapi_declares_the_request_models(tok: Any) -> None:
    app, _ = make_app(tok)
    async with client(app) as c:
        schema = (await c.get("/openapi.json")).json()
    post = schema["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert {"400", "429", "503"} <= set(post["responses"]) and "422" not in post["responses"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "stop", "stream", "logprobs"} <= set(props)


# ---- SSE framing -------------------------------------------------------------------------------


def expected_chat_events(tok: Any, rid: str, created: int, reply: str, usage: tuple[int, int] | None) -> str:
    def event(choices: list[Any], usage_value: Any = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage_value
        body["system_fingerprint"] = None
        body["service_tier"] = "default"  # the tier that served it (an interactive request here)
        return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    out = [event([choice({"role": "assistant", "content": ""})])]
    out += [event([choice({"content": tok.decode([t])})]) for t in tok.encode(reply, add_special_tokens=False)]
    out.append(event([choice({}, "stop")]))  # the EOS token: no text, only the finish reason
    if usage is not None:
        out.append(event([], {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                              "total_tokens": usage[0] + usage[1], "prompt_tokens_details": {"cached_tokens": 0}}))
    return "".join(out) + "data: [DONE]\n\n"


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_sse_framing_is_byte_exact(tok: Any, include_usage: bool) -> None:
    reply = "Hi there, friend"
    app, engine = make_app(tok, reply=reply)
    body: dict[str, Any] = {**CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with client(app) as c:
        resp = await c.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    first = json.loads(resp.text.split("\n\n")[0][6:])
    assert resp.headers["x-request-id"] == first["id"] == engine.requests[0].request_id
    n_prompt = len(engine.requests[0].prompt_token_ids)
    n_out = len(tok.encode(reply, add_special_tokens=False)) + 1
    usage = (n_prompt, n_out) if include_usage else None
    assert resp.content == expected_chat_events(tok, first["id"], first["created"], reply, usage).encode()


async def test_completion_stream_ends_with_finish_and_done(tok: Any) -> None:
    app, _ = make_app(tok, reply="one two", tokens_per_chunk=2)
    async with client(app) as c:
        resp = await c.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 2})
    events = resp.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    last = json.loads(events[-3][6:])
    assert last["choices"] == [{"index": 0, "text": "one two", "logprobs": None, "finish_reason": "length"}]
    assert "usage" not in last and last["object"] == "text_completion"


async def test_completion_stream_echo_comes_first(tok: Any) -> None:
    app, _ = make_app(tok, reply="two")
    async with client(app) as c:
        resp = await c.post("/v1/completions", json={"prompt": "one", "echo": True, "stream": True})
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in resp.text.split("\n\n")[:-2]]
    assert texts[0] == "one" and "".join(texts) == "onetwo"


# ---- the official client -----------------------------------------------------------------------


def openai_client(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))


async def test_openai_client_non_stream(tok: Any) -> None:
    app, _ = make_app(tok, reply="Sure thing.")
    oai = openai_client(app)
    chat = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_completion_tokens=20, temperature=0)
    assert chat.choices[0].message.content == "Sure thing." and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens == len(tok.encode("Sure thing.")) + 1
    comp = await oai.completions.create(model="smol", prompt="Say", max_tokens=2, logprobs=1)
    assert comp.choices[0].text == "Sure thing" and comp.choices[0].finish_reason == "length"
    assert comp.choices[0].logprobs is not None and comp.choices[0].logprobs.tokens == ["Sure", " thing"]
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL, "smol"]


async def test_openai_client_stream(tok: Any) -> None:
    app, _ = make_app(tok, reply="Streaming 世界 works 😀")
    oai = openai_client(app)
    stream = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streaming 世界 works 😀"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    comp = await oai.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=3)
    texts = [c.choices[0].text async for c in comp]
    assert "".join(texts) == tok.decode(tok.encode("Streaming 世界 works 😀", add_special_tokens=False)[:3])


async def test_openai_client_sees_typed_errors(tok: Any) -> None:
    app, _ = make_app(tok)
    oai = openai_client(app)
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.completions.create(model=MODEL, prompt="x", temperature=5)
    assert bad.value.param == "temperature" and bad.value.code == "less_than_equal"
    busy, _ = make_app(tok, first_error=EngineError(429, "rate_limit_error", "queue_full", "busy", 4.0))
    with pytest.raises(openai.RateLimitError) as limited:
        await openai_client(busy).chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True)
    assert limited.value.response.headers["retry-after"] == "4"


# ---- client disconnects ------------------------------------------------------------------------


def stream_scope(spec_version: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "server": ("ingress", 80), "client": ("c", 1)}


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_disconnect_mid_stream_closes_the_engine_generator(tok: Any, spec_version: str) -> None:
    """2.3: Starlette notices the disconnect on `receive`; 2.4: the next `send` raises OSError."""
    app, engine = make_app(tok, forever=True, delay_s=0.001)
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 1000}).encode()
    got_tokens = asyncio.Event()
    events: list[bytes] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await got_tokens.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if got_tokens.is_set() and spec_version == "2.4":
                raise OSError("connection reset by peer")
            events.append(message["body"])
            if len(events) >= 3:
                got_tokens.set()

    await asyncio.wait_for(app(stream_scope(spec_version), receive, send), 10)
    # Closed by the time the response returns: not left to the garbage collector's finalizer.
    assert len(engine.requests) == 1 and engine.closed_early == [engine.requests[0].request_id]
    assert engine.completed == []


async def test_cancelled_request_closes_the_engine_generator(tok: Any) -> None:
    """Serve cancels the replica's handler task when the HTTP client goes away."""
    app, engine = make_app(tok, forever=True, delay_s=0.001)
    body = json.dumps({**CHAT, "stream": True}).encode()
    streaming = asyncio.Event()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            streaming.set()

    scope = stream_scope("2.4")
    task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.wait_for(streaming.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.closed_early == [engine.requests[0].request_id]
