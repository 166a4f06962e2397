"""loadgen.client: one streamed request against a fake OpenAI server on a real 127.0.0.1 socket."""

from __future__ import annotations

import asyncio
import math
import socket

import httpx
import pytest

from loadgen.client import (
    ClientConfig,
    RequestResult,
    RequestSpec,
    discover_model,
    make_http_client,
    request_body,
    send_request,
)
from tests.loadgen.replay_fake_server import Behavior, FakeServer


def _send(server: FakeServer, behavior: Behavior, spec: RequestSpec, **cfg: object) -> RequestResult:
    server.reset(behavior)
    config = ClientConfig(server.url, model="fake-model", **cfg)  # type: ignore[arg-type]

    async def go() -> RequestResult:
        async with make_http_client(config) as client:
            return await send_request(client, config, spec)

    return asyncio.run(go())


def test_completion_is_timed_per_chunk_and_counted_from_usage(server: FakeServer) -> None:
    res = _send(server, Behavior(first_token_delay_s=0.05, token_delay_s=0.01), RequestSpec(0, 40, 6))
    assert res.status == "ok" and res.http_status == 200 and res.error is None
    assert res.usage_reported and res.output_tokens == 6
    assert len(res.chunk_t) == 6 and len(res.inter_token_ms()) == 5
    assert res.dispatch_t <= res.sent_t < res.first_token_t <= res.chunk_t[-1] <= res.end_t
    assert all(itl >= 0 for itl in res.inter_token_ms())
    body = server.log.bodies[0]
    assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert server.log.paths == ["/v1/completions"]


def test_chat_endpoint_sends_messages_and_skips_empty_deltas(server: FakeServer) -> None:
    res = _send(server, Behavior(), RequestSpec(1, 10, 3), endpoint="chat")
    assert res.status == "ok" and res.output_tokens == 3 and len(res.chunk_t) == 3
    assert server.log.paths == ["/v1/chat/completions"]
    assert server.log.bodies[0]["messages"][0]["role"] == "user"


def test_without_usage_the_chunks_are_counted(server: FakeServer) -> None:
    res = _send(server, Behavior(send_usage=False), RequestSpec(2, 10, 4))
    assert res.status == "ok" and not res.usage_reported and res.output_tokens == 4


def test_429_keeps_retry_after(server: FakeServer) -> None:
    res = _send(server, Behavior(reject_every=1, retry_after="7"), RequestSpec(3, 10, 4))
    assert (res.status, res.http_status, res.retry_after_s) == ("rejected", 429, 7.0)
    assert res.error == "overloaded" and res.error_code == "queue_full" and math.isnan(res.first_token_t)
    assert res.refused_by == "proxy"  # where tidalserve says it decided (x-tidal-refused-by)


def test_5xx_and_sse_error_events_are_errors(server: FakeServer) -> None:
    res = _send(server, Behavior(fail_every=1), RequestSpec(4, 10, 4))
    assert res.status == "error" and res.http_status == 500 and "boom" in (res.error or "")
    assert res.error_code is None and res.refused_by is None  # the body has no code, nor the response a place
    res = _send(server, Behavior(sse_error_every=1), RequestSpec(5, 10, 4))
    assert res.status == "error" and res.http_status == 200 and "engine died" in (res.error or "")
    assert len(res.chunk_t) == 1  # the token before the error was still timed


def test_connection_refused_is_an_error_not_an_exception() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ClientConfig(f"http://127.0.0.1:{port}")

    async def go() -> RequestResult:
        async with make_http_client(config) as client:
            return await send_request(client, config, RequestSpec(0, 5, 5))

    res = asyncio.run(go())
    assert res.status == "error" and res.http_status is None and "ConnectError" in (res.error or "")
    assert res.sent_t == res.dispatch_t


def test_truncated_stream_is_an_error() -> None:
    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": [{"text": "a"}]}\n\n'})  # type: ignore[operator]

    config = ClientConfig("http://test")

    async def go() -> RequestResult:
        async with make_http_client(config, transport=httpx.ASGITransport(app=app)) as client:
            return await send_request(client, config, RequestSpec(0, 5, 5))

    res = asyncio.run(go())
    assert res.status == "error" and "before [DONE]" in (res.error or "") and res.output_tokens == 1


def test_prompt_is_sized_by_words_per_token_and_seeded_per_request() -> None:
    cfg = ClientConfig("http://x", words_per_token=0.5, seed=1)
    a, b = request_body(cfg, RequestSpec(0, 100, 1)), request_body(cfg, RequestSpec(1, 100, 1))
    assert len(a["prompt"].split()) == 50 and a["prompt"] != b["prompt"]
    assert request_body(cfg, RequestSpec(0, 100, 1)) == a
    assert request_body(cfg, RequestSpec(2, 100, 1, prompt="own text"))["prompt"] == "own text"
    assert ClientConfig("http://x").words_per_token == pytest.approx(0.867)
    assert "secret" not in str(ClientConfig("http://x", api_key="secret").as_dict())
    with pytest.raises(ValueError, match="endpoint"):
        ClientConfig("http://x", endpoint="embeddings")  # type: ignore[arg-type]


def test_prompts_follow_the_trace_prefix_ids_unless_turned_off() -> None:
    cfg = ClientConfig("http://x", words_per_token=0.5)
    first = request_body(cfg, RequestSpec(0, 64, 1, prefix_ids=(7, 8), prefix_block_size=32))["prompt"]
    turn = request_body(cfg, RequestSpec(1, 96, 1, prefix_ids=(7, 8, 9), prefix_block_size=32))["prompt"]
    assert len(first.split()) == 32 and turn.startswith(first + " ")  # the next turn extends the first
    plain = ClientConfig("http://x", words_per_token=0.5, prefix_prompts=False)
    assert not request_body(plain, RequestSpec(1, 96, 1, prefix_ids=(7, 8, 9), prefix_block_size=32)
                            )["prompt"].startswith(first)
    assert request_body(cfg, RequestSpec(2, 64, 1, prompt="own", prefix_ids=(7, 8)))["prompt"] == "own"


def test_cached_tokens_are_read_from_usage(server: FakeServer) -> None:
    server.reset(Behavior(prefix_cache=True))
    config = ClientConfig(server.url, model="fake-model")

    async def go() -> list[RequestResult]:
        async with make_http_client(config) as client:
            return [await send_request(client, config, RequestSpec(i, 0, 2, prompt=p))
                    for i, p in enumerate(("a b c d", "a b c e f", "z"))]

    assert [r.cached_tokens for r in asyncio.run(go())] == [0, 3, 0]
    assert _send(server, Behavior(), RequestSpec(0, 10, 2)).cached_tokens is None  # not reported: unknown


def test_discover_model(server: FakeServer) -> None:
    async def go(url: str) -> str | None:
        async with httpx.AsyncClient() as client:
            return await discover_model(client, url)

    assert asyncio.run(go(server.url)) == "fake-model"
    assert asyncio.run(go(server.url + "/nothing-here")) is None
