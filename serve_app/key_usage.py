"""What each API key uses: its rate-limit buckets, its usage metrics, and the engine wrapper that
counts its tokens.

Owns: `CURRENT_KEY` (the key id of the request being served, set by serve_app/auth.py's
middleware for the duration of the request; streaming bodies inherit it), `KeyUsage` (admission
against the per-key limits of tidal_core/rate_limit.py, token charges, and the `tidal_api_*`
metrics of serve_app/metric_defs.py, labelled by key id only) and `MeteredEngine` (an
`EngineClient` that charges the current key for the prompt once the unit accepted the request and
for every generated token as it streams, so a long stream counts against TPM while it runs).

Must not import: torch, fastapi. Ray only inside `KeyUsage` when metrics are on.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app import metric_defs as M
from serve_app.unit_api import GenerateChunk, GenerateRequest, ModelInfo
from serve_app.unit_stream import EngineClient
from tidal_core.rate_limit import RateLimiter, Verdict

CURRENT_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("tidal_api_key_id", default=None)


class KeyUsage:
    """Per-key limits and usage counters of one Ingress replica."""

    def __init__(self, limiter: RateLimiter, metrics: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = limiter
        self.clock = clock
        self._m: dict[str, Any] = {}
        if metrics:
            from ray.util import metrics as ray_metrics

            for d in (M.API_REQUESTS, M.API_TOKENS, M.AUTH_FAILURES):
                self._m[d.name] = ray_metrics.Counter(d.name, description=d.description, tag_keys=d.tag_keys)

    def _inc(self, defn: M.MetricDef, value: float, tags: dict[str, str] | None = None) -> None:
        metric = self._m.get(defn.name)
        if metric is not None:
            metric.inc(value, tags)

    def admit(self, key: str) -> Verdict:
        verdict = self.limiter.admit(key, self.clock())
        outcome = "admitted" if verdict.allowed else "rate_limited"
        self._inc(M.API_REQUESTS, 1, {M.KEY_TAG: key, "outcome": outcome})
        return verdict

    def auth_failed(self) -> None:
        self._inc(M.AUTH_FAILURES, 1)

    def charge(self, key: str, kind: str, tokens: int) -> None:
        if tokens <= 0:
            return
        self.limiter.charge(key, tokens, self.clock())
        self._inc(M.API_TOKENS, tokens, {M.KEY_TAG: key, "kind": kind})

    def keep_only(self, key_ids: set[str]) -> None:
        self.limiter.forget(key_ids)


class MeteredEngine:
    """`engine`, with every request's tokens charged to the key in `CURRENT_KEY` (if any)."""

    def __init__(self, engine: EngineClient, usage: KeyUsage) -> None:
        self._engine = engine
        self._usage = usage

    @property
    def model_info(self) -> ModelInfo:
        return self._engine.model_info

    async def health(self) -> bool:
        return await self._engine.health()

    def __getattr__(self, name: str) -> Any:  # e.g. HandleEngineClient.recovering
        return getattr(self._engine, name)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        key = CURRENT_KEY.get()
        stream = self._engine.generate(request)
        started = False
        try:
            async for chunk in stream:
                if key is not None and chunk.error is None:
                    if not started:
                        started = True
                        self._usage.charge(key, "prompt", len(request.prompt_token_ids))
                    self._usage.charge(key, "completion", len(chunk.token_ids))
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
