"""The day shapes: real ServeGen rates, the ServeGen hour-of-day day, and the sharp tidal day.

Owns:
- `read_servegen_rates`: ServeGen's per-10-minute aggregate rates (14 days of Alibaba Bailian
  traffic, data/servegen/SOURCE.md) as a step `RateCurve`, data gaps filled;
- `servegen_day_curve`: a 24 h periodic curve whose hourly means are exactly ServeGen's
  hour-of-day profile (mean-preserving piecewise-linear interpolation, see below);
- `sharp_day_curve`: a designed conversation-service day with a deep night trough, a morning
  ramp, a midday and an evening peak, and a configurable peak/trough ratio (default 35).

t = 0 is 00:00 local time in every day curve. docs/traces.md explains the shapes and sources.
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from loadgen.datasets import SERVEGEN_PROFILE_FILE, SERVEGEN_RATE_FILES, data_path, servegen_rate_file
from loadgen.ratecurve import RateCurve

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S
SERVEGEN_WINDOW_S = 600.0

# The sharp day as fractions of the peak, one knot per hour 00:00 .. 23:00 (24:00 wraps to 00:00).
# Designed, not measured: a people-driven chat service in one time zone. The night trough (04:00)
# is exactly 1/35 of the peak, the evening peak (21:00) exactly 1.0. See docs/traces.md.
SHARP_DAY_FRACTIONS: tuple[float, ...] = (
    0.40, 0.22, 0.11, 0.05, 1.0 / 35.0, 0.04,   # 00-05: late evening tail, deep night trough
    0.09, 0.22, 0.45, 0.70, 0.88, 0.95,         # 06-11: morning ramp, midday peak
    0.85, 0.80, 0.88, 0.90, 0.86, 0.78,         # 12-17: lunch dip, afternoon plateau
    0.74, 0.85, 0.96, 1.00, 0.90, 0.65,         # 18-23: commute dip, evening peak, decline
)
SHARP_DAY_BASE_RATIO = 35.0


def read_servegen_profile(model_column: str = "m-large", *, data_dir: Path | str | None = None) -> list[float]:
    """The 24 hour-of-day factors (1.0 = daily mean) of one ServeGen model column."""
    path = data_path(SERVEGEN_PROFILE_FILE, data_dir)
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows or model_column not in rows[0] or model_column == "hour":
        known = [c for c in (rows[0] if rows else {}) if c != "hour"]
        raise KeyError(f"no ServeGen profile column {model_column!r} in {path.name}; known: {', '.join(known)}")
    by_hour = {int(r["hour"]): float(r[model_column]) for r in rows}
    if sorted(by_hour) != list(range(24)):
        raise ValueError(f"{path.name} must have one row per hour 0..23")
    return [by_hour[h] for h in range(24)]


def servegen_day_curve(model_column: str = "m-large", *, mean_rps: float,
                       data_dir: Path | str | None = None) -> RateCurve:
    """A 24 h periodic curve with ServeGen's real hour-of-day shape and the given daily mean.

    Knots sit at every half hour (h + 0.5 h) with values v chosen so that the mean of the
    linear interpolant over each clock hour is exactly the profile value p_h: over hour h that
    mean is (v[h-1] + 6 v[h] + v[h+1]) / 8, so v solves a periodic tridiagonal system. Plain
    interpolation through p_h would blur the hourly means; this keeps them and stays smooth.
    """
    if not (mean_rps > 0.0 and math.isfinite(mean_rps)):
        raise ValueError(f"mean_rps={mean_rps} must be finite and > 0")
    profile = np.array(read_servegen_profile(model_column, data_dir=data_dir))
    system = np.zeros((24, 24))
    for h in range(24):
        system[h, h] = 6.0 / 8.0
        system[h, (h - 1) % 24] = 1.0 / 8.0
        system[h, (h + 1) % 24] = 1.0 / 8.0
    knots = np.linalg.solve(system, profile)
    if np.any(knots < 0.0):
        raise ValueError(f"profile {model_column!r} is too spiky for a non-negative mean-preserving curve")
    # The shipped profile is rounded to 2 decimals, so its mean is ~1.0004, not 1: rescale so
    # the curve's mean is exactly mean_rps while hour ratios stay exactly the file's.
    knots *= mean_rps / profile.mean()
    edge = 0.5 * (knots[-1] + knots[0])
    times = np.concatenate(([0.0], (np.arange(24) + 0.5) * HOUR_S, [DAY_S]))
    return RateCurve(times, np.concatenate(([edge], knots, [edge])), periodic=True)


def sharp_day_curve(*, peak_rps: float, peak_to_trough: float = SHARP_DAY_BASE_RATIO) -> RateCurve:
    """The BurstGPT-like conversation day: peak `peak_rps` at 21:00, trough peak/ratio at 04:00.

    The hourly fractions are raised to the power ln(ratio)/ln(35), which keeps the shape (every
    knot's rank and the relative depth of each dip, in log space) for any ratio >= 1.
    """
    if not (peak_rps > 0.0 and math.isfinite(peak_rps)):
        raise ValueError(f"peak_rps={peak_rps} must be finite and > 0")
    if not (peak_to_trough >= 1.0 and math.isfinite(peak_to_trough)):
        raise ValueError(f"peak_to_trough={peak_to_trough} must be finite and >= 1 (1 = flat)")
    exponent = math.log(peak_to_trough) / math.log(SHARP_DAY_BASE_RATIO)
    fractions = np.array((*SHARP_DAY_FRACTIONS, SHARP_DAY_FRACTIONS[0])) ** exponent
    return RateCurve(np.arange(25) * HOUR_S, peak_rps * fractions, periodic=True)


def read_servegen_rates(path: str | Path = "m-large", *, column: str = "total_rate_rps", fill_gaps: bool = True,
                        data_dir: Path | str | None = None) -> RateCurve:
    """ServeGen's 10-minute aggregate rates as a step curve (`path` may be a model name).

    A window whose total is exactly 0 is a data gap, not silence (data/servegen/SOURCE.md); with
    `fill_gaps` it is filled by linear interpolation between the nearest windows with data.
    """
    file = servegen_rate_file(str(path), data_dir) if str(path) in SERVEGEN_RATE_FILES else Path(path)
    with file.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or column not in reader.fieldnames or "window_start_s" not in reader.fieldnames:
            raise ValueError(f"{file.name}: need columns window_start_s and {column!r}, got {reader.fieldnames}")
        pairs = sorted((float(r["window_start_s"]), float(r[column])) for r in reader)
    if not pairs:
        raise ValueError(f"{file.name} has no rows")
    starts = np.array([p[0] for p in pairs]) - pairs[0][0]
    rates = np.array([p[1] for p in pairs])
    if np.any(np.diff(starts) <= 0):
        raise ValueError(f"{file.name}: window_start_s values must be distinct")
    if fill_gaps:
        have = rates > 0.0
        if have.any() and not have.all():
            idx = np.arange(rates.size)
            rates = np.where(have, rates, np.interp(idx, idx[have], rates[have]))
    width = float(np.median(np.diff(starts))) if starts.size > 1 else SERVEGEN_WINDOW_S
    return RateCurve.from_steps(np.append(starts, starts[-1] + width), rates)
