"""Discrete-event simulation of serving units driving the real Scheduler on a virtual clock.

Owns: `Simulation` (the event loop: arrivals, engine events, autoscale and sampling ticks, the
summary), `simulate` (one call that runs it) and the run's records (`SimRun`, `StepSamples`).
The unit lives in loadgen/sim/unit.py, the fleet in loadgen/sim/cluster.py, the config in
loadgen/sim/config.py; this module sits on top of them and none of them imports it. Nothing here
decides anything a policy decides: scheduling, admission, routing and autoscaling all call
tidal_core, exactly as the Serve router does.

Events are arrivals (read in order from the trace arrays), unit engine events (a step ends, or
a micro-wait expires: a heap keyed by time then sequence number, so ties are broken
deterministically) and autoscale / sampling ticks. Same inputs and seed, same result.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loadgen.records import Trace
from loadgen.report import ERROR, OK, REJECTED, RunOutcomes
from loadgen.sim.cluster import Fleet
from loadgen.sim.config import SimConfig
from loadgen.sim.prefix_blocks import PrefixBlocks, ideal_hit_rate
from loadgen.sim.retries import RetryingClients
from loadgen.sim.unit import Unit
from tidal_core import Request, Run, SamplingParams, Scheduler, WaitUntil
from tidal_core.service_class import ServiceClass

INF = math.inf
BATCH, INTERACTIVE = ServiceClass.BATCH, ServiceClass.INTERACTIVE
PROGRESS_EVERY = 10_000  # arrivals between two progress callbacks


@dataclass
class StepSamples:
    batch_size: array[int] = field(default_factory=lambda: array("H"))
    wait_ms: array[float] = field(default_factory=lambda: array("f"))
    regime_changes: list[tuple[float, int, str]] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)


@dataclass
class SimRun:
    outcomes: RunOutcomes
    samples: StepSamples
    unit_intervals: list[tuple[float, float]]
    counters: dict[str, dict[str, int]]
    wall_s: float = 0.0
    retries: RetryingClients | None = None
    prefix_cache: dict[str, float] = field(default_factory=dict)  # hit counters, rates, the ideal


class _Recorder:
    """Per-request outcome arrays, filled as events happen."""

    def __init__(self, trace: Trace) -> None:
        n = len(trace)
        self.arrival = trace.arrival_s
        self.status = np.full(n, ERROR, np.int8)  # anything never finished counts as an error
        self.ttft = np.full(n, np.nan)
        self.e2e = np.full(n, np.nan)
        self.n_out = np.zeros(n, np.int64)
        self.predicted_ttft = np.full(n, np.nan)  # the scheduler's TTFT prediction at admission


class Simulation:
    """One run of a trace through a fleet: `run()` is the event loop, then `summarize()`."""

    def __init__(self, trace: Trace, config: SimConfig, progress: Callable[[int], None] | None = None) -> None:
        self.trace = trace
        self.config = config
        self.progress = progress
        self.arrivals: list[float] = trace.arrival_s.tolist()
        self.inputs: list[int] = np.maximum(trace.input_tokens, 1).tolist()
        self.outputs: list[int] = np.maximum(trace.output_tokens, 1).tolist()
        self.rec = _Recorder(trace)
        self.samples = StepSamples()
        self.fleet = Fleet(config, random.Random(config.seed))
        self.heap: list[tuple[float, int, int, int]] = []  # (time, seq, unit id, unit token)
        self._seq = itertools.count(1)
        self._regime_of: dict[int, str] = {}
        self.retries = None
        if config.retries is not None:  # the door's spread of Retry-After stops at the longest, as in Serve
            self.retries = RetryingClients(config.retries, trace, config.seed,
                                           config.scheduler.admission.max_retry_after_s)
        # Block hashes for the prefix cache and the cache-aware router, from the trace's prefix ids.
        self.prefix = PrefixBlocks(trace, config.scheduler.block_size)
        self._hashing = self.prefix.enabled and (config.scheduler.enable_prefix_caching or config.routing == "prefix")

    def run(self) -> SimRun:
        """Take the earliest of: a sample, an autoscale tick, an arrival, an engine event."""
        arrivals, heap, config, progress = self.arrivals, self.heap, self.config, self.progress
        n = len(arrivals)
        i = 0
        next_tick = config.autoscale_interval_s if config.autoscale else INF
        next_sample = 0.0
        retries = self.retries
        while True:
            t_next = arrivals[i] if i < n else INF
            t_retry = retries.next_s if retries is not None else INF
            t_arr = min(t_next, t_retry)
            t_evt = heap[0][0] if heap else INF
            if t_arr == INF and t_evt == INF:
                break
            if next_sample <= min(t_arr, t_evt):
                self.samples.timeline.append(self.fleet.snapshot(next_sample))
                next_sample += config.sample_interval_s
            elif next_tick <= min(t_arr, t_evt):
                self.on_autoscale_tick(next_tick)
                next_tick += config.autoscale_interval_s
            elif retries is not None and t_retry < t_next and t_retry <= t_evt:
                # A retry is an arrival of its own request at its send time, measured from there.
                t_sent, j = retries.pop()
                arrivals[j] = t_sent
                self.on_arrival(j, t_sent)
            elif t_arr <= t_evt:
                self.on_arrival(i, t_arr)
                i += 1
                if progress is not None and i % PROGRESS_EVERY == 0:
                    progress(PROGRESS_EVERY)
            else:
                _, _, uid, token = heapq.heappop(heap)
                self.on_engine_event(uid, token, t_evt)
        if progress is not None:
            progress(n % PROGRESS_EVERY)
        return self.summarize()

    def on_arrival(self, i: int, now: float) -> None:
        """Route request `i`; admission may reject it; an idle or waiting unit re-decides."""
        hashes = self.prefix.hashes(i, self.inputs[i]) if self._hashing else None
        unit = self.fleet.route(now, hashes, self.inputs[i])
        cls = BATCH if i in self.config.batch_ids else INTERACTIVE
        req = Request(str(i), self.inputs[i], SamplingParams(max_tokens=self.outputs[i], ignore_eos=True), now,
                      service_class=cls)
        req.block_hashes = hashes
        rejection = unit.sched.add_request(req, now) if unit is not None else None
        if unit is None or rejection is not None:
            if unit is not None and hashes:
                self.fleet.on_refused(unit, hashes)
            self.rec.status[i] = REJECTED
            if self.retries is not None:
                self.retries.on_rejected(i, now, rejection, self.fleet.capacity_rps())
            return
        if self.retries is not None:
            self.retries.on_admitted(i)
        if unit.inflight is None:  # idle, or in a micro-wait: the arrival may change the decision
            self.kick(unit, now)

    def on_engine_event(self, uid: int, token: int, now: float) -> None:
        """A unit's step ended or its micro-wait expired: record outputs, schedule again."""
        unit = self.fleet.units.get(uid)
        if unit is None or token != unit.token:  # retired since, or superseded by a later kick
            return
        if unit.inflight is not None:
            plan, result = unit.inflight
            unit.inflight = None
            out = unit.sched.on_step_done(plan, result, now)
            rec, arrivals = self.rec, self.arrivals
            for rid in out.first_token_ids:
                idx = int(rid)
                rec.ttft[idx] = now - arrivals[idx]
            for req in out.finished:
                idx = int(req.request_id)
                rec.e2e[idx] = now - arrivals[idx]
                rec.n_out[idx] = len(req.output_token_ids)
                rec.status[idx] = OK
                if req.predicted_ttft_s is not None:
                    rec.predicted_ttft[idx] = req.predicted_ttft_s
        self.kick(unit, now)
        self.fleet.maybe_retire(unit, now)

    def on_autoscale_tick(self, now: float) -> None:
        """One autoscaling decision; draining units with work left are kicked."""
        for unit in self.fleet.tick(now):
            if unit.inflight is None and unit.sched.has_unfinished:
                self.kick(unit, now)

    def kick(self, unit: Unit, now: float) -> None:
        """Ask the unit's scheduler what to do now and queue the engine event it implies."""
        unit.token += 1
        decision = unit.sched.schedule(now)
        if type(decision) is Run:
            plan = decision.plan
            result = unit.executor.execute(plan)
            unit.inflight = (plan, result)
            unit.busy_s += result.device_time_s
            self.samples.batch_size.append(plan.num_seqs)
            self.samples.wait_ms.append(unit.sched.stats.last_wait_s * 1000.0)
            heapq.heappush(self.heap, (now + result.device_time_s, next(self._seq), unit.uid, unit.token))
        elif type(decision) is WaitUntil:
            heapq.heappush(self.heap, (decision.deadline_s, next(self._seq), unit.uid, unit.token))
        regime = unit.sched.current_regime.value
        if self._regime_of.get(unit.uid) != regime:
            self._regime_of[unit.uid] = regime
            self.samples.regime_changes.append((now, unit.uid, regime))

    def summarize(self) -> SimRun:
        """Close the fleet at the last event; outcomes, GPU hours and the merged counters."""
        trace, rec, fleet = self.trace, self.rec, self.fleet
        last_unit_end = max((u.end_s or 0.0) for u in fleet.units.values()) if fleet.units else 0.0
        last_finish = float(np.nanmax(rec.arrival + rec.e2e)) if len(trace) and np.isfinite(rec.e2e).any() else 0.0
        intervals = fleet.close(max(trace.duration_s, last_unit_end, last_finish))
        gpu_hours = sum(b - a for a, b in intervals) * self.config.gpus_per_unit / 3600.0
        counters = _merge_counters([u.sched for u in fleet.all_units()])
        outcomes = RunOutcomes(rec.arrival, trace.input_tokens, rec.n_out, rec.status, rec.ttft, rec.e2e,
                               float(trace.duration_s), gpu_hours, counters["preempted"].get("kv_exhausted", 0),
                               extra={"predicted_ttft_s": rec.predicted_ttft})
        return SimRun(outcomes, self.samples, intervals, {k: dict(v) for k, v in counters.items()},
                      retries=self.retries, prefix_cache=self._prefix_summary(fleet.all_units()))

    def _prefix_summary(self, units: list[Unit]) -> dict[str, float]:
        """The fleet's prefix-cache counters, its hit rate and an unbounded cache's (empty when off)."""
        if not self.config.scheduler.enable_prefix_caching:
            return {}
        keys = ("prefix_cache_query_tokens", "prefix_cache_hit_tokens", "prefix_cache_query_requests",
                "prefix_cache_hit_requests")
        out: dict[str, float] = {k: float(sum(getattr(u.sched.stats, k) for u in units)) for k in keys}
        q, qr = out["prefix_cache_query_tokens"], out["prefix_cache_query_requests"]
        out["hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
        out["request_hit_rate"] = out["prefix_cache_hit_requests"] / qr if qr else 0.0
        bs = self.config.scheduler.block_size
        ideal = ideal_hit_rate(self.trace, bs, self.inputs)
        out["ideal_hit_rate"] = ideal if ideal is not None else 0.0
        served = ideal_hit_rate(self.trace, bs, self.inputs, (self.rec.status != REJECTED).tolist())
        out["ideal_hit_rate_served"] = served if served is not None else 0.0
        out["evictions"] = float(sum(c.num_evictions for u in units if (c := u.sched.q.cache) is not None))
        return out


def simulate(trace: Trace, config: SimConfig, progress: Callable[[int], None] | None = None) -> SimRun:
    return Simulation(trace, config, progress).run()


def _merge_counters(scheds: list[Scheduler]) -> dict[str, Counter[str]]:
    merged: dict[str, Counter[str]] = {k: Counter() for k in ("dispatch", "waits", "rejected", "preempted", "finished")}
    steps: Counter[str] = Counter()
    for s in scheds:
        for key, counter in merged.items():
            counter.update(getattr(s.stats, key))
        steps.update({"total": s.stats.num_steps, "tpot_limited": s.stats.tpot_limited_steps,
                      "prefill_deferred": s.stats.prefill_deferred_steps})
    merged["steps"] = steps
    return merged
