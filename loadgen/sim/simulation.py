"""Discrete-event simulation of serving units driving the real Scheduler on a virtual clock.

Owns: `SimConfig`, `Unit` (one serving unit: a core `Scheduler` + a simulated executor) and
`simulate` (the event loop). Nothing here decides anything a policy decides: scheduling,
admission, routing and autoscaling all call tidal_core, exactly as the Serve router does.

Events are arrivals (read in order from the trace arrays), unit engine events (a step ends, or
a micro-wait expires: a heap keyed by time then sequence number, so ties are broken
deterministically) and autoscale / sampling ticks. Same inputs and seed, same result.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.records import Trace
from loadgen.report import ERROR, OK, REJECTED, RunOutcomes, Slo
from loadgen.retry_policy import RetryPolicy
from loadgen.sim.cluster import Fleet
from loadgen.sim.retries import RetryingClients
from tidal_core import (
    AutoscaleConfig,
    Request,
    Run,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
    WaitUntil,
)

INF = math.inf


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    make_executor: Callable[[], Any]
    slo: Slo = field(default_factory=Slo)
    num_units: int = 1
    gpus_per_unit: int = 8
    autoscale: AutoscaleConfig | None = None
    autoscale_interval_s: float = 10.0
    provisioning_s: float = 300.0
    sample_interval_s: float = 60.0
    seed: int = 0
    retries: RetryPolicy | None = None  # clients retry refusals (loadgen/sim/retries.py); None: never


class Unit:
    """A serving unit in the simulation: its scheduler, executor and engine state."""

    __slots__ = ("busy_s", "draining", "end_s", "executor", "inflight", "ready_s", "sched", "start_s", "token", "uid")

    def __init__(self, uid: int, config: SimConfig, start_s: float, ready_s: float) -> None:
        self.uid = uid
        self.sched = Scheduler(config.scheduler, now=ready_s)
        self.executor = config.make_executor()
        self.inflight: tuple[StepPlan, StepResult] | None = None
        self.token = 0  # invalidates a superseded engine event in the heap
        self.start_s = start_s
        self.ready_s = ready_s
        self.end_s: float | None = None
        self.draining = False
        self.busy_s = 0.0

    @property
    def idle(self) -> bool:
        return self.inflight is None and not self.sched.has_unfinished


@dataclass
class StepSamples:
    batch_size: array = field(default_factory=lambda: array("H"))
    wait_ms: array = field(default_factory=lambda: array("f"))
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


def simulate(trace: Trace, config: SimConfig, progress: Callable[[int], None] | None = None) -> SimRun:
    arrivals = trace.arrival_s.tolist()
    inputs = np.maximum(trace.input_tokens, 1).tolist()
    outputs = np.maximum(trace.output_tokens, 1).tolist()
    n = len(arrivals)
    rec = _Recorder(trace)
    samples = StepSamples()
    fleet = Fleet(config, lambda uid, start, ready: Unit(uid, config, start, ready), random.Random(config.seed))
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    regime_of: dict[int, str] = {}
    retries = RetryingClients(config.retries, trace, config.seed) if config.retries is not None else None

    def kick(unit: Unit, now: float) -> None:
        nonlocal seq
        unit.token += 1
        decision = unit.sched.schedule(now)
        if type(decision) is Run:
            plan = decision.plan
            result = unit.executor.execute(plan)
            unit.inflight = (plan, result)
            unit.busy_s += result.device_time_s
            samples.batch_size.append(plan.num_seqs)
            stats = unit.sched.stats.last_step
            samples.wait_ms.append(stats.wait_s * 1000.0 if stats else 0.0)
            seq += 1
            heapq.heappush(heap, (now + result.device_time_s, seq, unit.uid, unit.token))
        elif type(decision) is WaitUntil:
            seq += 1
            heapq.heappush(heap, (decision.deadline_s, seq, unit.uid, unit.token))
        regime = unit.sched.current_regime.value
        if regime_of.get(unit.uid) != regime:
            regime_of[unit.uid] = regime
            samples.regime_changes.append((now, unit.uid, regime))

    def on_engine_event(unit: Unit, now: float) -> None:
        if unit.inflight is not None:
            plan, result = unit.inflight
            unit.inflight = None
            out = unit.sched.on_step_done(plan, result, now)
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
        kick(unit, now)

    def on_arrival(i: int, now: float) -> None:
        unit = fleet.route(now)
        req = Request(str(i), inputs[i], SamplingParams(max_tokens=outputs[i], ignore_eos=True), now)
        rejection = unit.sched.add_request(req, now) if unit is not None else None
        if unit is None or rejection is not None:
            rec.status[i] = REJECTED
            if retries is not None:
                retries.on_rejected(i, now, rejection)
            return
        if retries is not None:
            retries.on_admitted(i)
        if unit.inflight is None:  # idle, or in a micro-wait: the arrival may change the decision
            kick(unit, now)

    i = 0
    next_tick = config.autoscale_interval_s if config.autoscale else INF
    next_sample = 0.0
    while True:
        t_arr = arrivals[i] if i < n else INF
        t_evt = heap[0][0] if heap else INF
        t_retry = retries.next_s if retries is not None else INF
        t_arr = min(t_arr, t_retry)
        if t_arr == INF and t_evt == INF:
            break
        if next_sample <= min(t_arr, t_evt):
            samples.timeline.append(fleet.snapshot(next_sample))
            next_sample += config.sample_interval_s
            continue
        if next_tick <= min(t_arr, t_evt):
            for unit in fleet.tick(next_tick):
                if unit.inflight is None and unit.sched.has_unfinished:
                    kick(unit, next_tick)
            next_tick += config.autoscale_interval_s
            continue
        if t_retry == t_arr and t_arr <= t_evt and retries is not None and (i >= n or t_retry < arrivals[i]):
            # A retry is an arrival of its own request at its send time, measured from there.
            t_retry, j = retries.pop()
            arrivals[j] = t_retry
            on_arrival(j, t_retry)
        elif t_arr <= t_evt:
            on_arrival(i, t_arr)
            i += 1
            if progress is not None and i % 10_000 == 0:
                progress(10_000)
        else:
            _, _, uid, token = heapq.heappop(heap)
            unit = fleet.units[uid]
            if token == unit.token:
                on_engine_event(unit, t_evt)
                fleet.maybe_retire(unit, t_evt)
    if progress is not None:
        progress(n % 10_000)
    end = max(trace.duration_s, max((u.end_s or 0.0) for u in fleet.units.values()) if fleet.units else 0.0,
              float(np.nanmax(rec.arrival + rec.e2e)) if n and np.isfinite(rec.e2e).any() else 0.0)
    intervals = fleet.close(end)
    gpu_hours = sum(b - a for a, b in intervals) * config.gpus_per_unit / 3600.0
    counters = _merge_counters([u.sched for u in fleet.all_units()])
    outcomes = RunOutcomes(rec.arrival, trace.input_tokens, rec.n_out, rec.status, rec.ttft, rec.e2e,
                           float(trace.duration_s), gpu_hours, counters["preempted"].get("kv_exhausted", 0),
                           extra={"predicted_ttft_s": rec.predicted_ttft})
    return SimRun(outcomes, samples, intervals, {k: dict(v) for k, v in counters.items()}, retries=retries)


def _merge_counters(scheds: list[Scheduler]) -> dict[str, Counter[str]]:
    merged: dict[str, Counter[str]] = {k: Counter() for k in ("dispatch", "waits", "rejected", "preempted", "finished")}
    for s in scheds:
        for key, counter in merged.items():
            counter.update(getattr(s.stats, key))
    return merged
