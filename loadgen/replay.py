"""Open-loop replay of a trace against any OpenAI-compatible server (`tidal replay`).

Owns: `ReplayConfig`, `replay` / `replay_async` (the driver) and `ReplayReport`.

Open loop: one dispatcher coroutine walks the schedule and, at each request's scheduled time,
launches an asyncio task for it and moves on; it never waits for a response. The HTTP pool has
no cap by default, so no connection limit can hold a send back either. If the client itself
cannot keep up (its event loop is late, or a connection takes long to open), the request goes
out late and that lateness is recorded per request as drift (on the wire minus scheduled) and
reported as p50/p99/max, with a warning while it happens: a slow client never hides a slow
server. When the schedule ends, requests still in flight get `drain_timeout_s` to finish and are
then cancelled and counted as incomplete, so completed + rejected + errors + incomplete = sent.
Ctrl-C stops sending, cancels what is in flight and still writes the results.

Results (see `loadgen.replay_results` for the exact fields and time units): `requests.jsonl`,
`summary.json`, `per_hour.json`, `timeline.png`, `ttft_p99_per_hour.png`, `latency_cdf.png`.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import math
import random
import resource
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadgen.client import ClientConfig, HttpClients, RequestResult, RequestSpec, send_request
from loadgen.progress import LiveStats, ProgressBar
from loadgen.prompts import build_prompt
from loadgen.records import Trace
from loadgen.replay_results import Recorder, write_outputs
from loadgen.replay_retries import send_with_retries
from loadgen.report import Slo
from loadgen.retry_policy import RetryPolicy

PROGRESS_EVERY_S = 0.5
PEAK_WINDOW_S = 10.0
SHARD_CONNECTIONS = 16  # expected connections per httpx pool (see loadgen.client.HttpClients)
MAX_SHARDS = 256
_YIELD_EVERY = 64  # when behind schedule, let launched tasks run between launches


@dataclass(frozen=True)
class ReplayConfig:
    run_name: str = "replay"
    time_scale: float = 1.0  # what the trace was compressed by; sets the per-hour bins (trace hours)
    duration_s: float | None = None  # send only requests scheduled before this (wall seconds)
    drain_timeout_s: float = 120.0
    slo: Slo = field(default_factory=Slo)
    gpus: float = 0.0  # GPUs behind the server, for gpu_hours (0 when unknown)
    pool_shards: int | None = None  # httpx clients to spread connections over; None: from the trace
    progress: bool = True
    plots: bool = True
    retries: RetryPolicy | None = None  # retry refusals as the openai client does (`tidal replay` default)

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale={self.time_scale} must be finite and > 0")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s={self.duration_s} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")


@dataclass
class ReplayReport:
    summary: dict[str, Any]
    out_dir: Path
    sent: int
    interrupted: bool


def _raise_fd_limit() -> None:
    """Many requests in flight need many sockets: lift the soft open-files limit to the hard one."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def pool_shards_for(trace: Trace, window_s: float = PEAK_WINDOW_S) -> int:
    """httpx clients for `trace`: its most requests sent in any `window_s` (about the requests in
    flight at the peak when responses take that long), SHARD_CONNECTIONS per client, 1 to 256."""
    arrival = trace.arrival_s
    if arrival.size == 0:
        return 1
    most = int((np.searchsorted(arrival, arrival + window_s, side="left") - np.arange(arrival.size)).max())
    return max(1, min(MAX_SHARDS, math.ceil(most / SHARD_CONNECTIONS)))


def _spec(trace: Trace, i: int) -> RequestSpec:
    prompt = trace.prompts[i] if trace.prompts else None
    ids = trace.prefix_ids[i] if trace.prefix_ids is not None else None
    return RequestSpec(i, int(trace.input_tokens[i]), int(trace.output_tokens[i]), prompt, ids,
                       trace.prefix_block_size)


async def _dispatch(trace: Trace, start_t: float, launch: Callable[[int], None]) -> None:
    clock = time.perf_counter
    for i, at in enumerate(trace.arrival_s.tolist()):
        delay = start_t + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        elif i % _YIELD_EVERY == 0:
            await asyncio.sleep(0)
        launch(i)


async def _show_progress(bar: ProgressBar, stats: LiveStats, start_t: float) -> None:
    while True:
        now = time.perf_counter() - start_t
        bar.update(now, stats.snapshot(now))
        await asyncio.sleep(PROGRESS_EVERY_S)


def _on_interrupt(stop: asyncio.Event) -> Callable[[], None]:
    """Ctrl-C sets `stop`; returns the undo (a no-op where signals cannot be handled)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        return lambda: None

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGINT)

    return undo


async def _until(stop: asyncio.Event, aws: set[asyncio.Future[Any]], timeout: float | None) -> bool:
    """Wait for all of `aws` (or the timeout); False if `stop` was set first."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        pending = set(aws)
        deadline = None if timeout is None else time.perf_counter() + timeout
        while pending and not stop.is_set():
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                break
            _, pending = await asyncio.wait({*pending, waiter}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(waiter)
        return not stop.is_set()
    finally:
        waiter.cancel()


async def _warm_up(client: httpx.AsyncClient, base_url: str) -> None:
    """One GET before the clock starts: fails fast when nobody listens, and pays the client's
    first-request costs (lazy imports, the first connection) outside the measured schedule."""
    build_prompt(1, seed=0)  # reads the prompt passage once
    try:
        await client.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
    except httpx.ConnectError as exc:
        raise ConnectionError(f"cannot connect to {base_url}: {exc}") from exc
    except httpx.HTTPError:
        pass  # a slow or odd /v1/models is no reason not to replay


class _InFlight:
    """The requests of one replay between launch and record: launch on schedule, record when done."""

    def __init__(self, trace: Trace, client_config: ClientConfig, clients: HttpClients, rec: Recorder,
                 stats: LiveStats, retries: RetryPolicy | None = None) -> None:
        self.trace, self.client_config, self.clients, self.rec, self.stats = trace, client_config, clients, rec, stats
        self.retries = retries
        self.tasks: dict[int, tuple[asyncio.Task[RequestResult], RequestResult]] = {}

    def launch(self, i: int) -> None:
        now = time.perf_counter()
        spec = _spec(self.trace, i)
        result = RequestResult(i, spec.input_tokens)
        client = self.clients.for_request(i)
        coro: Coroutine[Any, Any, RequestResult]
        if self.retries is None:
            coro = send_request(client, self.client_config, spec, result=result)
        else:  # each request's jitter from its own seeded stream: the same trace retries the same way
            rng = random.Random(self.client_config.seed * 1_000_003 + i)
            coro = send_with_retries(client, self.client_config, spec, self.retries, rng, result)
        task = asyncio.create_task(coro)
        self.tasks[i] = (task, result)
        self.stats.on_sent(now - self.rec.start_t, self.rec.on_launch(i, now))
        task.add_done_callback(functools.partial(self._finish, i))

    def _finish(self, i: int, task: asyncio.Task[RequestResult]) -> None:
        _, result = self.tasks.pop(i)
        if task.cancelled() or task.exception() is not None:
            result.status = "incomplete"
            result.error = result.error or ("cancelled at the end of the drain" if task.cancelled()
                                            else f"client bug: {task.exception()!r}")
        self.rec.record(result)
        ttft = result.first_token_t - result.sent_t if result.status == "ok" else None
        self.stats.on_done(time.perf_counter() - self.rec.start_t, result.status, ttft)

    async def run(self, dispatcher: asyncio.Task[None], stop: asyncio.Event, drain_timeout_s: float) -> None:
        """Until the schedule is sent and drained (or `stop`); then cancel whatever is left."""
        if not await _until(stop, {dispatcher}, None):
            dispatcher.cancel()
        elif self.tasks:
            await _until(stop, {t for t, _ in self.tasks.values()}, drain_timeout_s)
        left = [t for t, _ in self.tasks.values()]
        for task in left:
            task.cancel()
        # Each task's done callback (the record) runs before gather returns.
        await asyncio.gather(*left, dispatcher, return_exceptions=True)


async def replay_async(trace: Trace, client_config: ClientConfig, config: ReplayConfig, out_dir: str | Path,
                       transport: httpx.AsyncBaseTransport | None = None,
                       stop: asyncio.Event | None = None) -> ReplayReport:
    """Play `trace` (arrival times in wall seconds from the start) open loop; write the results.

    Setting `stop` (or Ctrl-C) ends the run early as an interruption: no more sends, requests in
    flight cancelled (incomplete), results written.
    """
    out = Path(out_dir)
    if config.duration_s is not None and config.duration_s < trace.duration_s:
        trace = trace.window(0.0, config.duration_s)
    _raise_fd_limit()
    if client_config.max_keepalive is None:  # per pool: twice its expected share, to absorb bursts
        client_config = dataclasses.replace(client_config, max_keepalive=2 * SHARD_CONNECTIONS)
    # A connection cap is meant for the whole client: keep one pool then.
    shards = config.pool_shards or (1 if client_config.max_connections is not None else pool_shards_for(trace))
    stats, stop = LiveStats(), stop if stop is not None else asyncio.Event()
    bar = ProgressBar(trace.duration_s, enabled=config.progress, desc=config.run_name)
    # The clients first: building them (TLS context, certificate bundle) takes ~0.1 s, which
    # would otherwise show up as drift on the first requests.
    async with HttpClients(client_config, shards, transport) as clients:
        await _warm_up(clients.for_request(0), client_config.base_url)
        started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        rec = Recorder(trace, out / "requests.jsonl", time.perf_counter(), config.time_scale)
        flight = _InFlight(trace, client_config, clients, rec, stats, config.retries)
        undo = _on_interrupt(stop)
        shower = asyncio.create_task(_show_progress(bar, stats, rec.start_t))
        dispatcher = asyncio.create_task(_dispatch(trace, rec.start_t, flight.launch))
        try:
            await flight.run(dispatcher, stop, config.drain_timeout_s)
        finally:
            undo()
            shower.cancel()
            rec.close()
    if not dispatcher.cancelled() and dispatcher.exception() is not None:
        raise RuntimeError("the replay dispatcher failed") from dispatcher.exception()
    wall_s = time.perf_counter() - rec.start_t
    bar.update(wall_s, stats.snapshot(wall_s))
    bar.close()
    extra = {"client": client_config.as_dict(),
             "replay": {"trace": trace.name, "trace_source": trace.source, "scheduled": len(trace),
                        "sent": stats.sent, "interrupted": stop.is_set(), "pool_shards": shards,
                        "started_at": started_at, "wall_s": round(wall_s, 3), "time_scale": config.time_scale,
                        "duration_s": config.duration_s, "drain_timeout_s": config.drain_timeout_s,
                        "requests_file": "requests.jsonl", "time_unit": "wall seconds from the run start",
                        "slo": asdict(config.slo),
                        "retries": asdict(config.retries) if config.retries is not None else None}}
    summary = write_outputs(out, config.run_name, rec, slo=config.slo, duration_s=trace.duration_s,
                            time_scale=config.time_scale, gpus=config.gpus, extra=extra, plot=config.plots)
    drift_p99 = summary["drift"]["p99_ms"]
    if drift_p99 is not None and drift_p99 > 50.0:
        bar.warn(f"send drift p99 was {drift_p99:.0f} ms (max {summary['drift']['max_ms']:.0f} ms): the client "
                 "fell behind the schedule, so the server saw less load than the trace asks for")
    return ReplayReport(summary, out, stats.sent, stop.is_set())


def replay(trace: Trace, client_config: ClientConfig, config: ReplayConfig, out_dir: str | Path,
           transport: httpx.AsyncBaseTransport | None = None) -> ReplayReport:
    """`replay_async` on a fresh event loop (uvloop when installed: less client overhead, less drift)."""
    coro = replay_async(trace, client_config, config, out_dir, transport)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
