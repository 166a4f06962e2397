"""Counters of every scheduling decision, each with a reason label.

Owns: `SchedulerStats` (cumulative counters a driver exports as metrics) and `RequestTimes`
(one finished request's timeline, for latency metrics). Per-step detail is the `StepStats`
record of core/plan.py: `last_step`, built when a driver reads it from what `record_step`
kept (a step's arguments, not a new object each step); `last_wait_s` is its micro-wait alone.

Reason labels (stable; dashboards and alerts use them):
- dispatch: immediate, join, full, budget, microwait_expired, wait_expired, decode_only
- wait (WaitUntil): microwait, fixed_wait, static_batch
- rejected: too_long, concurrency_limit, queue_full, prefill_backlog, prompt_over_target, kv_pressure,
  batch_queue_full
- preempted: kv_exhausted, batch_yield (a batch request gave its slot or KV to interactive ones);
  `preempted_by_class`: the same preemptions by service class (interactive, batch);
  `preempted_by`: by (reason, service class), what the preemption metric exports
- finished: stop, length, abort
- `tpot_limited_steps`: steps whose prefill the step sizer cut (core/step_sizer.py)
- `prefill_deferred_steps`: decode-only steps the step sizer chose so the next chunk is bigger
  (`StepSizer.defer`)

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tidal_core.plan import StepPlan, StepStats
from tidal_core.request import Request


@dataclass(frozen=True, slots=True)
class RequestTimes:
    request_id: str
    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    num_preemptions: int

    @classmethod
    def of(cls, req: Request) -> RequestTimes:
        return cls(req.request_id, req.arrival_s, req.admitted_s, req.first_token_s, req.finished_s,
                   req.num_prompt_tokens, len(req.output_token_ids),
                   req.finish_reason.value if req.finish_reason else None, req.num_preemptions)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for 0 or 1 token)."""
        if self.finished_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_waits: int = 0
    num_arrived: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    dispatch: Counter[str] = field(default_factory=Counter)
    waits: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    preempted: Counter[str] = field(default_factory=Counter)
    finished: Counter[str] = field(default_factory=Counter)
    wait_s_total: float = 0.0
    tpot_limited_steps: int = 0
    prefill_deferred_steps: int = 0
    # Prefix cache, counted at every admission (a request resumed after preemption queries again):
    # tokens the admitted requests needed KV for, the tokens found cached, and the requests.
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_requests: int = 0
    prefix_cache_hit_requests: int = 0
    # The last step's `record_step` arguments; `last_step` builds its StepStats from them.
    _last_args: tuple[StepPlan, int, float, str, float, float, str, int, int, int, float] | None = field(
        default=None, repr=False, compare=False)
    _last_built: StepStats | None = field(default=None, repr=False, compare=False)
    last_wait_s: float = 0.0
    preempted_by_class: Counter[str] = field(default_factory=Counter)
    preempted_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    num_batch_arrived: int = 0
    num_batch_generated_tokens: int = 0
    num_batch_prompt_tokens_computed: int = 0

    def on_preempted(self, reason: str, service_class: str) -> None:
        self.preempted[reason] += 1
        self.preempted_by_class[service_class] += 1
        self.preempted_by[(reason, service_class)] += 1

    def record_wait(self, reason: str, wait_s: float) -> None:
        self.num_waits += 1
        self.waits[reason] += 1
        self.wait_s_total += wait_s

    def record_cut(self, deferred: bool) -> None:
        """A step whose prompt tokens the step limits held back: deferred to a bigger chunk after a
        decode-only step, or cut to the running decodes' TPOT banks."""
        if deferred:
            self.prefill_deferred_steps += 1
        else:
            self.tpot_limited_steps += 1

    def record_step(self, plan: StepPlan, now: float, regime: str, load: float, wait_s: float, reason: str,
                    num_preempted: int, num_waiting: int, num_running: int, kv_usage: float) -> None:
        """Count a step; `regime` may be a `Regime` (a str enum: its value is recorded)."""
        self.num_steps += 1
        self.dispatch[reason] += 1
        self.last_wait_s = wait_s
        self._last_args = (plan, len(plan.num_scheduled_tokens), now, regime, load, wait_s, reason, num_preempted,
                           num_waiting, num_running, kv_usage)
        self._last_built = None

    @property
    def last_step(self) -> StepStats | None:
        """What the last scheduled step looked like (None before the first)."""
        args = self._last_args
        if args is None:
            return None
        if self._last_built is None:
            plan, num_seqs, now, regime, load, wait_s, reason, num_preempted, num_waiting, num_running, kv_usage = args
            self._last_built = StepStats(now, plan.step_id, num_seqs, plan.num_decode_seqs +
                                         plan.num_prefill_tokens, plan.num_decode_seqs, plan.num_prefill_tokens,
                                         len(plan.new_requests), plan.padded_batch_size, num_waiting, num_running,
                                         kv_usage, str(regime), load, wait_s, reason, num_preempted)
        return self._last_built

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def num_preempted(self) -> int:
        return sum(self.preempted.values())

    @property
    def num_finished(self) -> int:
        return sum(self.finished.values())

    def record_prefix_queries(self, num_requests: int, num_tokens: int, num_hit_requests: int,
                              num_cached_tokens: int) -> None:
        """Admissions that asked the prefix cache: requests and prompt tokens queried, those with
        a hit and their cached tokens (one call per admission pass, not per request)."""
        self.prefix_cache_query_requests += num_requests
        self.prefix_cache_query_tokens += num_tokens
        self.prefix_cache_hit_requests += num_hit_requests
        self.prefix_cache_hit_tokens += num_cached_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens over queried tokens (0 before any admission)."""
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0
