"""A streaming OpenAI-compatible client that times one request at a time, for the open-loop replay.

Owns: `ClientConfig` (endpoint, model, prompt sizing, timeouts, connection pool), `RequestSpec`
(what to send), `RequestResult` (what happened, with wall times on the caller's clock),
`make_http_client` and `send_request` (one streamed request: TTFT, inter-chunk latencies, E2E,
HTTP status, 429 Retry-After, connection errors, 5xx and SSE error events, usage tokens).

A request asks for exactly the trace's output length: `max_tokens` = output tokens and
`ignore_eos: true` (a vLLM extension our server accepts). Prompts are English prose of the
trace's input length from `loadgen.prompts.build_prompt`, seeded per request; a trace that records
its prompts' shared prefixes (Mooncake's `hash_ids`) gets `build_prefixed_prompt`'s text instead,
which shares what the trace's prompts share, so a server's prefix cache hits as it would have on
the recorded traffic (`prefix_prompts=False` turns that off). The server's count of cached prompt
tokens (`usage.prompt_tokens_details.cached_tokens`) is kept per request.

`send_request` never raises for anything the server or the network does: every outcome is a
status in the result, so every request sent is accounted for. Cancellation propagates (the
replay cancels what is still in flight when its drain time runs out).

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loadgen.prompts import build_prefixed_prompt, build_prompt

# SmolLM2's tokenizer on our prompt passage (docs/traces.md, section 7).
DEFAULT_WORDS_PER_TOKEN = 0.867
DEFAULT_KEEPALIVE = 256
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# The httpcore trace event that marks the first byte of a request going on the wire.
_SEND_EVENT = "http11.send_request_headers.started"

Status = Literal["ok", "rejected", "error", "incomplete"]


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server. `max_connections=None` never queues a send behind the pool."""

    base_url: str
    model: str = "default"
    endpoint: Literal["completions", "chat"] = "completions"
    words_per_token: float = DEFAULT_WORDS_PER_TOKEN
    ignore_eos: bool = True
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # longest silence allowed inside one stream
    max_connections: int | None = None
    max_keepalive: int | None = None  # idle connections kept; None: the replay sizes it from the trace
    api_key: str | None = None
    seed: int = 0
    prefix_prompts: bool = True  # prompts share text where the trace's prefix ids say they share a prefix

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint={self.endpoint!r}: use one of {sorted(ENDPOINT_PATHS)}")
        if not 0.0 < self.words_per_token < 10.0:
            raise ValueError(f"words_per_token={self.words_per_token} must be in (0, 10); SmolLM2 measures 0.867")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections} must be >= 1 or None (unbounded)")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def as_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "api_key"}
        data["api_key"] = "set" if self.api_key else None  # never write a secret into results
        return data


@dataclass(frozen=True)
class RequestSpec:
    index: int
    input_tokens: int
    output_tokens: int
    prompt: str | None = None  # the trace's own text, if it has any
    prefix_ids: tuple[int, ...] | None = None  # the trace's prefix-block ids, one per prefix_block_size tokens
    prefix_block_size: int = 512


@dataclass
class RequestResult:
    """One request's outcome. Times are on the caller's `clock` (seconds); NaN where not reached."""

    index: int
    input_tokens: int  # the trace's count, replaced by the server's usage when reported
    status: Status = "incomplete"
    http_status: int | None = None
    dispatch_t: float = float("nan")  # the task began sending (before the pool and connect)
    sent_t: float = float("nan")  # request headers started on the wire (dispatch_t if not seen)
    first_token_t: float = float("nan")
    end_t: float = float("nan")
    chunk_t: list[float] = field(default_factory=list)  # arrival of each SSE chunk with text
    output_tokens: int = 0
    usage_reported: bool = False
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    retry_after_s: float | None = None
    error: str | None = None
    error_code: str | None = None  # an OpenAI-style error body's `code` (e.g. the admission rule of a 429)
    refused_by: str | None = None  # on a 429 / 503, where the server says it decided (`x-tidal-refused-by`)
    # With retries (loadgen/replay_retries.py): the fields above are the last attempt's.
    attempts: int = 1
    first_sent_t: float = float("nan")
    retries: list[tuple[float, bool]] = field(default_factory=list)  # (delay s, at the server's Retry-After)

    def inter_token_ms(self) -> list[float]:
        return [(b - a) * 1000.0 for a, b in zip(self.chunk_t, self.chunk_t[1:], strict=False)]


def make_http_client(config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None,
                     verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """An HTTP/1.1 keep-alive client; by default the pool has no cap, so a send never waits for it."""
    keepalive = config.max_keepalive if config.max_keepalive is not None else DEFAULT_KEEPALIVE
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=keepalive,
                          keepalive_expiry=30.0)
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s, write=30.0, pool=None)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(limits=limits, timeout=timeout, http2=False, headers=headers, transport=transport,
                             verify=verify)


class HttpClients:
    """`shards` httpx clients, request i on client i % shards.

    Why several: httpcore re-examines every connection of a pool, quadratically, each time a
    request enters or leaves it (and polls each idle socket), so one pool of hundreds of
    connections costs milliseconds of client CPU per request and shows up as drift. Small pools
    keep that cost flat. The clients share one TLS context (loading the CA bundle takes ~0.1 s).
    """

    def __init__(self, config: ClientConfig, shards: int = 1,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards={shards} must be >= 1")
        ctx = httpx.create_ssl_context()
        count = 1 if transport is not None else shards  # a given transport is one shared pool anyway
        self.clients = [make_http_client(config, transport, verify=ctx) for _ in range(count)]

    def for_request(self, index: int) -> httpx.AsyncClient:
        return self.clients[index % len(self.clients)]

    async def __aenter__(self) -> HttpClients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


def request_prompt(config: ClientConfig, spec: RequestSpec) -> str:
    """The trace's own text; else text that shares what the trace's prefix ids share; else prose
    of the trace's length, seeded per request."""
    if spec.prompt is not None:
        return spec.prompt
    if spec.prefix_ids and config.prefix_prompts:
        return build_prefixed_prompt(spec.prefix_ids, spec.input_tokens, spec.prefix_block_size, seed=config.seed,
                                     words_per_token=config.words_per_token)
    return build_prompt(spec.input_tokens, seed=config.seed * 1_000_003 + spec.index,
                        words_per_token=config.words_per_token)


def request_body(config: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    prompt = request_prompt(config, spec)
    body: dict[str, Any] = {"model": config.model, "max_tokens": max(int(spec.output_tokens), 1), "stream": True,
                            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None  # an HTTP date; our server sends seconds


def chunk_text(chunk: dict[str, Any]) -> str:
    text = []
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            text.append(choice.get("text") or "")
        else:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def _error_code(payload: Any) -> str | None:
    err = payload.get("error") if isinstance(payload, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or err)[:300]
        return str(err)[:300]
    return str(payload)[:300]


async def _read_stream(response: httpx.Response, result: RequestResult, clock: Callable[[], float]) -> None:
    """Consume the SSE stream into `result`; sets status ok or error."""
    done = finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines (the data line carries the error)
        data = line[5:].strip()
        if data == "[DONE]":
            # Keep reading to the end of the body (nothing more comes): a connection whose body was
            # left unread cannot go back to the keep-alive pool, and each request would open a new one.
            if not done:
                result.end_t = clock()
            done = True
            continue
        now = clock()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            result.status, result.error = "error", f"bad SSE data: {data[:120]!r}"
            return
        if not isinstance(chunk, dict) or "error" in chunk:
            result.status, result.error = "error", f"SSE error event: {_error_message(chunk)}"
            return
        if chunk_text(chunk):
            if not result.chunk_t:
                result.first_token_t = now
            result.chunk_t.append(now)
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
            result.input_tokens = int(usage.get("prompt_tokens") or result.input_tokens)
            result.usage_reported = True
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                result.cached_tokens = details["cached_tokens"]
    if not done:
        result.end_t = clock()
    if not result.usage_reported:
        result.output_tokens = len(result.chunk_t)  # one chunk per token is the usual framing
    if done or finished:
        result.status = "ok"
    else:
        result.status, result.error = "error", "stream ended before [DONE] or a finish_reason"


async def send_request(client: httpx.AsyncClient, config: ClientConfig, spec: RequestSpec,
                       clock: Callable[[], float] = time.perf_counter,
                       result: RequestResult | None = None) -> RequestResult:
    """Send one streamed request and time it; never raises except on cancellation.

    Pass `result` to keep the partial timings of a request that gets cancelled (it stays
    "incomplete"); otherwise a fresh one is returned.
    """
    result = result if result is not None else RequestResult(spec.index, spec.input_tokens)
    body = request_body(config, spec)

    async def on_trace(event: str, info: dict[str, Any]) -> None:
        if event == _SEND_EVENT and math.isnan(result.sent_t):  # first time only
            result.sent_t = clock()

    result.dispatch_t = clock()
    try:
        async with client.stream("POST", config.url, json=body, extensions={"trace": on_trace}) as response:
            result.http_status = response.status_code
            result.retry_after_s = _retry_after(response.headers.get("retry-after"))  # 429, also 503
            result.refused_by = response.headers.get("x-tidal-refused-by")  # tidalserve's: proxy, ingress, unit
            if math.isnan(result.sent_t):
                result.sent_t = result.dispatch_t  # transports without httpcore tracing
            if response.status_code == 429:
                result.status = "rejected"
                payload = _json_or_text(await response.aread())
                result.error, result.error_code = _error_message(payload), _error_code(payload)
                result.end_t = clock()
            elif response.status_code != 200:
                result.status = "error"
                payload = _json_or_text(await response.aread())
                result.error = f"HTTP {response.status_code}: {_error_message(payload)}"
                result.error_code = _error_code(payload)
                result.end_t = clock()
            else:
                await _read_stream(response, result, clock)
    except httpx.HTTPError as exc:  # connect/read timeouts, refused or reset connections, protocol errors
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}"[:300]
        result.end_t = clock()
    if math.isnan(result.sent_t):
        result.sent_t = result.dispatch_t
    return result


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id the server lists at /v1/models, or None if it lists none or fails."""
    try:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        if response.status_code != 200:
            return None
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    ids = [m.get("id") for m in models if isinstance(m, dict) and m.get("id")]
    return str(ids[0]) if ids else None


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:300].decode("utf-8", "replace")
