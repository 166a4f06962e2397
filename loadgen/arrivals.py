"""Arrival generation: bursty request times that follow a rate curve, and whole synthetic days.

Owns:
- `gamma_arrivals`: a non-homogeneous renewal process. Inter-arrival gaps are Gamma with mean 1
  and the requested coefficient of variation (cv = 1 is Poisson, cv > 1 burstier) on the
  curve's "operational time" Lambda(t) (the expected count up to t); mapping them back through
  Lambda^-1 makes the local rate follow the curve while the local CV stays the requested one.
- `synthetic_day`: those arrivals plus (input, output) pairs resampled from a real trace.
- `rate_for_peak_load`: the factor that puts a curve's peak at a multiple of one unit's capacity.

Re-exports the curve API (`RateCurve`, `servegen_day_curve`, `sharp_day_curve`) and
`sample_lengths`, so callers import arrival generation from one place. Same seed, same output.
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from loadgen.daycurve import read_servegen_rates, servegen_day_curve, sharp_day_curve
from loadgen.lengths import sample_length_arrays, sample_lengths
from loadgen.ratecurve import RateCurve
from loadgen.records import Trace

__all__ = [
    "RateCurve",
    "gamma_arrival_times",
    "gamma_arrivals",
    "rate_for_peak_load",
    "read_servegen_rates",
    "sample_lengths",
    "servegen_day_curve",
    "sharp_day_curve",
    "synthetic_day",
]


def gamma_arrival_times(curve: RateCurve, *, cv: float = 1.0, seed: int, start_s: float = 0.0,
                        end_s: float | None = None) -> NDArray[np.float64]:
    """Arrival times in `[start_s, end_s)` as a sorted float64 array; see `gamma_arrivals`."""
    if not (cv > 0.0 and math.isfinite(cv)):
        raise ValueError(f"cv={cv} must be finite and > 0 (1 = Poisson)")
    end = curve.duration_s if end_s is None else float(end_s)
    if not curve.periodic and end > curve.duration_s * (1 + 1e-12):
        raise ValueError(f"end_s={end} is past the curve's {curve.duration_s} s (make the curve periodic or longer)")
    if not 0.0 <= start_s <= end:
        raise ValueError(f"need 0 <= start_s <= end_s, got start_s={start_s}, end_s={end}")
    lo, hi = (float(v) for v in curve.cumulative(np.array([start_s, end])))
    mass = hi - lo
    if mass <= 0.0:
        return np.empty(0, dtype=np.float64)
    shape = 1.0 / (cv * cv)
    rng = np.random.default_rng([seed, 0])
    # Draw gaps in blocks until their sum passes the mass; the first block almost always does.
    blocks: list[NDArray[np.float64]] = []
    total, size = 0.0, int(mass + 8.0 * cv * math.sqrt(mass) + 64)
    while total <= mass:
        gaps = rng.gamma(shape, 1.0 / shape, size=size)  # mean 1, CV = cv
        blocks.append(gaps)
        total += float(gaps.sum())
        size = max(64, size // 4)
    units = lo + np.cumsum(np.concatenate(blocks))
    units = units[units < hi]
    times = curve.inverse_cumulative(units)
    # Floating point at a segment's edge may land a hair outside; keep the window half-open.
    return times[(times >= start_s) & (times < end)]


def gamma_arrivals(curve: RateCurve, *, cv: float = 1.0, seed: int, start_s: float = 0.0,
                   end_s: float | None = None) -> list[float]:
    """Request arrival times (seconds) following `curve`, with Gamma inter-arrivals of CV `cv`.

    The process starts fresh at `start_s` (its first gap is a full Gamma draw) and is deterministic
    for a seed. `end_s` defaults to the curve's duration; a periodic curve may go past it.
    """
    times: list[float] = gamma_arrival_times(curve, cv=cv, seed=seed, start_s=start_s, end_s=end_s).tolist()
    return times


def synthetic_day(curve: RateCurve, *, cv: float, lengths: str, seed: int, hours: float = 24.0,
                  time_scale: float = 1.0, name: str, max_input: int | None = None, max_output: int | None = None,
                  data_dir: str | Path | None = None) -> Trace:
    """`hours` of traffic following `curve` from t = 0, played `time_scale` times as long.

    Lengths come jointly from the real trace `lengths` (see `sample_lengths`), clipped to
    `max_input`/`max_output` if given. Compressing time after generation is exact: the
    time-rescaled process of a compressed curve is the compressed process of the curve.
    """
    if not (hours > 0.0 and math.isfinite(hours)):
        raise ValueError(f"hours={hours} must be finite and > 0")
    if not (time_scale > 0.0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale={time_scale} must be finite and > 0 (0.1 plays 10x faster)")
    span_s = hours * 3600.0
    arrival = gamma_arrival_times(curve, cv=cv, seed=seed, end_s=span_s)
    inp, out = sample_length_arrays(arrival.size, source=lengths, seed=seed, max_input=max_input,
                                    max_output=max_output, data_dir=data_dir)
    source = (f"synthetic: Gamma renewal arrivals (cv={cv:g}) on {curve!r}; lengths resampled from {lengths}; "
              f"seed {seed}")
    return Trace(name, arrival * time_scale, inp, out, duration_s=span_s * time_scale, source=source)


def rate_for_peak_load(curve: RateCurve, unit_capacity_rps: float, peak_load: float = 1.3) -> float:
    """The factor f such that `curve.scaled(f).peak == peak_load * unit_capacity_rps`.

    With peak_load > 1 the peak drives one serving unit past its capacity (OVERLOAD) while the
    trough stays far below it (LIGHT), so a day crosses every regime. The capacity comes from
    the caller (cost model or simulator), never from here.
    """
    if not (unit_capacity_rps > 0.0 and math.isfinite(unit_capacity_rps)):
        raise ValueError(f"unit_capacity_rps={unit_capacity_rps} must be finite and > 0")
    if not (peak_load > 0.0 and math.isfinite(peak_load)):
        raise ValueError(f"peak_load={peak_load} must be finite and > 0 (1.3 = peak at 130% of capacity)")
    if curve.peak <= 0.0:
        raise ValueError("the curve's peak is 0; no scale can give it a load")
    return peak_load * unit_capacity_rps / curve.peak
