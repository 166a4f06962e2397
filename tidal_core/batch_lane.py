"""The batch lane: deferrable work that runs only in the headroom interactive requests leave.

Owns: `BatchLane`, the batch service class's policy (its config is `BatchClassConfig`,
core/batch_config.py; its queue is `BatchQueue`, held by `UnitQueues`):

- **admission**: a batch request is never held to the TTFT target; it is refused only when
  the batch queue's prompt tokens would pass `max_queue_tokens` (`batch_queue_full`), with a
  Retry-After of the time the queue needs to drain enough to take it at the *measured* batch
  drain rate (batch tokens computed per second, time-decayed over `drain_tau_s`), or, before
  any batch work ran, at the headroom the step model leaves beside the interactive load
  (prefill speed x (1 - load));
- **filling a step**: after every interactive decode, chunk and new prompt is in the step,
  batch chunks and then new batch requests take what is left, but only so much that the
  step's predicted time stays within `step_fraction` x the step sizer's TPOT aim (and within
  the sizer's own allowance for the interactive decodes' banks); a new batch request starts
  only when no interactive request waits, a running slot is free, and its KV keeps usage
  within `max_kv_usage`. Batch decodes run in every step like any decode (the decode set
  moves in lock step) and count against the running-batch cap, which keeps decode-only steps
  within the aim;
- **yielding**: when interactive requests wait for a running slot, or the oldest of them for
  KV, the most recently admitted batch requests are preempted (recomputed later, from the
  head of the batch queue) before anything else is touched: reason `batch_yield`;
- **the wait it causes**: a step cannot be cut short, so a prompt arriving while batch work is
  in flight waits for it; `delay_s` is how much later the step in flight ends than it would
  without its batch part (predicted by the step model when the step was planned), and the
  TTFT prediction adds it (core/predictor.py). Without it the measured/predicted correction
  absorbed this wait as a ratio, which over-states a long prediction: admission refused
  prompts near the TTFT target that would have met it.

No batch request is dropped here: each one either waits, runs, or was refused at arrival.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.admission import AdmissionController
from tidal_core.batch_builder import BatchBuilder
from tidal_core.batch_config import BatchClassConfig
from tidal_core.budget import StepBudget
from tidal_core.load import LoadEstimator, RateEstimator, ServiceModel
from tidal_core.plan import NewRequestData, Rejection
from tidal_core.queues import UnitQueues
from tidal_core.request import Request, RequestStatus
from tidal_core.stats import SchedulerStats
from tidal_core.step_sizer import StepSizer


class BatchLane:
    __slots__ = ("_drain", "_ends", "_measured", "_step", "builder", "config", "keep_free_blocks", "queues")

    def __init__(self, config: BatchClassConfig, queues: UnitQueues, builder: BatchBuilder) -> None:
        self.config = config
        self.queues = queues
        self.builder = builder
        self._drain = RateEstimator(config.drain_tau_s)
        self._measured = False
        self._step = (0, 0)  # batch prompt tokens and batch decodes of the step in flight
        self._ends = (0.0, 0.0)  # when the step in flight ends, predicted: as planned, and without its batch work
        blocks = queues.blocks
        # A new batch request must leave this many blocks free: usage stays within max_kv_usage.
        self.keep_free_blocks = max(blocks.watermark_blocks,
                                    math.ceil((1.0 - config.max_kv_usage) * blocks.num_blocks))

    # ---- admission -----------------------------------------------------------------------
    def add(self, req: Request, now: float, load: LoadEstimator, admission: AdmissionController,
            stats: SchedulerStats) -> Rejection | None:
        """Queue a batch request: no TTFT rule applies, only its length and the batch queue's bound."""
        stats.num_batch_arrived += 1
        rejection = admission.check_length(req) or self.check(req, now, load)
        if rejection is not None:
            req.status, req.finished_s = RequestStatus.REJECTED, now
            stats.rejected[rejection.reason] += 1
            return rejection
        req.queued_s = now
        self.queues.expect_cached(req)  # hashes its blocks: batch work shares the prefix cache too
        self.queues.enqueue(req)
        return None

    def drain_rate(self, now: float, load: LoadEstimator) -> float:
        """Batch tokens per second this unit computes: measured, or its headroom before any."""
        if self._measured:
            return self._drain.rate(now)
        svc = load.service
        return max(0.0, 1.0 - load.load(now)) / svc.prefill_s_per_token

    def check(self, req: Request, now: float, load: LoadEstimator) -> Rejection | None:
        """`batch_queue_full` when `req` would take the batch queue past its bound, else None."""
        cfg, queue = self.config, self.queues.batch
        over = queue.num_tokens + req.num_tokens - cfg.max_queue_tokens
        if over <= 0:
            return None
        rate = self.drain_rate(now, load)
        wait_s = over / rate if rate > 0.0 else math.inf
        retry = min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, wait_s))
        return Rejection(req.request_id, "batch_queue_full", retry,
                         f"batch queue full: {queue.num_tokens} prompt tokens queued (limit {cfg.max_queue_tokens}); "
                         f"at the measured drain rate it has room for this request in {retry:.0f}s")

    def on_tokens(self, now: float, num_tokens: int) -> None:
        """A step computed `num_tokens` batch tokens (prompt chunks and sampled tokens)."""
        if num_tokens > 0:
            self._drain.on_event(now, float(num_tokens))
            self._measured = True

    # ---- yielding ------------------------------------------------------------------------
    def yield_to_interactive(self, running_cap: int) -> list[Request]:
        """Preempt batch requests while interactive ones wait for a running slot, or the oldest
        of them for its KV. Returns the requests preempted (now at the head of the batch queue)."""
        q = self.queues
        if not q.waiting or not q.num_batch_running:
            return []
        blocks, head = q.blocks, q.waiting[0]
        # Leave the blocks this step's decodes open too, or the freed KV goes to them instead.
        busy = bool(q.decodes.reqs) or bool(q.prefilling)
        keep_free = blocks.watermark_blocks + len(q.decodes.needing_block()) if busy else 0
        short = len(q.waiting) - (running_cap - q.num_running)
        victims: list[Request] = []
        while q.num_batch_running and (short > 0 or not blocks.can_allocate(head.request_id, head.num_tokens,
                                                                            keep_free)):
            victim = self.newest_running()
            q.preempt(victim)
            victims.append(victim)
            short -= 1
        return victims

    def newest_running(self) -> Request:
        """The most recently admitted running batch request (prefilling ones first)."""
        q = self.queues
        for req in reversed(q.prefilling.values()):
            if req.is_batch:
                return req
        for req in reversed(q.decodes.reqs.values()):
            if req.is_batch:
                return req
        raise AssertionError("no batch request is running")

    # ---- filling a step ------------------------------------------------------------------
    def fill_step(self, now: float, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
                  new_reqs: list[NewRequestData], num_decodes: int, prefill_tokens: int, sizer: StepSizer | None,
                  load: LoadEstimator, interactive_load: float, room: float) -> int:
        """The batch part of a step, after the interactive part: none while an interactive prompt
        is pending (the whole allowance, the decodes' banks, goes to interactive TTFT first), else
        chunks and new batch requests within `token_allowance`. Returns the batch prompt tokens."""
        q = self.queues
        if budget.exhausted or q.waiting or q.prefill_remaining != q.batch_prefill_remaining:
            return 0
        if not q.batch and not q.batch_prefill_remaining:
            return 0
        limit = self.token_allowance(load.service, sizer.aim_s if sizer else None, num_decodes, prefill_tokens,
                                     not sched, sizer.min_bank_s() if sizer else math.inf, interactive_load)
        return self.fill(now, budget, sched, prefill_ctx, new_reqs, limit, room)

    def started_step(self, now: float, batch_tokens: int, prefill_tokens: int, num_decodes: int,
                     svc: ServiceModel) -> None:
        """The step planned at `now` holds `batch_tokens` batch prompt tokens (of `prefill_tokens`)
        and every batch decode (of `num_decodes`): count them, and predict when the step ends
        with its batch work and without it (`delay_s`)."""
        q = self.queues
        if q.num_batch_running:
            batch_decodes = q.num_batch_decoding()
            self._step = (batch_tokens, batch_decodes)
            own_tokens, own_decodes = prefill_tokens - batch_tokens, num_decodes - batch_decodes
            own_s = svc.step_time(own_tokens, own_decodes) if own_tokens or own_decodes else 0.0
            self._ends = (now + svc.step_time(prefill_tokens, num_decodes), now + own_s)

    def delay_s(self, now: float) -> float:
        """How much later the step in flight ends, predicted, than it would without its batch
        work: the wait a prompt arriving now owes to batch work (0 when none is in flight)."""
        end, own_end = self._ends
        if end <= now or not self.config.predict_wait:
            return 0.0
        return (end - now) - max(0.0, own_end - now)

    def step_done(self, now: float, stats: SchedulerStats) -> None:
        """The step in flight ended: its batch tokens count, and train the drain rate."""
        self._ends = (0.0, 0.0)
        if self._step != (0, 0):
            batch_tokens, batch_decodes = self._step
            self._step = (0, 0)
            stats.num_batch_generated_tokens += batch_decodes
            stats.num_batch_prompt_tokens_computed += batch_tokens
            self.on_tokens(now, batch_tokens + batch_decodes)

    def token_allowance(self, svc: ServiceModel, aim_s: float | None, num_decodes: int, prefill_tokens: int,
                        empty: bool, min_bank_s: float = math.inf, load: float = 1.0) -> int:
        """Batch tokens that keep the step's predicted time within `step_fraction` x `aim_s`
        (no aim: no limit); none while an interactive decode's bank (`min_bank_s`) is below the
        reserve for interactive `load` (`reserve_s`). An otherwise empty step gets at least one
        block's worth (without chunked prefill: a whole prompt), so batch work always progresses
        on an idle unit."""
        if aim_s is None or (empty and not self.builder.chunked):
            return 1 << 30
        if min_bank_s < self.reserve_s(aim_s, load):
            return 0  # a young interactive decode is still banking the time its next prompt may need
        fixed = svc.overhead_s + svc.prefill_step_s + svc.decode_s_per_seq * num_decodes
        avail = self.config.step_fraction * aim_s - fixed - svc.prefill_s_per_token * prefill_tokens
        tokens = int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0
        return max(tokens, self.queues.blocks.block_size) if empty else tokens

    def reserve_s(self, aim_s: float, load: float) -> float:
        """The bank every interactive decode keeps before batch work shares its steps:
        `bank_reserve_steps` aims at an interactive load of `reserve_full_load` and above, less
        in proportion below it (a quiet unit's next prompt is further away); 0: always full."""
        cfg = self.config
        reserve = cfg.bank_reserve_steps * aim_s
        if cfg.reserve_full_load > 0.0:
            reserve *= min(1.0, max(0.0, load) / cfg.reserve_full_load)
        return reserve

    def fill(self, now: float, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
             new_reqs: list[NewRequestData], allowance: int, room: float) -> int:
        """Add batch chunks, then new batch requests, within `allowance` tokens and `room` more
        running requests; returns the batch prompt tokens scheduled."""
        q = self.queues
        saved = budget.tokens_left
        budget.tokens_left = min(saved, allowance)
        used = self.builder.continue_prefills(budget, sched, prefill_ctx, new_reqs, batch=True)
        if q.batch and not q.waiting and room > 0 and not budget.exhausted:
            # On an empty unit any prompt that fits the pool may start (none could start later).
            keep_free = self.keep_free_blocks if (q.decodes.reqs or q.prefilling) else 0
            used += self.builder.admit(now, budget, sched, prefill_ctx, new_reqs, room, batch=True,
                                       keep_free=keep_free)
        budget.tokens_left = saved - used
        return used
