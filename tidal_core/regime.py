"""Traffic regime: LIGHT / STEADY / OVERLOAD, with hysteresis.

Owns: `Regime` and `RegimeDetector`. Inputs are the observations of core/load.py (load =
utilisation), the predicted queueing delay relative to the target TTFT, and KV usage. Every
threshold is relative (to capacity, to the SLO, to the KV pool), so one config serves a CPU
box and an 8xA100 unit. Enter and exit marks differ, and a new regime must be called for
without a break for `min_dwell_s` before it is taken, so stationary noise does not flap it.

What a regime changes: LIGHT launches at once (no micro-wait); STEADY applies the adaptive
micro-wait; OVERLOAD launches at once (the queue batches by itself) and is the signal for
autoscaling and dashboards. With `enabled=False` (an ablation) the unit stays STEADY.
Admission control is checked on every arrival whatever the label,
because the label lags a burst by up to the dwell time.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import enum

from tidal_core.config import RegimeConfig


class Regime(enum.StrEnum):
    LIGHT = "light"
    STEADY = "steady"
    OVERLOAD = "overload"


REGIME_LEVEL = {Regime.LIGHT: 0, Regime.STEADY: 1, Regime.OVERLOAD: 2}
_LIGHT, _STEADY, _OVERLOAD = Regime.LIGHT, Regime.STEADY, Regime.OVERLOAD
# Module globals: reading a member off an enum class goes through the metaclass's `__getattr__`
# hook (about 1 k instructions on Python 3.11), and `target` runs at every observation.


class RegimeDetector:
    __slots__ = ("_pending", "_pending_since", "config", "num_transitions", "regime", "since_s")

    def __init__(self, config: RegimeConfig, now: float = 0.0) -> None:
        self.config = config
        self.regime = Regime.LIGHT if config.enabled else Regime.STEADY
        self.since_s = now
        self.num_transitions = 0
        self._pending: Regime | None = None
        self._pending_since = now

    def target(self, load: float, queue_delay_ratio: float, kv_usage: float) -> Regime:
        """The regime the observations call for, given the current one (hysteresis)."""
        c = self.config
        current = self.regime
        if current is _OVERLOAD:
            calm = (load < c.overload_exit and queue_delay_ratio < c.queue_delay_exit
                    and kv_usage < c.kv_overload_exit)
            if not calm:
                return _OVERLOAD
            return _LIGHT if load < c.light_enter else _STEADY
        if load >= c.overload_enter or queue_delay_ratio >= c.queue_delay_overload or kv_usage >= c.kv_overload:
            return _OVERLOAD
        if current is _LIGHT:
            return _STEADY if load > c.light_exit else _LIGHT
        return _LIGHT if load < c.light_enter and queue_delay_ratio < c.queue_delay_exit else _STEADY

    def update(self, now: float, load: float, queue_delay_ratio: float, kv_usage: float) -> Regime:
        if not self.config.enabled:
            return self.regime
        want = self.target(load, queue_delay_ratio, kv_usage)
        if want is self.regime:
            self._pending = None
        elif want is not self._pending:
            self._pending, self._pending_since = want, now
        if self._pending is not None and now - self._pending_since >= self.config.min_dwell_s:
            self.regime, self.since_s = self._pending, now
            self._pending = None
            self.num_transitions += 1
        return self.regime
