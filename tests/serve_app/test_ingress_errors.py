"""The FastAPI app in-process (httpx ASGITransport, no Ray), when things go wrong: HTTP errors in
OpenAI's shape (400, 413, 415, 404/405, 429/503 with Retry-After, 500 for a server bug), and the
Serve handle adapter turning Serve's failures into engine errors (503 until a probe says healthy).
The success paths are in test_ingress_app.py. (Fixtures `tok` and `anyio_backend`: tests/conftest.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app.handle_client import HandleEngineClient
from serve_app.ingress import build_app
from serve_app.openai.server import OpenAIServer
from serve_app.unit_api import EngineError, GenerateChunk, GenerateRequest, ModelInfo
from tests.serve_app.openai_fakes import CHAT, MODEL, FakeEngine, assert_openai_error, client, make_app, raw_post
from tidal_core.request import SamplingParams

pytestmark = pytest.mark.anyio
INFO = ModelInfo(MODEL, 2048, (2,), "hf")


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
async def test_bad_parameters_are_400_naming_the_parameter(tok: Any, path: str, body: dict[str, Any],
                                                           param: str) -> None:
    app, engine = make_app(tok)
    async with client(app) as c:
        err = assert_openai_error(await c.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error" and param.split("[")[0] in err["message"]
    assert engine.requests == []


async def test_context_error_says_both_numbers(tok: Any) -> None:
    app, _ = make_app(tok, max_model_len=64)
    async with client(app) as c:
        err = assert_openai_error(await c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 62}),
                                  400, "max_tokens")
    assert "64 tokens" in err["message"] and "65 tokens" in err["message"] and err["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", None), (b"", None), (b"[1, 2]", None), (b'{"prompt": "x",}', None), (b"\xff\xfe", None),
    (b'{"prompt": "\\ud800"}', "prompt"),  # valid JSON, not text: the tokenizer would raise
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),  # Python's json accepts NaN; we do not
])
async def test_malformed_bodies_are_400(tok: Any, raw: bytes, param: str | None) -> None:
    app, _ = make_app(tok)
    async with client(app) as c:
        resp = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, param)
    assert err["type"] == "invalid_request_error" and err["message"]


async def test_body_without_content_type_is_read_as_json(tok: Any) -> None:
    app, _ = make_app(tok)
    async with client(app) as c:
        resp = await c.post("/v1/completions", content=json.dumps({"prompt": "x"}).encode())
    assert resp.status_code == 200 and resp.json()["object"] == "text_completion"


async def test_non_json_content_type_is_415(tok: Any) -> None:
    app, engine = make_app(tok)
    async with client(app) as c:
        resp = await c.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": "text/plain"})
    assert assert_openai_error(resp, 415)["code"] == "unsupported_media_type" and engine.requests == []


async def test_oversized_body_is_413_by_content_length_without_reading_it(tok: Any) -> None:
    app, _ = make_app(tok, max_body_bytes=2048)
    sent, reads = await raw_post(app, "/v1/completions", b"x" * 4096, 4096)
    assert sent[0]["status"] == 413 and reads == 0
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


async def test_oversized_chunked_body_is_413(tok: Any) -> None:
    app, engine = make_app(tok, max_body_bytes=2048)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100
        yield b'"}'

    async with client(app) as c:
        resp = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    assert assert_openai_error(resp, 413)["code"] == "request_too_large" and engine.requests == []


async def test_unknown_route_404_and_wrong_method_405(tok: Any) -> None:
    app, _ = make_app(tok)
    async with client(app) as c:
        assert assert_openai_error(await c.post("/v1/embeddings", json={}), 404)["code"] == "unknown_url"
        resp = await c.get("/v1/chat/completions")
        assert assert_openai_error(resp, 405)["code"] == "method_not_allowed" and resp.headers["allow"] == "POST"


@pytest.mark.parametrize(("status", "retry_after_s", "header", "kind"), [
    (429, 2.2, "3", "rate_limit_error"), (429, None, "1", "rate_limit_error"), (503, 0.1, "1", "server_error"),
    (503, 30.0, "30", "server_error"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_rejections_carry_retry_after(tok: Any, status: int, retry_after_s: float | None, header: str,
                                                   kind: str, stream: bool) -> None:
    rejection = EngineError(status, kind, "prefill_backlog", "over capacity, retry later", retry_after_s)
    app, _ = make_app(tok, first_error=rejection)
    async with client(app) as c:
        resp = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    # Even for stream=true: an error before the first token is a plain HTTP error, not a 200 SSE.
    err = assert_openai_error(resp, status)
    assert resp.headers["retry-after"] == header
    assert (err["type"], err["code"]) == (kind, "prefill_backlog")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_server_bug_is_a_500_in_openai_shape_not_a_traceback(tok: Any, stream: bool) -> None:
    class Broken(FakeEngine):
        async def generate(self, request: Any) -> AsyncIterator[Any]:
            raise TypeError("bug in the engine client")
            yield  # an async generator

    engine = Broken(tok)
    app = build_app(OpenAIServer(engine, tok))
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # Starlette re-raises for the server's log
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as c:
        resp = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
    err = assert_openai_error(resp, 500)
    assert (err["type"], err["code"]) == ("server_error", "internal_error") and "Traceback" not in resp.text


# ---- the Serve handle adapter ------------------------------------------------------------------


class FakeResponse:
    """What `handle.generate.options(stream=True).remote(req)` returns: async-iterable, cancellable."""

    def __init__(self, chunks: list[GenerateChunk], error: Exception | None = None) -> None:
        self.chunks, self.error, self.cancelled = chunks, error, False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


class FakeHandle:
    def __init__(self, response: FakeResponse) -> None:
        self.response = response
        self.generate = self
        self.health = self

    def options(self, stream: bool = False) -> FakeHandle:
        assert stream
        return self

    def remote(self, *args: Any) -> Any:
        if not args:  # health.remote()
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            future.set_result(True)
            return future
        return self.response


def gen_request() -> GenerateRequest:
    return GenerateRequest("r1", [1, 2], SamplingParams(max_tokens=4), 0.0)


async def drain(client: HandleEngineClient, limit: int | None = None) -> list[GenerateChunk]:
    stream = client.generate(gen_request())
    out = []
    async for chunk in stream:
        out.append(chunk)
        if limit is not None and len(out) >= limit:
            break
    await stream.aclose()
    return out


@pytest.mark.parametrize(("error", "status", "code"), [
    (BackPressureError(10, 10, status_code=429, retry_after_s=2.0), 429, "router_queue_full"),
    (BackPressureError(10, 10), 503, "router_queue_full"),
    (DeploymentUnavailableError("ServingUnit"), 503, "engine_unavailable"),  # type: ignore[arg-type]
    (RuntimeError("actor died"), 503, "engine_failed"),
])
async def test_handle_client_maps_serve_failures_to_engine_errors(error: Exception, status: int, code: str) -> None:
    response = FakeResponse([GenerateChunk([5])], error)
    chunks = await drain(HandleEngineClient(FakeHandle(response), INFO))  # type: ignore[arg-type]
    assert chunks[0].token_ids == [5] and chunks[1].error is not None
    assert (chunks[1].error.status, chunks[1].error.code) == (status, code)
    assert response.cancelled


async def test_handle_client_cancels_only_unfinished_requests() -> None:
    done = FakeResponse([GenerateChunk([5]), GenerateChunk([6], "stop")])
    assert len(await drain(HandleEngineClient(FakeHandle(done), INFO), limit=2)) == 2  # type: ignore[arg-type]
    assert not done.cancelled
    early = FakeResponse([GenerateChunk([5]), GenerateChunk([6]), GenerateChunk([7], "length")])
    await drain(HandleEngineClient(FakeHandle(early), INFO), limit=1)  # type: ignore[arg-type]
    assert early.cancelled
    assert await HandleEngineClient(FakeHandle(done), INFO).health()  # type: ignore[arg-type]


class ProbedHandle(FakeHandle):
    """A handle whose health answers come from a list (None: never answers, like a handle with
    no replica to send to)."""

    def __init__(self, response: FakeResponse, answers: list[bool | None]) -> None:
        super().__init__(response)
        self.answers = answers
        self.generate_calls = 0
        self.health_calls = 0

    def remote(self, *args: Any) -> Any:
        if args:
            self.generate_calls += 1
            return self.response
        self.health_calls += 1
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        answer = self.answers.pop(0) if self.answers else True
        if answer is not None:
            future.set_result(answer)
        return future


@pytest.mark.parametrize("failure", [
    FakeResponse([GenerateChunk(error=EngineError(503, "server_error", "engine_failed", "x", 5.0))]),
    FakeResponse([GenerateChunk([5])], RuntimeError("actor died")),
])
async def test_after_a_unit_fails_new_requests_get_503_at_once_until_a_probe_says_healthy(
        failure: FakeResponse, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HandleEngineClient, "PROBE_PERIOD_S", 0.01)
    monkeypatch.setattr(HandleEngineClient, "PROBE_TIMEOUT_S", 0.05)
    # The failed unit says unhealthy, then no replica answers (the rebuild), then a new one is up.
    handle = ProbedHandle(failure, [False, None, None, True])
    client = HandleEngineClient(handle, INFO)  # type: ignore[arg-type]
    await drain(client)
    assert client.recovering and handle.generate_calls == 1
    held = await drain(client)
    assert held[0].error is not None
    assert (held[0].error.status, held[0].error.code, held[0].error.retry_after_s) == (503, "engine_recovering", 5.0)
    assert handle.generate_calls == 1  # answered without a call to the router
    for _ in range(200):
        if not client.recovering:
            break
        await asyncio.sleep(0.01)
    assert not client.recovering and handle.health_calls == 4
    handle.response = FakeResponse([GenerateChunk([7], "stop")])
    assert (await drain(client))[-1].finish_reason == "stop" and handle.generate_calls == 2


class SilentResponse(FakeResponse):
    """A call Serve's router still holds (routed again after its replica died): no chunk comes."""

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        await asyncio.Event().wait()
        yield GenerateChunk([1])


class QueueHandle(FakeHandle):
    """Each generate call gets the next response of a list."""

    def __init__(self, responses: list[FakeResponse]) -> None:
        super().__init__(responses[0])
        self.responses = responses

    def remote(self, *args: Any) -> Any:
        if args:
            return self.responses.pop(0)
        return super().remote()


async def test_requests_awaiting_their_first_chunk_get_503_when_a_unit_fails() -> None:
    """A request already on its way when a unit fails, with no chunk yet, is answered 503 +
    Retry-After as soon as the failure is seen, and its call cancelled: it does not wait in
    Serve's router for the rebuilt unit."""
    silent = SilentResponse([])
    failed = FakeResponse([GenerateChunk(error=EngineError(503, "server_error", "engine_failed", "x", 5.0))])
    client = HandleEngineClient(QueueHandle([silent, failed]), INFO)  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(drain(client))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no failure seen yet: it waits, as any request may
    await drain(client)  # another stream's unit fails
    chunks = await asyncio.wait_for(waiting, 2.0)
    assert len(chunks) == 1 and chunks[0].error is not None
    assert (chunks[0].error.status, chunks[0].error.code, chunks[0].error.retry_after_s) == (503, "engine_failed", 5.0)
    assert silent.cancelled


async def test_other_errors_do_not_stop_traffic() -> None:
    for error in (BackPressureError(10, 10, status_code=429, retry_after_s=2.0),
                  DeploymentUnavailableError("ServingUnit")):  # type: ignore[arg-type]
        client = HandleEngineClient(FakeHandle(FakeResponse([], error)), INFO)  # type: ignore[arg-type]
        await drain(client)
        assert not client.recovering
