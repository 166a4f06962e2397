"""The Scheduler: one serving unit's continuous-batching policy, driven by any clock.

Owns: the orchestration of one unit's policy objects, each in its own module: `UnitQueues`
(queues.py: where every request is, its KV blocks), `BatchBuilder` (batch_builder.py: what a
step holds, decode-first, chunked prefill), `LaunchPolicy` (microwait.py: when new prefills
launch), `StepSizer` (step_sizer.py: how big a step may be for the TPOT target),
`BatchLane` (batch_lane.py: the batch class, only in the headroom interactive requests leave),
`TtftPredictor` (predictor.py), `AdmissionController`, `RegimeDetector`, `LoadEstimator`,
`CudaGraphBuckets`. The baselines (presets.py) are configurations of these same objects.
Three calls make an engine step, besides `add_request` (admission may answer `Rejection`) and `abort`:

    decision = scheduler.schedule(now)                    # Run(plan) | WaitUntil(t) | Idle
    result = executor.execute(plan)                       # real model or simulated GPU
    outputs = scheduler.on_step_done(plan, result, now)   # tokens, first tokens, finishes

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.admission import AdmissionController, UnitState
from tidal_core.batch_builder import BatchBuilder
from tidal_core.batch_lane import BatchLane
from tidal_core.buckets import CudaGraphBuckets
from tidal_core.budget import StepBudget
from tidal_core.config import SchedulerConfig
from tidal_core.load import LoadEstimator
from tidal_core.microwait import LaunchPolicy
from tidal_core.plan import Decision, Idle, NewRequestData, Rejection, Run, StepOutputs, StepPlan, StepResult, WaitUntil
from tidal_core.predictor import TtftPredictor
from tidal_core.queues import UnitQueues
from tidal_core.regime import Regime, RegimeDetector
from tidal_core.request import FinishReason, Request, RequestStatus
from tidal_core.service_class import ServiceClass
from tidal_core.snapshot import UnitLoad
from tidal_core.stats import SchedulerStats
from tidal_core.step_sizer import StepSizer
from tidal_core.tpot_meter import TpotMeter

IDLE = Idle()
OBSERVE_PERIOD_S = 0.05
"""How often (in `now` units) load and regime are re-evaluated at step boundaries."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, now: float = 0.0) -> None:
        self.config = config
        self.q = UnitQueues(config)
        q = self.q
        self.blocks, self.decodes, self.waiting, self.prefilling, self.requests = (q.blocks, q.decodes, q.waiting,
                                                                                   q.prefilling, q.requests)
        self.stats = SchedulerStats()
        self.builder = BatchBuilder(config, self.q, self.stats)
        self.lane = BatchLane(config.batch, self.q, self.builder) if config.batch.enabled else None
        self.buckets = CudaGraphBuckets(config.cuda_graph_buckets)
        self.load = LoadEstimator(config.load_tau_s, config.service_prior, config.max_batch_size,
                                  config.num_kv_blocks * config.block_size)
        self.predictor = TtftPredictor(self.load)
        self.regime = RegimeDetector(config.regime, now)
        self.batching = LaunchPolicy(config.batching, config.max_batch_size, config.max_num_batched_tokens)
        self.admission = AdmissionController(config.admission, config.max_model_len)
        adm, sizing = config.admission, config.step_sizing
        self.sizer = StepSizer(sizing, adm.target_tpot_s, now) if sizing.enabled and adm.target_tpot_s else None
        self.tpot = TpotMeter()
        self.last_load = 0.0
        self._prefill_cap = config.max_prefill_tokens or math.inf
        self._pressure_s, self._borrow_over = sizing.pressure_fraction * adm.target_ttft_s, sizing.overload_borrow
        self._inflight: StepPlan | None = None
        self._aborted_inflight: set[str] = set()
        self._step_id = 0
        self._had_backlog = False
        self._scheduled_at = 0.0
        self._next_observe_s = -math.inf
        self._running_cap = config.max_batch_size
        self._refresh_running_cap()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return self.q.num_running

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def current_regime(self) -> Regime:
        return self.regime.regime

    def kv_usage(self) -> float:
        return self.blocks.usage()

    def backlog_prefill_tokens(self) -> int:
        """Interactive prompt tokens not yet computed: waiting prompts plus unfinished chunks
        (batch work runs behind them, so it never delays them)."""
        q = self.q
        return q.waiting_tokens + q.prefill_remaining - q.batch_prefill_remaining

    def max_running(self) -> int:
        """The running-batch cap: max_batch_size, or less where the step sizer says so."""
        return self._running_cap

    def snapshot(self, now: float, unit_id: str = "") -> UnitLoad:
        """This unit's state now, as routing, autoscaling, the simulator and metrics read it.
        `num_waiting`, `queue_delay_s` and `kv_usage` are the interactive view (batch work
        yields its slots and KV); the batch class is reported apart."""
        q = self.q
        batch_kv = self.q.batch_kv_usage()
        return UnitLoad(unit_id, self.num_running, len(self.waiting), self.predicted_queue_delay_s(now),
                        self.blocks.usage() - batch_kv, self.load.load(now), self.load.capacity_rps(),
                        self.regime.regime, batch_waiting=len(q.batch),
                        batch_backlog_tokens=q.batch.num_tokens + q.batch_prefill_remaining,
                        batch_running=q.num_batch_running, batch_kv_usage=batch_kv,
                        tpot_s=self.tpot.tpot_s(now), target_tpot_s=self.config.admission.target_tpot_s or 0.0)

    def predicted_queue_delay_s(self, now: float, own_prompt_tokens: int = 0, corrected: bool = True) -> float:
        """Time before a request arriving now would start its prefill (with `own_prompt_tokens`:
        would finish it, i.e. its predicted TTFT). See core/predictor.py."""
        n_dec = len(self.decodes.reqs)
        slots_short = len(self.waiting) + 1 - (self._running_cap - self.num_running + self.q.num_batch_running)
        return self.predictor.predict(now, self.backlog_prefill_tokens() + own_prompt_tokens, n_dec, slots_short,
                                      self.config.max_num_batched_tokens - n_dec, corrected,
                                      self.lane.delay_s(now) if self.lane is not None else 0.0)

    def unit_state(self, now: float, req: Request, queue_delay_s: float | None = None) -> UnitState:
        """What admission sees for `req`; its predicted TTFT is the client's: time spent before the
        unit (`arrival_s` is the front end's arrival) plus `queue_delay_s` (else predicted now)."""
        if queue_delay_s is None:
            queue_delay_s = self.predicted_queue_delay_s(now, req.num_prompt_tokens - req.expected_cached_tokens)
        q = self.q
        running = self.num_running - q.num_batch_running  # batch requests yield their slots and KV
        busy = bool(self.waiting) or q.prefill_remaining > q.batch_prefill_remaining or running >= self._running_cap
        return UnitState(len(self.waiting), len(self.decodes.reqs), self.blocks.usage() - self.q.batch_kv_usage(),
                         max(0.0, now - req.arrival_s) + queue_delay_s, busy, self.regime.regime,
                         len(self.requests) - len(q.batch) - q.num_batch_running)

    def add_request(self, req: Request, now: float) -> Rejection | None:
        """Queue a request, or return why admission control turned it away. Admission judges the
        client's TTFT from `req.arrival_s`; the micro-wait counts from `now` (`req.queued_s`)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.stats.num_arrived += 1
        if req.is_batch:
            if self.lane is not None:
                return self.lane.add(req, now, self.load, self.admission, self.stats)
            req.service_class, req.is_batch = ServiceClass.INTERACTIVE, False  # no batch class: served as one
        # With prefix caching the predictions see the uncached tokens only (peeked, nothing taken).
        own = req.num_prompt_tokens - self.q.expect_cached(req)
        self.load.on_arrival(now, own, req.sampling.max_tokens)
        raw = self.predicted_queue_delay_s(now, own, corrected=False)
        state = self.unit_state(now, req, raw * self.load.ttft_correction.factor(now))
        rejection = self.admission.check_length(req) or self.admission.check(req, state, self.load)
        if rejection is not None:
            req.status, req.finished_s = RequestStatus.REJECTED, now
            self.stats.rejected[rejection.reason] += 1
            return rejection
        # Admission's prediction, and the raw model's (whose measured error trains the correction).
        req.queued_s, req.predicted_ttft_s = now, state.predicted_ttft_s
        req.raw_predicted_ttft_s = max(0.0, now - req.arrival_s) + raw
        self.q.enqueue(req)
        return None

    def abort(self, request_id: str, now: float) -> Request | None:
        """End a request (client gone, stop string matched). Returns it, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if self._inflight is not None and request_id in self._inflight.num_scheduled_tokens:
            self._aborted_inflight.add(request_id)
        self._finish(req, FinishReason.ABORT, now, None)
        return req

    def abort_all(self, now: float) -> list[Request]:
        """End every request (the executor died). The caller reports the error to clients."""
        return [r for rid in list(self.requests) if (r := self.abort(rid, now)) is not None]

    def schedule(self, now: float) -> Decision:
        """Decide the next step at `now`: `Run(plan)`, `WaitUntil(deadline)` (the launch policy
        holds new prefills and nothing else can run) or `Idle` (no live request). The step holds
        every running decode, then unfinished chunks, then new requests when the launch policy
        admits them, within the token and sequence budget less the step sizer's prefill allowance
        and running-batch cap. One plan is in flight: `on_step_done` must come before the next."""
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is still in flight; call on_step_done first")
        decodes, waiting, prefilling, q = self.decodes, self.waiting, self.prefilling, self.q
        if not decodes.reqs and not prefilling and not waiting and not q.batch:
            return IDLE
        cfg = self.config
        if now >= self._next_observe_s:
            self._observe(now)
        load, regime = self.last_load, self.regime.regime
        budget = StepBudget(cfg.max_num_batched_tokens, cfg.max_batch_size)
        new_block_ids: dict[str, list[int]] = {}
        lane = self.lane
        yielded = lane.yield_to_interactive(self._running_cap) if lane is not None and waiting else ()
        preempted = self.builder.grow_decodes(new_block_ids) if decodes.reqs else ()
        for reason, victims in (("batch_yield", yielded), ("kv_exhausted", preempted)):
            for victim in victims:
                self.stats.on_preempted(reason, victim.service_class.value)
                if self.sizer is not None:
                    self.sizer.on_decode_end(victim.request_id)
        sched = decodes.ones.copy()
        n_dec = len(sched)
        budget.take_decodes(n_dec)
        wanted = budget.tokens_left
        interactive_work = bool(waiting) or q.prefill_remaining > q.batch_prefill_remaining
        batch_work = lane is not None and (bool(q.batch) or q.batch_prefill_remaining > 0)
        allowance = self._prefill_allowance(now, n_dec) if interactive_work or batch_work else wanted
        if allowance < wanted:
            budget.tokens_left = int(max(0, allowance))
        self._had_backlog = interactive_work
        self._scheduled_at = now
        new_reqs: list[NewRequestData] = []
        prefill_ctx: dict[str, int] = {}
        prefill_tokens = self.builder.continue_prefills(budget, sched, prefill_ctx, new_reqs)
        reason, wait_s = "decode_only", 0.0
        if waiting and not budget.exhausted:
            decision = self.batching.decide(now, waiting[0].queued_s, len(waiting), self.q.waiting_tokens,
                                            bool(sched) or bool(prefilling), load, regime)
            wait_s = decision.wait_s
            if decision.admit:
                reason = decision.reason
                room = self._running_cap - self.num_running if self.sizer is not None else math.inf
                prefill_tokens += self.builder.admit(now, budget, sched, prefill_ctx, new_reqs, room)
            elif not sched and decision.deadline_s is not None:
                self.stats.record_wait(decision.reason, max(0.0, decision.deadline_s - now))
                return WaitUntil(decision.deadline_s, decision.reason)
        batch_tokens = 0 if lane is None else lane.fill_step(now, budget, sched, prefill_ctx, new_reqs, n_dec,
                                                             prefill_tokens, self.sizer, self.load, load,
                                                             self._running_cap - self.num_running)
        prefill_tokens += batch_tokens
        if not sched:
            raise AssertionError(f"nothing schedulable with {len(waiting)} waiting and {self.num_running} running")
        if budget.tokens_left <= 0 < wanted and allowance < wanted and interactive_work:
            self.stats.tpot_limited_steps += 1
        if lane is not None:
            lane.started_step(now, batch_tokens, prefill_tokens, n_dec, self.load.service)
        preempted = [*yielded, *preempted] if yielded else preempted
        padded = self.buckets.pad_step(n_dec, prefill_tokens)
        self._step_id += 1
        plan = StepPlan(self._step_id, sched, prefill_ctx, new_reqs, new_block_ids, self.q.pending_finished,
                        n_dec, prefill_tokens, decodes.context_tokens, padded)
        self.q.pending_finished = []
        self._inflight = plan
        self.stats.record_step(plan, now, regime.value, load, wait_s, reason, len(preempted), len(waiting),
                               self.num_running, self.blocks.usage())
        return Run(plan, reason)

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        """Apply the step in flight: its measured time trains the step model, the prefill speed
        and the step sizer's banks; its sampled tokens extend decodes, end requests (stop
        token, length) and turn finished prefills into decodes with their first token."""
        if plan is not self._inflight:
            raise RuntimeError(f"on_step_done for step {plan.step_id}, which is not the step in flight")
        self._inflight = None
        self.load.on_step(plan.num_prefill_tokens, plan.num_decode_seqs, result.device_time_s)
        if self.lane is not None:
            self.lane.step_done(now, self.stats)
        self.tpot.on_step_done(now, plan.num_decode_seqs)
        if self._had_backlog:
            self.load.prefill.on_step(now, now - self._scheduled_at, plan.num_prefill_tokens)
        if self.sizer is not None:
            self.sizer.on_step_done(now, plan.num_decode_seqs)
            self._refresh_running_cap()
        sampled = result.sampled_token_ids
        if self._aborted_inflight:
            aborted = self._aborted_inflight
            sampled = {rid: tok for rid, tok in sampled.items() if rid not in aborted}
            aborted.clear()
        finished: list[Request] = []
        if (decodes := self.decodes).reqs:
            decodes.append_tokens(sampled)
            self.stats.num_generated_tokens += len(decodes.reqs)
            for req in self.q.stop_hits(sampled):
                self._finish(req, FinishReason.STOP, now, finished)
            for req in decodes.due_by_length():
                self._finish(req, FinishReason.LENGTH, now, finished)
        first = self._advance_prefills(plan, sampled, now, finished)
        return StepOutputs(sampled, first, finished, result.logprobs)

    def _observe(self, now: float) -> None:
        """Refresh load and regime (a regime change needs a sustained signal anyway)."""
        self._next_observe_s = now + OBSERVE_PERIOD_S
        self.last_load = load = self.load.load(now)
        self.regime.update(now, load, self.predicted_queue_delay_s(now) / self.config.admission.target_ttft_s,
                           self.blocks.usage() - self.q.batch_kv_usage())

    def _refresh_running_cap(self) -> None:
        cap = self.config.max_batch_size
        if self.sizer is not None:
            cap = min(cap, self.sizer.max_running(self.load.service))
            self.load.batch_cap = cap
        self._running_cap = cap

    def _prefill_allowance(self, now: float, n_dec: int) -> float:
        """The step sizer's prefill allowance (TTFT pressure once the oldest prompt waited `pressure_fraction`
        of the target; in OVERLOAD no borrowing, or the plain table with `overload_borrow`), within any cap."""
        if self.sizer is None:
            return self._prefill_cap
        over = self.regime.regime is Regime.OVERLOAD
        strict = over and not self._borrow_over
        pressure = not over and now - self.q.oldest_arrival_s() >= self._pressure_s
        return min(self._prefill_cap, self.sizer.prefill_allowance(self.load.service, n_dec, pressure, strict))

    def _advance_prefills(self, plan: StepPlan, sampled: dict[str, int], now: float,
                          finished: list[Request]) -> list[str]:
        computed, done = self.q.complete_prefills(plan, sampled)
        stats, sizer, first = self.stats, self.sizer, []
        stats.num_prompt_tokens_computed += computed
        stats.num_generated_tokens += len(done)
        for req in done:
            if req.first_token_s is None:
                self.predictor.on_first_token(req, now)
                first.append(req.request_id)
            if req.is_batch:
                stats.num_batch_generated_tokens += 1
            if self.q.hit_stop(req, req.output_token_ids[-1]):
                self._finish(req, FinishReason.STOP, now, finished)
            elif len(req.output_token_ids) >= self.decodes.length_limit(req):
                self._finish(req, FinishReason.LENGTH, now, finished)
            else:
                self.decodes.add(req)
                if sizer is not None and not req.is_batch:  # batch decodes keep no TPOT bank
                    sizer.on_decode_start(req.request_id)
        return first

    def _finish(self, req: Request, reason: FinishReason, now: float, finished: list[Request] | None) -> None:
        self.q.remove(req, reason, now)
        done = reason is not FinishReason.ABORT and not req.is_batch  # batch lengths would skew the SLO's models
        if done:
            self.load.on_finish(now, len(req.output_token_ids))
        if self.sizer is not None:
            self.sizer.on_request_end(req.request_id, len(req.output_token_ids) if done else None)
        self.stats.finished[reason.value] += 1
        if finished is not None:
            finished.append(req)

    def check_integrity(self) -> None:
        """Every invariant the scheduler relies on; tests call it after every operation."""
        self.q.check_integrity()
