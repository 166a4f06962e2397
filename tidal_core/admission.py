"""Admission control: turn requests away at arrival rather than let every request miss its SLO.

Owns: `AdmissionController.check`. Rules, in order, each with its metric label:

- `too_long`: prompt plus one output token exceeds `max_model_len` (never retryable: 400);
- `concurrency_limit`: `max_concurrent_requests` requests are already in the unit (TGI's
  cap; checked whether or not `enabled` is set, like the next one);
- `queue_full`: `max_queued_requests` requests already wait (Ray Serve's cap);
- `queue_full`: `max_queue_len` requests already wait;
- `prefill_backlog`: the predicted time to first token of a new arrival exceeds the learned
  aim x `target_ttft_s` in OVERLOAD (x `burst_factor` in LIGHT/STEADY, where a burst drains),
  and work is ahead of it. The prediction (core/predictor.py) is (a) prefilling the work
  ahead (waiting prompts plus unfinished chunks) and its own prompt, with the decodes those
  prompts will start sharing the steps, or at the prefill speed measured while prompts were
  queued if that is slower — the queued-prefill-token cap of DESIGN.md, about target TTFT x
  prefill throughput — plus (b) waiting for a batch slot when the running batch is at its
  cap, at the measured completion rate;
- `prompt_over_target` (with `refuse_slow_prompts_in_overload`, the default): in OVERLOAD, with
  nothing ahead, the request's own TTFT would still pass `target_ttft_s`: a bound of it
  (`UnitState.alone_ttft_s`: the time it already waited plus its prompt's prefill beside the
  decodes running now, on the fitted step model, in whole-budget steps or, under a TPOT target, in
  the chunks the step sizer would give it: `UnitView.alone_prefill_s`) times the median (by
  default: `slow_prompt_quantile`)
  of what the long prompts admitted with nothing ahead took against their bound (`AloneFit`: the
  bound is linear in a prompt's tokens, a long prompt's attention is not, and the decodes beside
  it grow while it prefills): refused when it more likely misses than not. Such a prompt misses
  the target on an idle unit too; served while the unit is over capacity, it takes the GPU time
  of requests that could meet it (one A100 70B unit on the Mooncake trace, whose prompts reach
  8k tokens, 1.17 s of prefill alone: 34% of the admitted missed 1 s and goodput halved;
  benchmarks/RESULTS.md, "Prompts too slow for the target, in overload").
  Outside OVERLOAD it is served, late (nothing is ahead of it, no unit could serve it sooner);
- `costly_prompt` (with `shed_costly_prompts_in_overload`, off by default): in OVERLOAD, with the
  current load above 1 (`LoadEstimator.overload`), the request's uncached prompt is longer than
  the limit up to which the recent arrivals' cost fits the capacity (core/costly_prompts.py):
  serving the cheapest requests first serves the most within the SLO;
- `kv_pressure`: KV usage is at `kv_reject_usage` and requests already wait for room.

The aim (`TtftAim`, a fraction of the limit) is learned from the first tokens of the requests
admitted with work ahead, the ones this rule judged: a miss of `target_ttft_s` lowers it by
`aim_gain` x (1 - `aim_tail`), a first token in time raises it by `aim_gain` x `aim_tail`,
within [`aim_floor`, 1]. The prediction is calibrated at its median (`PredictionCorrection`),
so admitting up to the target itself would let about half of the requests admitted near it
miss, and a unit with a queue keeps it at the limit: every request it admits is near it.
Measured on the simulator, one A100 70B unit at about twice its capacity: 93-95% of the
admitted within the 1 s target with the aim at the target itself, 96-97% learned, as many
admitted and goodput +2-3% (benchmarks/RESULTS.md, "The admission aim and the burst-onset
prediction"). The aim settles where about `aim_tail` of the judged requests miss, so a unit
whose prediction is good keeps a limit near the target.

In `mode` "protect" (a dev server: queue, do not refuse) only `too_long` and `queue_full`
apply: the SLO rules (`prefill_backlog`, `prompt_over_target`, `costly_prompt`, `kv_pressure`) are off, so a
burst is served late rather than turned away.

The retry-after estimate is the time until the rule would admit again if nothing else
arrived: the predicted delay above the target, the queue over the service rate, or one mean
decode span for KV; for `prompt_over_target`, when the unit leaves OVERLOAD, which nothing at
arrival foretells, so its own estimated TTFT (a retry is refused again while the overload lasts);
for `costly_prompt`, when the current load would fall to 1 if nothing else arrived
(`LoadEstimator.overload`). It is clamped to [min_retry_after_s, max_retry_after_s].

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal_core.config import AdmissionConfig
from tidal_core.costly_prompts import UNLIMITED, CostlyPrompts
from tidal_core.load import LoadEstimator
from tidal_core.plan import Rejection
from tidal_core.regime import Regime
from tidal_core.request import Request
from tidal_core.tail_track import track_tail


@dataclass(frozen=True, slots=True)
class UnitState:
    """What admission looks at, gathered by the scheduler at the moment of arrival.

    `predicted_ttft_s` is the scheduler's prediction of the new arrival's time to first token
    (queueing plus its own prefill; one definition: `Scheduler.predicted_queue_delay_s`).
    `work_ahead` is False on a unit that would start the request at once; then `alone_ttft_s` is
    a bound of its TTFT (the time it already waited plus `UnitView.alone_prefill_s`), else 0.
    `overload_ratio` and `overload_clear_s` are `LoadEstimator.overload` (the current load, and when
    it would fall to 1) and `uncached_tokens` the request's prompt tokens its prefix cache does not
    hold: the `costly_prompt` rule's.
    """

    num_waiting: int
    num_decoding: int
    kv_usage: float
    predicted_ttft_s: float
    work_ahead: bool
    regime: Regime
    num_in_system: int = 0
    alone_ttft_s: float = 0.0
    overload_ratio: float = 0.0
    overload_clear_s: float = 0.0
    uncached_tokens: int = 0


def regime_limit_s(cfg: AdmissionConfig, regime: Regime) -> float:
    """The TTFT limit of `regime` before the aim: the target in OVERLOAD, `burst_factor` x it
    otherwise; 0 where admission never refuses for TTFT (off, or "protect" mode)."""
    if not cfg.enabled or cfg.mode == "protect":  # AdmissionController.judges_ttft is False
        return 0.0
    return cfg.target_ttft_s if regime is Regime.OVERLOAD else cfg.burst_factor * cfg.target_ttft_s


class TtftAim:
    """The fraction of the TTFT limit admission acts on, learned from the requests it judged
    (see the module doc). `value` is in [`aim_floor`, 1]."""

    __slots__ = ("_floor", "_gain", "_tail", "num_missed", "num_observed", "target_s", "value")

    def __init__(self, config: AdmissionConfig) -> None:
        self.value = config.aim_start
        self.target_s = config.target_ttft_s
        self._gain, self._tail = config.aim_gain, config.aim_tail
        self._floor = config.aim_floor
        self.num_observed = 0
        self.num_missed = 0

    def observe(self, ttft_s: float) -> None:
        """A request admitted with work ahead got its first token `ttft_s` after arrival."""
        self.num_observed += 1
        missed = ttft_s > self.target_s
        self.num_missed += missed
        self.value = track_tail(self.value, self._gain, self._tail, missed, self._floor, 1.0)


class AloneFit:
    """measured / `alone_ttft_s` of the requests admitted with nothing ahead whose bound is at
    least `FROM` x the TTFT target (the prompts the rule could judge: a short prompt's TTFT is
    mostly the wait for the step in flight, which says nothing of a long one's): the `quantile`
    of that ratio (`admission.slow_prompt_quantile`, by default `QUANTILE`, the median), tracked
    online (up by `GAIN` x `quantile` for a ratio above it, down by `GAIN` x (1 - `quantile`) for
    one below, within [`FLOOR`, `CEILING`]). The bound is the fitted step
    model's, which is linear in a prompt's tokens: a long prompt's attention makes it slower than
    that, and the decodes beside it grow while it prefills. `value` starts at 1 (the bound)."""

    QUANTILE = 0.5  # the median, as the TTFT prediction itself is calibrated
    GAIN = 0.02
    FROM = 0.5
    FLOOR, CEILING = 0.5, 4.0
    __slots__ = ("num_observed", "quantile", "target_s", "value")

    def __init__(self, target_ttft_s: float, quantile: float = QUANTILE) -> None:
        self.target_s = target_ttft_s
        self.quantile = quantile
        self.value = 1.0
        self.num_observed = 0

    def observe(self, bound_s: float, measured_s: float) -> None:
        """A request admitted with nothing ahead and a bound of `bound_s` got its first token
        `measured_s` after arrival."""
        if bound_s < self.FROM * self.target_s:
            return
        self.num_observed += 1
        self.value = track_tail(self.value, self.GAIN, self.quantile, measured_s < self.value * bound_s, self.FLOOR,
                                self.CEILING)


class AdmissionController:
    __slots__ = ("aim", "alone", "config", "costly", "judges_ttft", "max_model_len")

    def __init__(self, config: AdmissionConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.aim = TtftAim(config)
        self.alone = AloneFit(config.target_ttft_s, config.slow_prompt_quantile)
        self.costly = CostlyPrompts()
        # The `prefill_backlog` rule applies at all (its limit is never 0): only then does a
        # request admitted with work ahead teach the aim.
        self.judges_ttft = config.enabled and config.mode != "protect"

    def limit_s(self, regime: Regime) -> float:
        """The predicted TTFT past which a request with work ahead is refused (`prefill_backlog`);
        0 where none is (admission off, or "protect" mode)."""
        return regime_limit_s(self.config, regime) * self.aim.value

    def alone_ttft_s(self, state: UnitState) -> float:
        """The request's own TTFT as `prompt_over_target` judges it: its bound times the learned
        ratio (0 when work is ahead: the `prefill_backlog` rule judges it then)."""
        return state.alone_ttft_s * self.alone.value

    def too_slow_alone(self, state: UnitState) -> bool:
        """`prompt_over_target`'s verdict, whether or not the rule is on: in OVERLOAD with nothing
        ahead, the request more likely misses the TTFT target than not."""
        return state.regime is Regime.OVERLOAD and self.alone_ttft_s(state) > self.config.target_ttft_s

    def alone_limit_tokens(self, regime: Regime, bound_s_per_token: float) -> int:
        """The longest prompt (uncached tokens) `too_slow_alone` lets start now with nothing ahead,
        for a bound of `bound_s_per_token` a token (`UnitView.alone_prefill_s` is linear in them)
        and no time already waited: what a unit publishes for the front gates
        (`UnitLoad.alone_limit_tokens`). 0 where the rule refuses none (it is off, admission judges
        no TTFT, the unit is not in OVERLOAD) or none short of `max_model_len`."""
        cfg = self.config
        if (not cfg.refuse_slow_prompts_in_overload or not self.judges_ttft or regime is not Regime.OVERLOAD
                or bound_s_per_token <= 0.0):
            return 0
        limit = cfg.target_ttft_s / (self.alone.value * bound_s_per_token)
        return int(limit) if limit < self.max_model_len else 0

    def costly_limit_tokens(self, regime: Regime, load: LoadEstimator, overload_ratio: float) -> int:
        """The `costly_prompt` rule's longest uncached prompt now: `CostlyPrompts.limit_tokens` in
        OVERLOAD (`UNLIMITED` where the rule refuses none: it is off, admission judges no TTFT,
        the unit is not in OVERLOAD or can serve every request)."""
        if not (self.config.shed_costly_prompts_in_overload and self.judges_ttft and regime is Regime.OVERLOAD):
            return UNLIMITED
        return self.costly.limit_tokens(overload_ratio, load.service.prefill_s_per_token, load.request_fixed_s())

    def check_length(self, req: Request) -> Rejection | None:
        if req.num_prompt_tokens + 1 > self.max_model_len:
            return Rejection(req.request_id, "too_long", 0.0,
                             f"prompt of {req.num_prompt_tokens} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten the prompt", retryable=False)
        return None

    def check(self, req: Request, state: UnitState, load: LoadEstimator) -> Rejection | None:
        cfg = self.config
        if cfg.max_concurrent_requests is not None and state.num_in_system >= cfg.max_concurrent_requests:
            return self._reject(req, "concurrency_limit", 1.0 / max(load.capacity_rps(), 1e-9),
                                f"{state.num_in_system} requests are in flight (limit {cfg.max_concurrent_requests})")
        if cfg.max_queued_requests is not None and state.num_waiting >= cfg.max_queued_requests:
            return self._reject(req, "queue_full", state.num_waiting / max(load.capacity_rps(), 1e-9),
                                f"{state.num_waiting} requests are already queued (limit {cfg.max_queued_requests})")
        if not cfg.enabled:
            return None
        if state.num_waiting >= cfg.max_queue_len:
            capacity = max(load.capacity_rps(), 1e-9)
            return self._reject(req, "queue_full", state.num_waiting / capacity,
                                f"{state.num_waiting} requests are already queued (limit {cfg.max_queue_len})")
        if cfg.mode == "protect":
            return None
        if cfg.shed_costly_prompts_in_overload:
            self.costly.observe(state.uncached_tokens)
            limit = self.costly_limit_tokens(state.regime, load, state.overload_ratio)
            if state.uncached_tokens > limit:
                return self._reject(req, "costly_prompt", state.overload_clear_s,
                                    f"the unit is over capacity and serves the requests that fit it, cheapest "
                                    f"first: a prompt of {state.uncached_tokens} tokens not in its cache is past "
                                    f"the {limit} that fit now")
        ttft = state.predicted_ttft_s
        # Past capacity every admitted request beyond the target would miss it; below capacity
        # a burst may be let queue up to `burst_factor` x the target (default 1), each times the
        # learned aim. A request nothing is ahead of is always admitted: no unit could serve it
        # sooner.
        if state.work_ahead and ttft > self.limit_s(state.regime):
            return self._reject(req, "prefill_backlog", ttft - cfg.target_ttft_s,
                                f"predicted time to first token {ttft:.2f}s exceeds the {cfg.target_ttft_s:.2f}s "
                                "target")
        # With nothing ahead, the prompt's own time: in OVERLOAD, one that more likely misses the
        # target than not would be served in place of requests that can meet it.
        if cfg.refuse_slow_prompts_in_overload and self.too_slow_alone(state):
            alone = self.alone_ttft_s(state)
            return self._reject(req, "prompt_over_target", alone,
                                f"this prompt's own time to first token, about {alone:.2f}s, exceeds the "
                                f"{cfg.target_ttft_s:.2f}s target and the unit is over capacity, so it would take "
                                "the place of requests that can meet it; it is served when the unit has room")
        if state.kv_usage >= cfg.kv_reject_usage and state.num_waiting > 0:
            svc = load.service
            decode_span = load.output_mean * (svc.overhead_s + svc.decode_s_per_seq * max(1, state.num_decoding))
            return self._reject(req, "kv_pressure", decode_span,
                                f"KV cache is {state.kv_usage:.0%} full and {state.num_waiting} requests wait for room")
        return None

    def _reject(self, req: Request, reason: str, retry_after_s: float, message: str) -> Rejection:
        cfg = self.config
        retry = min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, retry_after_s))
        return Rejection(req.request_id, reason, retry, f"server overloaded: {message}; retry after {retry:.1f}s")
