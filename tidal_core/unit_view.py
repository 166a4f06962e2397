"""What a unit looks like from outside: read-only views of one Scheduler's state.

Owns: `UnitView`, every read the scheduler's readers make and nothing that changes state:

- `backlog_prefill_tokens`: interactive prompt tokens not computed yet;
- `predicted_queue_delay_s`: the TTFT predictor (core/predictor.py) applied to this unit's
  backlog, decodes and free running slots (the step limits' running cap, core/step_limits.py),
  with the wait for a slot forecast from the running requests' ages (core/departures.py);
- `unit_state`: what admission control (core/admission.py) judges a new arrival on;
- `snapshot`: the `UnitLoad` routing, autoscaling, the simulator and the metrics read
  (core/snapshot.py).

The batch class yields its slots and KV to interactive requests, so every view here is the
interactive one, with the batch class reported apart in the snapshot.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from tidal_core.admission import UnitState
from tidal_core.batch_lane import BatchLane
from tidal_core.config import SchedulerConfig
from tidal_core.departures import DepartureForecast
from tidal_core.load import LoadEstimator
from tidal_core.predictor import TtftPredictor
from tidal_core.queues import UnitQueues
from tidal_core.refusal_meter import RefusalMeter
from tidal_core.regime import RegimeDetector
from tidal_core.request import Request
from tidal_core.snapshot import UnitLoad
from tidal_core.step_limits import StepLimits
from tidal_core.tpot_meter import TpotMeter


class UnitView:
    __slots__ = ("_max_tokens", "_sheds_costly", "_target_tpot_s", "_target_ttft_s", "departures", "lane", "limits",
                 "load", "predictor", "queues", "refusals", "regime", "tpot")

    def __init__(self, config: SchedulerConfig, queues: UnitQueues, load: LoadEstimator, predictor: TtftPredictor,
                 regime: RegimeDetector, limits: StepLimits, tpot: TpotMeter, lane: BatchLane | None = None,
                 refusals: RefusalMeter | None = None) -> None:
        self.lane = lane  # the batch class: its step in flight delays a prompt arriving now
        self.queues, self.load, self.predictor, self.regime, self.limits, self.tpot = (queues, load, predictor, regime,
                                                                                      limits, tpot)
        self.refusals = refusals if refusals is not None else RefusalMeter()
        self.departures = DepartureForecast(queues, load, tpot)
        self._max_tokens = config.max_num_batched_tokens
        self._target_tpot_s = config.admission.target_tpot_s or 0.0
        self._target_ttft_s = config.admission.target_ttft_s
        self._sheds_costly = config.admission.shed_costly_prompts_in_overload  # only its rule reads the overload

    def backlog_prefill_tokens(self) -> int:
        """Interactive prompt tokens not yet computed: waiting prompts plus unfinished chunks
        (batch work runs behind them, so it never delays them)."""
        q = self.queues
        return q.waiting_tokens + q.prefill_remaining - q.batch_prefill_remaining

    def predicted_queue_delay_s(self, now: float, own_prompt_tokens: int = 0, corrected: bool = True,
                                own_requests: int = 1) -> float:
        """Time before a request arriving now would start its prefill (with `own_prompt_tokens`:
        would finish it, i.e. its predicted TTFT). See core/predictor.py. With `own_requests` > 1
        the tokens arrive as that many requests (the last one's TTFT: a burst's price, which a
        front end reads from the snapshot, core/front_admission.py)."""
        raw, fixed = self.predicted_pair(now, own_prompt_tokens, own_requests)
        return fixed if corrected else raw

    def regime_delay_ratio(self, now: float) -> float:
        """`predicted_queue_delay_s` / the TTFT target, as the regime reads it: against its marks
        (`RegimeDetector.reads_alike`), so a bound reads the same as the exact ratio wherever
        `TtftPredictor.predict_pair` finds that it does (`reads_alike`)."""
        target, regime = self._target_ttft_s, self.regime
        alike = lambda lo, hi: regime.reads_alike(lo / target, hi / target)  # noqa: E731
        return self.predicted_pair(now, reads_alike=alike)[1] / target

    def predicted_pair(self, now: float, own_prompt_tokens: int = 0, own_requests: int = 1,
                       reads_alike: Callable[[float, float], bool] | None = None) -> tuple[float, float]:
        """`predicted_queue_delay_s` raw and corrected, from one evaluation (see `reads_alike` in
        `TtftPredictor.predict_pair`)."""
        q, limits = self.queues, self.limits
        n_dec = len(q.decodes.reqs)
        own_requests = own_requests if own_prompt_tokens else 0
        slots_short = len(q.waiting) + max(1, own_requests) - (limits.running_cap - q.num_running + q.num_batch_running)
        # The interactive decodes share the steps that drain the backlog (batch decodes yield to
        # waiting interactive prompts; their step in flight is `lane.delay_s`), and every prompt
        # queued or prefilling (and the new one) starts decoding when it finishes, up to the
        # running cap: those steps hold more decodes as the backlog drains.
        n_dec -= q.num_batch_decoding()
        after = n_dec + len(q.waiting) + len(q.prefilling) + own_requests
        cap = limits.running_cap if limits.running_cap > n_dec else n_dec
        sizer = limits.sizer
        slot_s: float | None = None
        first_slot_s: float | Callable[[], float] | None = None
        own_s, slot_tokens, first_bound_s = 0.0, 0, math.inf
        if slots_short > 0:  # the wait for a slot: its own (the last), and the first queued prompt's
            departures = self.departures
            slot_s = departures.wait_s(now, slots_short)
            if slots_short > 1:  # forecast only where it could rule (`predict_pair`)
                first_slot_s, first_bound_s = partial(departures.wait_s, now, 1), departures.first_wait_bound_s(now)
            else:
                first_slot_s = slot_s
            own_s = self.alone_prefill_s(own_prompt_tokens // own_requests) if own_requests else 0.0
            queued = min(len(q.waiting), slots_short - max(1, own_requests))  # the queued prompts short of a slot
            slot_tokens = own_prompt_tokens + (q.waiting_tokens * queued // len(q.waiting) if queued > 0 else 0)
        return self.predictor.predict_pair(now, self.backlog_prefill_tokens() + own_prompt_tokens, n_dec, slots_short,
                                           self._max_tokens, self.lane.delay_s(now) if self.lane is not None else 0.0,
                                           after if after < cap else cap, sizer.aim_s if sizer is not None else None,
                                           slot_s=slot_s, own_s=own_s, first_slot_s=first_slot_s,
                                           slot_tokens=slot_tokens, first_slot_bound_s=first_bound_s,
                                           reads_alike=reads_alike)

    def unit_state(self, now: float, req: Request, queue_delay_s: float | None = None) -> UnitState:
        """What admission sees for `req`; its predicted TTFT is the client's: time spent before the
        unit (`arrival_s` is the front end's arrival) plus `queue_delay_s` (else predicted now)."""
        if queue_delay_s is None:
            queue_delay_s = self.predicted_queue_delay_s(now, req.num_prompt_tokens - req.expected_cached_tokens)
        q = self.queues
        running = q.num_running - q.num_batch_running  # batch requests yield their slots and KV
        busy = bool(q.waiting) or q.prefill_remaining > q.batch_prefill_remaining or running >= self.limits.running_cap
        waited = max(0.0, now - req.arrival_s)
        # Nothing ahead: the bound admission's `prompt_over_target` rule judges (and learns) by.
        uncached = req.num_prompt_tokens - req.expected_cached_tokens
        alone = 0.0 if busy else waited + self.alone_prefill_s(uncached)
        ratio, clear = self.load.overload(now) if self._sheds_costly else (0.0, 0.0)
        return UnitState(len(q.waiting), len(q.decodes.reqs), q.blocks.usage() - q.batch_kv_usage(),
                         waited + queue_delay_s, busy, self.regime.regime,
                         len(q.requests) - len(q.batch) - q.num_batch_running, alone, ratio, clear, uncached)

    def alone_prefill_s(self, prompt_tokens: int) -> float:
        """The time `prompt_tokens` of one prompt take to prefill here if started now, beside the
        interactive decodes running now, on the fitted step model without the learned correction:
        in steps of the whole token budget or, where the step sizer holds a TPOT target, in the
        chunks it would give the prompt: the first what the decodes' banks allow now, the rest at
        the aim, deferral included (`ServiceModel.drain_time`), and in OVERLOAD within the learned
        prefill cap (`StepLimits.step_token_budget`). Beside decodes held to a tight target those
        chunks are small, and whole-budget steps would judge a prompt that takes twice as long."""
        n_dec = len(self.queues.decodes.reqs) - self.queues.num_batch_decoding()
        svc, sizer = self.load.service, self.limits.sizer
        if sizer is None or n_dec == 0:
            return svc.drain_time(prompt_tokens, n_dec, n_dec, self._max_tokens)
        # The first chunk is what the decodes' banks allow now (a quiet unit's are full), the rest
        # drains at the aim.
        tokens = self.limits.step_token_budget(n_dec)
        first = int(min(prompt_tokens, tokens - n_dec, self.limits.chunk_allowance(n_dec)))
        if first <= 0:
            return svc.drain_time(prompt_tokens, n_dec, n_dec, tokens, sizer.aim_s)
        return svc.step_time(first, n_dec) + svc.drain_time(prompt_tokens - first, n_dec, n_dec, tokens, sizer.aim_s)

    def snapshot(self, now: float, unit_id: str = "") -> UnitLoad:
        """This unit's state now. `num_waiting`, `queue_delay_s` and `kv_usage` are the
        interactive view (batch work yields its slots and KV); the batch class is reported apart."""
        q, load = self.queues, self.load
        batch_kv = q.batch_kv_usage()
        return UnitLoad(unit_id, q.num_running, len(q.waiting), self.predicted_queue_delay_s(now),
                        q.blocks.usage() - batch_kv, load.load(now), load.capacity_rps(), self.regime.regime,
                        batch_waiting=len(q.batch), batch_backlog_tokens=q.batch.num_tokens + q.batch_prefill_remaining,
                        batch_running=q.num_batch_running, batch_kv_usage=batch_kv, tpot_s=self.tpot.tpot_s(now),
                        target_tpot_s=self._target_tpot_s, refused_fraction=self.refusals.fraction(now))
