"""The step's limits: how many requests may run and how many prompt tokens one step may hold.

Owns: `StepLimits`, the step sizer (core/step_sizer.py) applied to one unit. It owns the
sizer itself (on when `step_sizing.enabled` and `admission.target_tpot_s` is set) and turns
its banks into the two limits `Scheduler.schedule` applies to every step:

- **running cap** (`running_cap`): `max_batch_size`, or less where the sizer's batch cap
  says so; refreshed after every step from the learned step-time model, and handed to the
  load estimator (`LoadEstimator.batch_cap`) so capacity is counted at the batch the SLO allows;
- **prefill allowance** (`prefill_allowance`): the prompt tokens a step may hold beside its
  decodes. Without the sizer it is `max_prefill_tokens` (or no limit). With it, the sizer's
  allowance within that cap, read with TTFT *pressure* once the oldest interactive prompt has
  waited `pressure_fraction` of the TTFT target (in every regime), and in OVERLOAD with each
  future token credited with the repayment the decode steps measurably made (not what a
  decode-only step would repay: a unit that fills every step borrows nothing).

- **OVERLOAD prefill cap** (`slot_cap`, `step_sizing.slot_gain`): in OVERLOAD a step's prompt
  tokens are also held under a cap learned from `max_num_batched_tokens` down. Where the TPOT
  target is slack for the unit (a small model on a fast GPU), nothing above limits a step: it
  prefills the queue's prompts at once, the batch fills to `max_batch_size`, and prompts wait
  for a slot. That wait is the same for every prompt, so admission refuses short prompts and long
  ones alike, and the unit serves fewer requests: a long prompt costs as much as several short
  ones. With smaller steps the batch stays under its cap and the queue forms in prompt tokens,
  where the TTFT prediction counts each prompt's own prefill and refuses the long ones first.
  A step that finds prompts waiting with the batch at `max_batch_size`, while the decode steps
  measurably leave more than half the aim unused (the sizer's `repay_s`: the target does not
  bind) and the load is at least `slot_min_load` (`LoadEstimator.overload`, current and
  lasting: 1.5, a third of the arrivals must be refused anyway), lowers the cap by `slot_gain x
  (1 - slot_tail)`; one whose prompts the allowance cut with a slot free raises it by `slot_gain
  x slot_tail`; within [64 tokens, the budget]. It settles where about `slot_tail` of those steps
  find the batch full. Smaller steps cost the GPU a prefill step's fixed cost more often, which
  is why a mild overload, where few are refused and which ones matters less, keeps the budget.
  A unit whose target binds (the 70B units) fills its steps to the aim and never lowers it.
  Outside OVERLOAD the cap is not applied, and is kept for the next overload.

Each finished step's interval is charged to the decodes' banks here (`on_step_done`); a
decode starting or ending, and a request's output length, reach the sizer from whoever moves
requests (core/completion.py).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.config import SchedulerConfig
from tidal_core.load import LoadEstimator
from tidal_core.queues import UnitQueues
from tidal_core.regime import Regime, RegimeDetector
from tidal_core.step_sizer import StepSizer

_SLOT_CAP_FLOOR = 64.0  # prompt tokens: the learned cap never starves the queue's prefill
_SLACK = 0.5  # share of the aim the decode steps must measurably leave unused for the cap to fall
_OVERLOAD = Regime.OVERLOAD  # a module global: an enum class's attribute lookup is slow (regime.py)


class StepLimits:
    __slots__ = ("_budget", "_defer", "_max_batch_size", "_prefill_cap", "_pressure_s", "_slot_down", "_slot_min_load",
                 "_slot_up", "deferred", "load", "queues", "regime", "running_cap", "sizer", "slot_cap")

    def __init__(self, config: SchedulerConfig, queues: UnitQueues, load: LoadEstimator, regime: RegimeDetector,
                 now: float = 0.0) -> None:
        adm, sizing = config.admission, config.step_sizing
        self.sizer = StepSizer(sizing, adm.target_tpot_s, now) if sizing.enabled and adm.target_tpot_s else None
        self.queues, self.load, self.regime = queues, load, regime
        self._max_batch_size = config.max_batch_size
        self._prefill_cap = config.max_prefill_tokens or math.inf
        self._pressure_s = sizing.pressure_fraction * adm.target_ttft_s
        self._defer = sizing.defer
        self.running_cap = config.max_batch_size
        self.deferred = False  # the last prefill_allowance deferred the step's prefill
        self._budget = self.slot_cap = float(config.max_num_batched_tokens)  # learned in OVERLOAD (slot_gain)
        self._slot_down = 1.0 - sizing.slot_gain * (1.0 - sizing.slot_tail)
        self._slot_up = 1.0 + sizing.slot_gain * sizing.slot_tail
        self._slot_min_load = sizing.slot_min_load
        self.refresh()

    def refresh(self) -> None:
        """Recompute the running cap from the step model as it stands (after each step)."""
        cap = self._max_batch_size
        if self.sizer is not None:
            cap = min(cap, self.sizer.max_running(self.load.service))
            self.load.batch_cap = cap
        self.running_cap = cap

    def chunk_allowance(self, num_decodes: int, pressure: bool = False) -> float:
        """Prompt tokens a step may hold beside `num_decodes` decodes, before any deferral: the
        sizer's allowance (in OVERLOAD with the measured repayment) within `max_prefill_tokens`.
        Reads only: the step's own `prefill_allowance` and the lone-prompt bound
        (`UnitView.alone_prefill_s`) share it."""
        if self.sizer is None:
            return self._prefill_cap
        over = self.regime.regime is _OVERLOAD
        allowance = min(self._prefill_cap, self.sizer.prefill_allowance(self.load.service, num_decodes, pressure, over))
        return min(allowance, self.slot_cap) if self._slot_capped() else allowance

    def step_token_budget(self, num_decodes: int) -> int:
        """A step's tokens, decodes included, where the learned OVERLOAD prefill cap holds the
        prompts below `max_num_batched_tokens` (`slot_cap`); else the token budget itself."""
        if self._slot_capped():
            return min(int(self._budget), num_decodes + int(self.slot_cap))
        return int(self._budget)

    def _slot_capped(self) -> bool:
        """The learned prefill cap holds now: in OVERLOAD, and learned below the budget."""
        return self.regime.regime is _OVERLOAD and self.slot_cap < self._budget

    def prefill_allowance(self, now: float, num_decodes: int, wanted: float = math.inf) -> float:
        """Prompt tokens the next step may hold beside `num_decodes` decodes (inf: no limit), of
        the `wanted` its token budget leaves; 0 when the sizer defers the prefill to a bigger
        chunk after a decode-only step (`deferred` is then True)."""
        self.deferred = False
        if self.sizer is None:
            return self._prefill_cap
        q = self.queues
        pressure = now - q.oldest_arrival_s() >= self._pressure_s
        allowance = self.chunk_allowance(num_decodes, pressure)
        if self._slot_up > 1.0 and self.regime.regime is _OVERLOAD:  # slot_gain > 0: the cap is learned
            self._learn_slot_cap(self.sizer, allowance, wanted, now)
        if self._defer and allowance < wanted:
            demand = min(wanted, self._prefill_cap, q.waiting_tokens + q.prefill_remaining)
            if self._slot_capped():  # the learned cap holds the chunk, not the banks: nothing to bank for
                demand = min(demand, self.slot_cap)
            # Only a chunk that would not finish the oldest prompt is worth deferring: one that
            # does gives that request its first token now.
            if allowance < demand and allowance < self._head_need() and \
                    self.sizer.defer(self.load.service, num_decodes, allowance, demand):
                self.deferred = True
                return 0
        return allowance

    def _learn_slot_cap(self, sizer: StepSizer, allowance: float, wanted: float, now: float) -> None:
        """One OVERLOAD step's verdict on the learned prefill cap: down when prompts wait with the
        batch at `max_batch_size` (the slots, not the allowance, hold them back) while the decode
        steps leave over half the aim unused and the load is at least `slot_min_load`; up when
        the allowance cut the prompts' tokens with a slot free (`step_sizing.slot_gain`)."""
        q = self.queues
        if q.num_running >= self._max_batch_size:
            if q.waiting and sizer.repay_s > _SLACK * sizer.aim_s and \
                    self.load.overload(now)[0] >= self._slot_min_load:
                self.slot_cap = max(_SLOT_CAP_FLOOR, self.slot_cap * self._slot_down)
        elif allowance < wanted and allowance < q.waiting_tokens + q.prefill_remaining:
            self.slot_cap = min(self._budget, self.slot_cap * self._slot_up)

    def _head_need(self) -> int:
        """Prompt tokens the oldest prompt still needs (prefilling first, then the queue's head)."""
        q = self.queues
        for req in q.prefilling.values():
            return req.num_tokens - req.num_computed_tokens
        if q.waiting:
            req = q.waiting[0]
            return req.num_tokens - req.expected_cached_tokens
        return 0

    def room(self, num_running: int) -> float:
        """How many more requests may start running: bounded by the cap only under the sizer
        (without it the step's sequence budget alone bounds them)."""
        return self.running_cap - num_running if self.sizer is not None else math.inf

    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step with `num_decodes` decodes ended at `now`: the sizer charges its interval to
        the decodes' banks, and the running cap follows the updated step model."""
        if self.sizer is not None:
            self.sizer.on_step_done(now, num_decodes)
            self.refresh()
