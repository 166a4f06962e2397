"""Front-end admission in the ingress: refuse at the door, before any queue holds a request.

Owns: `FrontGate` (the units' latest snapshots as this ingress replica sees them, kept fresh by a
poll and by every verdict a unit sends back; the verdict of `tidal_core.FrontAdmission` on each
new request; the spread of every 429's retry-after: `tidal_core.RetrySpread`) and the headers the
gates and the units answer with (`gate_headers`). The ingress asks its gate from an ASGI
middleware before FastAPI parses a body (serve_app/ingress_gate.py), the proxy from its own
(serve_app/proxy_gate.py).

Freshness. In a burst, hundreds of requests arrive before the first verdict on any of them comes
back; so each request let through is *pending* until its unit's verdict (or its end), and the
pending prompts are counted on top of the snapshots, priced as the unit prices a burst
(`FrontAdmission.check`'s `OnTheWay`; a request's ticket is found through a context variable).
Two sources feed the snapshots: (1) each request let through asks its unit to attach its
`UnitLoad` to the admission verdict (`GenerateRequest.report_load`; an admission sends it at once
in a chunk of its own), so while traffic flows the gate knows each unit's state as of the last
verdict; (2) a background task polls `ServingUnit.load_stats` every `period_s` (0.1 s), so a gate
that refuses everything still sees the unit drain. A snapshot older than `max_age_s` (5 s) is not
believed: the request then goes to the unit, whose own admission is the final authority.

The door's refusals reach the units. A request refused here never reaches a unit, so a unit's
load (its arrival rate) would see only what the door let through, about its capacity in any
overload: its regime would stay short of OVERLOAD (the rules it applies there, such as
`prompt_over_target`, would not) and an autoscaler reading its load and refusals would miss the
demand turned away. Each poll passes on the refusals since the last one, with each one's prompt
estimate and reason (`load_stats(refusals)`:
tidal_core/front_admission.py `absorb_door_refusals`), and a gate with refusals to pass on polls
even while verdicts keep its snapshots fresh, at most every `period_s`.

The poll is paced by what it serves: each poll costs CPU in the gate, the unit and Ray, which a
2-core box takes from the model's steps. While requests come through (or wait for verdicts) it
polls every `period_s`; when none came since its last poll it dozes for `idle_period_s` (1 s,
inside `max_age_s`) and the next request wakes it. It skips a poll while verdicts keep every
snapshot younger than `period_s`, and keeps the idle pace under traffic where no verdict could
refuse soon (`FrontAdmission.watch_closely`: `make serve`'s protect mode, every queue under half
its limit; the fast poll cost the dev server 8% of its single-stream tokens/s, RESULTS.md).

The way to the unit. A unit's verdict also says how long its request had waited (since the
proxy's arrival stamp) when the unit received it (`GenerateChunk.waited_s`): this gate learns its
stretch of the way from it (that wait less the one it judged the request with: `PathModel`, per
request on the way), and adds it to the response (`UNIT_WAITED`), from which the proxy's gate
learns the whole way. The work let through cannot start before it arrives, and on a small box in
a burst the way is what set the slowest 429s (tidal_core/front_admission.py).

What happened behind the gate. A gate's prediction is made before its unit's, from less, and
where it errs low the request is refused one or two hops later, in a burst the slowest 429s. So
each response to a request let through tells the gate whether its unit admitted it or a gate or
unit behind refused it for its predicted TTFT (`REFUSAL_REASON`: `prefill_backlog`), and the gate
acts on the share of the unit's limit that keeps about 3% of what it lets through from being
refused there (`judged_behind`; tidal_core/door_aim.py `DoorAim`). The aim goes to `on_aim` (a
gauge) when it changes and again every `AIM_REPORT_S` from the poll loop: Ray's metrics agent drops
a gauge series that is not set again within two export intervals (20 s), and an aim that holds
still for minutes (a quiet door) would vanish from Prometheus while its gate runs.

A prompt is estimated from the body's size (`Content-Length`) at the bytes per token the verdicts
taught (`PromptSizeModel`; the Ingress's gate passes their token counts on as `PROMPT_TOKENS`).

Must not import: torch, transformers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

from serve_app.openai.errors import OpenAIError
from tidal_core import AdmissionConfig, UnitLoad
from tidal_core.door_aim import DoorAim
from tidal_core.front_admission import FrontAdmission, FrontRefusal, OnTheWay, PathModel, PromptSizeModel, Sighting
from tidal_core.retry_spread import RetrySpread, retry_after_ms

logger = logging.getLogger(__name__)
POLL_PERIOD_S = 0.1
IDLE_POLL_PERIOD_S = 1.0  # between polls while no request comes through the gate
POLL_TIMEOUT_S = 1.0
_FORGET_AFTER_S = 60.0  # a unit not heard from for this long (a replaced replica) is dropped
PENDING_FOR_S = 5.0  # a request let through counts as pending at most this long
AIM_REPORT_S = 5.0  # the aim is set on its gauge at least this often (Ray drops a gauge unset for 20 s)
MAX_UNDELIVERED = 4096  # refusals kept for the next poll while none gets through (a unit being rebuilt)


@dataclasses.dataclass(eq=False)
class _Ticket:
    """A request let through, not yet seen by its unit: the prompt tokens it puts ahead of the
    requests behind it (its estimate, or none: `FrontAdmission.on_the_way_tokens`), when it left,
    how long it had waited then (since the proxy's arrival stamp), how many requests were on the
    way with it (itself included), its body's bytes and, from its unit's verdict, its wait when
    the unit received it and its prompt's tokens."""

    tokens: int
    sent_s: float
    waited_s: float = 0.0
    on_the_way: int = 1
    body_bytes: int = 0
    unit_waited_s: float | None = None
    prompt_tokens: int | None = None


_TICKET: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("tidal_front_ticket", default=None)


def current_ticket() -> _Ticket | None:
    """The ticket of the request in whose context this runs, if a gate let it through."""
    return _TICKET.get()


class FrontGate:
    def __init__(self, admission: AdmissionConfig, poll: Callable[[list[int]], Awaitable[UnitLoad]] | None = None, *,
                 period_s: float = POLL_PERIOD_S, idle_period_s: float = IDLE_POLL_PERIOD_S,
                 closed: Callable[[], OpenAIError | None] | None = None,
                 pending_for_s: float = PENDING_FOR_S, count_arrivals: bool = False,
                 on_refusal: Callable[[str], None] | None = None, on_aim: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.admission = FrontAdmission(admission)
        self.spread = RetrySpread(admission.max_retry_after_s)
        self.sightings: dict[str, Sighting] = {}
        self.refused: dict[str, int] = {}
        # The refusals the next poll passes on to a unit, one (prompt estimate, reason) each (its load, refusal
        # meters and `costly_prompt` sample count them); at most `MAX_UNDELIVERED` while no poll gets through.
        self.undelivered: list[tuple[int, str]] = []  # `DoorRefusal`s
        self._on_refusal = on_refusal  # each 429's reason, e.g. to a counter (`serve_app.metrics.refusal_counter`)
        self._poll = poll
        self._closed = closed  # e.g. a failed unit being rebuilt: 503 at the door
        if not 0.0 < period_s <= idle_period_s < self.admission.max_age_s:
            raise ValueError(f"front gate: need 0 < period_s ({period_s}) <= idle_period_s ({idle_period_s}) < "
                             f"the snapshots' max age ({self.admission.max_age_s} s)")
        self.period_s, self.idle_period_s = period_s, idle_period_s
        self._wake: asyncio.Event | None = None  # set by a request while the poll sleeps its idle period
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dozing = False
        self._requests_since_poll = 0
        self.num_polls = 0
        self.clock = clock
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._pending: set[_Ticket] = set()
        self.pending_for_s = pending_for_s
        # With `count_arrivals` (a gate that never sees the verdicts: the proxy's), the requests on
        # the way are those let through, less those the units say they received since first seen,
        # less those answered without reaching a unit, and never more than those still open.
        self.count_arrivals = count_arrivals
        # (prompt estimate, when it was let through), in order
        self._sent: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self.path = PathModel()  # how long the way to the units takes (learned from the units' verdicts)
        self.sizes = PromptSizeModel()  # a prompt's tokens from its body's bytes (learned from the same)
        self.aim = DoorAim()  # the share of a unit's limit to act on (learned from the refusals made behind)
        self._on_aim = on_aim  # each new aim, e.g. to a gauge (`serve_app.metrics.aim_gauge`)
        self._aim_reported_s = -math.inf  # when `on_aim` was last called (`_report_aim`)
        self._num_sent = 0
        self._num_skipped = 0  # answered without reaching a unit (the ingress refused them, a 400...)
        self._arrived: dict[str, tuple[int, int]] = {}  # unit -> (num_arrived when first seen, latest)

    # ---- snapshots ------------------------------------------------------------------------
    def observe(self, load: UnitLoad, unit_waited_s: float | None = None, prompt_tokens: int | None = None) -> None:
        """A unit's snapshot, just received (from its verdict on a request, or from the poll); in
        a request's context, that request is no longer pending (the snapshot holds it), and its
        wait when the unit received it and its prompt's tokens teach the path and size models."""
        self._learn(unit_waited_s, prompt_tokens)
        self.release()
        now = self.clock()
        self.sightings[load.unit_id] = Sighting(load, now)
        first, _ = self._arrived.get(load.unit_id, (load.num_arrived - self._num_sent + self._num_skipped, 0))
        self._arrived[load.unit_id] = (first, load.num_arrived)
        if len(self.sightings) > 1:
            for uid in [u for u, s in self.sightings.items() if now - s.seen_s > _FORGET_AFTER_S]:
                del self.sightings[uid]

    def start(self) -> None:
        """Start the poll (idempotent); called from inside the replica's event loop."""
        if self._poll is not None and self._task is None:
            self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
            # A fresh context: the poll must not be a child of the request that started it.
            self._task = asyncio.get_running_loop().create_task(self._run_poll(), context=contextvars.Context())

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping = True  # ends the loop even if a cancellation were lost on the way
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task, self._stopping = None, False

    async def _run_poll(self) -> None:
        assert self._poll is not None and self._wake is not None
        while not self._stopping:
            if self.undelivered or not self._all_fresh(self.clock()):
                self._requests_since_poll = 0
                self.num_polls += 1
                refused, self.undelivered = self.undelivered, []  # at most once: a failed poll loses them
                try:
                    # `asyncio.timeout`, not `wait_for`: on Python 3.11 a `wait_for` whose inner call has
                    # just finished can swallow the task's cancellation, and `stop()` then waits forever.
                    async with asyncio.timeout(POLL_TIMEOUT_S):
                        load = await self._poll(refused)
                    self.observe(load)
                except asyncio.CancelledError:
                    raise
                except Exception:  # no unit yet, a unit being rebuilt, a timeout: keep the last view
                    logger.debug("front gate: polling a unit's load failed", exc_info=True)
            if self.clock() - self._aim_reported_s >= AIM_REPORT_S:
                self._report_aim()
            if not self._quiet() and self._watch_closely():
                await asyncio.sleep(self.period_s)
                continue
            self._wake.clear()
            self._dozing = True
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.idle_period_s):
                        await self._wake.wait()
            finally:
                self._dozing = False

    def _all_fresh(self, now: float) -> bool:
        """Every unit's snapshot is younger than `period_s` (verdicts keep it so): a poll would add nothing."""
        return bool(self.sightings) and all(now - s.seen_s < self.period_s for s in self.sightings.values())

    def _watch_closely(self) -> bool:
        """Some unit's verdict could refuse soon, or no unit answered yet: else the poll keeps its idle pace."""
        return not self.sightings or any(self.admission.watch_closely(s.load) for s in self.sightings.values())

    def _quiet(self) -> bool:
        """No request came through since the last poll and none waits for its verdict, and the poll has
        answered at least once (a gate still looking for its unit keeps polling at `period_s`)."""
        if self._requests_since_poll or not self.sightings:
            return False
        now = self.clock()  # a ticket whose verdict was lost stops counting after `pending_for_s`, as in `_on_the_way`
        return not any(now - t.sent_s <= self.pending_for_s for t in self._pending)

    # ---- verdicts -------------------------------------------------------------------------
    def refusal(self, body_bytes: int, waited_s: float = 0.0) -> OpenAIError | None:
        """The error to answer a new request of `body_bytes` with, or None to let it through.
        A request let through is *pending* (its prefill counted on top of the snapshots) until
        its unit's verdict arrives in its context (`observe`) or the request ends (`release`)."""
        self._requests_since_poll += 1
        if self._dozing and self._watch_closely():  # traffic after a quiet spell: fresh snapshots now
            self._dozing = False
            assert self._wake is not None and self._loop is not None
            self._loop.call_soon_threadsafe(self._wake.set)
        if self._closed is not None and (closed := self._closed()) is not None:
            return closed
        now = self.clock()
        tokens = self.sizes.tokens(body_bytes)
        way = self._on_the_way(now)
        verdict = self.admission.check(self.sightings.values(), now, tokens, waited_s, way, aim=self.aim.value)
        if verdict is not None:
            self.refused[verdict.reason] = self.refused.get(verdict.reason, 0) + 1
            if len(self.undelivered) < MAX_UNDELIVERED:
                self.undelivered.append((tokens, verdict.reason))
            if self._on_refusal is not None:
                self._on_refusal(verdict.reason)
            return _rate_limited(verdict)
        ahead = self.admission.on_the_way_tokens(self.sightings.values(), now, tokens)  # what it puts ahead
        if self.count_arrivals:
            self._sent.append((ahead, now))
            self._num_sent += 1
        ticket = _Ticket(ahead, now, waited_s, way.requests + 1, body_bytes)
        self._pending.add(ticket)
        _TICKET.set(ticket)
        return None

    def release(self) -> None:
        """The current request's unit has answered (or the request is over): no longer pending."""
        ticket = _TICKET.get()
        if ticket is not None:
            self._pending.discard(ticket)
            _TICKET.set(None)

    def answered(self, reached_a_unit: bool, unit_waited_s: float | None = None,
                 prompt_tokens: int | None = None) -> None:
        """With `count_arrivals`: the current request's response starts; it ends its pending time
        (`release`), and one that never reached a unit will never show in its arrival counter.
        `unit_waited_s`: how long it had waited when its unit received it (`UNIT_WAITED`);
        `prompt_tokens`: its prompt's tokens (`PROMPT_TOKENS`)."""
        if _TICKET.get() is not None and not reached_a_unit:
            self._num_skipped += 1
        self._learn(unit_waited_s, prompt_tokens)
        self.release()

    def judged_behind(self, status: int, reason: str | None) -> None:
        """The response to a request this gate let through starts with `status`: its unit admitted
        it (200), or a gate or unit behind this one refused it for `reason` (its `REFUSAL_REASON`);
        a `prefill_backlog` refusal there says this gate's prediction fell short (`DoorAim`)."""
        if status == 200 or (status == 429 and reason == "prefill_backlog"):
            before = self.aim.value
            self.aim.observe(refused_behind=status == 429)
            if self.aim.value != before:
                self._report_aim()

    def _report_aim(self) -> None:
        if self._on_aim is not None:
            self._on_aim(self.aim.value)
        self._aim_reported_s = self.clock()

    def _learn(self, unit_waited_s: float | None, prompt_tokens: int | None) -> None:
        """What the current request's verdict tells of the way to the units and of its prompt (once each)."""
        if (ticket := _TICKET.get()) is None:
            return
        if unit_waited_s is not None and ticket.unit_waited_s is None:
            ticket.unit_waited_s = unit_waited_s
            self.path.observe(unit_waited_s - ticket.waited_s, ticket.on_the_way)
        if prompt_tokens and ticket.prompt_tokens is None:
            ticket.prompt_tokens = prompt_tokens
            self.sizes.observe(ticket.body_bytes, prompt_tokens)

    def in_flight(self) -> int:
        """With `count_arrivals`: requests let through that no unit has reported receiving yet (other
        front ends' requests count as received ones, so this errs low), at most those still open."""
        received = sum(latest - first for first, latest in self._arrived.values())
        return max(0, min(len(self._pending), len(self._sent), self._num_sent - self._num_skipped - received))

    def _on_the_way(self, now: float) -> OnTheWay:
        """The requests let through that no snapshot holds yet (their estimated prompt tokens, how
        many, how long ago the oldest left) and how long a request let through now would take to
        reach its unit."""
        if self.count_arrivals:
            sent = list(itertools.islice(reversed(self._sent), self.in_flight()))
        else:
            for old in [t for t in self._pending if now - t.sent_s > self.pending_for_s]:
                self._pending.discard(old)  # a verdict lost on the way: a snapshot holds it by now
            sent = [(t.tokens, t.sent_s) for t in self._pending]
        n = len(sent)
        oldest = min((at for _, at in sent), default=now)
        path = self.path
        return OnTheWay(sum(tokens for tokens, _ in sent), n, now - oldest, path.path_s(n + 1), path.path_s(1))

    def retry_after_s(self, base_s: float | None) -> float:
        """The spread retry-after of a 429 whose own estimate is `base_s` (the gate's or a unit's)."""
        now = self.clock()
        capacity = sum(s.load.capacity_rps for s in self.sightings.values()
                       if now - s.seen_s <= self.admission.max_age_s)
        base = self.admission.config.min_retry_after_s if base_s is None or not math.isfinite(base_s) else base_s
        return self.spread.delay_s(now, base, capacity, self._rng.random())

    def retry_headers(self, base_s: float | None) -> dict[str, str]:
        """`Retry-After` in whole seconds (HTTP's form, rounded up) and `retry-after-ms` (read first by
        the OpenAI clients), both from the one spread delay."""
        delay = self.retry_after_s(base_s)
        return {"Retry-After": str(max(1, math.ceil(delay))), "retry-after-ms": str(retry_after_ms(delay))}


def _rate_limited(verdict: FrontRefusal) -> OpenAIError:
    return OpenAIError(429, verdict.message, "rate_limit_error", None, verdict.reason, verdict.retry_after_s)


REFUSED_BY = "x-tidal-refused-by"  # on a 429 / 503: where it was decided (proxy, ingress, unit)
REFUSAL_REASON = "x-tidal-refusal-reason"  # on a 429: the rule that refused it (the error's `code`)
# On a response to a request its unit gave a verdict on: how long the request had waited (since
# the proxy's arrival stamp) when the unit received it; the proxy's gate learns its path from it.
UNIT_WAITED = "x-tidal-unit-waited-ms"
# On the same responses: the prompt's tokens as its unit counted them; the proxy's gate learns the
# bytes of request body per prompt token from it.
PROMPT_TOKENS = "x-tidal-prompt-tokens"


def gate_headers(gate: FrontGate | None, err: OpenAIError, where: str) -> dict[str, str]:
    """The headers of an error response: a 429's retry-after spread by the gate, if there is one,
    and where the refusal was decided."""
    headers = err.headers()
    if gate is not None and err.status == 429:
        headers.update(gate.retry_headers(err.retry_after_s))
    if err.status == 429 and err.code:
        headers[REFUSAL_REASON] = err.code
    if err.status in (429, 503):
        headers[REFUSED_BY] = where
    return headers
