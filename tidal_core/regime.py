"""Traffic regime: LIGHT / STEADY / OVERLOAD, with hysteresis.

Owns: `Regime`, `RegimeDetector` and `BACKLOG_REASONS`. Inputs are the observations of
core/load.py (load = utilisation), the predicted queueing delay relative to the target TTFT, KV
usage, and the recent share of arrivals admission refused for the work ahead of them (the
detector's own `RefusalMeter`, fed by `on_arrival`). Every threshold is relative (to capacity,
to the SLO, to the KV pool, to the arrivals), so one config serves a CPU box and an 8xA100 unit.

Why the refusals: utilisation counts GPU time, and a unit can have GPU time to spare while it
turns most requests away. Long prompts arriving together queue behind each other past the TTFT
target, so admission refuses them (`prefill_backlog`), and the queueing delay at any moment reads
short because admission keeps the queue short. Without the signal, one A100 70B unit on
Mooncake's conversation trace at 0.3x its rate (prompts up to 8k tokens, 1.2-1.3 s of prefill
alone against a 1 s target) read a load of about 1.0, spent a third of the hour in STEADY, and
served 200 prompts too slow to meet the target even alone, each in the place of requests that
could (`prompt_over_target` applies in OVERLOAD only): 0.861 of the best fixed token budget on the
sweet-spot matrix (benchmarks/RESULTS.md, "Refusals as an overload signal"). Refusals of a
request's own prompt (`prompt_over_target`, `costly_prompt`) do not count: they happen in
OVERLOAD, and would hold the unit there.

Enter and exit marks differ, and a new regime must be called for without a break for
`min_dwell_s` before it is taken, so stationary noise does not flap it.

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
from tidal_core.refusal_meter import RefusalMeter


class Regime(enum.StrEnum):
    LIGHT = "light"
    STEADY = "steady"
    OVERLOAD = "overload"


BACKLOG_REASONS = frozenset({"prefill_backlog", "queue_full", "kv_pressure", "concurrency_limit"})
"""Refusals for the work ahead of a request: what the unit cannot serve in time because of the
others (not `prompt_over_target` or `costly_prompt`, which judge the request's own prompt)."""

REGIME_LEVEL = {Regime.LIGHT: 0, Regime.STEADY: 1, Regime.OVERLOAD: 2}
_LIGHT, _STEADY, _OVERLOAD = Regime.LIGHT, Regime.STEADY, Regime.OVERLOAD
# Module globals: reading a member off an enum class goes through the metaclass's `__getattr__`
# hook (about 1 k instructions on Python 3.11), and `target` runs at every observation.


class RegimeDetector:
    __slots__ = ("_pending", "_pending_since", "config", "num_transitions", "refusals", "regime", "since_s")

    def __init__(self, config: RegimeConfig, now: float = 0.0) -> None:
        self.config = config
        self.regime = Regime.LIGHT if config.enabled else Regime.STEADY
        self.since_s = now
        self.num_transitions = 0
        self._pending: Regime | None = None
        self._pending_since = now
        # Refused for the work ahead (BACKLOG_REASONS); 0 after a time constant with no arrival: an
        # idle unit is not overloaded.
        self.refusals = RefusalMeter(config.refused_tau_s, quiet_taus=1.0)

    def target(self, load: float, queue_delay_ratio: float, kv_usage: float, refused: float = 0.0) -> Regime:
        """The regime the observations call for, given the current one (hysteresis)."""
        c = self.config
        current = self.regime
        if current is _OVERLOAD:
            calm = (load < c.overload_exit and queue_delay_ratio < c.queue_delay_exit
                    and kv_usage < c.kv_overload_exit and refused < c.refused_exit)
            if not calm:
                return _OVERLOAD
            return _LIGHT if load < c.light_enter else _STEADY
        if (load >= c.overload_enter or queue_delay_ratio >= c.queue_delay_overload or kv_usage >= c.kv_overload
                or refused >= c.refused_overload):
            return _OVERLOAD
        if current is _LIGHT:
            return _STEADY if load > c.light_exit else _LIGHT
        return _LIGHT if load < c.light_enter and queue_delay_ratio < c.queue_delay_exit else _STEADY

    def reads_alike(self, low: float, high: float) -> bool:
        """Whether every queue delay ratio from `low` to `high` reads the same in `target`: it is
        compared only with the two marks."""
        c = self.config
        return (high < c.queue_delay_exit or low >= c.queue_delay_overload
                or (low >= c.queue_delay_exit and high < c.queue_delay_overload))

    def update(self, now: float, load: float, queue_delay_ratio: float, kv_usage: float) -> Regime:
        if not self.config.enabled:
            return self.regime
        want = self.target(load, queue_delay_ratio, kv_usage, self.refusals.fraction(now))
        if want is self.regime:
            self._pending = None
        elif want is not self._pending:
            self._pending, self._pending_since = want, now
        if self._pending is not None and now - self._pending_since >= self.config.min_dwell_s:
            self.regime, self.since_s = self._pending, now
            self._pending = None
            self.num_transitions += 1
        return self.regime

    def on_arrival(self, now: float, reason: str | None) -> None:
        """An interactive arrival judged at `now`, refused for `reason` (None: admitted)."""
        self.refusals.on_arrival(now, reason in BACKLOG_REASONS)
