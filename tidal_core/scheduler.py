"""The Scheduler: one serving unit's continuous-batching policy, driven by any clock.

Owns: the orchestration of one unit's policy objects, each in its own module:

- `UnitQueues` (core/queues.py): where every request is, its KV blocks (single writer);
- `BatchBuilder` (core/batch_builder.py): what a step holds - decode-first, chunked prefill;
- `LaunchPolicy` (core/microwait.py): when new prefills launch - the micro-wait, baselines;
- `StepSizer` (core/step_sizer.py): how big a step may be so decodes keep the TPOT target;
- `TtftPredictor` (core/predictor.py): a new arrival's time to first token, and its error;
- `AdmissionController` (core/admission.py): 429 before the SLO is lost;
- `RegimeDetector` (core/regime.py), `LoadEstimator` (core/load.py), `CudaGraphBuckets`.

The baselines (core/presets.py) are configurations of these same objects. Three calls make
an engine step:

    decision = scheduler.schedule(now)                    # Run(plan) | WaitUntil(t) | Idle
    result = executor.execute(plan)                       # real model or simulated GPU
    outputs = scheduler.on_step_done(plan, result, now)   # tokens, first tokens, finishes

plus `add_request` (admission control may answer with a `Rejection`) and `abort`.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.admission import AdmissionController, UnitState
from tidal_core.batch_builder import BatchBuilder
from tidal_core.buckets import CudaGraphBuckets
from tidal_core.budget import StepBudget
from tidal_core.config import SchedulerConfig
from tidal_core.load import LoadEstimator
from tidal_core.microwait import LaunchPolicy
from tidal_core.plan import (
    Decision,
    Idle,
    NewRequestData,
    Rejection,
    Run,
    StepOutputs,
    StepPlan,
    StepResult,
    StepStats,
    WaitUntil,
)
from tidal_core.predictor import TtftPredictor
from tidal_core.queues import UnitQueues
from tidal_core.regime import Regime, RegimeDetector
from tidal_core.request import FinishReason, Request, RequestStatus
from tidal_core.snapshot import UnitLoad
from tidal_core.stats import SchedulerStats
from tidal_core.step_sizer import StepSizer

IDLE = Idle()
OBSERVE_PERIOD_S = 0.05
"""How often (in `now` units) load and regime are re-evaluated at step boundaries."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, now: float = 0.0) -> None:
        self.config = config
        self.q = UnitQueues(config)
        self.blocks, self.decodes, self.waiting, self.prefilling = (self.q.blocks, self.q.decodes, self.q.waiting,
                                                                    self.q.prefilling)
        self.requests = self.q.requests
        self.builder = BatchBuilder(config, self.q)
        self.buckets = CudaGraphBuckets(config.cuda_graph_buckets)
        self.load = LoadEstimator(config.load_tau_s, config.service_prior, config.max_batch_size,
                                  config.num_kv_blocks * config.block_size)
        self.predictor = TtftPredictor(self.load)
        self.regime = RegimeDetector(config.regime, now)
        self.batching = LaunchPolicy(config.batching, config.max_batch_size, config.max_num_batched_tokens)
        self.admission = AdmissionController(config.admission, config.max_model_len)
        adm, sizing = config.admission, config.step_sizing
        self.sizer = StepSizer(sizing, adm.target_tpot_s, now) if sizing.enabled and adm.target_tpot_s else None
        self.stats = SchedulerStats()
        self.last_load = 0.0
        self._prefill_cap = config.max_prefill_tokens or math.inf
        self._inflight: StepPlan | None = None
        self._aborted_inflight: set[str] = set()
        self._step_id = 0
        self._had_backlog = False
        self._scheduled_at = 0.0
        self._next_observe_s = -math.inf
        self._running_cap = config.max_batch_size
        self._refresh_running_cap()

    # ---- queries ------------------------------------------------------------------------
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
        """Prompt tokens not yet computed: waiting prompts plus unfinished chunks."""
        return self.q.waiting_tokens + self.q.prefill_remaining

    def max_running(self) -> int:
        """The running-batch cap: max_batch_size, or less where the step sizer says so."""
        return self._running_cap

    def snapshot(self, now: float, unit_id: str = "") -> UnitLoad:
        """This unit's state now, as routing, autoscaling, the simulator and metrics read it."""
        return UnitLoad(unit_id, self.num_running, len(self.waiting), self.predicted_queue_delay_s(now),
                        self.blocks.usage(), self.load.load(now), self.load.capacity_rps(), self.regime.regime)

    def predicted_queue_delay_s(self, now: float, own_prompt_tokens: int = 0, corrected: bool = True) -> float:
        """Time before a request arriving now would start its prefill (with `own_prompt_tokens`:
        would finish it, i.e. its predicted TTFT). See core/predictor.py."""
        n_dec = len(self.decodes.reqs)
        slots_short = len(self.waiting) + 1 - (self._running_cap - self.num_running)
        return self.predictor.predict(now, self.backlog_prefill_tokens() + own_prompt_tokens, n_dec, slots_short,
                                      self.config.max_num_batched_tokens - n_dec, corrected)

    def unit_state(self, now: float, req: Request) -> UnitState:
        busy = bool(self.waiting) or bool(self.prefilling) or self.num_running >= self._running_cap
        # The client's TTFT: what the request already spent before reaching the unit (its
        # `arrival_s` is the front end's arrival, moved onto this clock) plus what is predicted here.
        return UnitState(len(self.waiting), len(self.decodes.reqs), self.blocks.usage(),
                         max(0.0, now - req.arrival_s) + self.predicted_queue_delay_s(now, req.num_prompt_tokens),
                         busy, self.regime.regime, len(self.requests))

    # ---- arrivals and aborts -------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> Rejection | None:
        """Queue a request, or return why admission control turned it away.

        `req.arrival_s` is when the client sent it (the front end's clock, moved onto this
        one): admission judges the client's TTFT from it. `now` is when this unit got it: the
        micro-wait counts from there (`req.queued_s`)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.stats.num_arrived += 1
        self.load.on_arrival(now, req.num_prompt_tokens, req.sampling.max_tokens)
        state = self.unit_state(now, req)
        rejection = self.admission.check_length(req) or self.admission.check(req, state, self.load)
        if rejection is not None:
            req.status = RequestStatus.REJECTED
            req.finished_s = now
            self.stats.rejected[rejection.reason] += 1
            return rejection
        req.queued_s = now
        req.predicted_ttft_s = state.predicted_ttft_s
        # The raw model's prediction (plus the time already spent in front of the unit, which the
        # first token's measured TTFT holds too): its measured error is what the correction learns.
        req.raw_predicted_ttft_s = max(0.0, now - req.arrival_s) + self.predicted_queue_delay_s(
            now, req.num_prompt_tokens, corrected=False)
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

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, now: float) -> Decision:
        """Decide the next step at `now`: `Run(plan)`, `WaitUntil(deadline)` (a launch policy
        holds new prefills and nothing else can run) or `Idle` (no live request).

        The step holds every running decode, then unfinished prefill chunks, then new requests
        when the launch policy admits them, within `max_num_batched_tokens` tokens and
        `max_batch_size` sequences, less the step sizer's prefill allowance and running-batch
        cap. Exactly one plan is in flight: `on_step_done` must follow before the next call.
        """
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is still in flight; call on_step_done first")
        decodes, waiting, prefilling = self.decodes, self.waiting, self.prefilling
        if not decodes.reqs and not prefilling and not waiting:
            return IDLE
        cfg = self.config
        if now >= self._next_observe_s:
            self._observe(now)
        load, regime = self.last_load, self.regime.regime
        budget = StepBudget(cfg.max_num_batched_tokens, cfg.max_batch_size)
        new_block_ids: dict[str, list[int]] = {}
        preempted = self.builder.grow_decodes(new_block_ids) if decodes.reqs else ()
        for victim in preempted:
            self._on_preempted(victim)
        sched = decodes.ones.copy()
        n_dec = len(sched)
        budget.take_decodes(n_dec)
        wanted = budget.tokens_left
        allowance = self._prefill_cap
        if self.sizer is not None and (waiting or prefilling):
            allowance = min(allowance, self.sizer.prefill_allowance(self.load.service, n_dec, self._ttft_pressure(now)))
        if allowance < wanted:
            budget.tokens_left = int(max(0, allowance))
        self._had_backlog = bool(waiting) or bool(prefilling)
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
                self.stats.num_waits += 1
                self.stats.waits[decision.reason] += 1
                self.stats.wait_s_total += max(0.0, decision.deadline_s - now)
                return WaitUntil(decision.deadline_s, decision.reason)
        if not sched:
            raise AssertionError(f"nothing schedulable with {len(waiting)} waiting and {self.num_running} running")
        if budget.tokens_left <= 0 < wanted and allowance < wanted and (waiting or prefilling):
            self.stats.tpot_limited_steps += 1
        padded = self.buckets.bucket_for(n_dec) if n_dec and not prefill_tokens else None
        if not prefill_tokens:
            self.buckets.record(n_dec, padded)
        self._step_id += 1
        plan = StepPlan(self._step_id, sched, prefill_ctx, new_reqs, new_block_ids, self.q.pending_finished,
                        n_dec, prefill_tokens, decodes.context_tokens, padded)
        self.q.pending_finished = []
        self._inflight = plan
        self._record_step(plan, now, regime, load, wait_s, reason, len(preempted))
        return Run(plan, reason)

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        """Apply the step in flight: its measured time trains the step model, the prefill speed
        and the step sizer's banks; its sampled tokens extend decodes, end requests (stop
        token, length) and turn finished prefills into decodes with their first token."""
        if plan is not self._inflight:
            raise RuntimeError(f"on_step_done for step {plan.step_id}, which is not the step in flight")
        self._inflight = None
        self.load.on_step(plan.num_prefill_tokens, plan.num_decode_seqs, result.device_time_s)
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
        decodes = self.decodes
        if decodes.reqs:
            decodes.append_tokens(sampled)
            self.stats.num_generated_tokens += len(decodes.reqs)
            self._finish_decodes(sampled, now, finished)
        first = self._advance_prefills(plan, sampled, now, finished)
        return StepOutputs(sampled, first, finished, result.logprobs)

    # ---- internals ------------------------------------------------------------------------
    def _observe(self, now: float) -> None:
        """Refresh load and regime. Regime changes need a sustained signal (>= min_dwell_s), so
        evaluating every OBSERVE_PERIOD_S instead of every step loses nothing and keeps the
        per-step cost flat."""
        self._next_observe_s = now + OBSERVE_PERIOD_S
        self.last_load = load = self.load.load(now)
        self.regime.update(now, load, self.predicted_queue_delay_s(now) / self.config.admission.target_ttft_s,
                           self.blocks.usage())

    def _refresh_running_cap(self) -> None:
        cap = self.config.max_batch_size
        if self.sizer is not None:
            cap = min(cap, self.sizer.max_running(self.load.service))
            self.load.batch_cap = cap
        self._running_cap = cap

    def _ttft_pressure(self, now: float) -> bool:
        """The oldest prompt not yet computed has waited `pressure_fraction` of the TTFT target."""
        oldest = next(iter(self.prefilling.values())).arrival_s if self.prefilling else math.inf
        if self.waiting:
            oldest = min(oldest, self.waiting[0].arrival_s)
        return now - oldest >= self.config.step_sizing.pressure_fraction * self.config.admission.target_ttft_s

    def _on_preempted(self, req: Request) -> None:
        self.stats.preempted["kv_exhausted"] += 1
        if self.sizer is not None:
            self.sizer.on_decode_end(req.request_id)

    def _finish_decodes(self, sampled: dict[str, int], now: float, finished: list[Request]) -> None:
        decodes = self.decodes
        stop_set = self.q.stop_set
        if stop_set:
            hits = [rid for rid, tok in sampled.items() if tok in stop_set]
            for rid in hits:
                req = decodes.reqs.get(rid)
                if req is not None and self._hit_stop(req, sampled[rid]):
                    self._finish(req, FinishReason.STOP, now, finished)
        for req in decodes.due_by_length():
            self._finish(req, FinishReason.LENGTH, now, finished)

    def _advance_prefills(self, plan: StepPlan, sampled: dict[str, int], now: float,
                          finished: list[Request]) -> list[str]:
        first: list[str] = []
        q, prefilling, sizer = self.q, self.prefilling, self.sizer
        scheduled = plan.num_scheduled_tokens
        for rid in plan.prefill_context:
            req = prefilling.get(rid)
            if req is None:  # aborted during the step
                continue
            n = scheduled[rid]
            req.num_computed_tokens += n
            q.prefill_remaining -= n
            self.stats.num_prompt_tokens_computed += n
            if req.num_computed_tokens < req.num_tokens:
                continue
            tok = sampled.get(rid)
            if tok is None:
                raise AssertionError(f"executor sampled no token for {rid} at the end of its prefill")
            del prefilling[rid]
            req.output_token_ids.append(tok)
            self.stats.num_generated_tokens += 1
            if req.first_token_s is None:
                req.first_token_s = now
                first.append(rid)
                if req.raw_predicted_ttft_s is not None:
                    req.ttft_prediction_ratio = self.predictor.observe(now, req.raw_predicted_ttft_s,
                                                                       req.predicted_ttft_s, now - req.arrival_s)
            if self._hit_stop(req, tok):
                self._finish(req, FinishReason.STOP, now, finished)
            elif len(req.output_token_ids) >= self.decodes.length_limit(req):
                self._finish(req, FinishReason.LENGTH, now, finished)
            else:
                self.decodes.add(req)
                if sizer is not None:
                    sizer.on_decode_start(rid)
        return first

    @staticmethod
    def _hit_stop(req: Request, tok: int) -> bool:
        return tok in req.stop_ids and len(req.output_token_ids) >= req.sampling.min_tokens

    def _finish(self, req: Request, reason: FinishReason, now: float, finished: list[Request] | None) -> None:
        self.q.remove(req, reason, now)
        if self.sizer is not None:
            self.sizer.on_decode_end(req.request_id)
        if reason is not FinishReason.ABORT:
            self.load.on_finish(now, len(req.output_token_ids))
            if self.sizer is not None:
                self.sizer.on_finished(len(req.output_token_ids))
        self.stats.finished[reason.value] += 1
        if finished is not None:
            finished.append(req)

    def _record_step(self, plan: StepPlan, now: float, regime: Regime, load: float, wait_s: float,
                     reason: str, num_preempted: int) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.dispatch[reason] += 1
        stats.last_step = StepStats(now, plan.step_id, len(plan.num_scheduled_tokens), plan.num_decode_seqs +
                                    plan.num_prefill_tokens, plan.num_decode_seqs, plan.num_prefill_tokens,
                                    len(plan.new_requests), plan.padded_batch_size, len(self.waiting),
                                    self.num_running, self.blocks.usage(), regime.value,
                                    load, wait_s, reason, num_preempted)

    def check_integrity(self) -> None:
        """Every invariant the scheduler relies on; tests call it after every operation."""
        self.q.check_integrity()
