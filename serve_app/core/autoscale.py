"""How many serving units to run: a pure function of observations and its own state.

Owns: `AutoscaleConfig`, `AutoscaleObservation`, `AutoscaleState` and `decide`:

    decide(observation, state, config) -> (num_units, new_state)

The demand in units is `sum(load_u * capacity_u) / (target_load * mean capacity)`: the
arrival rate every unit measures, over what one unit serves at the target utilisation. Any
unit in OVERLOAD (or with a queueing delay past its TTFT target) adds one unit to that, since
its arrival rate alone can under-read a backlog. The demand is smoothed (EWMA); the unit
count moves up only after the smoothed demand has stayed above the current count for
`upscale_delay_s`, and down (one unit at a time) after it stayed below for
`downscale_delay_s`; the result is clamped to [min_units, max_units]. Serve calls the adapter
(serve_app/autoscaling.py) about every 0.1 s; the simulator calls it on its own tick.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.core.routing import UnitLoad


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    min_units: int = 1
    max_units: int = 8
    target_load: float = 0.7
    smoothing: float = 0.2
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    max_step_up: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_units <= self.max_units:
            raise ValueError(f"autoscale bounds min_units={self.min_units}, max_units={self.max_units} "
                             "must satisfy 1 <= min_units <= max_units")
        if not 0.0 < self.target_load <= 1.0:
            raise ValueError(f"autoscale target_load={self.target_load} must be in (0, 1]")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"autoscale smoothing={self.smoothing} must be in (0, 1]")
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
    above_since_s: float | None = None
    below_since_s: float | None = None
    last_demand: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AutoscaleState:
        if not data:
            return cls()
        known = {k: data[k] for k in ("smoothed_demand", "above_since_s", "below_since_s", "last_demand") if k in data}
        return cls(**known)


def demand_units(units: Sequence[UnitLoad], target_load: float) -> float:
    """Units needed for the traffic the units measure, at `target_load` utilisation."""
    reporting = [u for u in units if u.healthy and u.capacity_rps > 0]
    if not reporting:
        return 0.0
    arrival_rps = sum(u.load * u.capacity_rps for u in reporting)
    mean_capacity = sum(u.capacity_rps for u in reporting) / len(reporting)
    demand = arrival_rps / (target_load * mean_capacity)
    if any(u.regime == "overload" for u in reporting):
        demand = max(demand, len(reporting) + 1.0)
    return demand


def decide(obs: AutoscaleObservation, state: AutoscaleState, config: AutoscaleConfig) -> tuple[int, AutoscaleState]:
    now, current = obs.now_s, obs.num_units
    raw = demand_units(obs.units, config.target_load)
    prev = state.smoothed_demand
    smoothed = raw if prev is None else prev + config.smoothing * (raw - prev)
    wanted = math.ceil(smoothed - 1e-9)
    wanted = max(config.min_units, min(config.max_units, wanted))
    above = state.above_since_s if wanted > current else None
    below = state.below_since_s if wanted < current else None
    target = current
    if wanted > current:
        above = now if above is None else above
        if now - above >= config.upscale_delay_s:
            target = min(wanted, current + config.max_step_up)
            above = None
    elif wanted < current:
        below = now if below is None else below
        if now - below >= config.downscale_delay_s:
            target = current - 1
            below = None
    target = max(config.min_units, min(config.max_units, target))
    return target, AutoscaleState(smoothed, above, below, raw)
