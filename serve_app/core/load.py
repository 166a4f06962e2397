"""Load: the one definition every policy uses, measured from observations.

Owns: `RateEstimator` (time-decayed event rate), `ServiceModel` (step time learned online from
measured step times) and `LoadEstimator`, which defines

    load = arrival_rate / service_capacity

where `arrival_rate` is an exponentially weighted rate of request arrivals (time constant
`load_tau_s`) and `service_capacity` is how many requests per second this unit completes
when saturated:

    capacity = 1 / (prompt_mean * a + output_mean * (overhead + b * B) / B)

with `B = min(max_batch_size, KV tokens / (prompt_mean + output_mean))` the batch the unit
can actually run, `a` the prefill seconds per token, `b` the decode seconds per sequence and
`overhead` the fixed per-step cost, all fitted by recursive least squares to measured step
times. `load` is utilisation: 0 idle, 1 at capacity, above 1 in overload. It is not clamped.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from serve_app.core.config import ServicePrior

_P_SCALE = 1000.0  # prefill tokens are fitted per 1000 and decode seqs per 100, for conditioning
_D_SCALE = 100.0


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
    """`step_time = overhead + a * prefill_tokens + b * decode_seqs`, refined online.

    Recursive least squares with forgetting; the covariance is bounded so long runs of one
    step shape (e.g. only decodes at one batch size) cannot wind it up. Coefficients are kept
    at >= 2% of the prior so the capacity estimate never collapses to zero.
    """

    __slots__ = ("_floor", "_forget", "_p", "_theta", "_trace_cap", "num_observations")

    def __init__(self, prior: ServicePrior, forget: float = 0.998) -> None:
        self._theta = [prior.step_overhead_s, prior.prefill_s_per_token * _P_SCALE,
                       prior.decode_s_per_seq * _D_SCALE]
        self._floor = [0.02 * v for v in self._theta]
        init = [max(v, 1e-6) ** 2 for v in self._theta]
        self._p = [[init[0], 0.0, 0.0], [0.0, init[1], 0.0], [0.0, 0.0, init[2]]]
        self._trace_cap = sum(init)
        self._forget = forget
        self.num_observations = 0

    @property
    def overhead_s(self) -> float:
        return self._theta[0]

    @property
    def prefill_s_per_token(self) -> float:
        return self._theta[1] / _P_SCALE

    @property
    def decode_s_per_seq(self) -> float:
        return self._theta[2] / _D_SCALE

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        th = self._theta
        return th[0] + th[1] * (prefill_tokens / _P_SCALE) + th[2] * (decode_seqs / _D_SCALE)

    def observe(self, prefill_tokens: int, decode_seqs: int, device_time_s: float) -> None:
        if device_time_s <= 0.0 or not math.isfinite(device_time_s):
            return
        x0, x1, x2 = 1.0, prefill_tokens / _P_SCALE, decode_seqs / _D_SCALE
        p = self._p
        px0 = p[0][0] * x0 + p[0][1] * x1 + p[0][2] * x2
        px1 = p[1][0] * x0 + p[1][1] * x1 + p[1][2] * x2
        px2 = p[2][0] * x0 + p[2][1] * x1 + p[2][2] * x2
        denom = self._forget + x0 * px0 + x1 * px1 + x2 * px2
        k0, k1, k2 = px0 / denom, px1 / denom, px2 / denom
        th = self._theta
        err = device_time_s - (th[0] * x0 + th[1] * x1 + th[2] * x2)
        th[0] = max(self._floor[0], th[0] + k0 * err)
        th[1] = max(self._floor[1], th[1] + k1 * err)
        th[2] = max(self._floor[2], th[2] + k2 * err)
        # P <- (P - k px^T) / forget, then bounded; P stays symmetric so rows are rebuilt whole.
        inv_f = 1.0 / self._forget
        a00 = (p[0][0] - k0 * px0) * inv_f
        a01 = (p[0][1] - k0 * px1) * inv_f
        a02 = (p[0][2] - k0 * px2) * inv_f
        a11 = (p[1][1] - k1 * px1) * inv_f
        a12 = (p[1][2] - k1 * px2) * inv_f
        a22 = (p[2][2] - k2 * px2) * inv_f
        trace = a00 + a11 + a22
        if trace > self._trace_cap:
            s = self._trace_cap / trace
            a00, a01, a02, a11, a12, a22 = a00 * s, a01 * s, a02 * s, a11 * s, a12 * s, a22 * s
        self._p = [[a00, a01, a02], [a01, a11, a12], [a02, a12, a22]]
        self.num_observations += 1

    def drain_time(self, prefill_tokens: int, decode_seqs: int, prefill_tokens_per_step: int) -> float:
        """Seconds to prefill `prefill_tokens` while `decode_seqs` decodes share each step."""
        if prefill_tokens <= 0:
            return 0.0
        per_step = max(1, prefill_tokens_per_step)
        steps = -(-prefill_tokens // per_step)
        per_step_s = self.overhead_s + self.decode_s_per_seq * decode_seqs
        return steps * per_step_s + self.prefill_s_per_token * prefill_tokens


class LoadEstimator:
    """Arrival rate, mean request shape and the fitted service model -> `load` (see module doc)."""

    __slots__ = (
        "_have_finished",
        "_kv_tokens",
        "_max_batch",
        "_num_arrivals",
        "_output_mean",
        "_prompt_mean",
        "arrivals",
        "finishes",
        "service",
    )

    def __init__(self, tau_s: float, prior: ServicePrior, max_batch_size: int, kv_tokens: int) -> None:
        self.arrivals = RateEstimator(tau_s)
        self.finishes = RateEstimator(tau_s)
        self.service = ServiceModel(prior)
        self._prompt_mean = 0.0
        self._output_mean = 0.0
        self._have_finished = False
        self._num_arrivals = 0
        self._max_batch = max_batch_size
        self._kv_tokens = kv_tokens

    def on_arrival(self, now: float, num_prompt_tokens: int, max_tokens: int) -> None:
        first = self._num_arrivals == 0
        self._num_arrivals += 1
        self.arrivals.on_event(now)
        self._prompt_mean = num_prompt_tokens if first else 0.95 * self._prompt_mean + 0.05 * num_prompt_tokens
        if not self._have_finished:
            # Until a request finishes, max_tokens is the only hint of output length.
            guess = min(max_tokens, 256)
            self._output_mean = guess if first else 0.95 * self._output_mean + 0.05 * guess

    def on_finish(self, now: float, num_output_tokens: int) -> None:
        self.finishes.on_event(now)
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
        kv_batch = self._kv_tokens / per_request if per_request > 0 else float(self._max_batch)
        return max(1.0, min(float(self._max_batch), kv_batch))

    def capacity_rps(self) -> float:
        """Requests per second this unit completes when saturated with the current mix."""
        svc = self.service
        batch = self.effective_batch()
        per_request_s = (self._prompt_mean * svc.prefill_s_per_token
                         + max(1.0, self._output_mean) * (svc.overhead_s + svc.decode_s_per_seq * batch) / batch)
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
