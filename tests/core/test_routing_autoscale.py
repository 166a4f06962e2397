from __future__ import annotations

import random
from collections import Counter

import pytest

from tidal_core import AutoscaleConfig, AutoscaleObservation, AutoscaleState, Regime, UnitLoad, choose_unit, decide


def unit(uid: str, delay: float = 0.0, kv: float = 0.1, healthy: bool = True, load: float = 0.5,
         cap: float = 10.0, regime: str = "steady") -> UnitLoad:
    return UnitLoad(uid, 4, 0, delay, kv, load, cap, Regime(regime), healthy)


def test_least_delay_with_two_units_and_none_when_all_down() -> None:
    rng = random.Random(0)
    assert choose_unit([unit("a", 0.5), unit("b", 0.1)], rng) == "b"
    assert choose_unit([unit("a", 0.0, kv=0.99), unit("b", 0.3)], rng) == "b"  # KV nearly full
    assert choose_unit([unit("a", healthy=False), unit("b", 9.0)], rng) == "b"
    assert choose_unit([unit("a", healthy=False)], rng) is None


def test_power_of_two_avoids_the_worst_and_spreads() -> None:
    rng = random.Random(0)
    units = [unit("busy", 5.0)] + [unit(f"u{i}", 0.01 * i) for i in range(5)]
    picks = Counter(choose_unit(units, rng) for _ in range(2000))
    assert picks["busy"] == 0
    assert len(picks) >= 4  # not herded onto a single unit


def test_autoscale_up_after_delay_down_slowly_and_bounded() -> None:
    cfg = AutoscaleConfig(min_units=1, max_units=4, target_load=0.5, smoothing_s=0.0, lead_s=0.0,
                          upscale_delay_s=10, downscale_delay_s=60)
    state = AutoscaleState()
    hot = [unit("a", load=1.5, cap=10.0)]  # 15 rps on one unit at 5 rps target -> 3 units
    n, state = decide(AutoscaleObservation(0.0, 1, hot), state, cfg)
    assert n == 1
    n, state = decide(AutoscaleObservation(10.0, 1, hot), state, cfg)
    assert n == 3
    cold = [unit(u, load=0.05) for u in "abc"]
    for t in (20.0, 50.0):
        n, state = decide(AutoscaleObservation(t, 3, cold), state, cfg)
        assert n == 3
    n, state = decide(AutoscaleObservation(80.0, 3, cold), state, cfg)
    assert n == 2  # one at a time
    n, _ = decide(AutoscaleObservation(100.0, 9, cold), AutoscaleState.from_dict(state.to_dict()), cfg)
    assert n <= 4


def test_overload_adds_a_unit_even_if_rate_reads_low() -> None:
    cfg = AutoscaleConfig(upscale_delay_s=0, smoothing_s=0.0)
    n, _ = decide(AutoscaleObservation(0.0, 2, [unit("a", load=0.2, regime="overload"), unit("b", load=0.2)]),
                  AutoscaleState(), cfg)
    assert n == 3


def test_autoscale_config_validation() -> None:
    with pytest.raises(ValueError, match="min_units"):
        AutoscaleConfig(min_units=4, max_units=2)


def test_smoothing_is_per_second_not_per_call() -> None:
    """Serve calls the policy ~10x a second, the simulator every 10 s: the same demand step must
    give the same smoothed demand after the same time."""
    cfg = AutoscaleConfig(smoothing_s=30.0, lead_s=0.0, upscale_delay_s=1e9)
    results = []
    for period in (0.1, 10.0):
        state = AutoscaleState()
        t = 0.0
        _, state = decide(AutoscaleObservation(t, 1, [unit("a", load=0.0)]), state, cfg)
        while t < 60.0:
            t += period
            _, state = decide(AutoscaleObservation(t, 1, [unit("a", load=2.0)]), state, cfg)
        results.append(state.smoothed_demand)
    assert results[0] == pytest.approx(results[1], rel=1e-6)


def test_a_rising_trend_scales_up_ahead_of_the_demand() -> None:
    flat = AutoscaleConfig(smoothing_s=10.0, lead_s=0.0, upscale_delay_s=0.0)
    ahead = AutoscaleConfig(smoothing_s=10.0, lead_s=300.0, upscale_delay_s=0.0)
    units_by = {}
    for name, cfg in (("flat", flat), ("ahead", ahead)):
        state, n = AutoscaleState(), 1
        for step in range(30):  # demand ramps by 0.1 units every 10 s
            load = 0.7 * (1.0 + 0.1 * step)
            n, state = decide(AutoscaleObservation(10.0 * step, n, [unit("a", load=load)]), state, cfg)
        units_by[name] = n
    assert units_by["ahead"] > units_by["flat"]
