"""A small OpenAI-compatible streaming server for the replay tests, on a real 127.0.0.1 socket.

`FakeServer` runs FastAPI under uvicorn in a thread on an ephemeral port. `Behavior` scripts it:
delays before the first token and between tokens, and which requests (by arrival order, 1-based)
get a 429 with Retry-After, a 500, an SSE error event mid-stream, or a stream that never ends.
It records when each request arrived and the most requests it ever had in flight at once. With
`prefix_cache` it reports `usage.prompt_tokens_details.cached_tokens` as a word-level prefix cache
would: the longest run of leading words the prompt shares with any prompt it saw before.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class Behavior:
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    reject_every: int = 0  # every k-th arrival gets 429 + Retry-After
    fail_every: int = 0  # every k-th arrival gets 500
    sse_error_every: int = 0  # every k-th arrival streams one token, then an SSE error event
    hang_every: int = 0  # every k-th arrival streams one token, then nothing until cancelled
    retry_after: str = "3"
    send_usage: bool = True
    prefix_cache: bool = False  # report cached_tokens: leading words shared with an earlier prompt

    def fate(self, n: int) -> str:
        for name, every in (("hang", self.hang_every), ("reject", self.reject_every), ("fail", self.fail_every),
                            ("sse_error", self.sse_error_every)):
            if every and n % every == 0:
                return name
        return "ok"


@dataclass
class Log:
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() at arrival
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)  # one port per TCP connection
    in_flight: int = 0
    max_in_flight: int = 0
    prompts: list[list[str]] = field(default_factory=list)  # each prompt's words, for `prefix_cache`


def _chunk(endpoint: str, text: str, finish: str | None = None) -> str:
    if endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return "data: " + json.dumps({"id": "x", "object": "chunk", "choices": [choice]}) + "\n\n"


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class FakeServer:
    def __init__(self, behavior: Behavior | None = None) -> None:
        self.behavior = behavior or Behavior()
        self.log = Log()
        self.app = self._build()
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self, behavior: Behavior) -> None:
        self.behavior, self.log = behavior, Log()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._handle(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._handle(request, "chat")

        return app

    async def _handle(self, request: Request, endpoint: str) -> Response:
        log, behavior = self.log, self.behavior
        log.arrivals.append(time.perf_counter())
        n = len(log.arrivals)  # this request's arrival number, taken before any await lets another in
        body = await request.json()
        log.bodies.append(body)
        log.paths.append(request.url.path)
        log.client_ports.append(request.client.port if request.client else -1)
        fate = behavior.fate(n)
        if fate == "reject":
            return JSONResponse({"error": {"message": "overloaded", "type": "rate_limit", "code": "queue_full"}},
                                status_code=429, headers={"Retry-After": behavior.retry_after,
                                                          "x-tidal-refused-by": "proxy"})
        if fate == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "internal"}}, status_code=500)
        words = str(body.get("prompt") or body["messages"][-1]["content"]).split()
        cached = max((_shared(words, seen) for seen in log.prompts), default=0) if behavior.prefix_cache else None
        log.prompts.append(words)
        return StreamingResponse(self._stream(endpoint, int(body["max_tokens"]), len(words), fate, cached),
                                 media_type="text/event-stream")

    async def _stream(self, endpoint: str, max_tokens: int, prompt_tokens: int, fate: str,
                      cached: int | None = None) -> AsyncIterator[str]:
        log, behavior = self.log, self.behavior
        log.in_flight += 1
        log.max_in_flight = max(log.max_in_flight, log.in_flight)
        try:
            if endpoint == "chat":  # like OpenAI: a first delta with the role and no text
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(behavior.first_token_delay_s)
            for k in range(max_tokens):
                if k:
                    await asyncio.sleep(behavior.token_delay_s)
                yield _chunk(endpoint, f" t{k}", "length" if k == max_tokens - 1 else None)
                if fate == "sse_error":
                    yield "event: error\ndata: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    return
                if fate == "hang":
                    await asyncio.sleep(3600)
            if behavior.send_usage:
                usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                         "total_tokens": prompt_tokens + max_tokens}
                if cached is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            log.in_flight -= 1

    def __enter__(self) -> FakeServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=10)
