"""Prometheus metrics of a serving unit, through `ray.util.metrics` (Ray exports them).

Owns: `UnitMetrics`, the `EngineObserver` the engine loop calls, and the front gates' two
(`refusal_counter`, `front_delay_histogram`). Every metric is created from
its definition in serve_app/metric_defs.py (names are never typed twice). Gauges are refreshed
at most every `gauge_period_s`; counters and histograms are recorded as events happen, once
per step or per request (never per token: inter-token latency is the gap between steps, which
every decode in the step saw). Counters the scheduler keeps cumulatively (preemptions by reason
and service class, the batch class's tokens) are exported as the change since the last step.
The latency histograms (TTFT, queue time, TTFT prediction, end to end) are the interactive
class's: a batch request is never held to the TTFT target, and its hours in the batch queue
would read as an SLO burn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.util import metrics as ray_metrics

from serve_app import metric_defs as M
from tidal_core import Request, Scheduler, StepPlan
from tidal_core.costly_prompts import UNLIMITED
from tidal_core.regime import REGIME_LEVEL

# The scheduler's cumulative prefix-cache counters (SchedulerStats fields) and their metrics.
PREFIX_COUNTERS = (("prefix_cache_query_tokens", M.PREFIX_QUERIED_TOKENS),
                   ("prefix_cache_hit_tokens", M.PREFIX_HIT_TOKENS),
                   ("prefix_cache_query_requests", M.PREFIX_QUERIED_REQUESTS),
                   ("prefix_cache_hit_requests", M.PREFIX_HIT_REQUESTS))


def _make(defn: M.MetricDef) -> Any:
    if defn.kind == "counter":
        return ray_metrics.Counter(defn.name, description=defn.description, tag_keys=defn.tag_keys)
    if defn.kind == "gauge":
        return ray_metrics.Gauge(defn.name, description=defn.description, tag_keys=defn.tag_keys)
    return ray_metrics.Histogram(defn.name, description=defn.description, boundaries=list(defn.boundaries),
                                 tag_keys=defn.tag_keys)


def prefix_cache_counters(stats: Any) -> dict[str, int]:
    """The scheduler's prefix-cache counters by name (0 for a scheduler without them)."""
    return {field: int(getattr(stats, field, 0)) for field, _ in PREFIX_COUNTERS}


class UnitMetrics:
    def __init__(self, unit: str, gauge_period_s: float = 0.5) -> None:
        self.unit = unit
        self.tags = {M.UNIT_TAG: unit}
        self.gauge_period_s = gauge_period_s
        self._next_gauge = 0.0
        self._m: dict[str, Any] = {}
        for defn in M.ALL_METRICS:
            if M.UNIT_TAG in defn.tag_keys:
                metric = _make(defn)
                metric.set_default_tags({M.UNIT_TAG: unit})
                self._m[defn.name] = metric
        self._reasons: dict[tuple[str, str], dict[str, str]] = {}
        self._prefix_seen = dict.fromkeys((field for field, _ in PREFIX_COUNTERS), 0)
        self._preempted: dict[tuple[str, str], int] = {}  # (reason, class) -> count exported so far
        self._batch_tokens = {"prompt": 0, "generation": 0}  # kind -> batch tokens exported so far

    def _tags(self, key: str, value: str) -> dict[str, str]:
        tags = self._reasons.get((key, value))
        if tags is None:
            tags = self._reasons[(key, value)] = {M.UNIT_TAG: self.unit, key: value}
        return tags

    # ---- EngineObserver ----------------------------------------------------------------------
    def on_arrival(self) -> None:
        self._m[M.ARRIVALS.name].inc()

    def on_rejection(self, reason: str) -> None:
        self._m[M.REJECTIONS.name].inc(1, self._tags("reason", reason))

    def on_step(self, sched: Scheduler, plan: StepPlan, device_time_s: float, step_gap_s: float, now: float) -> None:
        m = self._m
        stats = sched.stats.last_step
        reason = stats.dispatch_reason if stats else "unknown"
        m[M.DISPATCHES.name].inc(1, self._tags("reason", reason))
        m[M.BATCH_SIZE.name].observe(plan.num_seqs)
        m[M.STEP_TIME.name].observe(device_time_s)
        m[M.MICROWAIT.name].observe(stats.wait_s if stats else 0.0)
        if plan.num_decode_seqs:
            m[M.ITL.name].observe(step_gap_s)
            m[M.GENERATION_TOKENS.name].inc(plan.num_decode_seqs)
        if stats and stats.num_preempted:
            self._export_preemptions(sched)
        self._export_batch_tokens(sched)
        self._prefix_counters(sched)
        if now >= self._next_gauge:
            self._next_gauge = now + self.gauge_period_s
            self.refresh_gauges(sched, now)

    def _prefix_counters(self, sched: Scheduler) -> None:
        """Advance each prefix-cache counter by what the scheduler's own counter gained."""
        seen, now = self._prefix_seen, prefix_cache_counters(sched.stats)
        for field, defn in PREFIX_COUNTERS:
            value = now[field]
            if value > seen[field]:
                self._m[defn.name].inc(value - seen[field])
                seen[field] = value
    def _export_preemptions(self, sched: Scheduler) -> None:
        for (reason, cls), total in sched.stats.preempted_by.items():
            delta = total - self._preempted.get((reason, cls), 0)
            if delta > 0:
                self._preempted[(reason, cls)] = total
                self._m[M.PREEMPTIONS.name].inc(delta, {M.UNIT_TAG: self.unit, "reason": reason, M.CLASS_TAG: cls})

    def _export_batch_tokens(self, sched: Scheduler) -> None:
        stats = sched.stats
        for kind, total in (("prompt", stats.num_batch_prompt_tokens_computed),
                            ("generation", stats.num_batch_generated_tokens)):
            delta = total - self._batch_tokens[kind]
            if delta > 0:
                self._batch_tokens[kind] = total
                self._m[M.BATCH_TOKENS.name].inc(delta, self._tags("kind", kind))

    def on_first_token(self, req: Request, now: float) -> None:
        if req.is_batch:  # tokens counted; no latency (see the module docstring)
            self._m[M.PROMPT_TOKENS.name].inc(req.num_prompt_tokens)
            self._m[M.GENERATION_TOKENS.name].inc(1)
            return
        self._m[M.TTFT.name].observe(now - req.arrival_s)
        if req.ttft_prediction_ratio is not None:
            self._m[M.TTFT_PREDICTION.name].observe(req.ttft_prediction_ratio)
        if req.admitted_s is not None:
            self._m[M.QUEUE_TIME.name].observe(req.admitted_s - req.arrival_s)
        self._m[M.PROMPT_TOKENS.name].inc(req.num_prompt_tokens)
        self._m[M.GENERATION_TOKENS.name].inc(1)

    def on_finish(self, req: Request, now: float) -> None:
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        self._m[M.FINISHED.name].inc(1, self._tags("reason", reason))
        if reason != "abort" and not req.is_batch:
            self._m[M.E2E.name].observe(now - req.arrival_s)

    def on_engine_error(self, kind: str) -> None:
        self._m[M.ENGINE_ERRORS.name].inc(1, self._tags("kind", kind))

    # ---- gauges ------------------------------------------------------------------------------
    def refresh_gauges(self, sched: Scheduler, now: float) -> None:
        m, snap = self._m, sched.snapshot(now, self.unit)
        m[M.RUNNING.name].set(snap.num_running)
        m[M.WAITING.name].set(snap.num_waiting)
        m[M.KV_USAGE.name].set(snap.kv_usage)
        m[M.REGIME.name].set(REGIME_LEVEL[snap.regime])
        m[M.LOAD.name].set(snap.load)
        m[M.CAPACITY.name].set(snap.capacity_rps)
        m[M.QUEUE_DELAY.name].set(snap.queue_delay_s)
        m[M.ADMISSION_LIMIT.name].set(sched.admission.limit_s(snap.regime))
        m[M.SLOW_PROMPT_RATIO.name].set(sched.admission.alone.value)
        costly = sched.admission.costly_limit_tokens(snap.regime, sched.load, sched.load.overload(now)[0])
        m[M.COSTLY_LIMIT.name].set(costly if costly < UNLIMITED else 0)
        m[M.MEASURED_TPOT.name].set(snap.tpot_s)
        sizer = sched.sizer
        m[M.TPOT_AIM.name].set(sizer.aim_s if sizer is not None else 0.0)
        m[M.BORROW_SCALE.name].set(sizer.borrow_scale if sizer is not None else 1.0)
        m[M.OVERLOAD_PREFILL_CAP.name].set(sched.limits.slot_cap)
        m[M.PADDING_WASTE.name].set(sched.buckets.padding_waste())
        m[M.BATCH_WAITING.name].set(snap.batch_waiting)
        m[M.BATCH_BACKLOG_TOKENS.name].set(snap.batch_backlog_tokens)
        m[M.BATCH_RUNNING.name].set(snap.batch_running)


def refusal_counter(where: str) -> Callable[[str], None]:
    """A gate's `on_refusal` that counts its 429s in `tidal_front_refusals{where, reason}`: a request
    the front door refuses never reaches a unit, so no unit's `tidal_rejections` counts it (its load
    and refusal meter do, from the gate's polls; dashboards and the rejection-rate alert add the two
    counters). Call inside a Ray worker (proxy, replica)."""
    d = M.FRONT_REFUSALS
    counter = ray_metrics.Counter(d.name, description=d.description, tag_keys=d.tag_keys)
    counter.set_default_tags({M.WHERE_TAG: where})
    tags: dict[str, dict[str, str]] = {}

    def count(reason: str) -> None:
        counter.inc(1, tags.get(reason) or tags.setdefault(reason, {"reason": reason}))

    return count


def aim_gauge(where: str, application: str) -> Callable[[float], None]:
    """A gate's `on_aim`: sets `tidal_front_aim{where, application}` (tidal_core/door_aim.py), from 1.
    The gate calls it on each change and every `AIM_REPORT_S` (Ray drops a gauge series not set again
    within two export intervals). Call inside a Ray worker."""
    d = M.FRONT_AIM
    gauge = ray_metrics.Gauge(d.name, description=d.description, tag_keys=d.tag_keys)
    gauge.set_default_tags({M.WHERE_TAG: where, M.APP_TAG: application})
    gauge.set(1.0)
    return gauge.set


def front_delay_histogram() -> Callable[[float], None]:
    """Observes `tidal_front_delay_seconds`: a stamped request's time from the proxy to this Ingress
    replica (serve_app/openai/arrival_stamp.py). Call inside a Ray worker."""
    d = M.FRONT_DELAY
    histogram = ray_metrics.Histogram(d.name, description=d.description, boundaries=list(d.boundaries),
                                      tag_keys=d.tag_keys)
    return histogram.observe
