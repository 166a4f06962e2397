"""The TTFT predictor: how long a request arriving now would wait for its first token.

Owns: `TtftPredictor`, the one prediction admission control, the regime detector, routing
(through `UnitLoad`) and the metrics read, and its measured error. The prediction is

    ttft = c x batch_s + max(c x prefill_s, slot_s + c x own_s, first_slot_s + c x behind_s)

(the last two terms only when the request must wait for a slot; `c` is the correction)

- `batch_s`: what batch-class work in the step in flight adds before the next step can start
  (core/batch_lane.py, `BatchLane.delay_s`; 0 without the batch class): an additive wait that
  comes and goes with the trough's batch work, which a learned ratio cannot follow;
- `prefill_s`: draining the prefill backlog (waiting prompts, unfinished chunks and, for a
  request's own TTFT, its prompt), the larger of two estimates: the fitted step model
  (`ServiceModel.drain_time`) with the decodes sharing each step growing by one for every
  prompt that finishes ahead of the new one (up to the running cap), at a mean step time no
  longer than the step sizer's TPOT aim (counting the decode-only steps deferred prefill waits
  for); and the backlog at the prefill speed measured while prompts were
  queued (`PrefillThroughput`). The measured speed is that of the decode mix it was measured
  with: at a burst's onset the decodes grow from a handful to dozens within a second, each
  prompt admitted ahead of a request takes part of every step its prefill shares, and with a
  speed measured a moment ago a 400-request burst's admitted requests got their first tokens
  1.36-1.53 s after arrival against predictions of 0.93-0.99 s (benchmarks/RESULTS.md, "The
  admission aim and the burst-onset prediction");
- `slot_s`: when the running batch is at its cap, waiting for enough running requests to
  finish: the caller's forecast from where each running request is in its output
  (core/departures.py, `DepartureForecast`), else at the measured completion rate (the capacity
  estimate before any finish);
- `own_s`: the request's own prompt, prefilled from the moment its slot frees (the unit's
  lone-prompt time, `UnitView.alone_prefill_s`);
- `first_slot_s`, `behind_s`: when the first queued prompt short of a slot gets one, and the
  share of `prefill_s` that is its prompt and those after it, the request's own included.
  A waiting prompt starts when a slot frees, and prefill runs in queue order. So the request's
  prompt is done at the latest of three times: the whole backlog drained; its own slot free,
  then its prompt; the first slot-short prompt started, then everything from it on. (That is
  the tandem queue's max over where the wait starts, at its two ends and the first slot.) When
  the running requests leave one by one, the backlog drains while the queue waits and the first
  two terms rule; when they leave together (a burst's young batch), every slot-short prompt
  starts at once and the third term is the sum of the two waits. The prediction used to be that
  sum always, which counted the overlap twice where departures spread. On the profiled H200 8B
  unit at 3x the constant trace, where nearly every admitted request waited for a slot, the sum
  was 1.38x the measured TTFT at its median, the correction scaled every prediction down by one
  factor, and what admission acted on spread p10/p50/p90 0.81/1.01/1.30; now 0.90/1.00/1.05
  (benchmarks/RESULTS.md, "The slot wait overlaps the prefill backlog");
- `correction`: the measured/predicted ratio of recent first tokens (`PredictionCorrection`),
  which absorbs what the simple queueing model misses (the step sizer throttling prefill,
  bursts of long prompts). It scales the prefill times, not the slot waits: the slot forecast
  is measured already (steps from the recorded output lengths, times the measured time per
  output token), and a factor learned while prefill ruled misprices it. In a 2,000-request
  burst into the simulated A100 unit, the factor learned at the burst's onset (0.87) took a
  slot-ruled prediction of 1.15 s to 1.00 s, and that request got its first token after 1.04 s.

`observe` feeds a finished prefill back: it trains the correction with the raw prediction
and keeps the ratio predicted/measured (the corrected prediction admission acted on) so a
driver can report its spread.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tidal_core.admission import AloneFit, TtftAim
from tidal_core.load import LoadEstimator
from tidal_core.request import Request


class TtftPredictor:
    __slots__ = ("aim", "alone", "load", "num_observed", "ratio_sum")

    def __init__(self, load: LoadEstimator, aim: TtftAim | None = None, alone: AloneFit | None = None) -> None:
        self.load = load
        self.aim = aim  # admission's learned aim, fed by the first tokens of what it judged
        self.alone = alone  # admission's measured/bound ratio, fed by those admitted with nothing ahead
        self.num_observed = 0
        self.ratio_sum = 0.0

    def predict(self, now: float, backlog_tokens: int, num_decodes: int, slots_short: int, budget: int,
                corrected: bool = True, batch_s: float = 0.0, decodes_after: int | None = None,
                aim_s: float | None = None, defer: bool = True, slot_s: float | None = None,
                own_s: float = 0.0, first_slot_s: float | None = None, slot_tokens: int = 0) -> float:
        """The corrected prediction, or with `corrected` False the raw one: see `predict_pair`."""
        raw, fixed = self.predict_pair(now, backlog_tokens, num_decodes, slots_short, budget, batch_s, decodes_after,
                                       aim_s, defer, slot_s, own_s, first_slot_s, slot_tokens)
        return fixed if corrected else raw

    def predict_pair(self, now: float, backlog_tokens: int, num_decodes: int, slots_short: int, budget: int,
                     batch_s: float = 0.0, decodes_after: int | None = None, aim_s: float | None = None,
                     defer: bool = True, slot_s: float | None = None, own_s: float = 0.0,
                     first_slot_s: float | Callable[[], float] | None = None, slot_tokens: int = 0,
                     first_slot_bound_s: float = math.inf,
                     reads_alike: Callable[[float, float], bool] | None = None) -> tuple[float, float]:
        """(raw, corrected): `batch_s` (what batch-class work in the step in flight adds before
        the next step) plus the longest of three waits that overlap:
        - until `backlog_tokens` of prompts are computed (while the `num_decodes` decodes grow to
          `decodes_after`, in steps of at most `budget` tokens and, with `aim_s`, no longer than
          the step sizer's aim, on average with `defer`);
        - when `slots_short` requests more than the free room must leave the running batch first:
          until they have (`slot_s` when the caller forecast it, else at the departure rate), then
          the request's own prefill `own_s`;
        - with `first_slot_s`: until the first queued prompt short of a slot gets one, then the
          `slot_tokens` of the prompts from it on, the request's own included (their share of the
          backlog's time). `first_slot_s` may be a function, called only where an upper bound
          of its answer (`first_slot_bound_s`) could make this the longest wait: the forecast
          reads every running request, and behind a deep queue the own slot's wait rules. Nor
          where `reads_alike(lo, hi)` says the caller reads every corrected prediction between
          the bounds without it and with the bound alike (the regime, which compares it with its
          marks): then both are those lower bounds.
        The correction scales the prefill times, not the slot waits: it is learned mostly where
        prefill rules, and the slot forecast is already measured (core/departures.py)."""
        load = self.load
        after = num_decodes if decodes_after is None else decodes_after
        prefill_s = load.service.drain_time(backlog_tokens, num_decodes, after, budget, aim_s, defer)
        measured = load.prefill.rate(now)
        if measured is not None and backlog_tokens / measured > prefill_s:
            prefill_s = backlog_tokens / measured
        c = load.ttft_correction.factor(now)
        if slots_short <= 0:
            return batch_s + prefill_s, (batch_s + prefill_s) * c
        if slot_s is None:
            slot_s = slots_short / load.departure_rate(now)
        first_s = behind_s = 0.0
        if first_slot_s is not None and slot_tokens > 0 and backlog_tokens > 0:
            behind_s = prefill_s * min(1.0, slot_tokens / backlog_tokens)
            if not callable(first_slot_s):
                first_s = first_slot_s
            else:  # formed only where it could change the answer
                others = max(c * prefill_s, slot_s + c * own_s)
                could_rule = (first_slot_bound_s + behind_s > max(prefill_s, slot_s + own_s)
                              or first_slot_bound_s + c * behind_s > others)
                if could_rule and (reads_alike is None or not reads_alike(
                        c * batch_s + others, c * batch_s + max(others, first_slot_bound_s + c * behind_s))):
                    first_s = first_slot_s()
                else:  # both maxima are the same without it, or the caller reads them alike
                    behind_s = 0.0
        return (batch_s + max(prefill_s, slot_s + own_s, first_s + behind_s),
                c * batch_s + max(c * prefill_s, slot_s + c * own_s, first_s + c * behind_s))

    def on_first_token(self, req: Request, now: float) -> None:
        """`req` got its first token at `now`: stamp it, with the prediction's error."""
        req.first_token_s = now
        if req.admitted_ahead and self.aim is not None:
            self.aim.observe(now - req.arrival_s)
        if req.alone_ttft_s > 0.0 and self.alone is not None:
            self.alone.observe(req.alone_ttft_s, now - req.arrival_s)
        if req.raw_predicted_ttft_s is not None:
            req.ttft_prediction_ratio = self.observe(now, req.raw_predicted_ttft_s, req.predicted_ttft_s,
                                                     now - req.arrival_s)

    def observe(self, now: float, raw_predicted_s: float, predicted_s: float | None, measured_s: float) -> float | None:
        """A first token came `measured_s` after arrival. Returns predicted/measured (None if
        it cannot be formed) and trains the correction with the raw prediction."""
        self.load.ttft_correction.observe(now, raw_predicted_s, measured_s)
        if predicted_s is None or measured_s <= 0.0:
            return None
        ratio = predicted_s / measured_s
        self.num_observed += 1
        self.ratio_sum += ratio
        return ratio
