"""Front-end admission: refuse at the front door, from the units' published snapshots.

Owns: `FrontAdmission` (the verdict on one new request from the latest `UnitLoad` of each unit
and how old each is), `Sighting` (a snapshot and when the front end received it), `OnTheWay`
(what the front end let through that no snapshot holds yet), `PathModel` (how long the way to a
unit takes), `PromptSizeModel` (a prompt's tokens from its body's bytes), `price_per_token`,
`FrontRefusal`, and the unit's side: `published_load` and `absorb_door_refusals`. The front end
(Serve's proxy, the ingress) decides before any queue of its own, of Serve's or of a unit holds
the request, and before tokenizing: every rule reads the units' state only, so a request refused
here costs no tokenizer work and no hop to a unit.

The rules are those of `AdmissionController.check` (tidal_core/admission.py) on a snapshot,
predicting what the unit will see when the request arrives; the unit's own check stays the
final authority for every request let through:

- `queue_full`: the unit's queue held `max_queue_len` requests;
- `prefill_backlog`: work will still be ahead when the request arrives, and the time it already
  waited plus the work ahead plus its own prefill (uncached estimates, as below) exceeds the
  unit's published limit (`target_ttft_s` in OVERLOAD, `burst_factor` x it otherwise, times the
  unit's learned admission aim: core/admission.py `TtftAim`) times the front end's own aim
  (learned from the refusals made behind it: tidal_core/door_aim.py). The work ahead is the
  snapshot's predicted queueing delay less the time since it (the unit drains while it ages),
  then the prompts let through since (in a burst, hundreds arrive before any verdict comes back),
  which start when the oldest of them arrives (and this one not before it arrives itself:
  `OnTheWay.path_s` behind them, `head_path_s` for the oldest), priced per estimated token as
  the unit prices a burst of prompts arriving together (`price_per_token`: from the published
  `prefill_s_per_token` for one prompt to `burst_s_per_token` for `BURST_REQUESTS`), since each
  prompt admitted becomes a decode in the steps that prefill the ones behind it;
- `kv_pressure`: KV usage was at `kv_reject_usage` with requests waiting for room.

- `prompt_over_target`: in OVERLOAD, with nothing ahead when the request arrives, its prompt is
  longer than the unit's published `alone_limit_tokens` (the rule's bound and learned ratio,
  inverted by the unit: core/admission.py `AdmissionController.alone_limit_tokens`). The limit
  counts the tokens the unit's prefix cache will not hold, which the front end cannot see, so
  it counts the estimate less what the unit's published line of cached tokens says a prompt of
  its length finds cached (`UnitLoad.uncached_tokens`, core/cached_fit.py); and the time the
  request waited, which the unit adds, is left out, so this errs towards letting through (as does
  the bound's inversion: the unit reads it per token at 1,024 tokens, and beside decodes held to
  a TPOT target a longer prompt costs more per token, its first chunk being the cheapest);
- `costly_prompt` (checked right after `queue_full`, in the unit's order): the unit is over its
  capacity and the prompt (its uncached estimate, as above) is longer than the unit's published
  `costly_limit_tokens`, the longest it serves now (core/costly_prompts.py); retry after the
  unit's `overload_clear_s`.

Two estimates make the prediction, each learned from the units' verdicts: the prompt's tokens,
from the body's size (`PromptSizeModel`: each verdict says how many tokens its request's prompt
held), and the way to the unit (`PathModel`: each verdict says how long its request had waited
when it arrived). Without the way, the front end's prediction was a lower bound of the unit's
and it refused only what the unit would refuse; but in a burst into an idle unit the first
requests took 0.06-0.5 s to arrive on a small box, the unit counted that time, and the requests
the front end let through at the edge of the limit were refused by the unit after the full round
trip: the slowest 429s of a burst (docs/reliability.md, section 6). The prompts had the same
effect: estimated deliberately low (6 bytes a token), the hundreds let through before any verdict
came back were priced at 83% of the tokens the unit then counted (the burst benchmark's bodies
run at 5.0 bytes a token). The size is now meant to be right on average, so a request whose
prompt is shorter than learned may be refused where the unit would have admitted it, by the
margin of that difference. Priors set high on purpose would buy more margin against a burst into
one unit, and refuse part of a burst that a fleet could take whole: a development build with 4.5
bytes a token and 20 ms a request on the way let 14-16 of 32 requests sent at once through to two
idle units that would have taken them all (tests/integration/test_routing_fleet.py).

A snapshot older than `max_age_s` (5 s) is not believed (no verdict); a younger one is aged: its
queue drains in real time, so a busy snapshot refuses only while the queue it saw could not be
gone. (A short horizon would open the gate exactly when the front end is too starved to poll.)
With several units, a request is refused only when every unit with a fresh snapshot refuses
it: the request router would pick the best one. The retry-after of a refusal is the unit's
estimate (clamped as the unit clamps it); spreading retries is `RetrySpread`'s (retry_spread.py).

`absorb_door_refusals` is the other way: the front end's refusals (Serve's gates pass them on with
their polls), counted at the unit as if they had reached it. `published_load` is the snapshot a
unit publishes for this: `Scheduler.snapshot` with `prefill_s_per_token` and `burst_s_per_token`
measured as the scheduler's own marginal TTFT predictions, `num_arrived` and `ttft_limit_s` (the
regime's limit, which the request router's choice reads too).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tidal_core.admission import regime_limit_s
from tidal_core.config import AdmissionConfig
from tidal_core.costly_prompts import UNLIMITED
from tidal_core.regime import Regime
from tidal_core.scheduler import Scheduler
from tidal_core.snapshot import UnitLoad

DEFAULT_MAX_AGE_S = 5.0  # aged by the drain, a busy snapshot keeps refusing until its queue would be gone
_PROBE_TOKENS = 1024
BURST_REQUESTS = 16  # the burst probe: this many prompts of `_BURST_PROMPT_TOKENS` arriving together
_BURST_PROMPT_TOKENS = 256
PATH_PRIOR_S = 0.01  # `PathModel`'s time per request on the way before any verdict
# `PromptSizeModel`'s bytes of request body per prompt token before any verdict: what chat and
# completion bodies of English words measure with SmolLM2's tokenizer on this project's benchmarks
# (5.0-5.4, docs/reliability.md section 6); the verdicts then teach the deployment's own
PROMPT_BYTES_PER_TOKEN = 5.0


def ttft_limit_s(cfg: AdmissionConfig, regime: Regime) -> float:
    """The predicted TTFT past which a unit with this config refuses a request with work ahead
    (`prefill_backlog`) before it learned an aim (at `aim_start`); 0 where it never does
    (admission off, or "protect" mode). A snapshot carries the unit's learned one."""
    return regime_limit_s(cfg, regime) * cfg.aim_start


def published_load(sched: Scheduler, now: float, unit_id: str = "") -> UnitLoad:
    """`sched`'s snapshot with `prefill_s_per_token`: how much a prompt's tokens add to its
    predicted TTFT now (the measured prefill speed, corrections included), `burst_s_per_token`:
    the same per token of `BURST_REQUESTS` prompts arriving together (the last one's TTFT),
    `ttft_limit_s`, `alone_limit_tokens` (the `prompt_over_target` rule's longest prompt, on the
    unit's own bound per token) and `cached_fixed_tokens` with `cached_share` (how much of an
    arriving prompt its cache holds: core/cached_fit.py)."""
    snap = sched.snapshot(now, unit_id)
    with_prompt = sched.predicted_queue_delay_s(now, _PROBE_TOKENS)
    per_token = max(0.0, with_prompt - snap.queue_delay_s) / _PROBE_TOKENS
    burst_tokens = BURST_REQUESTS * _BURST_PROMPT_TOKENS
    with_burst = sched.predicted_queue_delay_s(now, burst_tokens, own_requests=BURST_REQUESTS)
    alone_per_token = sched.view.alone_prefill_s(_PROBE_TOKENS) / _PROBE_TOKENS
    ratio, clear = sched.load.overload(now)
    costly = sched.admission.costly_limit_tokens(snap.regime, sched.load, ratio)
    fixed, share = sched.q.cached_fit.line()
    return dataclasses.replace(snap, prefill_s_per_token=per_token,
                               burst_s_per_token=max(per_token, (with_burst - snap.queue_delay_s) / burst_tokens),
                               num_arrived=sched.stats.num_arrived,
                               ttft_limit_s=sched.admission.limit_s(snap.regime),
                               alone_limit_tokens=sched.admission.alone_limit_tokens(snap.regime, alone_per_token),
                               cached_fixed_tokens=fixed, cached_share=share,
                               costly_limit_tokens=costly if costly < UNLIMITED else 0,
                               overload_clear_s=clear)


DoorRefusal = tuple[int, str]  # a request refused at the door: (its prompt tokens, estimated; the rule)


def absorb_door_refusals(sched: Scheduler, now: float, refused: Sequence[DoorRefusal]) -> None:
    """The requests a front end refused at the door for `sched`'s unit since it last said
    (`FrontAdmission` refuses only what every unit would): they count as the unit's arrivals in
    its load and in its refusal meters (the regime's: those refused for the work ahead), as had
    they reached it. Without this the unit saw only what the door let through, about its capacity
    in any overload: its regime stayed short of OVERLOAD and an autoscaler reading its load and
    refusals missed the demand turned away. Their prompts, less what the unit's cache would hold
    (its `cached_fit`), join the `costly_prompt` rule's sample (without the long prompts the door
    refused, its limit would fall with every refusal). Not counted in `num_arrived` (the requests
    on the way) nor in the prompt mean."""
    num_refused = len(refused)
    if num_refused > 0:
        sched.load.on_arrivals_elsewhere(now, float(num_refused))
        sched.view.refusals.on_arrival(now, True, float(num_refused))
        for _, reason in refused:
            sched.regime.on_arrival(now, reason)
        if sched.admission.config.shed_costly_prompts_in_overload:
            sched.admission.costly.observe_many(sched.q.cached_fit.uncached(n) for n, _ in refused)


def price_per_token(load: UnitLoad, num_requests: int) -> float:
    """What each prompt token of `num_requests` requests arriving together adds to the last one's
    predicted TTFT at the unit of `load`: `prefill_s_per_token` for one, rising linearly to
    `burst_s_per_token` at `BURST_REQUESTS` and held there (the unit's own prediction grows on
    past it, so this errs low for a larger burst; verdicts come back by then)."""
    base, burst = load.prefill_s_per_token, load.burst_s_per_token
    if burst <= base or num_requests <= 1:
        return base
    return base + (burst - base) * (min(num_requests, BURST_REQUESTS) - 1) / (BURST_REQUESTS - 1)


@dataclass(frozen=True, slots=True)
class Sighting:
    """A unit's snapshot as the front end holds it: `seen_s` is when it arrived (front end's clock)."""

    load: UnitLoad
    seen_s: float


@dataclass(frozen=True, slots=True)
class OnTheWay:
    """What a front end let through that no snapshot holds yet, and how long its way to the units
    is: `requests` requests of about `tokens` prompt tokens, the oldest let through `oldest_s`
    ago, `path_s`, how long a request let through now will take to reach its unit, behind them
    (`PathModel`), and `head_path_s`, how long the oldest takes from when it left (the head of
    the way: one request's path)."""

    tokens: int = 0
    requests: int = 0
    oldest_s: float = 0.0
    path_s: float = 0.0
    head_path_s: float = 0.0

    def share(self, num_units: int) -> OnTheWay:
        """One unit's share when `num_units` units take them (the request router spreads them)."""
        if num_units <= 1:
            return self
        return dataclasses.replace(self, tokens=self.tokens // num_units, requests=-(-self.requests // num_units))


NOTHING_ON_THE_WAY = OnTheWay()


class PathModel:
    """How long a request a front end lets through takes to reach its unit: `per_request_s` times
    the requests on the way with it (itself included). On a busy box that time is the front end's
    own queue: in a burst into an idle unit the first requests took 0.1-0.3 s to arrive while the
    front end forwarded the ones behind them (docs/reliability.md, section 6), and the unit counts
    that time against the TTFT target. Learned from the units' own count of it (each verdict says
    how long its request had waited since the front end let it through), as an exponentially
    weighted mean of that time per request on the way (`gain`: the weight of the newest), from
    `prior_s`: what a burst into a fresh server meets before any verdict came back. The default
    prior, 10 ms, is about what Serve's proxy spends per request it forwards on a small box
    (docs/reliability.md, section 6); on a faster one the first verdicts take it down.
    One request's way counts for at most `outlier_factor` times the mean: a client that uploads
    its body slowly waits long before its unit sees it (the proxy stamps the request's start),
    and one such request must not make the gates refuse everyone's for the next dozens of
    verdicts; a way that really grows still raises the mean by a third or so per verdict."""

    __slots__ = ("gain", "num_observed", "outlier_factor", "per_request_s")

    def __init__(self, gain: float = 0.1, prior_s: float = PATH_PRIOR_S, outlier_factor: float = 4.0) -> None:
        if not 0.0 < gain <= 1.0 or not prior_s >= 0.0 or not outlier_factor > 1.0:
            raise ValueError(f"path model gain={gain} must be in (0, 1], prior_s={prior_s} >= 0 "
                             f"and outlier_factor={outlier_factor} > 1")
        self.gain, self.per_request_s, self.num_observed = gain, prior_s, 0
        self.outlier_factor = outlier_factor

    def observe(self, path_s: float, on_the_way: int) -> None:
        """A request let through with `on_the_way` requests on the way (itself included) reached
        its unit `path_s` after it was let through."""
        if on_the_way < 1 or not 0.0 <= path_s < float("inf"):
            return
        x = path_s / on_the_way
        if self.per_request_s > 0.0 and x > self.outlier_factor * self.per_request_s:
            x = self.outlier_factor * self.per_request_s
        self.per_request_s += self.gain * (x - self.per_request_s)
        self.num_observed += 1

    def path_s(self, on_the_way: int) -> float:
        return self.per_request_s * max(1, on_the_way)


class PromptSizeModel:
    """How many prompt tokens a request body of so many bytes holds: the front end decides before
    it parses or tokenizes a body, from `Content-Length` alone. Learned from the units' verdicts
    (each says how many tokens its request's prompt held, chat template included) as the ratio of
    exponentially weighted sums of bytes and of tokens (`gain`: the weight of the newest), so the
    bytes of the prompts let through together are turned into about the tokens the unit will
    count (a ratio of sums weighs a long prompt by its length, which is what its prefill costs).
    Before any verdict, `prior_bytes_per_token` (`PROMPT_BYTES_PER_TOKEN`, 5.0); a body whose
    tokens a verdict gives as fewer than one per `max_bytes_per_token` bytes (a large field that
    is not the prompt) counts as that."""

    __slots__ = ("_bytes", "_tokens", "gain", "max_bytes_per_token", "num_observed")
    _PRIOR_TOKENS = 512.0  # the prior weighs as one verdict on a prompt of this size

    def __init__(self, gain: float = 0.1, prior_bytes_per_token: float = PROMPT_BYTES_PER_TOKEN,
                 max_bytes_per_token: float = 64.0) -> None:
        if not 0.0 < gain <= 1.0 or not 0.0 < prior_bytes_per_token <= max_bytes_per_token:
            raise ValueError(f"prompt size model gain={gain} must be in (0, 1] and prior_bytes_per_token="
                             f"{prior_bytes_per_token} in (0, max_bytes_per_token={max_bytes_per_token}]")
        self.gain, self.max_bytes_per_token, self.num_observed = gain, max_bytes_per_token, 0
        self._tokens = self._PRIOR_TOKENS
        self._bytes = self._PRIOR_TOKENS * prior_bytes_per_token

    @property
    def bytes_per_token(self) -> float:
        return self._bytes / self._tokens

    def observe(self, body_bytes: int, prompt_tokens: int) -> None:
        """A unit counted `prompt_tokens` in the prompt of a request whose body had `body_bytes`."""
        if body_bytes <= 0 or prompt_tokens <= 0:
            return
        g = self.gain
        self._bytes += g * (min(body_bytes, prompt_tokens * self.max_bytes_per_token) - self._bytes)
        self._tokens += g * (prompt_tokens - self._tokens)
        self.num_observed += 1

    def tokens(self, body_bytes: int) -> int:
        return int(body_bytes * self._tokens / self._bytes) if body_bytes > 0 else 0


@dataclass(frozen=True, slots=True)
class FrontRefusal:
    """Why the front end turned a request away; `reason` is the unit's metric label for the same rule."""

    unit_id: str
    reason: str
    retry_after_s: float
    message: str


class FrontAdmission:
    __slots__ = ("config", "max_age_s")

    def __init__(self, config: AdmissionConfig, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        if not max_age_s > 0.0:
            raise ValueError(f"front admission max_age_s={max_age_s} must be > 0 (seconds a snapshot is believed)")
        self.config = config
        self.max_age_s = max_age_s

    def watch_closely(self, load: UnitLoad) -> bool:
        """Whether a verdict on `load` could refuse soon, so the front end should keep it fresh. In "protect"
        mode only a full queue is refused: while it is under half its limit, a snapshot a second old decides as
        a fresh one would (and admission off never refuses)."""
        cfg = self.config
        return cfg.enabled and (cfg.mode != "protect" or 2 * load.num_waiting >= cfg.max_queue_len)

    def check(self, sightings: Iterable[Sighting], now: float, prompt_tokens: int = 0,
              waited_s: float = 0.0, on_the_way: OnTheWay = NOTHING_ON_THE_WAY, *,
              aim: float = 1.0) -> FrontRefusal | None:
        """None (let the request through) unless every fresh snapshot says its unit would refuse
        it; then the refusal with the shortest retry-after (the unit that frees up first).
        `prompt_tokens` is the front end's estimate of the request's prompt (before tokenizing);
        `on_the_way` what it let through that no snapshot holds yet (shared evenly by the fresh
        units: the request router spreads them) and how long the way is; `aim`: `DoorAim.value`."""
        fresh = [(s.load, now - s.seen_s) for s in sightings if 0.0 <= now - s.seen_s <= self.max_age_s]
        refusals: list[FrontRefusal] = []
        share = on_the_way.share(len(fresh))
        for load, age in fresh:  # a stale snapshot (or one from the future: a clock bug) is not believed
            refusal = self.unit_verdict(load, age, prompt_tokens, waited_s, share, aim=aim)
            if refusal is None:
                return None
            refusals.append(refusal)
        return min(refusals, key=lambda r: r.retry_after_s, default=None)

    def on_the_way_tokens(self, sightings: Iterable[Sighting], now: float, prompt_tokens: int) -> int:
        """What a request this front end lets through counts for while it is on its way (the
        prefill the requests behind it are priced to wait for): its prompt, or nothing when every
        fresh unit's `prompt_over_target` rule would refuse its whole prompt. Such a prompt passed
        here only on the tokens a prompt finds cached on average (the door cannot see its own
        hit): its unit refuses it, unless its cache holds most of it, and either way it puts
        almost no prefill ahead of the requests behind it (counted whole, one at the head of a burst
        had the door refuse short prompts the unit served: RESULTS.md, "Cache-aware routing in Serve")."""
        units = [s.load for s in sightings if 0.0 <= now - s.seen_s <= self.max_age_s]
        if self.config.enabled and self.config.mode != "protect" and units and all(
                0 < u.alone_limit_tokens < prompt_tokens for u in units):
            return 0
        return prompt_tokens

    def unit_verdict(self, load: UnitLoad, age_s: float, prompt_tokens: int = 0, waited_s: float = 0.0,
                     on_the_way: OnTheWay = NOTHING_ON_THE_WAY, *, aim: float = 1.0) -> FrontRefusal | None:
        """What the unit of `load` would answer a request of about `prompt_tokens` let through
        `age_s` after the snapshot, having already waited `waited_s`, with `on_the_way` sent its
        way since: a refusal, or None (it might admit: the unit decides)."""
        cfg = self.config
        if not cfg.enabled:
            return None
        if load.num_waiting >= cfg.max_queue_len:
            retry = load.num_waiting / load.capacity_rps if load.capacity_rps > 0 else cfg.min_retry_after_s
            return self._refuse(load, "queue_full", retry,
                                f"{load.num_waiting} requests are already queued (limit {cfg.max_queue_len})")
        if cfg.mode == "protect":  # a dev server queues: only a full queue is refused, as the unit does
            return None
        # The unit's own rules' order: over capacity, a prompt past the costliest it serves now, by
        # its tokens the unit's prefix cache will not hold (unseen here: estimated on the line of
        # cached tokens the unit published; so are those on the way, below).
        uncached = load.uncached_tokens(prompt_tokens)
        if 0 < load.costly_limit_tokens < uncached:
            return self._refuse(load, "costly_prompt", load.overload_clear_s,
                                f"the unit is over capacity and serves the requests that fit it, cheapest first: "
                                f"a prompt of about {prompt_tokens} tokens is past the {load.costly_limit_tokens} "
                                "that fit now")
        # The snapshot's queue drained since (at most in real time), then what was sent since, which
        # cannot start before the oldest of it arrives; the sent prompts and this one priced as a
        # burst of them (each one a decode in the steps of the prompts behind it), as the unit will
        # price them. All times from now; this request arrives at `way.path_s`.
        way = on_the_way
        per_token = price_per_token(load, max(0, way.requests) + 1)
        ahead_s = max(0.0, load.queue_delay_s - age_s)
        if way.requests > 0:  # the unit starts on them as the first arrives, not when this one does
            sent = load.uncached_tokens(way.tokens, way.requests)
            ahead_s = max(ahead_s, way.head_path_s - way.oldest_s) + sent * per_token
        # Work still ahead when it arrives is what makes the unit refuse at all: with none, it
        # would start the request at once, however long its prompt.
        ttft = waited_s + max(ahead_s, way.path_s) + uncached * per_token
        ahead_s -= max(0.0, way.path_s)
        # The unit's own limit (its learned aim included; else the config's) times this front end's `DoorAim`.
        limit = aim * (load.ttft_limit_s if load.ttft_limit_s > 0.0 else ttft_limit_s(cfg, load.regime))
        if ahead_s > 0.0 and ttft > limit:  # past the target, or short of it but past the door's aim
            target = cfg.target_ttft_s
            past = f"the {target:.2f}s target" if ttft > target else f"the {limit:.2f}s the door admits now"
            return self._refuse(load, "prefill_backlog", ttft - target, f"predicted time to first token {ttft:.2f}s "
                                f"exceeds {past}")
        # Nothing ahead when it arrives: in OVERLOAD a prompt too slow on its own is refused, by
        # its tokens the unit's prefix cache will not hold (estimated, as above) and without the
        # time it waited (the unit counts it, so this errs towards letting through).
        if 0 < load.alone_limit_tokens < uncached and ahead_s <= 0.0:
            alone = cfg.target_ttft_s * uncached / load.alone_limit_tokens
            return self._refuse(load, "prompt_over_target", alone,
                                f"a prompt of about {prompt_tokens} tokens would take about {alone:.2f}s to its "
                                f"first token on its own, past the {cfg.target_ttft_s:.2f}s target, and the unit is "
                                "over capacity")
        if load.kv_usage >= cfg.kv_reject_usage and load.num_waiting > 0:
            return self._refuse(load, "kv_pressure", cfg.min_retry_after_s,
                                f"KV cache is {load.kv_usage:.0%} full and {load.num_waiting} requests wait for room")
        return None

    def _refuse(self, load: UnitLoad, reason: str, retry_after_s: float, message: str) -> FrontRefusal:
        cfg = self.config
        retry = min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, retry_after_s))
        return FrontRefusal(load.unit_id, reason, retry, f"server overloaded: {message}; retry after {retry:.1f}s")
