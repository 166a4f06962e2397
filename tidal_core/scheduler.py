"""The Scheduler: one serving unit's continuous-batching policy, driven by any clock.

Owns: the step in flight and the orchestration of the unit's policy objects, one module each;
it holds no policy of its own and calls them in a fixed order every step:
`UnitQueues` (queues.py: where every request is, its KV blocks), the batching policy
`BatchBuilder` (batch_builder.py: decode-first, chunked prefill, KV preemption), the launch
policy `LaunchPolicy` (microwait.py: when new prefills launch), the step sizer `StepSizer`
(step_sizer.py) applied as `StepLimits` (step_limits.py: prefill allowance, running-batch cap),
the `TtftPredictor` (predictor.py) read through `UnitView` (unit_view.py: predictions, what
admission sees, the snapshot), the `AdmissionController`, the batch class's `BatchLane`
(batch_lane.py: only in the headroom interactive requests leave), the `RegimeDetector` over the
`LoadEstimator` and the refusals, `Completion` (completion.py: first tokens, finishes, preemptions
and the accounts that learn from them), `CudaGraphBuckets` and the `TpotMeter`. The baselines
(presets.py) are configurations of these same objects, never another code path.
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
from tidal_core.completion import Completion
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
from tidal_core.step_limits import StepLimits
from tidal_core.tpot_meter import TpotMeter
from tidal_core.unit_view import UnitView

IDLE = Idle()
OBSERVE_PERIOD_S = 0.05  # how often (in `now` units) load and regime are re-evaluated (`observe`)


class Scheduler:
    def __init__(self, config: SchedulerConfig, now: float = 0.0) -> None:
        self.config = config
        self.q = q = UnitQueues(config)
        self.blocks, self.decodes, self.waiting, self.prefilling, self.requests = (q.blocks, q.decodes, q.waiting,
                                                                                   q.prefilling, q.requests)
        self.stats = SchedulerStats()
        self.builder = BatchBuilder(config, self.q, self.stats)
        self.lane = BatchLane(config.batch, self.q, self.builder) if config.batch.enabled else None
        self.buckets = CudaGraphBuckets(config.cuda_graph_buckets)
        self.load = LoadEstimator(config.load_tau_s, config.service_prior, config.max_batch_size,
                                  config.num_kv_blocks * config.block_size)
        self.admission = AdmissionController(config.admission, config.max_model_len)
        self.predictor = TtftPredictor(self.load, self.admission.aim, self.admission.alone)
        self.regime = RegimeDetector(config.regime, now)
        self.batching = LaunchPolicy(config.batching, config.max_batch_size, config.max_num_batched_tokens)
        self.limits = StepLimits(config, self.q, self.load, self.regime, now)
        self.sizer = self.limits.sizer
        self.tpot = TpotMeter()
        self.view = UnitView(config, self.q, self.load, self.predictor, self.regime, self.limits, self.tpot, self.lane)
        self.completion = Completion(self.q, self.stats, self.load, self.predictor, self.sizer)
        self.last_load = 0.0
        self._inflight: StepPlan | None = None
        self._aborted_inflight: set[str] = set()
        self._step_id = 0
        self._had_backlog = False
        self._scheduled_at = 0.0
        self._next_observe_s = -math.inf

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
        """Interactive prompt tokens not yet computed (`UnitView.backlog_prefill_tokens`)."""
        return self.view.backlog_prefill_tokens()

    def max_running(self) -> int:
        """The running-batch cap: max_batch_size, or less where the step sizer says so."""
        return self.limits.running_cap

    def snapshot(self, now: float, unit_id: str = "") -> UnitLoad:
        """This unit's state now, as routing, autoscaling, the simulator and metrics read it
        (`UnitView.snapshot`: the interactive view, the batch class reported apart)."""
        return self.view.snapshot(now, unit_id)

    def predicted_queue_delay_s(self, now: float, own_prompt_tokens: int = 0, corrected: bool = True,
                                own_requests: int = 1) -> float:
        """Time before a request arriving now would start its prefill (with `own_prompt_tokens`:
        would finish it, i.e. its predicted TTFT; with `own_requests`, those tokens arrive as that
        many requests). See `UnitView` and core/predictor.py."""
        return self.view.predicted_queue_delay_s(now, own_prompt_tokens, corrected, own_requests)

    def unit_state(self, now: float, req: Request, queue_delay_s: float | None = None) -> UnitState:
        """What admission sees for `req` (`UnitView.unit_state`)."""
        return self.view.unit_state(now, req, queue_delay_s)

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
        own = self.q.arriving_uncached(req)
        self.load.on_arrival(now, own, req.sampling.max_tokens)
        raw, corrected = self.view.predicted_pair(now, own)
        state = self.view.unit_state(now, req, corrected)
        rejection = self.admission.check_length(req) or self.admission.check(req, state, self.load)
        self.view.refusals.on_arrival(now, rejection is not None and rejection.retryable)
        self.regime.on_arrival(now, rejection.reason if rejection is not None else None)
        if rejection is not None:
            req.status, req.finished_s = RequestStatus.REJECTED, now
            self.stats.rejected[rejection.reason] += 1
            return rejection
        # Admission's prediction, and the raw model's (whose measured error trains the correction).
        req.queued_s, req.predicted_ttft_s, req.alone_ttft_s = now, state.predicted_ttft_s, state.alone_ttft_s
        req.admitted_ahead = state.work_ahead and self.admission.judges_ttft
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
        self.completion.finish(req, FinishReason.ABORT, now, None)
        return req

    def abort_all(self, now: float) -> list[Request]:
        """End every request (the executor died). The caller reports the error to clients."""
        return [r for rid in list(self.requests) if (r := self.abort(rid, now)) is not None]

    def schedule(self, now: float) -> Decision:
        """Decide the next step at `now`. Returns `Run(plan)`, `WaitUntil(deadline)` (the launch
        policy holds new prefills and nothing else can run) or `Idle` (no live request). In order:

        1. every `OBSERVE_PERIOD_S`, refresh the load estimate and the regime;
        2. running batch requests yield to waiting interactive ones (the batch lane), and every
           decode opening a KV block gets one, preempting the newest running request if KV runs
           out (the batching policy, `BatchBuilder.grow_decodes`);
        3. every running decode takes one token of the budget (`max_num_batched_tokens` tokens,
           `max_batch_size` sequences); what is left for prompts is capped by the step limits'
           prefill allowance (the step sizer's TPOT banks, `max_prefill_tokens`);
        4. unfinished prefill chunks continue, oldest first; then, when the launch policy (the
           micro-wait, fixed wait or static batches) admits them, new requests from the head of
           the queue, within the step limits' running cap;
        5. the batch lane fills what interactive work left; the step is padded to its CUDA-graph
           bucket and recorded in the stats.

        One plan is in flight at a time: `on_step_done` must come before the next `schedule`."""
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is still in flight; call on_step_done first")
        decodes, waiting, prefilling, q = self.decodes, self.waiting, self.prefilling, self.q
        if not decodes.reqs and not prefilling and not waiting and not q.batch:
            return IDLE
        cfg = self.config
        self.observe(now)
        load, regime, cap = self.last_load, self.regime.regime, self.limits.running_cap
        new_block_ids: dict[str, list[int]] = {}
        lane = self.lane
        yielded = lane.yield_to_interactive(cap) if lane is not None and waiting and q.num_batch_running else ()
        preempted = self.builder.grow_decodes(new_block_ids) if decodes.reqs else ()
        if yielded or preempted:
            self.completion.on_preempted(yielded, preempted)
        sched = decodes.step_tokens()
        n_dec = len(sched)
        budget = StepBudget(cfg.max_num_batched_tokens - n_dec, cfg.max_batch_size - n_dec)  # decodes first
        wanted = budget.tokens_left
        interactive_work = bool(waiting) or q.prefill_remaining > q.batch_prefill_remaining
        batch_work = lane is not None and (bool(q.batch) or q.batch_prefill_remaining > 0)
        allowance = self.limits.prefill_allowance(now, n_dec, wanted) if interactive_work or batch_work else wanted
        if allowance < wanted:
            budget.tokens_left = int(max(0, allowance))
        self._had_backlog, self._scheduled_at = interactive_work, now
        new_reqs: list[NewRequestData] = []
        prefill_ctx: dict[str, int] = {}
        prefill_tokens = self.builder.continue_prefills(budget, sched, prefill_ctx, new_reqs)
        reason, wait_s = "decode_only", 0.0
        if waiting and not budget.exhausted:
            launched = self._launch(now, budget, sched, prefill_ctx, new_reqs, load, regime)
            if isinstance(launched, WaitUntil):
                return launched
            admitted, reason, wait_s = launched
            prefill_tokens += admitted
        batch_tokens = 0 if lane is None or not batch_work or waiting else lane.fill_step(
            now, budget, sched, prefill_ctx, new_reqs, n_dec, prefill_tokens, self.sizer, self.load, load,
            cap - len(decodes.reqs) - len(prefilling))
        prefill_tokens += batch_tokens
        if not sched:
            raise AssertionError(f"nothing schedulable with {len(waiting)} waiting and {self.num_running} running")
        if budget.tokens_left <= 0 < wanted and allowance < wanted and interactive_work:
            self.stats.record_cut(self.limits.deferred)
        if lane is not None and q.num_batch_running:
            lane.started_step(now, batch_tokens, prefill_tokens, n_dec, self.load.service)
        preempted = [*yielded, *preempted] if yielded else preempted
        padded = self.buckets.pad_step(n_dec, prefill_tokens)
        self._step_id += 1
        plan = StepPlan(self._step_id, sched, prefill_ctx, new_reqs, new_block_ids, self.q.pending_finished,
                        n_dec, prefill_tokens, decodes.context_tokens, padded)
        self.q.pending_finished = []
        self._inflight = plan
        self.stats.record_step(plan, now, regime, load, wait_s, reason, len(preempted), len(waiting),
                               len(decodes.reqs) + len(prefilling), self.blocks.usage())
        return Run(plan, reason)

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        """Apply the step in flight (`plan`, which `schedule` returned; `result`, the executor's)
        at `now`, the time it ended:

        1. its measured device time trains the step-time model, its batch tokens the batch
           lane's drain rate, its decodes the TPOT meter and, when prompts were queued, the
           measured prefill speed the TTFT predictor reads;
        2. the step limits charge the step's interval to the running decodes' TPOT banks and
           refresh the running cap;
        3. its sampled tokens (less those of requests aborted while it ran) extend decodes, end
           requests (stop token, length) and turn finished prefills into decodes with their first
           token (`Completion.apply`: the predictor's error is recorded on the request).

        Returns the tokens, the ids with their first token and the finished requests."""
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
            self.limits.on_step_done(now, plan.num_decode_seqs)
        sampled, aborted = result.sampled_token_ids, self._aborted_inflight
        if aborted:
            sampled = {rid: tok for rid, tok in sampled.items() if rid not in aborted}
            aborted.clear()
        first, finished = self.completion.apply(plan, sampled, now)
        return StepOutputs(sampled, first, finished, result.logprobs)

    def _launch(self, now: float, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
                new_reqs: list[NewRequestData], load: float, regime: Regime) -> tuple[int, str, float] | WaitUntil:
        """Ask the launch policy whether new requests join this step. Returns the prompt tokens
        admitted, the dispatch reason and the micro-wait taken, or `WaitUntil` when the policy
        holds them and nothing else would run."""
        waiting = self.waiting
        decision = self.batching.decide(now, waiting[0].queued_s, len(waiting), self.q.waiting_tokens,
                                        bool(sched) or bool(self.prefilling), load, regime)
        if decision.admit:
            room = self.limits.room(self.num_running)
            return (self.builder.admit(now, budget, sched, prefill_ctx, new_reqs, room), decision.reason,
                    decision.wait_s)
        if not sched and decision.deadline_s is not None:
            self.stats.record_wait(decision.reason, max(0.0, decision.deadline_s - now))
            return WaitUntil(decision.deadline_s, decision.reason)
        return 0, "decode_only", decision.wait_s

    def observe(self, now: float) -> None:
        """Refresh load and regime each `OBSERVE_PERIOD_S`: `schedule` with work, Serve's polls idle too."""
        if now < self._next_observe_s:
            return
        self._next_observe_s = now + OBSERVE_PERIOD_S
        self.last_load = load = self.load.load(now)
        self.regime.update(now, load, self.view.regime_delay_ratio(now), self.blocks.usage() - self.q.batch_kv_usage())

    def check_integrity(self) -> None:
        """Every invariant the scheduler relies on; tests call it after every operation."""
        self.q.check_integrity()
