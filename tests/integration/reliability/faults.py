"""Faults injected under streaming load, and how the app comes back.

Owns `Outcome` / `request_outcome` (how one request ended, as the client saw it: finished, cut by
us, an SSE error event, an HTTP error with a message, or a dropped connection), `FaultRun` and
`run_fault` (kill a TP worker or a ServingUnit replica while streams run; probe until a new unit
serves), and the kill functions.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.integration.reliability.cluster import (
    alive_actors,
    replica_actor_names,
    tp_worker_actor_names,
    unit_state_async,
)


@dataclass
class Outcome:
    """How one request ended, times on `time.perf_counter()`.

    kind: "finished" (a complete response), "cut" (we left a stream that was being served),
    "error_event" (an SSE error event after the 200), "http_error" (an HTTP error status with an
    OpenAI error body), "transport_error" (the connection dropped or timed out: no message reached
    the client)."""

    sent_t: float
    kind: str = "transport_error"
    status: int | None = None
    first_chunk_t: float | None = None
    end_t: float | None = None
    chunks: int = 0
    message: str | None = None
    retry_after: str | None = None


def _error_message(raw: str) -> str | None:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        err = json.loads(raw).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    return None


async def request_outcome(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                          first_chunk: asyncio.Event | None = None, cut_after_chunks: int | None = None) -> Outcome:
    """Send one request (streamed if `body["stream"]`) and classify how it ended; never raises.
    With `cut_after_chunks`, leave once that many chunks arrived (kind "cut": it was being served)."""
    out = Outcome(time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            out.status = response.status_code
            out.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                out.message = _error_message((await response.aread()).decode("utf-8", "replace"))
                out.kind = "http_error" if out.message else "transport_error"
            elif not body.get("stream"):
                await response.aread()
                out.kind = "finished"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    message = _error_message(line[5:])
                    if message is not None:
                        out.kind, out.message = "error_event", message
                        break
                    out.chunks += 1
                    if out.first_chunk_t is None:
                        out.first_chunk_t = time.perf_counter()
                        if first_chunk is not None:
                            first_chunk.set()
                    if '"finish_reason":"' in line:
                        out.kind = "finished"
                    elif cut_after_chunks is not None and out.chunks >= cut_after_chunks:
                        out.kind = "cut"
                        break  # leaving the block drops the connection mid-stream
    except httpx.HTTPError as exc:
        out.kind, out.message = "transport_error", f"{type(exc).__name__}: {exc}"[:300]
    out.end_t = time.perf_counter()
    return out


@dataclass
class FaultRun:
    """One fault injected under streaming load, and how the app came back. Times: perf_counter."""

    fault: str
    method: str  # how it was injected
    old_unit: str
    kill_t: float
    streams: list[Outcome]  # in flight (each had its first token) when the fault hit
    probes: list[Outcome]  # one new request every `probe_period_s` from the fault until recovery
    new_unit: str | None = None
    unit_ready_t: float | None = None  # unit_state first answered from a new, healthy unit
    state_after: dict[str, Any] | None = None  # a few seconds after recovery

    @property
    def served_again_t(self) -> float | None:
        """First token of the first request sent after the fault that was served."""
        times = [p.first_chunk_t for p in self.probes if p.kind in ("cut", "finished") and p.first_chunk_t]
        return min(times) if times else None

    def held(self, margin_s: float = 1.0) -> list[Outcome]:
        """Requests sent while no unit could take them, yet served once the new unit was up: they
        waited for the rebuild instead of getting 503 + Retry-After."""
        if self.unit_ready_t is None:
            return []
        return [p for p in self.probes if p.kind in ("cut", "finished") and p.sent_t < self.unit_ready_t - margin_s]

    def figures(self) -> dict[str, Any]:
        k = self.kill_t

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - k, 3)

        def answer_s(p: Outcome) -> float:
            return round((p.first_chunk_t or p.end_t or p.sent_t) - p.sent_t, 3)

        held = self.held()
        probes = [{"sent_s": rel(p.sent_t), "kind": p.kind, "status": p.status, "retry_after": p.retry_after,
                   "answer_s": answer_s(p)} for p in self.probes]
        return {"fault": self.fault, "method": self.method, "old_unit": self.old_unit, "new_unit": self.new_unit,
                "streams": [{"kind": s.kind, "status": s.status, "chunks": s.chunks, "error_after_s": rel(s.end_t),
                             "message": (s.message or "")[:120]} for s in self.streams],
                "stream_error_max_s": max((rel(s.end_t) or 0.0) for s in self.streams),
                "unit_ready_s": rel(self.unit_ready_t), "served_again_s": rel(self.served_again_t),
                "probes_503": sum(1 for p in self.probes if p.status == 503), "probes_held": len(held),
                "held_wait_max_s": max((answer_s(p) for p in held), default=None), "probes": probes}


def serves(url: str, model: str) -> bool:
    """True when a 2-token completion through the proxy comes back 200 (the unit serves again)."""
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def kill_tp_worker(unit: str) -> str:
    """Kill rank 0 of `unit`'s TP workers: by name (`tidal-tp-<unit>-r0`) when the workers are
    named, else SIGKILL the one live TPWorker process of this cluster."""
    import os
    import signal

    import ray

    names = tp_worker_actor_names(unit)
    if names:
        namespace, name = names[0]
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        return f"ray.kill({name})"
    workers = alive_actors("TPWorker")
    if len(workers) != 1:
        raise RuntimeError(f"expected the one TP worker of unit {unit}, found {workers}")
    os.kill(workers[0]["pid"], signal.SIGKILL)
    return f"SIGKILL to TPWorker pid {workers[0]['pid']} (TP workers are not named tidal-tp-<unit>-r<rank> yet)"


def kill_router_replica(app: str, unit: str) -> str:
    import ray

    (name,) = [n for n in replica_actor_names(app, "ServingUnit") if n.endswith(f"#{unit}")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return f"ray.kill({name})"


async def _until_new_unit(app: str, old: str, run: FaultRun) -> None:
    while True:
        try:  # while no replica exists this call waits in the handle: time out and ask again
            state = await unit_state_async(app, check=False, timeout_s=2.0)
            if state["unit"] != old and state["healthy"]:
                run.unit_ready_t, run.new_unit = time.perf_counter(), state["unit"]
                return
        except Exception:
            pass
        await asyncio.sleep(0.25)


async def run_fault(base_url: str, app: str, model: str, fault: str, *, num_streams: int = 4,
                    probe_period_s: float = 0.5, timeout_s: float = 180.0, settle_s: float = 4.0) -> FaultRun:
    """Start `num_streams` long streams, wait for their first tokens, inject `fault` ("tp_worker"
    or "router"), send a probe every `probe_period_s` (streamed, left after its first token: the
    new unit's first request is a disconnect) until a new unit serves, then check the unit again
    `settle_s` later (more than one health-check period)."""
    old = (await unit_state_async(app))["unit"]
    url = base_url + "/v1/completions"
    stream_body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                   "stream": True}
    probe_body = {"model": model, "prompt": "Hello there", "max_tokens": 8, "stream": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        started = [asyncio.Event() for _ in range(num_streams)]
        streams = [asyncio.create_task(request_outcome(client, url, stream_body, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 120.0)
        kill_t = time.perf_counter()
        method = kill_tp_worker(old) if fault == "tp_worker" else kill_router_replica(app, old)
        run = FaultRun(fault, method, old, kill_t, [], [])
        probes: list[asyncio.Task[Outcome]] = []

        async def send_probes() -> None:
            while True:
                probes.append(asyncio.create_task(request_outcome(client, url, probe_body, cut_after_chunks=1)))
                await asyncio.sleep(probe_period_s)

        sender = asyncio.create_task(send_probes())
        watcher = asyncio.create_task(_until_new_unit(app, old, run))
        try:
            run.streams = list(await asyncio.wait_for(asyncio.gather(*streams), timeout_s))
            while time.perf_counter() - kill_t < timeout_s:
                if run.unit_ready_t is not None and any(p.done() and p.result().kind in ("cut", "finished")
                                                        for p in probes):
                    break
                await asyncio.sleep(0.25)
        finally:
            sender.cancel()
            watcher.cancel()
        run.probes = list(await asyncio.wait_for(asyncio.gather(*probes), timeout_s))
    await asyncio.sleep(settle_s)
    run.state_after = await unit_state_async(app)
    return run


