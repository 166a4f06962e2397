"""The Scheduler: one serving unit's continuous-batching policy, driven by any clock.

Owns: the request queues of a unit and, through `BlockManager`, its KV block tables (single
writer). Three calls make an engine step:

    decision = scheduler.schedule(now)                    # Run(plan) | WaitUntil(t) | Idle
    result = executor.execute(plan)                       # real model or simulated GPU
    outputs = scheduler.on_step_done(plan, result, now)   # tokens, first tokens, finishes

plus `add_request` (admission control may answer with a `Rejection`) and `abort`.

A step is filled decode-first: every running decode (one token each), then unfinished prefill
chunks, then new requests when the batching policy says so, until the token budget or the
batch size is reached. A prompt that does not fit the remaining budget is chunked. The policy
parts are small objects composed here: `BatchingPolicy` (micro-wait and baselines),
`RegimeDetector`, `AdmissionController`, `LoadEstimator`, `CudaGraphBuckets`, `DecodeSet`.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from tidal_core.admission import AdmissionController, UnitState
from tidal_core.buckets import CudaGraphBuckets
from tidal_core.budget import StepBudget
from tidal_core.config import SchedulerConfig
from tidal_core.decode_set import DecodeSet
from tidal_core.kv_blocks import NO_NEW_BLOCK, BlockManager
from tidal_core.load import LoadEstimator
from tidal_core.microwait import BatchingPolicy
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
from tidal_core.regime import Regime, RegimeDetector
from tidal_core.request import FinishReason, Request, RequestStatus
from tidal_core.snapshot import UnitLoad
from tidal_core.stats import SchedulerStats
from tidal_core.tpot import STRICT, TpotGovernor

IDLE = Idle()
OBSERVE_PERIOD_S = 0.05
"""How often (in `now` units) load and regime are re-evaluated at step boundaries."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, now: float = 0.0) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.kv_watermark)
        self.buckets = CudaGraphBuckets(config.cuda_graph_buckets)
        self.load = LoadEstimator(config.load_tau_s, config.service_prior, config.max_batch_size,
                                  config.num_kv_blocks * config.block_size)
        self.regime = RegimeDetector(config.regime, now)
        self.batching = BatchingPolicy(config.batching, config.max_batch_size, config.max_num_batched_tokens)
        self.admission = AdmissionController(config.admission, config.max_model_len)
        self.stats = SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: dict[str, Request] = {}
        self.decodes = DecodeSet(config.block_size, config.max_model_len)
        self.last_load = 0.0
        self._waiting_tokens = 0
        self._prefill_remaining = 0  # prompt tokens of admitted requests not yet computed
        self._announced: set[str] = set()
        self._pending_finished: list[str] = []
        self._inflight: StepPlan | None = None
        self._aborted_inflight: set[str] = set()
        self._step_id = 0
        self._stop_counts: Counter[int] = Counter()
        self._stop_set: frozenset[int] = frozenset()
        self._static = config.batching.mode == "static"
        adm = config.admission
        self.governor = (TpotGovernor(adm.target_tpot_s)
                         if adm.enabled and adm.target_tpot_s and config.batching.mode == "adaptive" else None)
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
        return len(self.decodes.reqs) + len(self.prefilling)

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
        return self._waiting_tokens + self._prefill_remaining

    def snapshot(self, now: float, unit_id: str = "") -> UnitLoad:
        """This unit's state now, as routing, autoscaling, the simulator and metrics read it."""
        return UnitLoad(unit_id, self.num_running, len(self.waiting), self.predicted_queue_delay_s(now),
                        self.blocks.usage(), self.load.load(now), self.load.capacity_rps(), self.regime.regime)

    def unit_state(self, now: float, req: Request) -> UnitState:
        busy = bool(self.waiting) or bool(self.prefilling) or self.num_running >= self.max_running()
        # The client's TTFT: what the request already spent before reaching the unit (its
        # `arrival_s` is the front end's arrival, moved onto this clock) plus what is predicted here.
        return UnitState(len(self.waiting), len(self.decodes.reqs), self.blocks.usage(),
                         max(0.0, now - req.arrival_s) + self.predicted_queue_delay_s(now, req.num_prompt_tokens),
                         busy, self.regime.regime)

    def predicted_queue_delay_s(self, now: float, own_prompt_tokens: int = 0, corrected: bool = True) -> float:
        """Time before a request arriving now would start its prefill (with `own_prompt_tokens`:
        would finish it, i.e. its predicted TTFT), from measurements.

        Draining the prefill backlog (waiting prompts and unfinished chunks) at the prefill
        speed measured while prompts were queued (before there is such a measurement: the
        fitted step model with the decodes sharing each step), plus, when the running batch
        is at its cap, waiting for enough running requests to finish (at the measured
        completion rate, or the estimated capacity before any request has finished); all
        scaled by the measured/predicted ratio of recent first tokens (`ttft_correction`).
        """
        n_dec = len(self.decodes.reqs)
        backlog = self.backlog_prefill_tokens() + own_prompt_tokens
        measured = self.load.prefill.rate(now)
        if measured is not None:
            prefill_s = backlog / measured
        else:
            per_step = max(1, self.config.max_num_batched_tokens - n_dec)
            prefill_s = self.load.service.drain_time(backlog, n_dec, per_step)
        behind = len(self.waiting) + 1 - (self.max_running() - self.num_running)
        slot_s = behind / self.load.departure_rate(now) if behind > 0 else 0.0
        return (prefill_s + slot_s) * (self.load.ttft_correction.factor(now) if corrected else 1.0)

    def _observe(self, now: float) -> None:
        """Refresh load and regime. Regime changes need a sustained signal (>= min_dwell_s), so
        evaluating every OBSERVE_PERIOD_S instead of every step loses nothing and keeps the
        per-step cost flat."""
        self._next_observe_s = now + OBSERVE_PERIOD_S
        self.last_load = load = self.load.load(now)
        self.regime.update(now, load, self.predicted_queue_delay_s(now) / self.config.admission.target_ttft_s,
                           self.blocks.usage())

    def max_running(self) -> int:
        """The running-batch cap: max_batch_size, or less where the TPOT governor says so
        (refreshed when a step's measurement updates the step model)."""
        return self._running_cap

    def _refresh_running_cap(self) -> None:
        cap = self.config.max_batch_size
        if self.governor is not None:
            cap = min(cap, self.governor.max_running(self.load.service))
            self.load.batch_cap = cap
        self._running_cap = cap

    # ---- arrivals and aborts -------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> Rejection | None:
        """Queue a request, or return why admission control turned it away."""
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
        # The raw model's prediction (plus the time already spent in front of the unit, which the
        # first token's measured TTFT holds too): its measured error is what the correction learns.
        req.predicted_ttft_s = max(0.0, now - req.arrival_s) + self.predicted_queue_delay_s(
            now, req.num_prompt_tokens, corrected=False)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._waiting_tokens += req.num_tokens
        self._register_stops(req)
        return None

    def abort(self, request_id: str, now: float) -> Request | None:
        """End a request (client gone, stop string matched). Returns it, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._waiting_tokens -= req.num_tokens - req.num_computed_tokens
        if self._inflight is not None and request_id in self._inflight.num_scheduled_tokens:
            self._aborted_inflight.add(request_id)
        self._finish(req, FinishReason.ABORT, now, None)
        return req

    def abort_all(self, now: float) -> list[Request]:
        """End every request (the executor died). The caller reports the error to clients."""
        return [r for rid in list(self.requests) if (r := self.abort(rid, now)) is not None]

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, now: float) -> Decision:
        if self._inflight is not None:
            raise RuntimeError(f"step {self._inflight.step_id} is still in flight; call on_step_done first")
        decodes, waiting = self.decodes, self.waiting
        if not decodes.reqs and not self.prefilling and not waiting:
            return IDLE
        cfg = self.config
        if now >= self._next_observe_s:
            self._observe(now)
        load, regime = self.last_load, self.regime.regime
        budget = StepBudget(cfg.max_num_batched_tokens, cfg.max_batch_size)
        new_block_ids: dict[str, list[int]] = {}
        num_preempted = self._grow_decodes(new_block_ids) if decodes.reqs else 0
        sched = decodes.ones.copy()
        n_dec = len(sched)
        budget.take_decodes(n_dec)
        wanted_tokens = budget.tokens_left
        if self.governor is not None:
            strict = regime is Regime.OVERLOAD
            if strict != (self.governor.profile is STRICT):
                self.governor.set_strict(strict)
                self._refresh_running_cap()
            budget.tokens_left = min(budget.tokens_left,
                                     self.governor.prefill_allowance(self.load.service, n_dec, self._oldest_wait(now),
                                                                     cfg.admission.target_ttft_s, self._running_cap))
        self._had_backlog = bool(waiting) or bool(self.prefilling)
        self._scheduled_at = now
        new_reqs: list[NewRequestData] = []
        prefill_ctx: dict[str, int] = {}
        prefill_tokens = self._continue_prefills(budget, sched, prefill_ctx, new_reqs)
        reason, wait_s = "decode_only", 0.0
        if waiting and not budget.exhausted:
            decision = self.batching.decide(now, waiting[0].arrival_s, len(waiting), self._waiting_tokens,
                                            bool(sched) or bool(self.prefilling), load, regime)
            wait_s = decision.wait_s
            if decision.admit:
                reason = decision.reason
                prefill_tokens += self._admit(now, budget, sched, prefill_ctx, new_reqs)
            elif not sched and decision.deadline_s is not None:
                self.stats.num_waits += 1
                self.stats.waits[decision.reason] += 1
                self.stats.wait_s_total += max(0.0, decision.deadline_s - now)
                return WaitUntil(decision.deadline_s, decision.reason)
        if not sched:
            if self.governor is not None and n_dec == 0 and not self.prefilling:
                raise AssertionError("the TPOT governor blocked an idle unit")
            raise AssertionError(f"nothing schedulable with {len(waiting)} waiting and no running request")
        if budget.tokens_left <= 0 < wanted_tokens and (waiting or self.prefilling) and self.governor is not None:
            self.stats.tpot_limited_steps += 1
        padded = self.buckets.bucket_for(n_dec) if n_dec and not prefill_tokens else None
        if not prefill_tokens:
            self.buckets.record(n_dec, padded)
        self._step_id += 1
        plan = StepPlan(self._step_id, sched, prefill_ctx, new_reqs, new_block_ids, self._pending_finished,
                        n_dec, prefill_tokens, decodes.context_tokens, padded)
        self._pending_finished = []
        self._inflight = plan
        self._record_step(plan, now, regime, load, wait_s, reason, num_preempted)
        return Run(plan, reason)

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        if plan is not self._inflight:
            raise RuntimeError(f"on_step_done for step {plan.step_id}, which is not the step in flight")
        self._inflight = None
        self.load.on_step(plan.num_prefill_tokens, plan.num_decode_seqs, result.device_time_s)
        if self._had_backlog:
            self.load.prefill.on_step(now, now - self._scheduled_at, plan.num_prefill_tokens)
        if self.governor is not None:
            self.governor.on_step(plan.num_decode_seqs, result.device_time_s)
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

    # ---- step internals -------------------------------------------------------------------
    def _grow_decodes(self, new_block_ids: dict[str, list[int]]) -> int:
        """Give every decode opening a new block one; preempt (recompute) when KV runs out."""
        blocks, decodes = self.blocks, self.decodes
        group = decodes.needing_block()
        if not group:
            return 0
        granted = blocks.append_blocks([r.request_id for r in group])
        if granted is not None:  # the common case: room for the whole phase group at once
            new_block_ids.update(granted)
            return 0
        num_preempted = 0
        for req in group:
            rid = req.request_id
            while rid in decodes.reqs:
                block = blocks.append_slot(rid, req.num_tokens)
                if block is None:
                    self._preempt(self._pick_victim())
                    num_preempted += 1
                    continue
                if block != NO_NEW_BLOCK:
                    new_block_ids[rid] = [block]
                break
        return num_preempted

    def _pick_victim(self) -> Request:
        """The most recently admitted running request (vLLM's recompute order)."""
        if self.prefilling:
            return next(reversed(self.prefilling.values()))
        return next(reversed(self.decodes.reqs.values()))

    def _preempt(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.decodes:
            self.decodes.remove(rid)
        else:
            del self.prefilling[rid]
            self._prefill_remaining -= req.num_tokens - req.num_computed_tokens
        self.blocks.free(rid)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._waiting_tokens += req.num_tokens
        self._forget_executor_state(rid)
        self.stats.preempted["kv_exhausted"] += 1

    def _continue_prefills(self, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
                           new_reqs: list[NewRequestData]) -> int:
        total = 0
        chunked = self.config.enable_chunked_prefill
        for rid, req in self.prefilling.items():
            if budget.exhausted:
                break
            grant = budget.grant(req.num_tokens - req.num_computed_tokens, chunked)
            if grant:
                sched[rid] = grant
                prefill_ctx[rid] = req.num_computed_tokens
                budget.charge(grant)
                total += grant
                if rid not in self._announced:
                    self._announce(req, new_reqs)
        return total

    def _admit(self, now: float, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
               new_reqs: list[NewRequestData]) -> int:
        """Move waiting requests into the step (FIFO) while budget, batch and KV allow.

        KV for the whole prompt is reserved at admission so a prefill never stalls half-way.
        Static batching admits a whole batch at once; its later chunks follow step by step.
        """
        cfg, waiting, blocks = self.config, self.waiting, self.blocks
        limit = cfg.batching.static_batch_size if self._static else (cfg.max_new_requests_per_step or math.inf)
        if self.governor is not None:
            limit = min(limit, self.max_running() - self.num_running)
        keep_free = blocks.watermark_blocks if (self.decodes.reqs or self.prefilling) else 0
        chunked = cfg.enable_chunked_prefill
        admitted = total = 0
        while waiting and admitted < limit:
            req = waiting[0]
            rid = req.request_id
            need = req.num_tokens
            grant = budget.grant(need, chunked)
            if not grant and not self._static:
                break
            if blocks.try_allocate(rid, need, keep_free) is None:
                break
            waiting.popleft()
            self._waiting_tokens -= need
            self._prefill_remaining += need
            req.status = RequestStatus.RUNNING
            if req.admitted_s is None:
                req.admitted_s = now
            self.prefilling[rid] = req
            admitted += 1
            keep_free = blocks.watermark_blocks
            if grant:
                sched[rid] = grant
                prefill_ctx[rid] = 0
                budget.charge(grant)
                total += grant
                self._announce(req, new_reqs)
        return total

    def _oldest_wait(self, now: float) -> float:
        """How long the oldest prompt not yet fully computed has been in the unit."""
        oldest = self.waiting[0].arrival_s if self.waiting else now
        if self.prefilling:  # admission order: the first is the oldest
            oldest = min(oldest, next(iter(self.prefilling.values())).arrival_s)
        return now - oldest

    def _announce(self, req: Request, new_reqs: list[NewRequestData]) -> None:
        rid = req.request_id
        self._announced.add(rid)
        new_reqs.append(NewRequestData(rid, req.all_token_ids(), req.num_tokens, req.sampling,
                                       list(self.blocks.table(rid))))

    def _finish_decodes(self, sampled: dict[str, int], now: float, finished: list[Request]) -> None:
        decodes = self.decodes
        stop_set = self._stop_set
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
        prefilling = self.prefilling
        scheduled = plan.num_scheduled_tokens
        for rid in plan.prefill_context:
            req = prefilling.get(rid)
            if req is None:  # aborted during the step
                continue
            n = scheduled[rid]
            req.num_computed_tokens += n
            self._prefill_remaining -= n
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
                if req.predicted_ttft_s is not None:
                    self.load.ttft_correction.observe(now, req.predicted_ttft_s, now - req.arrival_s)
            if self._hit_stop(req, tok):
                self._finish(req, FinishReason.STOP, now, finished)
            elif len(req.output_token_ids) >= self.decodes.length_limit(req):
                self._finish(req, FinishReason.LENGTH, now, finished)
            else:
                self.decodes.add(req)
        return first

    @staticmethod
    def _hit_stop(req: Request, tok: int) -> bool:
        return tok in req.stop_ids and len(req.output_token_ids) >= req.sampling.min_tokens

    def _finish(self, req: Request, reason: FinishReason, now: float, finished: list[Request] | None) -> None:
        rid = req.request_id
        if rid in self.decodes:
            self.decodes.remove(rid)
            req.num_computed_tokens = req.num_tokens - 1
        elif self.prefilling.pop(rid, None) is not None:
            self._prefill_remaining -= req.num_tokens - req.num_computed_tokens
        self.blocks.free(rid)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_s = now
        del self.requests[rid]
        self._unregister_stops(req)
        self._forget_executor_state(rid)
        if reason is not FinishReason.ABORT:
            self.load.on_finish(now, len(req.output_token_ids))
        self.stats.finished[reason.value] += 1
        if finished is not None:
            finished.append(req)

    def _forget_executor_state(self, rid: str) -> None:
        if rid in self._announced:
            self._announced.discard(rid)
            self._pending_finished.append(rid)

    def _register_stops(self, req: Request) -> None:
        if req.stop_ids:
            before = len(self._stop_counts)
            self._stop_counts.update(req.stop_ids)
            if len(self._stop_counts) != before:
                self._stop_set = frozenset(self._stop_counts)

    def _unregister_stops(self, req: Request) -> None:
        if req.stop_ids:
            counts = self._stop_counts
            counts.subtract(req.stop_ids)
            gone = [t for t in req.stop_ids if counts[t] <= 0]
            if gone:
                for t in gone:
                    del counts[t]
                self._stop_set = frozenset(counts)

    def _record_step(self, plan: StepPlan, now: float, regime: Regime, load: float, wait_s: float,
                     reason: str, num_preempted: int) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.dispatch[reason] += 1
        stats.last_step = StepStats(now, plan.step_id, len(plan.num_scheduled_tokens), plan.num_decode_seqs +
                                    plan.num_prefill_tokens, plan.num_decode_seqs, plan.num_prefill_tokens,
                                    len(plan.new_requests), plan.padded_batch_size, len(self.waiting),
                                    len(self.decodes.reqs) + len(self.prefilling), self.blocks.usage(), regime.value,
                                    load, wait_s, reason, num_preempted)

    # ---- integrity ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every invariant the scheduler relies on; tests call it after every operation."""
        self.blocks.check_integrity()
        self.decodes.check_integrity()
        waiting_ids = [r.request_id for r in self.waiting]
        groups = (set(waiting_ids), set(self.prefilling), set(self.decodes.reqs))
        if len(waiting_ids) != len(groups[0]):
            raise AssertionError("a request is queued twice")
        if sum(map(len, groups)) != len(self.requests) or set().union(*groups) != set(self.requests):
            raise AssertionError("waiting, prefilling and decoding do not partition the live requests")
        blocks = self.blocks
        for req in self.waiting:
            held = blocks.num_blocks_of(req.request_id)
            if req.status is not RequestStatus.WAITING or req.num_computed_tokens or held:
                raise AssertionError(f"waiting {req} is not pristine")
        for req in self.prefilling.values():
            held = blocks.num_blocks_of(req.request_id)
            if req.status is not RequestStatus.RUNNING or held != blocks.blocks_for(req.num_tokens):
                raise AssertionError(f"prefilling {req} does not hold exactly its prompt's blocks")
            if not 0 <= req.num_computed_tokens < req.num_tokens:
                raise AssertionError(f"prefilling {req} has an impossible computed count")
        for req in self.decodes.reqs.values():
            held = blocks.num_blocks_of(req.request_id)
            fits = blocks.blocks_for(req.num_tokens - 1) <= held <= blocks.blocks_for(req.num_tokens)
            if req.status is not RequestStatus.RUNNING or not fits:
                raise AssertionError(f"decoding {req} holds {held} blocks for {req.num_tokens} tokens")
            if len(req.output_token_ids) >= self.decodes.length_limit(req):
                raise AssertionError(f"{req} is past its length limit but still decodes")
        used = sum(blocks.num_blocks_of(rid) for rid in self.requests)
        if used != blocks.num_used_blocks:
            raise AssertionError(f"{blocks.num_used_blocks} blocks in use but live requests hold {used}")
        if self._waiting_tokens != sum(r.num_tokens - r.num_computed_tokens for r in self.waiting):
            raise AssertionError("waiting token count drifted")
        if self._prefill_remaining != sum(r.num_tokens - r.num_computed_tokens for r in self.prefilling.values()):
            raise AssertionError("prefill backlog count drifted")
        expected = Counter[int]()
        for req in self.requests.values():
            expected.update(req.stop_ids)
        if +expected != +self._stop_counts or self._stop_set != frozenset(+expected):
            raise AssertionError("stop-token index drifted")
        if not self._announced <= set(self.requests):
            raise AssertionError("executor state announced for requests that are gone")
