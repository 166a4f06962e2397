"""How many serving units to run: a pure function of observations and its own state.

Owns: `AutoscaleConfig`, `AutoscaleObservation`, `AutoscaleState`, `Signals` and `decide`:

    decide(observation, state, config) -> (num_units, new_state)

Three signals, all read from the units' snapshots (`UnitLoad`):

- **arrival demand** in units, `sum(load_u * capacity_u) / (target_load * mean capacity)`: the
  arrival rate every unit measures, over what one unit serves at the target utilisation (the
  units' capacity is capacity *within the latency SLO*: core/load.py). Any unit in OVERLOAD adds
  one unit to that, since its arrival rate alone can under-read a backlog. The demand is
  smoothed with time constant `smoothing_s` (so the result does not depend on how often this is
  called: Serve calls it about every 0.1 s, the simulator every 10 s), and its trend is
  projected `lead_s` ahead: a new unit takes minutes to come up (GPU node, weights), so scaling
  up on the demand expected when it is ready keeps the ramp inside the SLO;
- **measured step time**: each unit's recent time per output token (`tpot_s`, core/tpot_meter.py)
  against its TPOT target. The arrival rate says how much traffic there is; the step time says
  what it costs the unit's decodes, whatever the mix of lengths. A unit at `hot_tpot_fraction`
  of its target or above is *hot* and asks for one more unit than are serving; while any unit
  is at `cool_tpot_fraction` or above, no unit is removed (scale-down needs cold units);
- **measured refusals**: the share of the fleet's interactive arrivals its units refused lately
  for an SLO reason (`refused_fraction`, core/refusal_meter.py), each unit weighted by its
  arrival rate. The step sizer keeps decodes within their TPOT target by holding prefill back,
  so what runs out on a busy unit is a long prompt's TTFT, and admission refuses it: neither
  the arrival rate nor the step time shows that. At `hot_refused_fraction` or above the fleet
  asks for one unit more than are serving; at `cool_refused_fraction` or above none is removed.

Only interactive demand counts (unless `scale_for_batch`): batch (deferrable) work runs in the
headroom interactive requests leave and yields first when they return, so the batch part of
`load` is left out, a unit in OVERLOAD does not count when only batch work waits and its interactive arrivals are
within capacity, and a
unit that still runs batch requests is never hot (it has room: batch work is preempted first).
The valley is filled, not paid for.

The wanted count is the smoothed demand with its trend projected `lead_s` ahead when it rises
and `down_lead_s` when it falls (0 by default: scale down on the demand itself), and at least
the hot floor. The count moves up after the wanted count has stayed above it for
`upscale_delay_s`, and down (one unit at a time) after it has stayed below for
`downscale_delay_s` with no unit warm; the result is clamped to [min_units, max_units].

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
    # Arrival-demand defaults chosen on the simulated sharp day (docs/day-in-the-life.md §4): the
    # cheapest setting that kept the fleet at >= 99% SLO attainment on the code of the time; the
    # step-time knobs below, and what both give on today's code, are in the same section.
    target_load: float = 0.65
    smoothing_s: float = 300.0
    lead_s: float = 300.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    max_step_up: int = 4
    # The measured step time (None: off): a unit at `hot_tpot_fraction` x its TPOT target asks
    # for one more unit; none is removed while a unit is at `cool_tpot_fraction` or above. Chosen on
    # three simulated days (docs/day-in-the-life.md §4): the cheapest pair kept >= 99% on each.
    hot_tpot_fraction: float | None = 0.85
    cool_tpot_fraction: float = 0.76
    down_lead_s: float = 0.0
    scale_for_batch: bool = False
    # The measured refusals (None: off): while the units refuse `hot_refused_fraction` of their
    # interactive arrivals or more (arrival-weighted), the fleet asks for one more unit; none is
    # removed while they refuse `cool_refused_fraction` or more.
    hot_refused_fraction: float | None = None
    cool_refused_fraction: float = 0.005

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
        if self.down_lead_s < 0:
            raise ValueError(f"autoscale down_lead_s={self.down_lead_s} must be >= 0 (0: scale down on the "
                             "smoothed demand)")
        hot = self.hot_tpot_fraction
        if hot is not None and not 0.0 < self.cool_tpot_fraction <= hot:
            raise ValueError(f"autoscale cool_tpot_fraction={self.cool_tpot_fraction} must be in (0, "
                             f"hot_tpot_fraction={hot}]: a unit cannot be hot and cool at once")
        if hot is not None and not 0.0 < hot <= 1.5:
            raise ValueError(f"autoscale hot_tpot_fraction={hot} must be in (0, 1.5] (a fraction of the TPOT "
                             "target), or None to scale on arrival rate only")
        refused = self.hot_refused_fraction
        if refused is not None and not 0.0 < self.cool_refused_fraction <= refused < 1.0:
            raise ValueError(f"autoscale cool_refused_fraction={self.cool_refused_fraction} and hot_refused_fraction="
                             f"{refused} must satisfy 0 < cool <= hot < 1 (shares of the arrivals refused), or set "
                             "hot_refused_fraction None to ignore refusals")


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


def interactive_load(unit: UnitLoad, scale_for_batch: bool = False) -> float:
    """The part of `unit.load` that counts as demand: all of it with `scale_for_batch`."""
    return unit.load if scale_for_batch else max(0.0, unit.load - unit.batch_load)


def overloaded(unit: UnitLoad, scale_for_batch: bool = False) -> bool:
    """OVERLOAD that more units would relieve: not when only batch work waits and the interactive
    arrivals alone are within capacity (unless batch counts)."""
    if unit.regime is not Regime.OVERLOAD:
        return False
    batch_only = 0 < unit.batch_waiting >= unit.num_waiting and interactive_load(unit) < 1.0
    return scale_for_batch or not batch_only


def tpot_ratio(unit: UnitLoad, scale_for_batch: bool = False) -> float:
    """Measured TPOT over the unit's target (0: not measured, no target, or batch work still running,
    which yields to interactive requests first, so the unit has room)."""
    if unit.tpot_s <= 0.0 or unit.target_tpot_s <= 0.0 or (unit.batch_running > 0 and not scale_for_batch):
        return 0.0
    return unit.tpot_s / unit.target_tpot_s


def demand_units(units: Sequence[UnitLoad], target_load: float, scale_for_batch: bool = False) -> float:
    """Units needed for the traffic the units measure, at `target_load` utilisation."""
    reporting = [u for u in units if u.healthy and u.capacity_rps > 0]
    if not reporting:
        return 0.0
    arrival_rps = sum(interactive_load(u, scale_for_batch) * u.capacity_rps for u in reporting)
    mean_capacity = sum(u.capacity_rps for u in reporting) / len(reporting)
    demand = arrival_rps / (target_load * mean_capacity)
    if any(overloaded(u, scale_for_batch) for u in reporting):
        demand = max(demand, len(reporting) + 1.0)
    return demand


@dataclass(frozen=True, slots=True)
class Signals:
    """What one observation says: the raw arrival demand in units, the floor the hot units ask
    for (0: none hot) and whether a warm unit holds scale-down back."""

    demand: float
    hot_floor: int
    warm: bool


def refused_fraction(units: Sequence[UnitLoad], scale_for_batch: bool = False) -> float:
    """The share of the fleet's interactive arrivals its units refuse lately: each unit's
    `refused_fraction` weighted by its interactive arrival rate (0: no unit reports arrivals)."""
    weights = [(interactive_load(u, scale_for_batch) * u.capacity_rps, u.refused_fraction)
               for u in units if u.healthy and u.capacity_rps > 0]
    total = sum(w for w, _ in weights)
    return sum(w * f for w, f in weights) / total if total > 0 else 0.0


def read_signals(units: Sequence[UnitLoad], config: AutoscaleConfig) -> Signals:
    batch = config.scale_for_batch
    demand = demand_units(units, config.target_load, batch)
    serving = sum(1 for u in units if u.healthy)
    floor, warm = 0, False
    hot = config.hot_tpot_fraction
    if hot is not None:
        ratios = [tpot_ratio(u, batch) for u in units if u.healthy]
        floor = serving + 1 if any(r >= hot for r in ratios) else 0
        warm = any(r >= config.cool_tpot_fraction for r in ratios)
    if config.hot_refused_fraction is not None:
        refused = refused_fraction(units, batch)
        floor = serving + 1 if refused >= config.hot_refused_fraction else floor
        warm = warm or refused >= config.cool_refused_fraction
    return Signals(demand, floor, warm)


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
    signals = read_signals(obs.units, config)
    raw = signals.demand
    smoothed, slope = _smooth(state, raw, now, config)

    def clamp(n: int) -> int:
        return max(config.min_units, min(config.max_units, n))

    # The trend projected `lead_s` ahead when it rises, `down_lead_s` when it falls.
    projected = smoothed + slope * (config.lead_s if slope > 0.0 else config.down_lead_s)
    wanted_up = clamp(max(math.ceil(projected - 1e-9), signals.hot_floor))
    wanted_down = clamp(math.ceil(projected - 1e-9))
    shrink = wanted_down < current and wanted_up < current and not signals.warm
    above = state.above_since_s if wanted_up > current else None
    below = state.below_since_s if shrink else None
    target = current
    if wanted_up > current:
        above = now if above is None else above
        if now - above >= config.upscale_delay_s:
            target = min(wanted_up, current + config.max_step_up)
            above = None
    elif shrink:
        below = now if below is None else below
        if now - below >= config.downscale_delay_s:
            target = current - 1
            below = None
    return clamp(target), AutoscaleState(smoothed, slope, now, above, below, raw)
