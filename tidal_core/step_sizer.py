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
  `pressure_fraction` of the TTFT target, the `pressure_quantile` table is used instead.
  Only a request that ends before repaying can miss the aim, about that quantile of them;
- **repayment in OVERLOAD**: `g` assumes the steps to come are decode-only, which a unit whose
  prompts never stop arriving does not run. In OVERLOAD each future token is credited with the
  *measured* repayment instead, `min(g, r)`, where `r` is the mean of `aim - interval` over the
  last `repay_steps` decode steps (what every decode's bank actually gained per step, long
  steps included). A unit that fills every step to the aim measures `r = 0` and borrows
  nothing (a full batch pays for every long step); one whose bursts leave decode-only steps
  between them (long prompts arriving in batches) lets a decode that just got its first token
  borrow against them, so the next prompt's chunks are not cut to one aim;
- **prefill allowance**: the step may last the smallest such limit over the running decodes
  (banks capped at `max_bank_steps` aims): prefill tokens worth that, less the decode part
  and the fixed cost of a prefill step. A step right after a first token on a busy unit is
  short; a quiet unit whose decodes banked time (3 a.m.) takes big chunks and the fastest
  TTFT; with no decode running nothing is at risk and only the token budget applies;
- **deferred prefill** (`defer`): when the allowance would cut the oldest prompt's chunk
  small, a decode-only step first (every bank gains `g`), then a bigger chunk, may compute
  the queue's prompts sooner, since every prefill step pays a fixed cost and the decodes'
  time; the step then holds no prefill (`step_sizing.defer`, docs/scheduler.md);
- **batch cap**: decode-only steps must leave room under the aim,
  `max_running = (decode_share x aim - overhead) / b`, so the batch never grows past what
  the SLO allows however long the queue is (the queue is admission control's job).

The limit is a scan over the running decodes, done only for steps that could hold prefill.
Intervals are measured between step completions (`now`), so the model's errors, host time
and anything else a client sees are charged to the banks; a step that ran over its
prediction shrinks the next allowance instead of being forgotten.

**The aim** starts at `target_tpot_s x headroom` and is learned from the TPOT each finished
request actually got (from its first token to its last, what its client measured): a request
that came within `aim_band` of the target lowers it by `aim_gain x (1 - aim_tail)`, any other
raises it by `aim_gain x aim_tail`, within [`aim_floor`, 1] x the target. It settles where
`aim_tail` of the requests come that close: the TPOT p99 sits near `(1 - aim_band) x target`
where the tail comes from the step model's error (the fixed margin this replaces gave away
throughput where there is none, and was too little where there is much).

**The borrow scale** holds the other tail: requests that ended before repaying a borrow, which
a lower aim does not spare (it shrinks what each future token repays, not which requests
borrow). A finished request that missed the target itself lowers the scale by `borrow_gain x
(1 - borrow_tail)`, any other raises it by `borrow_gain x borrow_tail`, within [0, 1]; both
quantiles are multiplied by it, and a miss rebuilds the tables at once. It settles where
`borrow_tail` of the requests miss the target, and stays at 1 where fewer do. Nothing here is
hardware-specific.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import bisect
import math

from tidal_core.config import StepSizingConfig
from tidal_core.load import ServiceModel
from tidal_core.tail_track import track_tail

UNLIMITED = 1 << 30
"""Prefill allowance meaning no limit beyond the token budget."""
_LENGTHS_KEPT = 512  # finished output lengths the borrow tables are read from
_REFRESH_EVERY = 64
_MIN_FINISHED = 16
_NO_BORROW: tuple[int, ...] = ()


def remaining_quantiles(lengths: list[int], quantile: float, less: int = 0) -> tuple[int, ...]:
    """`m(k) - less` for k = 0..max: `m(k)` the `quantile` of (decode tokens - k) over requests with
    more than k decode tokens (a request's first token is its prefill's; it decodes `length - 1`)."""
    return _quantile_tables(lengths, (quantile,), less)[0]


def _quantile_tables(lengths: list[int], quantiles: tuple[float, ...], less: int) -> list[tuple[int, ...]]:
    """`remaining_quantiles` for each of `quantiles`, from one sort. Between two recorded lengths
    the survivors are the same, so `m` falls by one a token: each table is built a run per distinct
    length, not a search per token (`python benchmarks/scheduler_parts.py`)."""
    decoded = sorted(n - 1 for n in lengths)
    total = len(decoded)
    if not decoded:
        return [_NO_BORROW for _ in quantiles]
    tables: list[list[int]] = [[] for _ in quantiles]
    pairs = list(zip(quantiles, tables, strict=True))
    k, top = 0, decoded[-1]
    first = bisect.bisect_right(decoded, 0)  # survivors: decoded[first:] > k
    while k < top:
        end, span = decoded[first], total - first - 1  # the survivors stay the same up to `end`
        if end - k == 1:  # a run of one token (dense lengths): no `range` to build
            for quantile, table in pairs:
                table.append(decoded[first + int(quantile * span)] - less - k)
        else:
            for quantile, table in pairs:
                m = decoded[first + int(quantile * span)] - less
                table.extend(range(m - k, m - end, -1))
        k = end
        first = bisect.bisect_right(decoded, k, first)
    return [tuple(table) for table in tables]


def _past_this_step(lengths: list[int], borrow: float, pressure: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`m(k) - 1` at the `borrow` and `pressure` quantiles: the tokens past the current one a decode
    at `k` may borrow against (none at quantile 0)."""
    wanted = tuple(q for q in (borrow, pressure) if q)
    tables = dict(zip(wanted, _quantile_tables(lengths, wanted, 1), strict=True))
    return tables.get(borrow, _NO_BORROW), tables.get(pressure, _NO_BORROW)


class StepSizer:
    __slots__ = ("_defer_expect", "_last_done_s", "_lengths", "_num_finished", "_refresh_now", "_since", "_start",
                 "account_s", "aim_s", "borrow", "borrow_scale", "config", "decode_steps", "pressure", "repay_s",
                 "target_tpot_s")

    def __init__(self, config: StepSizingConfig, target_tpot_s: float, now: float = 0.0) -> None:
        self.config = config
        self.target_tpot_s = target_tpot_s
        self.aim_s = target_tpot_s * config.headroom
        self._refresh_now = False
        self.borrow_scale = 1.0  # learned: the share of the borrow quantiles lent against
        self.account_s = 0.0
        self.decode_steps = 0
        self.borrow = _NO_BORROW  # m(k) - 1 (tokens past this step), normally and under TTFT pressure
        self.pressure = _NO_BORROW
        self.repay_s = 0.0  # measured mean of aim - interval per decode step (what future steps repay)
        self._start: dict[str, tuple[float, int]] = {}  # rid -> (account, decode step) when it started
        self._since: dict[str, float] = {}  # rid -> when its first token (or its resumption) came
        self._lengths: list[int] = []
        self._num_finished = 0
        self._last_done_s = now
        self._defer_expect = (-1, 0.0)  # (decode step, least allowance) a deferral expects next

    # ---- the two limits ------------------------------------------------------------------
    def max_running(self, svc: ServiceModel) -> int:
        """Largest batch whose decode-only step leaves room for prefill under the aim."""
        per_seq = svc.decode_s_per_seq
        if per_seq <= 0.0:
            return UNLIMITED
        room = self.config.decode_share * self.aim_s - svc.overhead_s
        return max(1, int(room / per_seq))

    def prefill_allowance(self, svc: ServiceModel, num_decodes: int, pressure: bool = False,
                          overload: bool = False) -> int:
        """Prefill tokens this step may hold next to `num_decodes` running decodes; with
        `pressure` (a prompt's TTFT is at risk) decodes borrow against the pressure table; in
        `overload` their future tokens are credited with the measured repayment, not `g`."""
        if num_decodes == 0 or not self._start:
            return UNLIMITED
        aim = self.aim_s
        decode_s = svc.step_time(0, num_decodes)
        gain = max(0.0, aim - decode_s)
        future = min(gain, max(0.0, self.repay_s)) if overload else gain
        credit = self._min_credit(gain, future, self.pressure if pressure else self.borrow)
        step_s = decode_s + min(credit, self.config.max_bank_steps * aim + gain)
        avail = step_s - decode_s - svc.prefill_step_s
        return int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0

    def defer(self, svc: ServiceModel, num_decodes: int, allowance: float, demand: float) -> bool:
        """True if this step should hold no prefill: a decode-only step now, then a chunk bigger
        by what it banks, computes the `demand` (the prompt tokens this step could take) faster
        than `allowance` tokens now. Every prefill step pays a fixed cost and the decodes' time,
        so chunks the banks cut small waste the GPU: by the A100 70B cost model's step times, with
        8 decodes a step at the aim holds ~200 prompt tokens in 95 ms where two steps (a
        decode-only one, then one chunk) hold ~600 in 190 ms. The decodes' mean interval stays at
        the aim either way. Decided with the learned linear model `svc`: with any positive fixed
        prefill cost it defers at least once from an empty bank.
        Deferring again needs the banks to have grown by at least half the modelled gain (a host
        slower than the model would otherwise defer for ever)."""
        expected, self._defer_expect = self._defer_expect, (-1, 0.0)
        if allowance >= demand or num_decodes == 0 or (expected[0] == self.decode_steps and allowance < expected[1]):
            return False
        decode_s = svc.step_time(0, num_decodes)
        gain = self.aim_s - decode_s
        if gain <= 0.0:
            return False
        banked = gain / svc.prefill_s_per_token
        later = min(allowance + banked, demand)
        if later * svc.step_time(int(allowance), num_decodes) <= allowance * (
                decode_s + svc.step_time(int(later), num_decodes)):
            return False
        self._defer_expect = (self.decode_steps + 1, allowance + 0.5 * banked)
        return True

    def _min_credit(self, gain: float, future: float, table: tuple[int, ...]) -> float:
        """min over running decodes of `bank + gain + future x (max(1, m(k)) - 1)`: this step's
        gain, and `future` for each further token the decode is expected to produce (the tables
        hold `m(k) - 1`)."""
        account, steps, size, entries = self.account_s, self.decode_steps, len(table), self._start.values()
        if not size or future <= 0.0:
            return account - max(start for start, _ in entries) + gain
        return account + gain - max([start - future * (table[steps - at] if steps - at < size else 0)
                                     for start, at in entries])

    def min_bank_s(self) -> float:
        """The smallest bank among running decodes (inf with none)."""
        return min((self.account_s - start for start, _ in self._start.values()), default=math.inf)

    # ---- what happened -------------------------------------------------------------------
    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step with `num_decodes` decodes ended at `now`: charge its interval to their banks."""
        if num_decodes:
            gained = self.aim_s - (now - self._last_done_s)
            self.account_s += gained
            self.decode_steps += 1
            self.repay_s += (gained - self.repay_s) / self.config.repay_steps
        self._last_done_s = now

    def on_decode_start(self, rid: str) -> None:
        """`rid` produced its first token (or resumed) and decodes from the next step, bank empty."""
        self._start[rid] = (self.account_s, self.decode_steps)
        self._since[rid] = self._last_done_s

    def on_decode_end(self, rid: str) -> None:
        """`rid` stopped decoding (finished, aborted or preempted)."""
        self._start.pop(rid, None)
        self._since.pop(rid, None)

    def on_request_end(self, rid: str, num_output_tokens: int | None) -> None:
        """`rid` ended: finished with `num_output_tokens`, or aborted (None)."""
        entry, since = self._start.pop(rid, None), self._since.pop(rid, 0.0)
        if num_output_tokens is not None:
            if entry is not None:
                self.learn_aim(entry[1], since)
            self.on_finished(num_output_tokens)

    def learn_aim(self, started_step: int, started_s: float) -> None:
        """A request that decoded from step `started_step` (time `started_s`) to the last step
        finished: its TPOT moves the aim and the borrow scale (see the module doc)."""
        cfg = self.config
        steps = self.decode_steps - started_step
        if steps < 1:
            return
        target = self.target_tpot_s
        tpot = (self._last_done_s - started_s) / steps
        if cfg.borrow_gain > 0.0:
            missed = tpot > target
            self.borrow_scale = track_tail(self.borrow_scale, cfg.borrow_gain, cfg.borrow_tail, missed, 0.0, 1.0)
            if missed:
                self._refresh_now = True
        if cfg.aim_gain <= 0.0:
            return
        close = tpot > (1.0 - cfg.aim_band) * target
        self.aim_s = target * track_tail(self.aim_s / target, cfg.aim_gain, cfg.aim_tail, close, cfg.aim_floor, 1.0)

    def on_finished(self, num_output_tokens: int) -> None:
        """A request ended with `num_output_tokens`: the borrow tables learn output lengths."""
        lengths = self._lengths
        if len(lengths) < _LENGTHS_KEPT:
            lengths.append(num_output_tokens)
        else:
            lengths[self._num_finished % _LENGTHS_KEPT] = num_output_tokens
        self._num_finished += 1
        if (self._num_finished % _REFRESH_EVERY == 0 or self._num_finished == _MIN_FINISHED
                or (self._refresh_now and self._num_finished > _MIN_FINISHED)):
            self._refresh_now = False
            cfg, scale = self.config, self.borrow_scale
            self.borrow, self.pressure = _past_this_step(lengths, cfg.borrow_quantile * scale,
                                                         cfg.pressure_quantile * scale)

    def bank_s(self, rid: str) -> float | None:
        """`rid`'s bank: seconds its tokens came in under the aim so far (None if not decoding)."""
        entry = self._start.get(rid)
        return None if entry is None else self.account_s - entry[0]
