"""Admission control: turn requests away at arrival rather than let every request miss its SLO.

Owns: `AdmissionController.check`. Rules, in order, each with its metric label:

- `too_long`: prompt plus one output token exceeds `max_model_len` (never retryable: 400);
- `concurrency_limit`: `max_concurrent_requests` requests are already in the unit (TGI's
  cap; checked whether or not `enabled` is set, like the next one);
- `queue_full`: `max_queued_requests` requests already wait (Ray Serve's cap);
- `queue_full`: `max_queue_len` requests already wait;
- `prefill_backlog`: the predicted time to first token of a new arrival exceeds
  `target_ttft_s` in OVERLOAD (or `burst_factor` x `target_ttft_s` in LIGHT/STEADY, where a
  burst drains), and work is ahead of it. The prediction is (a) prefilling the work ahead
  (waiting prompts plus unfinished chunks) and its own prompt at the prefill speed measured
  while prompts were queued — the queued-prefill-token cap of DESIGN.md, about target TTFT x
  prefill throughput — plus (b) waiting for a batch slot when the running batch is at its
  cap, at the measured completion rate;
- `kv_pressure`: KV usage is at `kv_reject_usage` and requests already wait for room.

In `mode` "protect" (a dev server: queue, do not refuse) only `too_long` and `queue_full`
apply: the SLO rules (`prefill_backlog`, `kv_pressure`) are off, so a burst is served late
rather than turned away.

The retry-after estimate is the time until the rule would admit again if nothing else
arrived: the predicted delay above the target, the queue over the service rate, or one mean
decode span for KV. It is clamped to [min_retry_after_s, max_retry_after_s].

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal_core.config import AdmissionConfig
from tidal_core.load import LoadEstimator
from tidal_core.plan import Rejection
from tidal_core.regime import Regime
from tidal_core.request import Request


@dataclass(frozen=True, slots=True)
class UnitState:
    """What admission looks at, gathered by the scheduler at the moment of arrival.

    `predicted_ttft_s` is the scheduler's prediction of the new arrival's time to first token
    (queueing plus its own prefill; one definition: `Scheduler.predicted_queue_delay_s`).
    `work_ahead` is False on a unit that would start the request at once.
    """

    num_waiting: int
    num_decoding: int
    kv_usage: float
    predicted_ttft_s: float
    work_ahead: bool
    regime: Regime
    num_in_system: int = 0


class AdmissionController:
    __slots__ = ("config", "max_model_len")

    def __init__(self, config: AdmissionConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

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
        ttft = state.predicted_ttft_s
        # Past capacity every admitted request beyond the target would miss it; below capacity
        # a burst may be let queue up to `burst_factor` x the target (default 1: the prediction
        # is calibrated, so a request predicted past the target misses it). A request nothing is
        # ahead of is always admitted: no unit could serve it sooner.
        limit = cfg.target_ttft_s if state.regime is Regime.OVERLOAD else cfg.burst_factor * cfg.target_ttft_s
        if state.work_ahead and ttft > limit:
            return self._reject(req, "prefill_backlog", ttft - cfg.target_ttft_s,
                                f"predicted time to first token {ttft:.2f}s exceeds the {cfg.target_ttft_s:.2f}s "
                                "target")
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
