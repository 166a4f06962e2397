"""A burst, as a new user would send one: N chat requests in T seconds, and every outcome.

Owns: `BurstSpec` (N requests evenly spaced over T seconds; prompts of 50-450 random words;
max_tokens 128; streamed), `run_burst` (send it with plain httpx, one attempt each, or with the
official `openai` client and its default retries: 2, honouring `retry-after-ms` / `Retry-After`)
and `burst_figures` (outcomes, refusal latency, TTFT of the admitted against the target,
amplification, how the retries arrive). Every attempt is recorded: its send time, status,
`Retry-After` / `retry-after-ms`, time to the response's headers, and for a 200 the time to its
first text and whether it ended with `[DONE]`. Figures are returned, never asserted here.

The sender's own garbage collector is off while the burst runs (`_no_gc`): its one full
collection in a 2,000-request burst paused the event loop for 130-160 ms, which both delayed
the sends due then (a clump the server answered one after another) and timestamped every
response that arrived meanwhile that much late (benchmarks/RESULTS.md, "The slot wait of a
young batch").

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact be have do say get make go know take see come think look "
         "want give use find tell ask seem feel try leave call good new first last long great little own other "
         "old right big high different small large next early young important few public bad same able")
WORDS = tuple(_WORDS.split())
UNLIMITED = httpx.Limits(max_connections=None, max_keepalive_connections=None)


@dataclass(frozen=True)
class BurstSpec:
    n: int
    seconds: float
    min_words: int = 50
    max_words: int = 450
    max_tokens: int = 128
    seed: int = 14

    def prompts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [" ".join(rng.choices(WORDS, k=rng.randint(self.min_words, self.max_words))) for _ in range(self.n)]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)], 1)


async def _read_sse(response: httpx.Response, t_sent: float, record: dict[str, Any]) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            record["done"] = True
            return
        event = json.loads(data)
        if "error" in event:
            record["stream_error"] = event["error"].get("code")
            continue
        if record.get("ttft_ms") is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
            record["ttft_ms"] = (time.perf_counter() - t_sent) * 1e3


async def _httpx_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float) -> dict[str, Any]:
    sent = time.perf_counter()
    rec: dict[str, Any] = {"sent_s": sent - t0}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            rec.update(status=resp.status_code, headers_ms=(time.perf_counter() - sent) * 1e3,
                       retry_after=resp.headers.get("retry-after"), retry_after_ms=resp.headers.get("retry-after-ms"),
                       refused_by=resp.headers.get("x-tidal-refused-by"),
                       unit_waited_ms=resp.headers.get("x-tidal-unit-waited-ms"))
            if resp.status_code == 200:
                await _read_sse(resp, sent, rec)
            else:
                error = json.loads(await resp.aread())["error"]
                rec.update(code=error.get("code"), message=error.get("message"))
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        rec.update(status=None, error=repr(err)[:200])
    return {**rec, "attempts": [dict(rec)]}


async def _openai_one(client: Any, i: int, body: dict[str, Any], t0: float, attempts: dict[int, list[Any]]
                      ) -> dict[str, Any]:
    import openai

    sent = time.perf_counter()
    rec: dict[str, Any] = {"sent_s": sent - t0}
    try:
        stream = await client.chat.completions.create(**body, extra_headers={"x-burst-id": str(i)})
        rec["status"] = 200
        async for chunk in stream:
            if rec.get("ttft_ms") is None and chunk.choices and chunk.choices[0].delta.content:
                rec["ttft_ms"] = (time.perf_counter() - sent) * 1e3
        rec["done"] = True
    except openai.APIStatusError as err:
        rec.update(status=err.status_code, code=getattr(err, "code", None),
                   retry_after=err.response.headers.get("retry-after"))
    except openai.APIError as err:
        rec.update(status=None, error=repr(err)[:200])
    rec["attempts"] = attempts.get(i, [])
    rec["headers_ms"] = rec["attempts"][-1]["headers_ms"] if rec["attempts"] else None
    return rec


async def run_burst(url: str, model: str, spec: BurstSpec, client_kind: str = "httpx") -> dict[str, Any]:
    """Send the burst; one record per request (its attempts inside). `url` is the app's base URL."""
    bodies = [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": spec.max_tokens,
               "stream": True} for p in spec.prompts()]
    gap = spec.seconds / spec.n
    attempts: dict[int, list[dict[str, Any]]] = {}
    t0 = time.perf_counter() + 0.5

    async def on_request(request: httpx.Request) -> None:
        request.extensions["t_sent"] = time.perf_counter()

    async def on_response(response: httpx.Response) -> None:
        req = response.request
        sent = req.extensions.get("t_sent", time.perf_counter())
        attempts.setdefault(int(req.headers.get("x-burst-id", -1)), []).append(
            {"sent_s": sent - t0, "status": response.status_code, "headers_ms": (time.perf_counter() - sent) * 1e3,
             "retry_after": response.headers.get("retry-after"),
             "retry_after_ms": response.headers.get("retry-after-ms"),
             "refused_by": response.headers.get("x-tidal-refused-by"),
             "code": response.headers.get("x-tidal-refusal-reason")})  # the body's code, without reading it here

    hooks = {"request": [on_request], "response": [on_response]} if client_kind == "openai" else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=UNLIMITED, event_hooks=hooks) as http:
        if client_kind == "openai":
            import openai

            client: Any = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http)

            async def one(i: int) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
                return await _openai_one(client, i, bodies[i], t0, attempts)
        else:
            async def one(i: int) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
                return await _httpx_one(http, url, bodies[i], t0)

        with _no_gc():
            records = await asyncio.gather(*(one(i) for i in range(spec.n)))
    for i, rec in enumerate(records):
        rec["i"] = i
        rec["scheduled_s"] = i * gap
    return {"client": client_kind, "n": spec.n, "seconds": spec.seconds, "records": list(records),
            "wall_s": round(time.perf_counter() - t0, 2)}


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the block (reference counting still frees nearly
    everything), then one collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def _outcome(rec: dict[str, Any]) -> str:
    status = rec.get("status")
    if status == 200:
        return "200 complete" if rec.get("done") and not rec.get("stream_error") else "200 incomplete"
    if status in (429, 503):
        return f"{status} + Retry-After" if rec.get("retry_after") else f"{status} without Retry-After"
    return f"{status} {rec.get('error', '')}".strip()


def burst_figures(run: dict[str, Any], target_ttft_s: float = 1.0) -> dict[str, Any]:
    records = run["records"]
    outcomes: dict[str, int] = {}
    for rec in records:
        outcomes[_outcome(rec)] = outcomes.get(_outcome(rec), 0) + 1
    tries = [a for rec in records for a in rec["attempts"]]
    refusals = [a["headers_ms"] for a in tries if a["status"] in (429, 503)]
    # TTFT of the attempt that was admitted (what the unit promises), and from the first attempt (what
    # a user of a retrying client waits, retries included).
    ttft = [rec["ttft_ms"] - (rec["attempts"][-1]["sent_s"] - rec["sent_s"]) * 1e3 if rec["attempts"]
            else rec["ttft_ms"] for rec in records if rec.get("ttft_ms") is not None]
    waited = [rec["ttft_ms"] for rec in records if rec.get("ttft_ms") is not None]
    retries = sorted(a["sent_s"] for rec in records for a in rec["attempts"][1:])
    drift = [rec["sent_s"] - rec["scheduled_s"] for rec in records]
    return {
        "client": run["client"], "requests": len(records), "burst_s": run["seconds"], "wall_s": run["wall_s"],
        "outcomes": dict(sorted(outcomes.items())),
        "http_attempts": len(tries), "amplification": round(len(tries) / max(1, len(records)), 3),
        "refusal_ms": {"n": len(refusals), "p50": _pct(refusals, 50), "p99": _pct(refusals, 99),
                       "max": _pct(refusals, 100)},
        "refused_by": _count(a.get("refused_by") or "unmarked" for a in tries if a["status"] in (429, 503)),
        "refusal_ms_by_where": {w: {"p50": _pct(v, 50), "p99": _pct(v, 99)} for w, v in _by_where(tries).items()},
        "refusal_codes_by_where": _count(f"{a.get('refused_by') or 'unmarked'}: {a.get('code') or 'unknown'}"
                                         for a in tries if a["status"] in (429, 503)),
        "retry_after_s": _spread([float(a["retry_after_ms"]) / 1e3 if a.get("retry_after_ms") else
                                  float(a["retry_after"]) for a in tries if a.get("retry_after")]),
        "admitted_ttft_ms": {"n": len(ttft), "p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "max": _pct(ttft, 100),
                             "share_within_target": round(sum(t <= target_ttft_s * 1e3 for t in ttft) / len(ttft), 3)
                             if ttft else None},
        "first_token_from_first_attempt_ms": {"p50": _pct(waited, 50), "p99": _pct(waited, 99)},
        "retries": {"n": len(retries), "peak_per_s": _peak_per_s(retries),
                    "first_s": round(retries[0], 2) if retries else None,
                    "last_s": round(retries[-1], 2) if retries else None},
        "send_drift_ms": {"p50": _pct([d * 1e3 for d in drift], 50), "max": _pct([d * 1e3 for d in drift], 100)},
    }


def _count(keys: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in keys:
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _by_where(tries: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for a in tries:
        if a["status"] in (429, 503):
            out.setdefault(a.get("refused_by") or "unmarked", []).append(a["headers_ms"])
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "min": _pct(values, 0.0001), "p50": _pct(values, 50), "max": _pct(values, 100),
            "distinct_whole_seconds": len({math.ceil(v) for v in values})}


def _peak_per_s(times: list[float]) -> int:
    """The most retries that arrived within any one second (a wave shows as a high peak)."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] < t - 1.0:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
