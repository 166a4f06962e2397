"""Completion: what a finished step, an end or a preemption does to a unit's requests and accounts.

Owns: `Completion`, the bookkeeping of requests leaving or changing place, and the accounts
that must hear of it: the statistics, the load estimator (finished output lengths), the TTFT
predictor (first tokens and their prediction error) and the step sizer's per-decode banks.

- `apply`: a step's sampled tokens extend the running decodes; a decode ends on a stop token
  (after `min_tokens`) or its length limit; prompts whose last chunk ran get their first token
  and either end at once (stop, length) or join the decodes, opening a TPOT bank (interactive
  requests only: batch decodes keep none);
- `finish`: a request ends (stop, length, abort): out of the queues with its KV, and its output
  length taught to the load estimator and the sizer's borrow tables (not for aborts, nor for
  batch requests, whose lengths would skew the interactive SLO's models);
- `on_preempted`: preempted requests (yielded to interactive ones, or out of KV) are counted
  by reason and class, and their banks closed. Moving them back to a queue is `UnitQueues`'.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal_core.load import LoadEstimator
from tidal_core.plan import StepPlan
from tidal_core.predictor import TtftPredictor
from tidal_core.queues import UnitQueues
from tidal_core.request import FinishReason, Request
from tidal_core.stats import SchedulerStats
from tidal_core.step_sizer import StepSizer

_STOP, _LENGTH, _ABORT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT
# Module globals: reading a member off an enum class goes through the metaclass's `__getattr__`
# hook (about 1 k instructions on Python 3.11), and requests end every few steps.


class Completion:
    __slots__ = ("load", "predictor", "queues", "sizer", "stats")

    def __init__(self, queues: UnitQueues, stats: SchedulerStats, load: LoadEstimator, predictor: TtftPredictor,
                 sizer: StepSizer | None) -> None:
        self.queues, self.stats, self.load, self.predictor, self.sizer = queues, stats, load, predictor, sizer

    def apply(self, plan: StepPlan, sampled: dict[str, int], now: float) -> tuple[list[str], list[Request]]:
        """Apply step `plan`'s `sampled` tokens (aborted requests already left out). Returns the
        ids that got their first token and the requests that finished, in the order they did."""
        finished: list[Request] = []
        if (decodes := self.queues.decodes).reqs:
            decodes.append_tokens(sampled)
            self.stats.num_generated_tokens += len(decodes.reqs)
            if self.queues.stop_set:
                for req in self.queues.stop_hits(sampled):
                    self.finish(req, _STOP, now, finished)
            for req in decodes.due_by_length():
                self.finish(req, _LENGTH, now, finished)
        first = self._advance_prefills(plan, sampled, now, finished)
        return first, finished

    def _advance_prefills(self, plan: StepPlan, sampled: dict[str, int], now: float,
                          finished: list[Request]) -> list[str]:
        """The step's prefill chunks count as computed; completed prompts get their first token."""
        q = self.queues
        computed, done = q.complete_prefills(plan, sampled)
        stats, sizer, first = self.stats, self.sizer, []
        stats.num_prompt_tokens_computed += computed
        stats.num_generated_tokens += len(done)
        for req in done:
            if req.first_token_s is None:
                self.predictor.on_first_token(req, now)
                first.append(req.request_id)
            if req.is_batch:
                stats.num_batch_generated_tokens += 1
            if q.hit_stop(req, req.output_token_ids[-1]):
                self.finish(req, _STOP, now, finished)
            elif len(req.output_token_ids) >= q.decodes.length_limit(req):
                self.finish(req, _LENGTH, now, finished)
            else:
                q.decodes.add(req)
                if sizer is not None and not req.is_batch:  # batch decodes keep no TPOT bank
                    sizer.on_decode_start(req.request_id)
        return first

    def finish(self, req: Request, reason: FinishReason, now: float, finished: list[Request] | None) -> None:
        """End `req` for `reason`; appended to `finished` when one is given."""
        self.queues.remove(req, reason, now)
        done = reason is not _ABORT and not req.is_batch  # batch lengths would skew the SLO's models
        if done:
            self.load.on_finish(now, len(req.output_token_ids))
        if self.sizer is not None:
            self.sizer.on_request_end(req.request_id, len(req.output_token_ids) if done else None)
        self.stats.finished[str(reason)] += 1  # the value, not the member
        if finished is not None:
            finished.append(req)

    def on_preempted(self, yielded: Sequence[Request], out_of_kv: Sequence[Request]) -> None:
        """Count this step's preemptions: batch requests `yielded` to interactive ones (reason
        `batch_yield`), then requests preempted because KV ran out (`kv_exhausted`)."""
        for reason, victims in (("batch_yield", yielded), ("kv_exhausted", out_of_kv)):
            for victim in victims:
                self.stats.on_preempted(reason, victim.service_class.value)
                if self.sizer is not None:
                    self.sizer.on_decode_end(victim.request_id)
