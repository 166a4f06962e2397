"""The step sizer: how big a step may be so every running decode keeps its time-per-token SLO.

Owns: `StepSizer` (the adaptive policy's first-class knob; on when `step_sizing.enabled` and
`admission.target_tpot_s` is set). Every decode in a step waits for the whole step, so a long
prefill chunk or a huge batch makes every running request's TPOT worse, while small steps
waste the GPU and the queue's time to first token. The sizer derives both limits from the
learned step-time model (core/load.py, `ServiceModel`) and one account per decode:

- **bank**: a request's TPOT is the *mean* time between its tokens, so what counts is
  `bank_r = aim x tokens_r - time_r` over the tokens it produced since its first one. All
  decodes run in every step (decode-first), so every bank moves by the same
  `aim - interval` each step; the sizer keeps one running sum `account` and, per decode, the
  sum when it started decoding: `bank_r = account - start_r`. The smallest bank belongs to
  the decode with the largest start, found in a heap (lazy deletion, rebuilt when stale);
- **prefill allowance**: a step may last `aim + min(bank)` (bank capped at
  `max_bank_steps` aims), so no running decode's mean goes above the aim: prefill tokens
  worth `aim + min_bank - decode_step(n) - prefill_fixed` of model time. A decode that just
  started has an empty bank, so the step after a first token is short; a step whose decodes
  all banked time (few, old decodes at 3 a.m.) takes big chunks and the fastest TTFT; with
  no decode running nothing is at risk and only the token budget applies;
- **batch cap**: decode-only steps must leave room under the aim,
  `max_running = (decode_share x aim - overhead) / b`, so the batch never grows past what
  the SLO allows however long the queue is (the queue is admission control's job).

Intervals are measured between step completions (`now`), so the model's errors, host time
and anything else a client sees are charged to the banks; a step that ran over its
prediction shrinks the next allowance instead of being forgotten. `aim` is
`target_tpot_s x headroom`. Nothing here is hardware-specific.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import heapq
import math

from tidal_core.config import StepSizingConfig
from tidal_core.load import ServiceModel

UNLIMITED = 1 << 30
"""Prefill allowance meaning no limit beyond the token budget."""


class StepSizer:
    __slots__ = ("_heap", "_last_done_s", "_start", "account_s", "aim_s", "config", "target_tpot_s")

    def __init__(self, config: StepSizingConfig, target_tpot_s: float, now: float = 0.0) -> None:
        self.config = config
        self.target_tpot_s = target_tpot_s
        self.aim_s = target_tpot_s * config.headroom
        self.account_s = 0.0
        self._start: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (-start, rid): the largest start on top
        self._last_done_s = now

    # ---- the two limits ------------------------------------------------------------------
    def max_running(self, svc: ServiceModel) -> int:
        """Largest batch whose decode-only step leaves room for prefill under the aim."""
        per_seq = svc.decode_s_per_seq
        if per_seq <= 0.0:
            return UNLIMITED
        room = self.config.decode_share * self.aim_s - svc.overhead_s
        return max(1, int(room / per_seq))

    def prefill_allowance(self, svc: ServiceModel, num_decodes: int) -> int:
        """Prefill tokens this step may hold next to `num_decodes` running decodes."""
        if num_decodes == 0:
            return UNLIMITED
        bank = min(self.min_bank_s(), self.config.max_bank_steps * self.aim_s)
        avail = self.aim_s + bank - svc.step_time(0, num_decodes) - svc.prefill_step_s
        return int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0

    def min_bank_s(self) -> float:
        """The smallest bank among running decodes (inf with none)."""
        heap, start = self._heap, self._start
        while heap:
            neg, rid = heap[0]
            if start.get(rid) == -neg:
                return self.account_s + neg
            heapq.heappop(heap)
        return math.inf

    # ---- what happened -------------------------------------------------------------------
    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step with `num_decodes` decodes ended at `now`: charge its interval to their banks."""
        if num_decodes:
            self.account_s += self.aim_s - (now - self._last_done_s)
        self._last_done_s = now

    def on_decode_start(self, rid: str) -> None:
        """`rid` produced its first token (or resumed) and decodes from the next step, bank empty."""
        start = self.account_s
        self._start[rid] = start
        heapq.heappush(self._heap, (-start, rid))
        if len(self._heap) > 2 * len(self._start) + 64:
            self._heap = [(-s, r) for r, s in self._start.items()]
            heapq.heapify(self._heap)

    def on_decode_end(self, rid: str) -> None:
        """`rid` stopped decoding (finished, aborted or preempted)."""
        self._start.pop(rid, None)

    def bank_s(self, rid: str) -> float | None:
        """`rid`'s bank: seconds its tokens came in under the aim so far (None if not decoding)."""
        start = self._start.get(rid)
        return None if start is None else self.account_s - start
