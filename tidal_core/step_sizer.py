"""The step sizer: how big a step may be so every running decode keeps its time-per-token SLO.

Owns: `StepSizer` (the adaptive policy's first-class knob; on when `step_sizing.enabled` and
`admission.target_tpot_s` is set). Every decode in a step waits for the whole step, so a long
prefill chunk or a huge batch makes every running request's TPOT worse, while small steps
waste the GPU and the queue's time to first token. The sizer derives both limits from the
learned step-time model (core/load.py, `ServiceModel`) and one account per decode:

- **bank**: a request's TPOT is the *mean* time between its tokens, so what counts is
  `bank_r = aim x k_r - time_r` over the `k_r` tokens it produced since its first one.
  All decodes run in every step (decode-first), so every bank moves by the same
  `aim - interval` each step; the sizer keeps one running sum `account` and, per decode, the
  sum when it started decoding: `bank_r = account - start_r`;
- **borrowing**: a decode may borrow against the tokens it is still expected to produce:
  each decode-only step repays `g = aim - decode_step(n)`, so its limit is
  `decode_step + bank_r + g x max(1, m(k_r))`, where `m(k)` is the `borrow_quantile` of how
  many more tokens requests that reached `k` tokens went on to produce, read from the output
  lengths of recently finished requests (a table by `k`, refreshed every 64 finishes; 1, no
  borrowing, until 16 requests have finished). When the oldest prompt has waited
  `pressure_fraction` of the TTFT target, the `pressure_quantile` table is used instead; in
  OVERLOAD (`strict`) nothing is borrowed: a full batch pays for every long step.
  Only a request that ends before repaying can miss the aim, about that quantile of them;
- **prefill allowance**: the step may last the smallest such limit over the running decodes
  (banks capped at `max_bank_steps` aims): prefill tokens worth that, less the decode part
  and the fixed cost of a prefill step. A step right after a first token on a busy unit is
  short; a quiet unit whose decodes banked time (3 a.m.) takes big chunks and the fastest
  TTFT; with no decode running nothing is at risk and only the token budget applies;
- **batch cap**: decode-only steps must leave room under the aim,
  `max_running = (decode_share x aim - overhead) / b`, so the batch never grows past what
  the SLO allows however long the queue is (the queue is admission control's job).

The limit is a scan over the running decodes, done only for steps that could hold prefill.
Intervals are measured between step completions (`now`), so the model's errors, host time
and anything else a client sees are charged to the banks; a step that ran over its
prediction shrinks the next allowance instead of being forgotten. `aim` is
`target_tpot_s x headroom`. Nothing here is hardware-specific.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import bisect
import math

from tidal_core.config import StepSizingConfig
from tidal_core.load import ServiceModel

UNLIMITED = 1 << 30
"""Prefill allowance meaning no limit beyond the token budget."""
_LENGTHS_KEPT = 512  # finished output lengths the borrow tables are read from
_REFRESH_EVERY = 64
_MIN_FINISHED = 16
_NO_BORROW: tuple[int, ...] = ()


def remaining_quantiles(lengths: list[int], quantile: float) -> tuple[int, ...]:
    """`m(k)` for k = 0..max: the `quantile` of (decode tokens - k) over requests with more than
    k decode tokens (a request's first token is its prefill's; it decodes `length - 1`)."""
    decoded = sorted(n - 1 for n in lengths)
    total = len(decoded)
    table: list[int] = []
    if not decoded:
        return _NO_BORROW
    for k in range(decoded[-1]):
        first = bisect.bisect_right(decoded, k)  # survivors: decoded[first:] > k
        idx = first + int(quantile * (total - first - 1))
        table.append(decoded[idx] - k)
    return tuple(table)


class StepSizer:
    __slots__ = ("_last_done_s", "_lengths", "_num_finished", "_start", "account_s", "aim_s", "borrow",
                 "config", "decode_steps", "pressure", "target_tpot_s")

    def __init__(self, config: StepSizingConfig, target_tpot_s: float, now: float = 0.0) -> None:
        self.config = config
        self.target_tpot_s = target_tpot_s
        self.aim_s = target_tpot_s * config.headroom
        self.account_s = 0.0
        self.decode_steps = 0
        self.borrow = _NO_BORROW  # m(k), normally and under TTFT pressure
        self.pressure = _NO_BORROW
        self._start: dict[str, tuple[float, int]] = {}  # rid -> (account, decode step) when it started
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

    def prefill_allowance(self, svc: ServiceModel, num_decodes: int, pressure: bool = False,
                          strict: bool = False) -> int:
        """Prefill tokens this step may hold next to `num_decodes` running decodes; with
        `pressure` (a prompt's TTFT is at risk) decodes borrow against the pressure table,
        `strict` (OVERLOAD: a full batch pays for every long step) they borrow nothing."""
        if num_decodes == 0 or not self._start:
            return UNLIMITED
        aim = self.aim_s
        decode_s = svc.step_time(0, num_decodes)
        gain = max(0.0, aim - decode_s)
        table = _NO_BORROW if strict else self.pressure if pressure else self.borrow
        credit = self._min_credit(gain, table)
        step_s = decode_s + min(credit, self.config.max_bank_steps * aim + gain)
        avail = step_s - decode_s - svc.prefill_step_s
        return int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0

    def _min_credit(self, gain: float, table: tuple[int, ...]) -> float:
        """min over running decodes of `bank + gain x max(1, m(k))` (every `m` in a table is >= 1)."""
        account, steps, size, entries = self.account_s, self.decode_steps, len(table), self._start.values()
        if not size:
            return account - max(start for start, _ in entries) + gain
        return account - max([start - gain * (table[steps - at] if steps - at < size else 1) for start, at in entries])

    def min_bank_s(self) -> float:
        """The smallest bank among running decodes (inf with none)."""
        return min((self.account_s - start for start, _ in self._start.values()), default=math.inf)

    # ---- what happened -------------------------------------------------------------------
    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step with `num_decodes` decodes ended at `now`: charge its interval to their banks."""
        if num_decodes:
            self.account_s += self.aim_s - (now - self._last_done_s)
            self.decode_steps += 1
        self._last_done_s = now

    def on_decode_start(self, rid: str) -> None:
        """`rid` produced its first token (or resumed) and decodes from the next step, bank empty."""
        self._start[rid] = (self.account_s, self.decode_steps)

    def on_decode_end(self, rid: str) -> None:
        """`rid` stopped decoding (finished, aborted or preempted)."""
        self._start.pop(rid, None)

    def on_request_end(self, rid: str, num_output_tokens: int | None) -> None:
        """`rid` ended: finished with `num_output_tokens`, or aborted (None)."""
        self.on_decode_end(rid)
        if num_output_tokens is not None:
            self.on_finished(num_output_tokens)

    def on_finished(self, num_output_tokens: int) -> None:
        """A request ended with `num_output_tokens`: the borrow tables learn output lengths."""
        lengths = self._lengths
        if len(lengths) < _LENGTHS_KEPT:
            lengths.append(num_output_tokens)
        else:
            lengths[self._num_finished % _LENGTHS_KEPT] = num_output_tokens
        self._num_finished += 1
        if self._num_finished % _REFRESH_EVERY == 0 or self._num_finished == _MIN_FINISHED:
            cfg = self.config
            self.borrow = remaining_quantiles(lengths, cfg.borrow_quantile) if cfg.borrow_quantile else _NO_BORROW
            self.pressure = remaining_quantiles(lengths, cfg.pressure_quantile) if cfg.pressure_quantile else _NO_BORROW

    def bank_s(self, rid: str) -> float | None:
        """`rid`'s bank: seconds its tokens came in under the aim so far (None if not decoding)."""
        entry = self._start.get(rid)
        return None if entry is None else self.account_s - entry[0]
