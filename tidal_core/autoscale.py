"""How many serving units to run: a pure function of observations and its own state.

Owns: `AutoscaleConfig`, `AutoscaleObservation`, `AutoscaleState` and `decide`:

    decide(observation, state, config) -> (num_units, new_state)

The demand in units is `sum(load_u * capacity_u) / (target_load * mean capacity)`: the
arrival rate every unit measures, over what one unit serves at the target utilisation (the
units' capacity is capacity *within the latency SLO*: core/load.py). Any unit in OVERLOAD adds
one unit to that, since its arrival rate alone can under-read a backlog. The demand is smoothed
with time constant `smoothing_s` (so the result does not depend on how often this is called:
Serve calls it about every 0.1 s, the simulator every 10 s), and its trend is projected
`lead_s` ahead: a new unit takes minutes to come up (GPU node, weights), so scaling up on the
demand expected when it is ready keeps the ramp inside the SLO. The count moves up after the
projected demand has stayed above it for `upscale_delay_s`, and down (one unit at a time)
after the smoothed demand has stayed below it for `downscale_delay_s`; the result is clamped
to [min_units, max_units].

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tidal_core.regime import Regime
from tidal_core.snapshot import UnitLoad


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    min_units: int = 1
    max_units: int = 8
    # Defaults chosen on the simulated sharp day (docs/day-in-the-life.md §4): the cheapest
    # setting tried that kept the fleet at >= 99% SLO attainment.
    target_load: float = 0.65
    smoothing_s: float = 300.0
    lead_s: float = 300.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    max_step_up: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_units <= self.max_units:
            raise ValueError(f"autoscale bounds min_units={self.min_units}, max_units={self.max_units} "
                             "must satisfy 1 <= min_units <= max_units")
        if not 0.0 < self.target_load <= 1.0:
            raise ValueError(f"autoscale target_load={self.target_load} must be in (0, 1]")
        if self.smoothing_s < 0 or self.lead_s < 0:
            raise ValueError(f"autoscale smoothing_s={self.smoothing_s} and lead_s={self.lead_s} must be >= 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("autoscale delays must be >= 0 seconds")
        if self.max_step_up < 1:
            raise ValueError(f"autoscale max_step_up={self.max_step_up} must be >= 1")


@dataclass(frozen=True, slots=True)
class AutoscaleObservation:
    now_s: float
    num_units: int
    units: Sequence[UnitLoad]


@dataclass(frozen=True, slots=True)
class AutoscaleState:
    smoothed_demand: float | None = None
    slope_per_s: float = 0.0
    last_s: float | None = None
    above_since_s: float | None = None
    below_since_s: float | None = None
    last_demand: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AutoscaleState:
        if not data:
            return cls()
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def demand_units(units: Sequence[UnitLoad], target_load: float) -> float:
    """Units needed for the traffic the units measure, at `target_load` utilisation."""
    reporting = [u for u in units if u.healthy and u.capacity_rps > 0]
    if not reporting:
        return 0.0
    arrival_rps = sum(u.load * u.capacity_rps for u in reporting)
    mean_capacity = sum(u.capacity_rps for u in reporting) / len(reporting)
    demand = arrival_rps / (target_load * mean_capacity)
    if any(u.regime is Regime.OVERLOAD for u in reporting):
        demand = max(demand, len(reporting) + 1.0)
    return demand


def _smooth(state: AutoscaleState, raw: float, now: float, config: AutoscaleConfig) -> tuple[float, float]:
    """(smoothed demand, smoothed slope per second), both with time constant `smoothing_s`."""
    prev, last = state.smoothed_demand, state.last_s
    if prev is None or last is None or now <= last:
        return (raw if prev is None else prev), state.slope_per_s
    dt = now - last
    alpha = 1.0 - math.exp(-dt / config.smoothing_s) if config.smoothing_s > 0 else 1.0
    smoothed = prev + alpha * (raw - prev)
    slope = state.slope_per_s + alpha * ((smoothed - prev) / dt - state.slope_per_s)
    return smoothed, slope


def decide(obs: AutoscaleObservation, state: AutoscaleState, config: AutoscaleConfig) -> tuple[int, AutoscaleState]:
    now, current = obs.now_s, obs.num_units
    raw = demand_units(obs.units, config.target_load)
    smoothed, slope = _smooth(state, raw, now, config)

    def clamp(n: int) -> int:
        return max(config.min_units, min(config.max_units, n))

    wanted_up = clamp(math.ceil(smoothed + max(0.0, slope) * config.lead_s - 1e-9))
    wanted_down = clamp(math.ceil(smoothed - 1e-9))
    above = state.above_since_s if wanted_up > current else None
    below = state.below_since_s if wanted_down < current and wanted_up < current else None
    target = current
    if wanted_up > current:
        above = now if above is None else above
        if now - above >= config.upscale_delay_s:
            target = min(wanted_up, current + config.max_step_up)
            above = None
    elif wanted_down < current and wanted_up < current:
        below = now if below is None else below
        if now - below >= config.downscale_delay_s:
            target = current - 1
            below = None
    return clamp(target), AutoscaleState(smoothed, slope, now, above, below, raw)
