"""When running requests will leave: the wait for a slot in a full running batch.

Owns: `DepartureForecast`, the TTFT predictor's slot wait (core/predictor.py), read from the
output lengths of recently finished requests (`OutputLengths`, core/load.py). When the running
batch is at its cap, a prompt cannot start until `j` running requests have finished. How long
that takes depends on where each running request is in its output, not only on the unit's mean
departure rate: a burst's requests start together, and none finishes until each has produced
its output. Measured in Serve (configs/sim.yaml, 2,000 requests in 10 s with max_tokens 128):
with the batch at its cap of ~76 decodes that had started within the same three seconds, the
rate the unit had estimated said a slot would free every ~0.3 s; none freed for seven seconds,
and the requests admitted on that promise got their first tokens after 1.1-3.4 s
(benchmarks/RESULTS.md, "The slot wait of a young batch").

The forecast counts the decode steps `s` until `j` departures are expected,

    E(s) = sum over running requests r of P(L <= k_r + s | L > k_r) >= j

with `k_r` the tokens `r` has produced (a prefilling request: 0) and `L` an output length, from
the empirical distribution of the last 512 finished requests (a request already past
every recorded length counts as leaving at the next step). In steady state this gives the
measured departure rate's answer; for a young batch it gives the wait its ages imply. Until
16 requests have finished there is no distribution: each running request is
expected to produce exactly `min(max_tokens, OUTPUT_GUESS)` tokens (max_tokens is then the only
hint; it is not used afterwards, since in the simulator it is each request's exact length).
Seconds are steps times the unit's measured time per output token (core/tpot_meter.py), or the
step model's decode step before any was measured. Batch-class requests are not counted: they
yield their slots (core/batch_lane.py). A queue that needs the whole running batch to leave
waits at the measured departure rate instead (the capacity estimate before any finish). A
forecast holds for one step: it is kept until the running set moves.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from tidal_core.load import OUTPUT_GUESS, LoadEstimator
from tidal_core.queues import UnitQueues
from tidal_core.request import Request
from tidal_core.tpot_meter import TpotMeter


class _Running:
    """The running requests' produced tokens read against the recorded lengths, for one step:
    each one's count of lengths at or below it and its survivors (`steps` then costs one bisect
    per request and probe, and probes are remembered across the step's questions)."""

    __slots__ = ("expected_at", "gone", "hazard", "lengths")

    def __init__(self, produced: list[int], lengths: list[int]) -> None:
        n = len(lengths)
        self.lengths = lengths
        self.hazard: list[tuple[int, int, int]] = []  # (k, lengths <= k, survivors) of those expected to run on
        self.gone = 0  # past every recorded length: they leave at the next step
        for k in produced:
            done = bisect.bisect_right(lengths, k)
            if done == n:
                self.gone += 1
            else:
                self.hazard.append((k, done, n - done))
        self.expected_at: dict[int, float] = {}

    def expected(self, s: int) -> float:
        """Departures expected within `s` steps."""
        e = self.expected_at.get(s)
        if e is None:
            lengths = self.lengths
            e = self.expected_at[s] = self.gone + sum((bisect.bisect_right(lengths, k + s) - done) / left
                                                      for k, done, left in self.hazard)
        return e

    def steps(self, j: int) -> int:
        """Fewest steps within which `j` (at most the running count) departures are expected."""
        if self.gone >= j:
            return 1
        top = max(1, self.lengths[-1] - min(k for k, _, _ in self.hazard))  # all of them gone by then
        lo, hi = 0, 1
        while hi < top and self.expected(hi) < j - 1e-9:
            lo, hi = hi, min(2 * hi, top)
        while hi - lo > 1:  # expected(lo) < j <= expected(hi)
            mid = (lo + hi) // 2
            if self.expected(mid) < j - 1e-9:
                lo = mid
            else:
                hi = mid
        return hi


def steps_until(j: int, produced: list[int], lengths: list[int]) -> int:
    """Fewest decode steps after which `j` of the requests that have produced `produced` tokens
    are expected to have finished, output lengths drawn from `lengths` (sorted, non-empty).
    `j` must be at most `len(produced)`."""
    return _Running(produced, lengths).steps(j)


class DepartureForecast:
    """The slot wait of one unit (see the module doc)."""

    __slots__ = ("_key", "_memo", "_running", "load", "queues", "tpot")

    def __init__(self, queues: UnitQueues, load: LoadEstimator, tpot: TpotMeter) -> None:
        self.queues, self.load, self.tpot = queues, load, tpot
        self._key: tuple[int, int, int, int] = (-1, -1, -1, -1)
        self._memo: dict[int, int] = {}
        self._running: _Running | list[int] | None = None

    def wait_s(self, now: float, slots_short: int) -> float:
        """Seconds until `slots_short` (> 0) running interactive requests have left; a queue that
        needs the whole running batch to turn over waits at the measured departure rate."""
        if slots_short >= self._num_running():
            return slots_short / self.load.departure_rate(now)
        memo = self._current()
        steps = memo.get(slots_short)
        if steps is None:
            steps = memo[slots_short] = self._steps(slots_short)
        return steps * self._step_s(now)

    def first_wait_bound_s(self, now: float) -> float:
        """An upper bound of `wait_s(now, 1)` from one running request instead of all of them:
        the first slot frees no later than the steps until the longest-running interactive decode
        (the first to have joined) has certainly ended: past the longest recorded output (before
        16 have finished: its guess). Exact where the forecast is memoized, needs no forecast, or
        where that decode leaves at the next step (then memoized)."""
        if self._num_running() <= 1:
            return self.wait_s(now, 1)
        memo = self._current()
        if 1 in memo:
            return memo[1] * self._step_s(now)
        q = self.queues
        oldest = next((r for r in q.decodes.reqs.values() if not r.is_batch), None)
        if oldest is None:  # only batch decodes: an interactive prompt is prefilling, 0 tokens produced
            oldest = next(r for r in q.prefilling.values() if not r.is_batch)
            produced = 0
        else:
            produced = len(oldest.output_token_ids)
        lengths = self.load.lengths.sorted
        last = min(oldest.sampling.max_tokens, OUTPUT_GUESS) if lengths is None else lengths[-1]
        steps = last - produced
        if steps <= 1:  # it leaves at the next step: no forecast is shorter
            steps = memo[1] = 1
        return steps * self._step_s(now)

    def _num_running(self) -> int:
        """The running interactive requests (batch-class ones yield their slots)."""
        q = self.queues
        return len(q.decodes.reqs) + len(q.prefilling) - q.num_batch_running

    def _current(self) -> dict[int, int]:
        """The memo of forecasts (slots -> steps), emptied when the running set has moved."""
        q = self.queues
        key = (q.decodes.step, len(q.decodes.reqs), len(q.prefilling), self.load.lengths.num_finished)
        if key != self._key:
            self._key, self._memo, self._running = key, {}, None
        return self._memo

    def _step_s(self, now: float) -> float:
        """The time of one decode step: measured per output token, else the step model's."""
        return self.tpot.tpot_s(now) or self.load.service.step_time(0, max(1, len(self.queues.decodes.reqs)))

    def _steps(self, j: int) -> int:
        running = self._running
        if running is None:
            q = self.queues
            decoding = _interactive(q.decodes.reqs.values())
            prefilling = _interactive(q.prefilling.values())
            produced = [len(r.output_token_ids) for r in decoding] + [0] * len(prefilling)
            lengths = self.load.lengths.sorted
            if lengths is None:  # each is expected to produce exactly its guess
                running = sorted(max(1, min(r.sampling.max_tokens, OUTPUT_GUESS) - k)
                                 for r, k in zip(decoding + prefilling, produced, strict=True))
            else:
                running = _Running(produced, lengths)
            self._running = running
        return running[j - 1] if isinstance(running, list) else running.steps(j)


def _interactive(reqs: Iterable[Request]) -> list[Request]:
    return [r for r in reqs if not r.is_batch]
