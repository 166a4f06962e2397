"""`tidal replay --retries`: each request sent the way the openai client sends it, retries included.

Owns: `send_with_retries` (one original request: sent, and on a retryable refusal sent again
after the delay `loadgen.retry_policy.RetryPolicy` gives, up to `max_retries` times) and
`retry_summary` (the replay's load amplification, retries admitted, and how many retries sent at
the server's Retry-After got in). A retry is a fresh HTTP request on the same client; its
result replaces the refused attempt's timings, and the first send is kept in `first_sent_t`
so the wait a user sees (from the first send) can be reported beside the server's.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from loadgen.client import ClientConfig, RequestResult, RequestSpec, send_request
from loadgen.retry_policy import RetryPolicy


def _retryable(result: RequestResult) -> bool:
    """A 429, or an error before any 200 (408/409/5xx, or no response at all)."""
    if result.status == "rejected":
        return True
    return result.status == "error" and result.http_status != 200 and RetryPolicy.retryable_status(
        result.http_status)


def _reset(result: RequestResult, spec: RequestSpec) -> None:
    """Clear one attempt's outcome before the next (keeps index, dispatch and the first send)."""
    result.input_tokens = spec.input_tokens
    result.status, result.http_status, result.error, result.retry_after_s = "incomplete", None, None, None
    result.error_code = result.refused_by = None
    result.sent_t = result.first_token_t = result.end_t = math.nan
    result.chunk_t = []
    result.output_tokens, result.usage_reported, result.cached_tokens = 0, False, None


async def send_with_retries(client: httpx.AsyncClient, config: ClientConfig, spec: RequestSpec,
                            policy: RetryPolicy, rng: random.Random, result: RequestResult,
                            clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """`send_request`, then retries by the openai client's rules; `result` holds the last attempt."""
    while True:
        await send_request(client, config, spec, clock, result)
        if math.isnan(result.first_sent_t):
            result.first_sent_t = result.sent_t
        if not _retryable(result):
            return result
        delay = policy.delay_s(result.attempts - 1, result.retry_after_s, rng)
        if delay is None:
            return result
        honoured = policy.honours_retry_after(result.retry_after_s)
        await asyncio.sleep(delay)
        result.retries.append((round(delay, 6), honoured))
        _reset(result, spec)
        result.attempts += 1
        result.dispatch_t = clock()


def retry_summary(results: Sequence[dict[str, Any]], policy: dict[str, Any] | None) -> dict[str, Any]:
    """Counters over the replay's request records (`requests.jsonl` lines)."""
    n = len(results)
    attempts = sum(int(r.get("attempts") or 1) for r in results)
    sent = sum(len(r.get("retries") or ()) for r in results)
    at_ra = sum(sum(1 for _, honoured in (r.get("retries") or ()) if honoured) for r in results)
    admitted = [r for r in results if r.get("retries") and r.get("http_status") == 200]
    admitted_at_ra = sum(1 for r in admitted if r["retries"][-1][1])
    return {"policy": policy, "original_requests": n, "attempts": attempts,
            "amplification": round(attempts / n, 4) if n else None, "retries_sent": sent,
            "retries_at_retry_after": at_ra, "retries_admitted": len(admitted),
            "admitted_at_retry_after": admitted_at_ra,
            "retry_admit_rate": round(len(admitted) / sent, 4) if sent else None,
            "retry_after_admit_rate": round(admitted_at_ra / at_ra, 4) if at_ra else None}
