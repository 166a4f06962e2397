"""A request rate over time: the shape a synthetic day or a load test follows.

Owns `RateCurve`: a piecewise-linear rate in requests/s over `[0, duration_s]`. Steps are the
same object with two knots at one instant (a jump), so 10-minute window data and smooth
hour-of-day curves share one code path for evaluation, integration and inversion. A periodic
curve repeats itself beyond `duration_s` (a day curve asked for 48 h); a non-periodic one has
rate 0 outside its domain.

The integral `cumulative(t)` (the expected request count up to t) and its inverse are what the
arrival generator needs for time rescaling; both are exact for piecewise-linear rates.

Pure numpy; must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]


class RateCurve:
    """Piecewise-linear rate (requests/s) through knots `(times_s[i], rates_rps[i])`.

    `times_s` starts at 0 and never decreases; a repeated time is a jump (the rate just after
    it is the later knot's). Immutable: the arrays are read-only and every transform returns
    a new curve.
    """

    __slots__ = ("_cum", "_rates", "_times", "periodic")

    def __init__(self, times_s: ArrayLike, rates_rps: ArrayLike, *, periodic: bool = False) -> None:
        times = np.array(times_s, dtype=np.float64)
        rates = np.array(rates_rps, dtype=np.float64)
        if times.ndim != 1 or times.shape != rates.shape or times.size < 2:
            raise ValueError("RateCurve needs two 1-D arrays of equal length >= 2 (times_s, rates_rps)")
        if times[0] != 0.0 or np.any(np.diff(times) < 0) or times[-1] <= 0.0:
            raise ValueError("times_s must start at 0, never decrease and end after 0")
        if not (np.all(np.isfinite(rates)) and np.all(rates >= 0.0)):
            raise ValueError("rates_rps must be finite and >= 0")
        # Trapezoids per segment; a zero-width segment (a jump) adds nothing.
        cum = np.concatenate(([0.0], np.cumsum(0.5 * (rates[1:] + rates[:-1]) * np.diff(times))))
        for arr in (times, rates, cum):
            arr.setflags(write=False)
        self._times, self._rates, self._cum = times, rates, cum
        self.periodic = periodic

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def constant(cls, rate_rps: float, duration_s: float) -> RateCurve:
        return cls([0.0, duration_s], [rate_rps, rate_rps])

    @classmethod
    def from_steps(cls, edges_s: Sequence[float] | FloatArray, rates_rps: Sequence[float] | FloatArray,
                   *, periodic: bool = False) -> RateCurve:
        """A step curve: `rates_rps[i]` holds on `[edges_s[i], edges_s[i+1])`."""
        edges = np.asarray(edges_s, dtype=np.float64)
        rates = np.asarray(rates_rps, dtype=np.float64)
        if edges.size != rates.size + 1:
            raise ValueError(f"from_steps needs len(edges_s) == len(rates_rps) + 1, got {edges.size}, {rates.size}")
        times = np.repeat(edges, 2)[1:-1]  # e0, e1, e1, e2, e2, ..., en
        return cls(times, np.repeat(rates, 2), periodic=periodic)

    # -- basic properties -----------------------------------------------------------------
    @property
    def times_s(self) -> FloatArray:
        return self._times

    @property
    def rates_rps(self) -> FloatArray:
        return self._rates

    @property
    def duration_s(self) -> float:
        return float(self._times[-1])

    @property
    def total(self) -> float:
        """Expected number of requests over one period / the whole domain."""
        return float(self._cum[-1])

    @property
    def mean(self) -> float:
        return self.total / self.duration_s

    @property
    def peak(self) -> float:
        return float(self._rates.max())

    @property
    def trough(self) -> float:
        return float(self._rates.min())

    @property
    def peak_to_trough(self) -> float:
        return self.peak / self.trough if self.trough > 0 else math.inf

    # -- evaluation -----------------------------------------------------------------------
    @overload
    def rate_at(self, t_s: float) -> float: ...
    @overload
    def rate_at(self, t_s: FloatArray) -> FloatArray: ...
    def rate_at(self, t_s: float | FloatArray) -> float | FloatArray:
        """Rate at time t (right limit at a jump)."""
        t = np.asarray(t_s, dtype=np.float64)
        local, inside = self._fold(t)
        idx = np.clip(np.searchsorted(self._times, local, side="right") - 1, 0, self._times.size - 2)
        t0, t1 = self._times[idx], self._times[idx + 1]
        r0, r1 = self._rates[idx], self._rates[idx + 1]
        width = t1 - t0
        frac = np.divide(local - t0, width, out=np.ones_like(local), where=width > 0)
        out = np.where(inside, r0 + (r1 - r0) * frac, 0.0)
        return float(out) if out.ndim == 0 else out

    def cumulative(self, t_s: float | FloatArray) -> FloatArray:
        """Expected arrivals in `[0, t]`: the integral of the rate (periodic curves wrap)."""
        t = np.asarray(t_s, dtype=np.float64)
        periods = np.floor(t / self.duration_s) if self.periodic else np.zeros_like(t)
        local = np.clip(t - periods * self.duration_s, 0.0, self.duration_s)
        idx = np.clip(np.searchsorted(self._times, local, side="right") - 1, 0, self._times.size - 2)
        t0, t1 = self._times[idx], self._times[idx + 1]
        r0, r1 = self._rates[idx], self._rates[idx + 1]
        width = t1 - t0
        slope = np.divide(r1 - r0, width, out=np.zeros_like(local), where=width > 0)
        dt = local - t0
        return np.asarray(periods * self.total + self._cum[idx] + r0 * dt + 0.5 * slope * dt * dt)

    def inverse_cumulative(self, counts: FloatArray) -> FloatArray:
        """Times at which `cumulative` reaches `counts` (vectorised, exact on each segment)."""
        y = np.asarray(counts, dtype=np.float64)
        if self.total <= 0.0:
            raise ValueError("the curve's rate is 0 everywhere; it has no arrivals to place")
        periods = np.floor(y / self.total) if self.periodic else np.zeros_like(y)
        local = np.clip(y - periods * self.total, 0.0, self.total)
        # side="right" skips zero-mass segments (rate 0 stretches, jumps) that end at this count.
        idx = np.clip(np.searchsorted(self._cum, local, side="right") - 1, 0, self._times.size - 2)
        t0, t1 = self._times[idx], self._times[idx + 1]
        r0, r1 = self._rates[idx], self._rates[idx + 1]
        width = t1 - t0
        slope = np.divide(r1 - r0, width, out=np.zeros_like(local), where=width > 0)
        d = local - self._cum[idx]
        # Solve r0*x + slope*x^2/2 = d in the cancellation-free form 2d / (r0 + sqrt(r0^2 + 2*slope*d)).
        denom = r0 + np.sqrt(np.maximum(r0 * r0 + 2.0 * slope * d, 0.0))
        x = np.divide(2.0 * d, denom, out=np.zeros_like(local), where=denom > 0)
        return np.asarray(periods * self.duration_s + np.minimum(t0 + x, t1))

    def mean_over(self, start_s: float, end_s: float) -> float:
        """Mean rate over `[start_s, end_s)`."""
        if end_s <= start_s:
            raise ValueError(f"mean_over needs end_s > start_s, got [{start_s}, {end_s})")
        total = self.cumulative(np.array([start_s, end_s]))
        return float(total[1] - total[0]) / (end_s - start_s)

    # -- transforms -----------------------------------------------------------------------
    def scaled(self, factor: float) -> RateCurve:
        """Same shape, rate multiplied by `factor`."""
        if not (factor >= 0.0 and math.isfinite(factor)):
            raise ValueError(f"scale factor={factor} must be finite and >= 0")
        return RateCurve(self._times, self._rates * factor, periodic=self.periodic)

    def compressed(self, time_scale: float) -> RateCurve:
        """Time multiplied by `time_scale` (0.1 = a day in 2.4 h), rate divided by it.

        The expected request count is unchanged: the same day, played faster.
        """
        if not (time_scale > 0.0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale={time_scale} must be finite and > 0 (0.1 plays 10x faster)")
        return RateCurve(self._times * time_scale, self._rates / time_scale, periodic=self.periodic)

    def window(self, start_s: float, end_s: float) -> RateCurve:
        """The part `[start_s, end_s]`, re-based to start at 0 (not periodic)."""
        if not 0.0 <= start_s < end_s:
            raise ValueError(f"window needs 0 <= start_s < end_s, got [{start_s}, {end_s}]")
        if not self.periodic and end_s > self.duration_s:
            raise ValueError(f"window end {end_s} s is past the curve's {self.duration_s} s")
        periods = range(math.floor(start_s / self.duration_s), math.floor(end_s / self.duration_s) + 1)
        if not self.periodic:
            periods = range(1)
        # Unrolled knots keep their own rates, so jumps (two knots at one time) survive intact.
        times = np.concatenate([self._times + k * self.duration_s for k in periods])
        rates = np.concatenate([self._rates for _ in periods])
        inner = (times > start_s) & (times < end_s)
        return RateCurve(
            np.concatenate(([start_s], times[inner], [end_s])) - start_s,
            np.concatenate(([self.rate_at(start_s)], rates[inner], [self._left_rate(end_s)])),
        )

    def _left_rate(self, t_s: float) -> float:
        """Rate just before t (left limit), for closing a window at a jump."""
        local = t_s - math.floor(t_s / self.duration_s) * self.duration_s if self.periodic else t_s
        if self.periodic and local == 0.0:
            local = self.duration_s
        idx = int(np.searchsorted(self._times, local, side="left"))
        idx = min(max(idx, 1), self._times.size - 1)
        t0, t1 = self._times[idx - 1], self._times[idx]
        r0, r1 = self._rates[idx - 1], self._rates[idx]
        return float(r1) if t1 == t0 else float(r0 + (r1 - r0) * (local - t0) / (t1 - t0))

    def _fold(self, t: FloatArray) -> tuple[FloatArray, NDArray[np.bool_]]:
        if self.periodic:
            return t - np.floor(t / self.duration_s) * self.duration_s, np.ones(t.shape, dtype=bool)
        return t, (t >= 0.0) & (t <= self.duration_s)

    def __repr__(self) -> str:
        kind = "periodic " if self.periodic else ""
        return (f"RateCurve({kind}{self.duration_s:.0f} s, {self._times.size} knots, mean {self.mean:.3g} rps, "
                f"peak {self.peak:.3g}, trough {self.trough:.3g})")
