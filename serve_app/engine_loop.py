"""The async engine loop of one serving unit: the core Scheduler on the wall clock.

Owns: `EngineLoop` — per-request token streams (coalesced when the unit is busy:
`StreamCoalescing`; arrival taken from the ingress's clock), the step loop (schedule -> execute ->
on_step_done -> fan tokens out), micro-wait sleeps, abort on cancellation, and failure
handling. It makes no policy decision (tidal_core does) and knows nothing of Serve:
the ServingUnit deployment (serve_app/unit.py) wraps it, and tests drive it with a fake executor.

Failure: if the executor raises (a TP worker died or stalled: `WorkerFailure`), every
in-flight request receives an `EngineError` (503, `engine_failed`) at once, the loop stops,
and `healthy` turns False so Serve's health check replaces the unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from serve_app.unit_api import UNIT_REPLACED, EngineError, GenerateChunk, GenerateRequest
from tidal_core import Idle, Request, Run, Scheduler, StepOutputs, StepPlan, UnitLoad, WaitUntil
from tidal_core.block_hash import HashScheme
from tidal_core.front_admission import DoorRefusal, absorb_door_refusals, published_load
from tidal_core.plan import AsyncExecutor
from tidal_core.service_class import ServiceClass

log = logging.getLogger("tidalserve.engine")

# A front-end delay larger than this is not believed (a node's clock is off): treated as none.
MAX_FRONT_END_DELAY_S = 60.0
_END = object()  # queue sentinel: the request is over (its finish reason is on the stream)


class EngineObserver(Protocol):
    """Metrics hooks (serve_app/metrics.py); every method must be cheap."""

    def on_arrival(self) -> None: ...
    def on_rejection(self, reason: str) -> None: ...
    def on_step(self, sched: Scheduler, plan: StepPlan, device_time_s: float, step_gap_s: float,
                now: float) -> None: ...
    def on_first_token(self, req: Request, now: float) -> None: ...
    def on_finish(self, req: Request, now: float) -> None: ...
    def on_engine_error(self, kind: str) -> None: ...


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Stream:
    __slots__ = ("ended", "finish_reason", "last_sent", "logprobs", "queue", "request", "waiter")

    def __init__(self, request: Request, logprobs: bool) -> None:
        self.request = request
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.logprobs = logprobs
        self.last_sent: float | None = None  # when its last chunk was yielded (None: nothing yet)
        self.ended = False  # its end (or an error) is queued
        self.waiter: asyncio.Future[None] | None = None  # set while a chunk is held

    def end(self, item: object) -> None:
        """Queue the end (or an error); a held chunk goes out at once."""
        self.ended = True
        self.queue.put_nowait(item)
        if self.waiter is not None:
            _wake(self.waiter)


@dataclasses.dataclass(frozen=True)
class StreamCoalescing:
    """When many streams are open, send each stream's tokens at most every `interval_s`.

    Every streamed chunk costs the front end (Serve's streaming call to the ingress, an SSE event,
    the proxy's HTTP write) about the same whatever it holds, so under load the ingress and
    proxy spend their CPU per chunk, not per token (docs/reliability.md, finding 4). With at
    least `min_streams` streams open, a stream's tokens wait until `interval_s` has passed since
    its previous chunk and go out together; with fewer (a quiet unit), every token goes out as it
    is made. A stream's first chunk (TTFT) and its last (finish or error) are never held, so no
    request ends later and a client's time per output token is unchanged; only the gaps between
    chunks grow (vLLM's and SGLang's `stream_interval` trade the same thing, counted in tokens).
    """

    interval_s: float = 0.0
    min_streams: int = 1

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.min_streams < 1:
            raise ValueError(f"stream coalescing needs interval_s >= 0 and min_streams >= 1, got {self}")


class EngineLoop:
    def __init__(self, scheduler: Scheduler, executor: AsyncExecutor, observer: EngineObserver | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 coalescing: StreamCoalescing = StreamCoalescing(), unit_id: str = "") -> None:
        self.sched = scheduler
        self.unit_id = unit_id
        self.coalescing = coalescing
        self.executor = executor
        self.observer = observer
        self.clock = clock
        self.streams: dict[str, _Stream] = {}
        self.healthy = True
        self.failure: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_step_end: float | None = None
        cfg = scheduler.config
        # How this unit hashes prompt blocks (None: no prefix caching): carried hashes of any
        # other scheme are ignored and the scheduler hashes the prompt itself.
        self.hash_scheme = HashScheme(cfg.block_size, cfg.prefix_cache_namespace) \
            if cfg.enable_prefix_caching else None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            # A fresh context, not the caller's: started from inside the first request, the loop would
            # inherit that request's Ray task id, and when that request is cancelled (its client left)
            # Ray cancels its child tasks too: the TP workers' step in flight, failing the whole unit.
            self._task = asyncio.get_running_loop().create_task(self._run(), name="tidal-engine-loop",
                                                                context=contextvars.Context())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, gen: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream one request's tokens. Closing the iterator aborts the request."""
        self.start()
        if not self.healthy:
            # The cause stays in the log and in unit_state()["failure"]: clients are not shown
            # the cluster's insides (actor ids, pids, addresses).
            yield GenerateChunk(error=EngineError.unavailable("engine_failed", UNIT_REPLACED, 5.0))
            return
        now = self.clock()
        # Arrival is when the front end received the request (its wall clock, moved onto this
        # loop's clock): admission then judges, and TTFT metrics measure, the client's TTFT, with
        # the time spent in the proxy and ingress, not only the time in this unit.
        waited = time.time() - gen.arrival_s
        if not 0.0 < waited <= MAX_FRONT_END_DELAY_S:
            waited = 0.0
        req = Request(gen.request_id, len(gen.prompt_token_ids), gen.sampling, now - waited,
                      list(gen.prompt_token_ids), service_class=gen.service_class)
        if gen.prompt_hashes is not None and self.hash_scheme is not None:  # hashed once, by the ingress
            req.block_hashes = gen.prompt_hashes.usable_for(self.hash_scheme, req.num_prompt_tokens)
        if self.observer:
            self.observer.on_arrival()
        rejection = self.sched.add_request(req, now)
        if rejection is not None:
            if self.observer:
                self.observer.on_rejection(rejection.reason)
            status, kind = (429, "rate_limit_error") if rejection.retryable else (400, "invalid_request_error")
            yield GenerateChunk(num_prompt_tokens=req.num_prompt_tokens,
                                error=EngineError(status, kind, rejection.reason, rejection.message,
                                                  rejection.retry_after_s if rejection.retryable else None),
                                load=self.load(now) if gen.report_load else None,
                                waited_s=waited if gen.report_load else None)
            return
        stream = _Stream(req, gen.sampling.logprobs is not None)
        self.streams[gen.request_id] = stream
        self._wake.set()
        try:
            if gen.report_load:  # the admission verdict, at once (the first token may be seconds away)
                yield GenerateChunk(num_prompt_tokens=req.num_prompt_tokens, load=self.load(now), waited_s=waited)
            async for chunk in self._drain(stream):
                yield chunk
        finally:
            self.streams.pop(gen.request_id, None)
            if not req.is_finished:
                self.sched.abort(gen.request_id, self.clock())
                self._wake.set()

    def load(self, now: float, refused_at_door: Sequence[DoorRefusal] = ()) -> UnitLoad:
        """The unit's published snapshot (front-end admission, routing, autoscaling), after counting
        the requests a front gate refused since its last poll, one (prompt estimate, reason) each
        (`refused_at_door`, `absorb_door_refusals`)."""
        absorb_door_refusals(self.sched, now, refused_at_door)
        self.sched.observe(now)  # an idle unit's regime too: it leaves OVERLOAD once nothing is refused
        return published_load(self.sched, now, self.unit_id)

    async def _hold(self, stream: _Stream) -> None:
        """Wait until the stream's next chunk is due (see StreamCoalescing), or until it ends."""
        rule = self.coalescing
        if stream.last_sent is None or stream.ended or len(self.streams) < rule.min_streams:
            return
        delay = stream.last_sent + rule.interval_s - self.clock()
        if delay <= 0:
            return
        loop = asyncio.get_running_loop()
        stream.waiter = waiter = loop.create_future()
        timer = loop.call_later(delay, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            stream.waiter = None

    async def _drain(self, stream: _Stream) -> AsyncIterator[GenerateChunk]:
        queue = stream.queue
        num_prompt = stream.request.num_prompt_tokens
        hold = self.coalescing.interval_s > 0
        served: ServiceClass | None = stream.request.service_class  # as the scheduler admitted it
        while True:
            item = await queue.get()
            if hold:  # an end or an error sets `stream.ended` first: `_hold` never delays one
                await self._hold(stream)
            tokens: list[int] = []
            logprobs: list[list[tuple[int, float]]] | None = [] if stream.logprobs else None
            done = False
            error: EngineError | None = None
            while True:  # coalesce whatever is already queued into one chunk
                if item is _END:
                    done = True
                elif isinstance(item, EngineError):
                    error = item
                    done = True
                else:
                    tok, lp = item
                    tokens.append(tok)
                    if logprobs is not None:
                        logprobs.append(lp or [])
                if done or queue.empty():
                    break
                item = queue.get_nowait()
            stream.last_sent = self.clock()
            yield GenerateChunk(tokens, stream.finish_reason if done and error is None else None, logprobs,
                                num_prompt, error, num_cached_tokens=stream.request.num_cached_tokens,
                                service_class=served)
            served = None  # said once, on the first chunk
            if done:
                return

    # ---- the step loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        sched = self.sched
        try:
            decision = sched.schedule(self.clock())
            while True:
                if type(decision) is Run:
                    after = await self._steps(decision.plan)
                    decision = after if after is not None else sched.schedule(self.clock())
                    continue
                if type(decision) is WaitUntil:
                    self._wake.clear()
                    # `asyncio.timeout`, not `wait_for`: on Python 3.11 a `wait_for` whose event was
                    # just set can swallow the loop's cancellation, and `stop()` then waits forever.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, decision.deadline_s - self.clock())):
                            await self._wake.wait()
                else:
                    assert type(decision) is Idle
                    self._wake.clear()
                    await self._wake.wait()
                decision = sched.schedule(self.clock())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an executor failure or a bug: fail every request loudly, never hang
            log.exception("engine loop failed")
            self._fail(exc)

    async def _steps(self, plan: StepPlan) -> WaitUntil | Idle | None:
        """Run steps back to back from `plan` until the scheduler decides otherwise; return that
        decision (None: schedule again).

        The next plan depends only on the scheduler's state, which `on_step_done` has brought up
        to date, not on the tokens reaching their clients. So each next step is scheduled and
        dispatched first (its task is queued on the loop before any stream's consumer is woken),
        and the fan-out, the metrics and the consumers' work (Serve's streaming of each chunk) run
        while the workers compute it, instead of leaving them idle between two steps. One step is
        in flight at a time. When the next decision is a wait, the consumers run first, and an
        arrival or an abort among them (`_wake`) makes the loop schedule again, as it would have
        after the wait.
        """
        sched = self.sched
        start = self.clock()
        running = asyncio.ensure_future(self.executor.execute(plan))
        try:
            while True:
                result = await running
                now = self.clock()
                outputs = sched.on_step_done(plan, result, now)
                gap = now - (self._last_step_end if self._last_step_end is not None else start)
                self._last_step_end = now
                decision = sched.schedule(now)
                if type(decision) is not Run:
                    self._wake.clear()
                    self._fan_out(plan, outputs, result.device_time_s, gap, now)
                    await asyncio.sleep(0)  # nothing in flight: the consumers run before the loop waits
                    return None if self._wake.is_set() else decision
                running = asyncio.ensure_future(self.executor.execute(decision.plan))
                self._fan_out(plan, outputs, result.device_time_s, gap, now)
                plan = decision.plan
        finally:
            if not running.done():  # cancelled, or a bug in the fan-out: no step left running
                running.cancel()

    def _fan_out(self, plan: StepPlan, outputs: StepOutputs, device_time_s: float, gap: float,
                 now: float) -> None:
        """One step's tokens to their streams, and its metrics."""
        observer = self.observer
        if observer:
            observer.on_step(self.sched, plan, device_time_s, gap, now)
        streams = self.streams
        logprobs = outputs.logprobs or {}
        for rid, tok in outputs.tokens.items():
            stream = streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait((tok, logprobs.get(rid)))
        if observer:
            for rid in outputs.first_token_ids:
                stream = streams.get(rid)
                if stream is not None:
                    observer.on_first_token(stream.request, now)
        for req in outputs.finished:
            if observer:
                observer.on_finish(req, now)
            stream = streams.get(req.request_id)
            if stream is not None:
                stream.finish_reason = req.finish_reason.value if req.finish_reason else None
                stream.end(_END)

    def _fail(self, exc: BaseException) -> None:
        self.healthy = False
        self.failure = f"{type(exc).__name__}: {exc}"
        if self.observer:
            self.observer.on_engine_error(type(exc).__name__)
        error = EngineError.unavailable("engine_failed", "the serving unit failed mid-request; retry", 5.0)
        self.sched.abort_all(self.clock())
        for stream in list(self.streams.values()):
            stream.end(error)
