"""The measured refusal rate: what share of a unit's interactive arrivals admission turns away.

Owns: `RefusalMeter`. Every interactive arrival the unit judges counts once; one refused for an
SLO reason (`prefill_backlog`, `queue_full`, `kv_pressure`: a 429 a bigger fleet would have
avoided; not `too_long`, which no fleet serves) also counts as refused. The meter keeps both
counts time-decayed (time constant `tau_s`), and their ratio is the unit's recent refused
fraction: the share of requests that miss the SLO at the door. The step time
(core/tpot_meter.py) cannot see these: the step sizer holds prefill back to keep decodes within
their TPOT target, and what runs out is a long prompt's TTFT, so the unit refuses it. It is the
autoscaler's third signal (core/autoscale.py). A unit that received nothing for `quiet_taus` time
constants (3 by default; the regime's meter, core/regime.py, 1) reports 0.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.tpot_meter import decay

REFUSAL_TAU_S = 120.0
"""The meter's time constant: refusals are rare events (about one arrival in a hundred), so the
mean needs minutes of arrivals to say more than noise, yet a unit starting to refuse shows well
within the `provisioning_s` a new unit takes."""


class RefusalMeter:
    __slots__ = ("_arrived", "_refused", "_t_last", "quiet_s", "tau_s")

    def __init__(self, tau_s: float = REFUSAL_TAU_S, quiet_taus: float = 3.0) -> None:
        if not tau_s > 0.0:
            raise ValueError(f"RefusalMeter tau_s={tau_s} must be > 0")
        self.tau_s = tau_s
        # Both counts decay alike, so their ratio does not fall while nothing arrives: after this
        # long without an arrival the meter reads 0 (nothing is being refused now).
        self.quiet_s = quiet_taus * tau_s
        self._arrived = 0.0
        self._refused = 0.0
        self._t_last = -math.inf

    def on_arrival(self, now: float, refused: bool, count: float = 1.0) -> None:
        """`count` interactive arrivals judged at `now`; `refused`: turned away for an SLO reason."""
        kept = decay(now - self._t_last, self.tau_s)
        self._arrived = self._arrived * kept + count
        self._refused = self._refused * kept + (count if refused else 0.0)
        self._t_last = max(now, self._t_last)

    def fraction(self, now: float) -> float:
        """The recent share of interactive arrivals refused; 0.0 when none arrived lately."""
        if self._arrived <= 0.0 or now - self._t_last > self.quiet_s:
            return 0.0
        return self._refused / self._arrived
