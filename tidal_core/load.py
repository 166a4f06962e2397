"""Load: the one definition every policy uses, measured from observations.

Owns: `OutputLengths` (the output lengths of recently finished requests, kept sorted: the
slot wait's distribution, core/departures.py), `RateEstimator` (time-decayed event rate),
`ServiceModel` (step time learned online from measured step times) and `LoadEstimator`, which
defines

    load = arrival_rate / service_capacity

where `arrival_rate` is an exponentially weighted rate of request arrivals (time constant
`load_tau_s`) and `service_capacity` is how many requests per second this unit completes
when saturated:

    capacity = 1 / (prompt_mean * a + prefill_step + output_mean * (overhead + b * B) / B)

with `B = min(batch cap, KV tokens / (prompt_mean + output_mean))` the batch the unit can
actually run (the cap is `max_batch_size`, or the TPOT governor's lower cap: capacity *within
the latency SLO*), `a` the prefill seconds per token, `b` the decode seconds per sequence,
`overhead` the fixed per-step cost and `prefill_step` the extra fixed cost of a step holding
prefill, all fitted by recursive least squares to measured step times. `load` is
utilisation: 0 idle, 1 at capacity, above 1 in overload. It is not clamped.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.config import ServicePrior
from tidal_core.sorted_window import SortedWindow

_P_SCALE = 1000.0  # prefill tokens are fitted per 1000 and decode seqs per 100, for conditioning
_D_SCALE = 100.0
_DRAIN_PARTS = 8  # shares of a backlog `ServiceModel.drain_time` integrates over
_MIN_STEP_TOKENS = 16.0  # a step holds at least this much prompt beside its decodes (one block)

OUTPUT_GUESS = 256
"""Output tokens expected of a request without max_tokens before any request has finished."""
RECENT_TAU_S = 2.0
"""Time constant (s) of the recent arrival rate beside the load's `load_tau_s` (`LoadEstimator.overload`)."""
LENGTHS_KEPT = 512
MIN_FINISHED = 16


class OutputLengths(SortedWindow):
    """The output lengths of the last `LENGTHS_KEPT` finished requests, kept sorted as they come
    (`sorted` is None until `MIN_FINISHED` have finished)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(LENGTHS_KEPT)

    @property
    def num_finished(self) -> int:
        return self.count

    @property
    def sorted(self) -> list[int] | None:
        return self.values if self.count >= MIN_FINISHED else None

    def on_finish(self, num_output_tokens: int) -> None:
        self.add(num_output_tokens)


class RateEstimator:
    """Exponentially weighted event rate: each event adds 1/tau, and the sum decays with tau."""

    __slots__ = ("_t_last", "_value", "tau_s")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._value = 0.0
        self._t_last: float | None = None

    def on_event(self, now: float, weight: float = 1.0) -> None:
        self._value = self.rate(now) + weight / self.tau_s
        self._t_last = now

    def rate(self, now: float) -> float:
        if self._t_last is None:
            return 0.0
        dt = now - self._t_last
        return self._value * math.exp(-dt / self.tau_s) if dt > 0.0 else self._value


class ServiceModel:
    """`step_time = overhead + prefill_step*[prefill>0] + a*prefill_tokens + b*decode_seqs`, online.

    `prefill_step` is a fixed cost of a step that holds any prefill (measured engines show
    one: prompt steps cost ~20 ms more than decode steps of similar work on A100 70B).
    Recursive least squares with forgetting; the covariance is bounded so long runs of one
    step shape (e.g. only decodes at one batch size) cannot wind it up. Coefficients stay
    at >= 2% of the prior (the fixed prefill cost at >= 0) so capacity never collapses.
    """

    __slots__ = ("_floor", "_forget", "_p", "_theta", "_trace_cap", "num_observations")

    def __init__(self, prior: ServicePrior, forget: float = 0.998) -> None:
        self._theta = [prior.step_overhead_s, prior.prefill_step_s, prior.prefill_s_per_token * _P_SCALE,
                       prior.decode_s_per_seq * _D_SCALE]
        self._floor = [0.02 * self._theta[0], 0.0, 0.02 * self._theta[2], 0.02 * self._theta[3]]
        scale = max(self._theta[0], 1e-6) ** 2
        init = [max(v, 1e-3 * self._theta[0]) ** 2 for v in self._theta]
        # The symmetric 4x4 covariance as its 10 distinct entries, row by row: p00 p01 p02 p03
        # p11 p12 p13 p22 p23 p33.
        self._p = (init[0], 0.0, 0.0, 0.0, init[1], 0.0, 0.0, init[2], 0.0, init[3])
        self._trace_cap = sum(init) + scale
        self._forget = forget
        self.num_observations = 0

    @property
    def overhead_s(self) -> float:
        return self._theta[0]

    @property
    def prefill_step_s(self) -> float:
        return self._theta[1]

    @property
    def prefill_s_per_token(self) -> float:
        return self._theta[2] / _P_SCALE

    @property
    def decode_s_per_seq(self) -> float:
        return self._theta[3] / _D_SCALE

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        th = self._theta
        fixed = th[0] + th[1] if prefill_tokens > 0 else th[0]
        return fixed + th[2] * (prefill_tokens / _P_SCALE) + th[3] * (decode_seqs / _D_SCALE)

    def observe(self, prefill_tokens: int, decode_seqs: int, device_time_s: float) -> None:
        if device_time_s <= 0.0 or not math.isfinite(device_time_s):
            return
        # Unrolled over the 10 distinct entries of the symmetric 4x4 covariance: this runs once
        # per engine step, so it is written for speed (x0 = 1 always, x1 is 0 or 1; `a if a > b
        # else b` is max(b, a) without the call).
        x1 = 1.0 if prefill_tokens > 0 else 0.0
        x2, x3 = prefill_tokens / _P_SCALE, decode_seqs / _D_SCALE
        p00, p01, p02, p03, p11, p12, p13, p22, p23, p33 = self._p
        px0 = p00 + p01 * x1 + p02 * x2 + p03 * x3
        px1 = p01 + p11 * x1 + p12 * x2 + p13 * x3
        px2 = p02 + p12 * x1 + p22 * x2 + p23 * x3
        px3 = p03 + p13 * x1 + p23 * x2 + p33 * x3
        inv_d = 1.0 / (self._forget + px0 + x1 * px1 + x2 * px2 + x3 * px3)
        k0, k1, k2, k3 = px0 * inv_d, px1 * inv_d, px2 * inv_d, px3 * inv_d
        th, (f0, f1, f2, f3) = self._theta, self._floor
        t0, t1, t2, t3 = th
        err = device_time_s - (t0 + t1 * x1 + t2 * x2 + t3 * x3)
        t0, t1, t2, t3 = t0 + k0 * err, t1 + k1 * err, t2 + k2 * err, t3 + k3 * err
        th[:] = (t0 if t0 > f0 else f0, t1 if t1 > f1 else f1, t2 if t2 > f2 else f2, t3 if t3 > f3 else f3)
        # P <- (P - k px^T) / forget, then bounded against wind-up.
        f = 1.0 / self._forget
        p00, p01, p02, p03 = (p00 - k0 * px0) * f, (p01 - k0 * px1) * f, (p02 - k0 * px2) * f, (p03 - k0 * px3) * f
        p11, p12, p13 = (p11 - k1 * px1) * f, (p12 - k1 * px2) * f, (p13 - k1 * px3) * f
        p22, p23, p33 = (p22 - k2 * px2) * f, (p23 - k2 * px3) * f, (p33 - k3 * px3) * f
        trace = p00 + p11 + p22 + p33
        if trace > self._trace_cap:
            c = self._trace_cap / trace
            p00, p01, p02, p03, p11, p12, p13, p22, p23, p33 = (
                p00 * c, p01 * c, p02 * c, p03 * c, p11 * c, p12 * c, p13 * c, p22 * c, p23 * c, p33 * c)
        self._p = (p00, p01, p02, p03, p11, p12, p13, p22, p23, p33)
        self.num_observations += 1

    def drain_time(self, prefill_tokens: int, decodes_now: int, decodes_after: int, budget: int,
                   aim_s: float | None = None, defer: bool = True) -> float:
        """Seconds to prefill `prefill_tokens` while the decodes sharing each step grow from
        `decodes_now` to `decodes_after` (each prompt that finishes starts decoding), in steps of
        at most `budget` tokens, decodes included, and, with `aim_s` (the step sizer's TPOT aim),
        at a mean step time no longer than the aim: where a full step would run past it, decode-only
        steps bank time for chunks as big as `StepSizer.defer` lets them grow (without `defer`,
        every step at the aim).
        Integrated over `_DRAIN_PARTS` equal shares of the tokens, each at the decode count of its
        middle: a share's tokens cost their own time plus their part of a step's fixed cost, which
        is spread over fewer tokens as the decodes take the step."""
        if prefill_tokens <= 0:
            return 0.0
        oh, fixed, ppt, dps = self.overhead_s, self.prefill_step_s, self.prefill_s_per_token, self.decode_s_per_seq
        parts = _DRAIN_PARTS if decodes_after != decodes_now else 1  # no growth: one share is exact
        grow, total = (decodes_after - decodes_now) / parts, 0.0
        for k in range(parts):
            d = decodes_now + grow * (k + 0.5)
            per_step = budget - d
            decode_s = oh + dps * d
            if aim_s is not None and decode_s + fixed + ppt * per_step > aim_s:  # a full step runs past the aim
                at_aim = (aim_s - decode_s - fixed) / ppt  # prompt tokens a step at the aim holds
                if defer and aim_s > decode_s:
                    # StepSizer.defer banks decode-only steps until a chunk holds a bank's tokens x
                    # (1 + fixed / decode step), where one more deferral stops paying; the tokens
                    # pay for those steps too, at a mean step time of the aim.
                    grown = (aim_s - decode_s) / ppt * (1.0 + fixed / decode_s) if decode_s > 0.0 else math.inf
                    chunk = max(min(per_step, max(at_aim, grown)), _MIN_STEP_TOKENS)
                    total += (fixed / chunk + ppt) * aim_s / (aim_s - decode_s)
                    continue
                per_step = at_aim
            if per_step < _MIN_STEP_TOKENS:
                per_step = _MIN_STEP_TOKENS
            total += (decode_s + fixed) / per_step + ppt
        return total * prefill_tokens / parts


class PrefillThroughput:
    """Prompt tokens per second the unit actually computes while prompts are queued.

    Only steps that began with a backlog count, each for its own duration (otherwise the rate
    would measure demand, or idle time, not service); both sums decay with `tau_s`, so the
    figure follows the current batch mix. A figure older than `3 * tau_s` is dropped: a rate
    measured in the evening peak says nothing about the night.
    """

    __slots__ = ("_t_backlog", "_time", "_tokens", "tau_s")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._tokens = 0.0
        self._time = 0.0
        self._t_backlog = -math.inf

    def on_step(self, now: float, step_s: float, prefill_tokens: int) -> None:
        """A step that began with prompts queued took `step_s` and computed `prefill_tokens`."""
        if step_s <= 0.0:
            return
        decay = math.exp(-min(now - self._t_backlog, 10.0 * self.tau_s) / self.tau_s)
        self._tokens = self._tokens * decay + prefill_tokens
        self._time = self._time * decay + step_s
        self._t_backlog = now

    def rate(self, now: float, min_busy_s: float = 1.0) -> float | None:
        """Tokens/s, or None until `min_busy_s` of backlogged time has been seen recently."""
        if self._time < min_busy_s or self._tokens <= 0.0 or now - self._t_backlog > 3.0 * self.tau_s:
            return None
        return self._tokens / self._time


class PredictionCorrection:
    """Ratio of measured to predicted time-to-first-token, learned from finished prefills.

    The queueing model is simple on purpose; this factor (EWMA sums of both, weight 0.02,
    clamped to [0.5, 4]) absorbs what it misses - the TPOT governor throttling prefill,
    bursts of long prompts - so admission acts on predictions that measurements back. What it
    learned fades back to 1 with time constant `fade_s` when no first token confirms it (the
    error of a busy hour is not the error of a quiet one).
    """

    __slots__ = ("_actual", "_predicted", "_t_last", "fade_s")

    def __init__(self, fade_s: float = 60.0) -> None:
        self._actual = 0.0
        self._predicted = 0.0
        self._t_last = -math.inf
        self.fade_s = fade_s

    def observe(self, now: float, predicted_s: float, actual_s: float) -> None:
        self._actual = 0.98 * self._actual + 0.02 * actual_s
        self._predicted = 0.98 * self._predicted + 0.02 * predicted_s
        self._t_last = now

    def factor(self, now: float) -> float:
        if self._predicted <= 1e-6:
            return 1.0
        learned = max(0.5, min(4.0, self._actual / self._predicted))
        return 1.0 + (learned - 1.0) * math.exp(-max(0.0, now - self._t_last) / self.fade_s)


class LoadEstimator:
    """Arrival rate, mean request shape and the fitted service model -> `load` (see module doc)."""

    __slots__ = (
        "_have_finished",
        "_kv_tokens",
        "_num_arrivals",
        "_output_mean",
        "_prompt_mean",
        "arrivals",
        "batch_cap",
        "finishes",
        "lengths",
        "prefill",
        "recent",
        "service",
        "ttft_correction",
    )

    def __init__(self, tau_s: float, prior: ServicePrior, max_batch_size: int, kv_tokens: int) -> None:
        self.arrivals = RateEstimator(tau_s)
        self.recent = RateEstimator(RECENT_TAU_S)  # the same arrivals over the last seconds (`overload`)
        self.finishes = RateEstimator(tau_s)
        self.lengths = OutputLengths()  # the slot wait's distribution (core/departures.py)
        self.prefill = PrefillThroughput(tau_s)
        self.ttft_correction = PredictionCorrection()
        self.service = ServiceModel(prior)
        self._prompt_mean = 0.0
        self._output_mean = 0.0
        self._have_finished = False
        self._num_arrivals = 0
        self.batch_cap = max_batch_size  # the scheduler lowers it to the TPOT governor's cap
        self._kv_tokens = kv_tokens

    def on_arrival(self, now: float, num_prompt_tokens: int, max_tokens: int) -> None:
        first = self._num_arrivals == 0
        self._num_arrivals += 1
        self.arrivals.on_event(now)
        self.recent.on_event(now)
        self._prompt_mean = num_prompt_tokens if first else 0.95 * self._prompt_mean + 0.05 * num_prompt_tokens
        if not self._have_finished:
            # Until a request finishes, max_tokens is the only hint of output length.
            guess = min(max_tokens, OUTPUT_GUESS)
            self._output_mean = guess if first else 0.95 * self._output_mean + 0.05 * guess

    def on_finish(self, now: float, num_output_tokens: int) -> None:
        self.finishes.on_event(now)
        self.lengths.on_finish(num_output_tokens)
        if not self._have_finished:
            self._have_finished = True
            self._output_mean = float(num_output_tokens)
        else:
            self._output_mean = 0.95 * self._output_mean + 0.05 * num_output_tokens

    def on_step(self, prefill_tokens: int, decode_seqs: int, device_time_s: float) -> None:
        self.service.observe(prefill_tokens, decode_seqs, device_time_s)

    @property
    def prompt_mean(self) -> float:
        return self._prompt_mean

    @property
    def output_mean(self) -> float:
        return self._output_mean

    def effective_batch(self) -> float:
        per_request = self._prompt_mean + self._output_mean
        kv_batch = self._kv_tokens / per_request if per_request > 0 else float(self.batch_cap)
        return max(1.0, min(float(self.batch_cap), kv_batch))

    def request_fixed_s(self) -> float:
        """What a request costs at saturation besides its prompt's prefill (`prompt x
        prefill_s_per_token`): the fixed cost of a prefill step, charged once per request (prompts
        rarely share one), and its share of the decode steps for the mean output."""
        svc = self.service
        batch = self.effective_batch()
        decode_s = (svc.overhead_s + svc.decode_s_per_seq * batch) / batch
        return svc.prefill_step_s + max(1.0, self._output_mean) * decode_s

    def capacity_rps(self) -> float:
        """Requests per second this unit completes when saturated with the current mix."""
        per_request_s = self._prompt_mean * self.service.prefill_s_per_token + self.request_fixed_s()
        return 1.0 / per_request_s if per_request_s > 0 else math.inf

    def departure_rate(self, now: float) -> float:
        """Requests/s leaving the running batch: measured, or the capacity estimate before any finish."""
        if not self._have_finished:
            return self.capacity_rps()
        return max(self.finishes.rate(now), 1e-3)

    def load(self, now: float) -> float:
        rate = self.arrivals.rate(now)
        if rate == 0.0:
            return 0.0
        return rate / self.capacity_rps()

    def on_arrivals_elsewhere(self, now: float, count: float) -> None:
        """`count` arrivals this unit did not receive (a front gate refused them for it): counted in
        the arrival rates, not in the prompt mean."""
        self.arrivals.on_event(now, count)
        self.recent.on_event(now, count)

    def overload(self, now: float) -> tuple[float, float]:
        """(ratio, seconds to clear): the load over the last `RECENT_TAU_S` seconds and over `tau_s`,
        whichever is smaller, and how long until it would fall to 1 if nothing else arrived (0 at or
        below 1). An overload that is over, such as the seconds after a burst, leaves the slow load
        above 1 for `tau_s x ln(load)` while the recent one has fallen; one that only just began has
        not yet raised the slow one. What the `costly_prompt` rule sheds for (core/costly_prompts.py)."""
        capacity = self.capacity_rps()
        slow, fast = self.arrivals.rate(now) / capacity, self.recent.rate(now) / capacity
        clear = min(self.arrivals.tau_s * math.log(slow) if slow > 1.0 else 0.0,
                    RECENT_TAU_S * math.log(fast) if fast > 1.0 else 0.0)
        return min(slow, fast), clear
