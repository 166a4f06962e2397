"""The step sizer: how big a step may be so every running decode keeps its time-per-token SLO.

Owns: `StepSizer` (the adaptive policy's first-class knob; on when `step_sizing.enabled` and
`admission.target_tpot_s` is set). Every decode in a step waits for the whole step, so a long
prefill chunk or a huge batch makes every running request's TPOT worse, while small steps
waste the GPU and the queue's time to first token. The sizer derives both limits from the
learned step-time model (core/load.py, `ServiceModel`) and one account per decode:

- **bank**: a request's TPOT is the *mean* time between its tokens, so what counts is
  `bank_r = aim x tokens_r - time_r` over the `k_r` tokens it produced since its first one.
  All decodes run in every step (decode-first), so every bank moves by the same
  `aim - interval` each step; the sizer keeps one running sum `account` and, per decode, the
  sum when it started decoding: `bank_r = account - start_r`;
- **borrowing**: a young decode (`k_r < q`) may borrow against its next tokens: each
  decode-only step repays `g = aim - decode_step(n)`, so it may be `g x (q - k_r)` short,
  provided every later step leaves the repayment room. `q` is the `borrow_quantile` of the
  output lengths of finished requests (measured, one less for the first token; 1 = no
  borrowing until requests have finished). A request that produces at least `q + 1` tokens
  keeps its mean under the aim; a shorter one may not, which is why the quantile is low;
- **prefill allowance**: the step may last `aim + bank_r` for every old decode and
  `decode_step + bank_r + g x (q - k_r)` for every young one (banks capped at
  `max_bank_steps` aims): prefill tokens worth that, less the decode part and the fixed cost
  of a prefill step. A step right after a first token on a busy unit is short; a quiet unit
  whose decodes banked time (3 a.m.) takes big chunks and the fastest TTFT; with no decode
  running nothing is at risk and only the token budget applies;
- **batch cap**: decode-only steps must leave room under the aim,
  `max_running = (decode_share x aim - overhead) / b`, so the batch never grows past what
  the SLO allows however long the queue is (the queue is admission control's job).

Old decodes are kept in a heap by `start_r` (lazy deletion, rebuilt when stale), young ones
in join order (few: those that joined in the last `q` steps). Intervals are measured between
step completions (`now`), so the model's errors, host time and anything else a client sees
are charged to the banks; a step that ran over its prediction shrinks the next allowance
instead of being forgotten. `aim` is `target_tpot_s x headroom`. Nothing here is
hardware-specific.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from tidal_core.config import StepSizingConfig
from tidal_core.load import ServiceModel

UNLIMITED = 1 << 30
"""Prefill allowance meaning no limit beyond the token budget."""
_LENGTHS_KEPT = 512  # finished output lengths the borrow quantile is read from
_REFRESH_EVERY = 64

class StepSizer:
    __slots__ = ("_heap", "_last_done_s", "_lengths", "_num_finished", "_start", "_young", "account_s", "aim_s",
                 "borrow_tokens", "config", "decode_steps", "pressure_tokens", "target_tpot_s")

    def __init__(self, config: StepSizingConfig, target_tpot_s: float, now: float = 0.0) -> None:
        self.config = config
        self.target_tpot_s = target_tpot_s
        self.aim_s = target_tpot_s * config.headroom
        self.account_s = 0.0
        self.decode_steps = 0
        self.borrow_tokens = 1  # q: no borrowing until finished requests say how long outputs run
        self.pressure_tokens = 1  # q when a prompt's TTFT is at risk
        self._start: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # old decodes, (-start, rid): the largest start on top
        self._young: deque[tuple[str, int, float]] = deque()  # (rid, decode step at start, start)
        self._lengths: list[int] = []
        self._num_finished = 0
        self._last_done_s = now

    # ---- the two limits ------------------------------------------------------------------
    def max_running(self, svc: ServiceModel) -> int:
        """Largest batch whose decode-only step leaves room for prefill under the aim."""
        per_seq = svc.decode_s_per_seq
        if per_seq <= 0.0:
            return UNLIMITED
        room = self.config.decode_share * self.aim_s - svc.overhead_s
        return max(1, int(room / per_seq))

    def prefill_allowance(self, svc: ServiceModel, num_decodes: int, pressure: bool = False) -> int:
        """Prefill tokens this step may hold next to `num_decodes` running decodes; with
        `pressure` (a prompt's TTFT is at risk) young decodes borrow against `pressure_tokens`."""
        if num_decodes == 0:
            return UNLIMITED
        aim, cap = self.aim_s, self.config.max_bank_steps * self.aim_s
        decode_s = svc.step_time(0, num_decodes)
        gain = max(0.0, aim - decode_s)
        if self._young:
            self._graduate()
        step_s = aim + min(self._min_old_bank(), cap)
        if self._young:
            q = self.pressure_tokens if pressure else self.borrow_tokens
            step_s = min(step_s, decode_s + min(self._min_young_credit(gain, q), cap + gain))
        avail = step_s - decode_s - svc.prefill_step_s
        return int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0

    def min_bank_s(self) -> float:
        """The smallest bank among running decodes, young or old (inf with none)."""
        self._graduate()
        low = self._min_old_bank()
        for rid, _, start in self._young:
            if self._start.get(rid) == start:
                low = min(low, self.account_s - start)
        return low

    def _min_old_bank(self) -> float:
        heap, start = self._heap, self._start
        while heap:
            neg, rid = heap[0]
            if start.get(rid) == -neg:
                return self.account_s + neg
            heapq.heappop(heap)
        return math.inf

    def _graduate(self) -> None:
        """Decodes past the largest borrow horizon move from the young ones to the heap of old ones."""
        young, starts, steps = self._young, self._start, self.decode_steps
        q = max(self.borrow_tokens, self.pressure_tokens)
        while young and steps - young[0][1] >= q:
            rid, _, start = young.popleft()
            if starts.get(rid) == start:
                self._push_old(rid, start)

    def _min_young_credit(self, gain_s: float, q: int) -> float:
        """min over young decodes of `bank + gain x max(1, q - k)`: what a step may add to a
        decode-only step for each (`max(1, ...)`: a decode past `q` has the old ones' aim)."""
        young, starts, steps = self._young, self._start, self.decode_steps
        account = self.account_s
        low = math.inf
        for rid, at, start in young:
            if starts.get(rid) == start:
                left = q - (steps - at)
                credit = account - start + gain_s * (left if left > 1 else 1)
                if credit < low:
                    low = credit
        return low

    def _push_old(self, rid: str, start: float) -> None:
        heapq.heappush(self._heap, (-start, rid))
        if len(self._heap) > 2 * len(self._start) + 64:
            self._heap = [(-s, r) for r, s in self._start.items()]
            heapq.heapify(self._heap)

    # ---- what happened -------------------------------------------------------------------
    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step with `num_decodes` decodes ended at `now`: charge its interval to their banks."""
        if num_decodes:
            self.account_s += self.aim_s - (now - self._last_done_s)
            self.decode_steps += 1
        self._last_done_s = now

    def on_decode_start(self, rid: str) -> None:
        """`rid` produced its first token (or resumed) and decodes from the next step, bank empty."""
        start = self.account_s
        self._start[rid] = start
        self._young.append((rid, self.decode_steps, start))

    def on_decode_end(self, rid: str) -> None:
        """`rid` stopped decoding (finished, aborted or preempted)."""
        self._start.pop(rid, None)

    def on_finished(self, num_output_tokens: int) -> None:
        """A request ended with `num_output_tokens`: the borrow quantile learns output lengths."""
        lengths = self._lengths
        if len(lengths) < _LENGTHS_KEPT:
            lengths.append(num_output_tokens)
        else:
            lengths[self._num_finished % _LENGTHS_KEPT] = num_output_tokens
        self._num_finished += 1
        if self._num_finished % _REFRESH_EVERY == 0 or self._num_finished == 16:
            ordered = sorted(lengths)
            last = len(ordered) - 1
            self.borrow_tokens = max(1, ordered[int(self.config.borrow_quantile * last)] - 1)
            self.pressure_tokens = max(1, ordered[int(self.config.pressure_quantile * last)] - 1)

    def bank_s(self, rid: str) -> float | None:
        """`rid`'s bank: seconds its tokens came in under the aim so far (None if not decoding)."""
        start = self._start.get(rid)
        return None if start is None else self.account_s - start
