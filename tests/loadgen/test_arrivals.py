"""Rate curves, day shapes, Gamma arrivals, length sampling and synthetic days.

Statistical checks use fixed seeds, enough samples and generous (4-6 sigma) bounds, so they
test the model, not the luck of a seed.
"""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.arrivals import (
    RateCurve,
    gamma_arrival_times,
    gamma_arrivals,
    rate_for_peak_load,
    read_servegen_rates,
    sample_lengths,
    servegen_day_curve,
    sharp_day_curve,
    synthetic_day,
)
from loadgen.datasets import DATA_DIR
from loadgen.lengths import sample_length_arrays
from loadgen.traces import load_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
HOUR = 3600.0


def profile_column(column: str) -> list[float]:
    """The hour-of-day profile read straight from the shipped CSV (independent of daycurve.py)."""
    with (DATA_DIR / "servegen/derived/servegen_hour_of_day_profile.csv").open() as fh:
        return [float(row[column]) for row in csv.DictReader(fh)]


def hourly_means(curve: RateCurve, hours: int = 24) -> np.ndarray:
    return np.array([curve.mean_over(h * HOUR, (h + 1) * HOUR) for h in range(hours)])


# -- RateCurve -------------------------------------------------------------------------------------
def test_linear_curve_integral_and_inverse_are_exact() -> None:
    curve = RateCurve([0.0, 10.0, 20.0], [0.0, 10.0, 2.0])
    assert curve.total == pytest.approx(50.0 + 60.0)
    assert curve.rate_at(5.0) == pytest.approx(5.0)
    assert float(curve.cumulative(5.0)) == pytest.approx(12.5)
    t = np.linspace(0.01, 19.99, 500)
    np.testing.assert_allclose(curve.inverse_cumulative(curve.cumulative(t)), t, rtol=1e-9, atol=1e-9)


def test_step_curve_jumps_take_the_right_limit() -> None:
    curve = RateCurve.from_steps([0.0, 10.0, 20.0, 30.0], [1.0, 0.0, 4.0])
    assert curve.rate_at(9.999) == 1.0
    assert curve.rate_at(10.0) == 0.0
    assert curve.rate_at(20.0) == 4.0
    assert curve.total == pytest.approx(50.0)
    # A count reached during the silent stretch maps to its end, never inside it.
    assert float(curve.inverse_cumulative(np.array([10.0]))[0]) == pytest.approx(20.0)
    assert float(curve.inverse_cumulative(np.array([10.5]))[0]) == pytest.approx(20.125)


def test_periodic_curve_wraps_and_non_periodic_is_zero_outside() -> None:
    day = sharp_day_curve(peak_rps=10.0)
    assert day.rate_at(21 * HOUR + 86400.0) == pytest.approx(10.0)
    assert float(day.cumulative(2 * 86400.0)) == pytest.approx(2 * day.total)
    flat = RateCurve.constant(2.0, 100.0)
    assert flat.rate_at(150.0) == 0.0 and flat.rate_at(-1.0) == 0.0
    assert float(flat.cumulative(150.0)) == pytest.approx(200.0)


def test_scaled_compressed_and_window() -> None:
    day = servegen_day_curve(mean_rps=4.0)
    assert day.scaled(2.5).mean == pytest.approx(10.0)
    fast = day.compressed(0.1)
    assert fast.duration_s == pytest.approx(8640.0)
    assert fast.total == pytest.approx(day.total)
    assert fast.rate_at(864.0) == pytest.approx(10 * day.rate_at(8640.0))
    part = day.window(3.25 * HOUR, 30 * HOUR)  # crosses midnight of a periodic curve
    assert part.duration_s == pytest.approx(26.75 * HOUR)
    assert part.total == pytest.approx(float(day.cumulative(30 * HOUR) - day.cumulative(3.25 * HOUR)))
    steps = RateCurve.from_steps([0.0, 10.0, 20.0], [1.0, 3.0])
    assert steps.window(5.0, 15.0).total == pytest.approx(5.0 + 15.0)
    assert steps.window(10.0, 20.0).rate_at(0.0) == 3.0


@pytest.mark.parametrize(("times", "rates"), [
    ([0.0], [1.0]), ([1.0, 2.0], [1.0, 1.0]), ([0.0, 2.0, 1.0], [1.0, 1.0, 1.0]), ([0.0, 1.0], [-1.0, 1.0]),
    ([0.0, 1.0], [float("inf"), 1.0]),
])
def test_rate_curve_rejects_bad_knots(times: list[float], rates: list[float]) -> None:
    with pytest.raises(ValueError):
        RateCurve(times, rates)


# -- day shapes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("column", ["m-large", "m-mid", "m-small", "deepseek-r1", "mm-image"])
def test_servegen_curve_hour_ratios_equal_the_profile(column: str) -> None:
    profile = np.array(profile_column(column))
    curve = servegen_day_curve(column, mean_rps=7.0)
    means = hourly_means(curve)
    np.testing.assert_allclose(means / means[0], profile / profile[0], rtol=1e-9)
    assert curve.mean == pytest.approx(7.0)
    assert curve.periodic and curve.duration_s == 86400.0
    assert curve.rate_at(0.0) == pytest.approx(curve.rate_at(86400.0 - 1e-6), rel=1e-6)  # continuous at midnight


def test_servegen_m_large_shape_is_the_documented_one() -> None:
    means = hourly_means(servegen_day_curve("m-large", mean_rps=1.0))
    assert int(np.argmax(means)) == 19 and int(np.argmin(means)) == 8  # data/servegen/SOURCE.md
    assert means.max() / means.min() == pytest.approx(1.45, abs=0.01)


def test_sharp_curve_peak_to_trough_and_shape() -> None:
    curve = sharp_day_curve(peak_rps=20.0)
    assert curve.peak == pytest.approx(20.0)
    assert curve.peak_to_trough == pytest.approx(35.0)
    assert curve.rate_at(21 * HOUR) == pytest.approx(20.0)  # evening peak
    assert curve.rate_at(4 * HOUR) == pytest.approx(20.0 / 35.0)  # night trough
    hourly = [curve.rate_at(h * HOUR) for h in range(25)]
    assert all(a < b for a, b in itertools.pairwise(hourly[4:12]))  # morning ramp 04:00-11:00
    assert hourly[11] > hourly[12] > hourly[13] < hourly[14]  # midday peak, then a lunch dip
    local_max = [h for h in range(1, 24) if hourly[h - 1] < hourly[h] > hourly[h + 1]]
    assert 11 in local_max and 21 in local_max
    assert sharp_day_curve(peak_rps=5.0, peak_to_trough=10.0).peak_to_trough == pytest.approx(10.0)
    assert sharp_day_curve(peak_rps=5.0, peak_to_trough=1.0).peak_to_trough == pytest.approx(1.0)
    with pytest.raises(ValueError):
        sharp_day_curve(peak_rps=5.0, peak_to_trough=0.5)


def test_servegen_rates_fill_gaps() -> None:
    curve = read_servegen_rates(FIXTURES / "servegen_gap.csv")
    assert curve.duration_s == 3600.0
    np.testing.assert_allclose([curve.rate_at(600.0 * i + 1) for i in range(6)], [10, 12, 14, 16, 18, 6])
    raw = read_servegen_rates(FIXTURES / "servegen_gap.csv", fill_gaps=False)
    assert raw.rate_at(1300.0) == 0.0 and raw.trough == 0.0


def test_servegen_real_rates_match_the_source_table() -> None:
    large = read_servegen_rates("m-large")
    assert large.duration_s == 14 * 86400.0
    assert large.mean == pytest.approx(195.8, abs=0.1)  # data/servegen/SOURCE.md summary
    assert large.total == pytest.approx(236.9e6, rel=1e-3)
    assert read_servegen_rates("m-mid", fill_gaps=False).trough == 0.0  # 84 gap windows
    assert read_servegen_rates("m-mid").trough > 0.0
    one_day = large.window(86400.0, 2 * 86400.0)
    assert one_day.duration_s == 86400.0 and one_day.mean > 0


# -- Gamma arrivals --------------------------------------------------------------------------------
@pytest.mark.parametrize("cv", [1.0, 2.5])
def test_arrival_counts_follow_the_curve(cv: float) -> None:
    curve = sharp_day_curve(peak_rps=20.0)
    times = gamma_arrival_times(curve, cv=cv, seed=7)
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < 86400.0
    edges = np.arange(0.0, 86400.0 + 1, 1800.0)
    counts = np.histogram(times, edges)[0]
    expected = np.diff(curve.cumulative(edges))
    # A renewal count over many gaps has variance ~ cv^2 * mean; allow 5 sigma plus a little.
    assert np.all(np.abs(counts - expected) <= 5.0 * cv * np.sqrt(expected) + 5.0)
    assert len(times) == pytest.approx(curve.total, rel=5.0 * cv / math.sqrt(curve.total))


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_interarrival_cv_matches_on_a_flat_curve(cv: float) -> None:
    times = gamma_arrival_times(RateCurve.constant(10.0, 40_000.0), cv=cv, seed=3)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_poisson_counts_have_unit_dispersion() -> None:
    times = gamma_arrival_times(RateCurve.constant(5.0, 50_000.0), cv=1.0, seed=9)
    counts = np.histogram(times, np.arange(0.0, 50_001.0, 1.0))[0]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.05)


def test_arrivals_are_deterministic_per_seed_and_respect_the_window() -> None:
    curve = servegen_day_curve(mean_rps=3.0)
    a = gamma_arrivals(curve, cv=1.5, seed=42, start_s=3600.0, end_s=7200.0)
    assert a == gamma_arrivals(curve, cv=1.5, seed=42, start_s=3600.0, end_s=7200.0)
    assert a != gamma_arrivals(curve, cv=1.5, seed=43, start_s=3600.0, end_s=7200.0)
    assert isinstance(a, list) and all(3600.0 <= t < 7200.0 for t in a)
    two_days = gamma_arrival_times(curve, seed=1, end_s=2 * 86400.0)  # periodic: runs past 24 h
    assert len(two_days) == pytest.approx(2 * curve.total, rel=0.02)
    with pytest.raises(ValueError, match="past the curve"):
        gamma_arrival_times(RateCurve.constant(1.0, 10.0), seed=1, end_s=20.0)
    with pytest.raises(ValueError):
        gamma_arrival_times(curve, cv=0.0, seed=1)
    assert gamma_arrivals(RateCurve.constant(0.0, 10.0), seed=1) == []


def test_arrivals_skip_silent_stretches() -> None:
    curve = RateCurve.from_steps([0.0, 100.0, 200.0, 300.0], [5.0, 0.0, 5.0])
    times = gamma_arrival_times(curve, cv=2.0, seed=5)
    assert not np.any((times >= 100.0) & (times < 200.0))
    assert len(times) == pytest.approx(1000, abs=5 * 2 * math.sqrt(1000))


# -- lengths and synthetic days --------------------------------------------------------------------
def test_lengths_are_resampled_jointly() -> None:
    source = load_trace("azure-conv")
    pairs = set(zip(source.input_tokens.tolist(), source.output_tokens.tolist(), strict=True))
    drawn = sample_lengths(5000, source="azure-conv", seed=4)
    assert all(pair in pairs for pair in drawn)  # independent marginals would break most pairs
    assert drawn == sample_lengths(5000, source="azure-conv", seed=4)
    inp = np.array([p[0] for p in drawn])
    assert inp.mean() == pytest.approx(source.input_tokens.mean(), rel=0.05)
    clipped = sample_lengths(2000, source="mooncake-conv", seed=4, max_input=4096, max_output=512)
    assert max(p[0] for p in clipped) == 4096 and max(p[1] for p in clipped) <= 512
    by_path = sample_length_arrays(10, source=str(FIXTURES / "azure_small.csv"), seed=0)
    assert set(by_path[0].tolist()) <= {374, 396, 879, 1200, 91}
    with pytest.raises(KeyError):
        sample_lengths(1, source="nope", seed=0)


def test_synthetic_day_counts_duration_and_compression() -> None:
    curve = sharp_day_curve(peak_rps=4.0)
    day = synthetic_day(curve, cv=1.5, lengths="azure-code", seed=8, name="d")
    assert day.duration_s == 86400.0 and day.name == "d"
    assert len(day) == pytest.approx(curve.total, rel=6 * 1.5 / math.sqrt(curve.total))
    fast = synthetic_day(curve, cv=1.5, lengths="azure-code", seed=8, name="d", time_scale=0.01)
    np.testing.assert_allclose(fast.arrival_s, day.arrival_s * 0.01)
    assert fast.duration_s == pytest.approx(864.0)
    assert np.array_equal(fast.input_tokens, day.input_tokens)
    half = synthetic_day(curve, cv=1.5, lengths="azure-code", seed=8, name="d", hours=12.0)
    assert half.duration_s == 12 * HOUR and half.arrival_s.max() < 12 * HOUR


def test_rate_for_peak_load_puts_the_peak_past_capacity() -> None:
    curve = sharp_day_curve(peak_rps=1.0)
    factor = rate_for_peak_load(curve, unit_capacity_rps=12.0)
    scaled = curve.scaled(factor)
    assert scaled.peak == pytest.approx(1.3 * 12.0)
    assert scaled.trough < 0.15 * 12.0  # the night is LIGHT at any sensible threshold
    assert rate_for_peak_load(servegen_day_curve(mean_rps=2.0), 10.0, peak_load=0.8) * \
        servegen_day_curve(mean_rps=2.0).peak == pytest.approx(8.0)
    with pytest.raises(ValueError):
        rate_for_peak_load(curve, unit_capacity_rps=0.0)


@settings(max_examples=60, deadline=None)
# Gaps are exact jumps (0) or at least a microsecond: a 1e-308 s gap is not a rate curve.
@given(st.lists(st.tuples(st.one_of(st.just(0.0), st.floats(1e-6, 50.0)), st.floats(0.0, 20.0)), min_size=2,
                max_size=12), st.booleans())
def test_inverse_cumulative_inverts_any_curve(knots: list[tuple[float, float]], periodic: bool) -> None:
    times = np.cumsum([0.0] + [gap for gap, _ in knots[1:]])  # gaps of 0 make jumps
    rates = [rate for _, rate in knots]
    if times[-1] <= 0.0 or sum(rates) == 0.0:
        return
    curve = RateCurve(times, rates, periodic=periodic)
    if curve.total <= 1e-9:
        return
    span = 2 * curve.total if periodic else curve.total
    counts = np.linspace(0.0, span, 97)
    back = curve.cumulative(curve.inverse_cumulative(counts))
    np.testing.assert_allclose(back, counts, rtol=1e-7, atol=1e-7 * max(1.0, span))
    assert np.all(np.diff(curve.inverse_cumulative(counts)) >= 0)
