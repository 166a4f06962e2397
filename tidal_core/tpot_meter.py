"""The measured time per output token: how long a unit's decodes actually wait between tokens.

Owns: `TpotMeter` and `decay`, the forgetting factor of the unit's time-decayed meters (this
one and core/refusal_meter.py). Every running decode gets one token per engine step, so the interval between
two step completions is the time per output token (TPOT) of every decode in the later step:
what its clients see, host time and prefill chunks included (a step holding decodes always
follows another step: decodes start from a finished prefill). The meter keeps a token-weighted,
time-decayed mean of those intervals (time constant `tau_s`): the unit's recent TPOT, the
autoscaler's signal of a hot unit (core/autoscale.py). A figure older than `3 * tau_s` is
dropped: a unit that stopped decoding reports none (0).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math


def decay(elapsed_s: float, tau_s: float) -> float:
    """How much of a time-decayed sum survives `elapsed_s` (clamped to [0, 10 tau]: a meter's first
    update, from minus infinity, keeps e^-10 of nothing)."""
    return math.exp(-min(max(0.0, elapsed_s), 10.0 * tau_s) / tau_s)


TPOT_TAU_S = 30.0
"""The meter's time constant: long enough to average prefill and decode-only steps, short
enough that a unit turning hot shows within a minute."""


class TpotMeter:
    __slots__ = ("_last_done_s", "_t_last", "_time", "_tokens", "tau_s")

    def __init__(self, tau_s: float = TPOT_TAU_S) -> None:
        if not tau_s > 0.0:
            raise ValueError(f"TpotMeter tau_s={tau_s} must be > 0")
        self.tau_s = tau_s
        self._tokens = 0.0
        self._time = 0.0
        self._t_last = -math.inf
        self._last_done_s: float | None = None

    def on_step_done(self, now: float, num_decodes: int) -> None:
        """A step that held `num_decodes` running decodes completed at `now`."""
        last, self._last_done_s = self._last_done_s, now
        if num_decodes <= 0 or last is None or now < last:
            return
        kept = decay(now - self._t_last, self.tau_s)
        self._tokens = self._tokens * kept + num_decodes
        self._time = self._time * kept + num_decodes * (now - last)
        self._t_last = now

    def tpot_s(self, now: float) -> float:
        """The recent mean seconds per output token; 0.0 when none was measured lately."""
        if self._tokens <= 0.0 or now - self._t_last > 3.0 * self.tau_s:
            return 0.0
        return self._time / self._tokens
