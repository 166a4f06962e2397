"""The autoscaler's measured-step-time signal and its interactive-only demand, one rule per test."""

from __future__ import annotations

import dataclasses

import pytest

from tidal_core import AutoscaleConfig, AutoscaleObservation, AutoscaleState, Regime, UnitLoad, decide
from tidal_core.autoscale import demand_units, read_signals

TARGET = 0.100  # the units' TPOT target (s)
# Arrival demand switched to an instant reading: each test sees the rule it names, not smoothing.
CFG = AutoscaleConfig(min_units=1, max_units=8, target_load=0.5, smoothing_s=0.0, lead_s=0.0,
                      upscale_delay_s=0.0, downscale_delay_s=0.0, hot_tpot_fraction=0.8, cool_tpot_fraction=0.7)


def unit(uid: str, load: float = 0.4, tpot_ms: float = 60.0, **batch: float) -> UnitLoad:
    """A unit at `load` (capacity 2 req/s, so 0.5 load is one unit's worth at the 0.5 target)."""
    return UnitLoad(uid, 8, 0, 0.0, 0.2, load, 2.0, Regime.STEADY, tpot_s=tpot_ms / 1000.0, target_tpot_s=TARGET,
                    **batch)  # type: ignore[arg-type]


def step(units: list[UnitLoad], num_units: int, cfg: AutoscaleConfig = CFG, now: float = 0.0) -> int:
    n, _ = decide(AutoscaleObservation(now, num_units, units), AutoscaleState(), cfg)
    return n


def test_a_hot_unit_asks_for_one_more_unit_though_the_arrival_rate_reads_low() -> None:
    cool = [unit("a", tpot_ms=60.0), unit("b", tpot_ms=60.0)]
    assert step(cool, 2) == 2  # demand 2 x 0.4 / 0.5 = 1.6 units: no change
    hot = [unit("a", tpot_ms=85.0), unit("b", tpot_ms=60.0)]
    assert step(hot, 2) == 3


def test_a_hot_unit_does_not_stack_units_while_one_is_still_coming_up() -> None:
    hot = [unit("a", tpot_ms=90.0), unit("b", tpot_ms=90.0)]
    assert step(hot, 3) == 3  # two serve, one provisioning: the hot floor (2 + 1) is met


def test_the_hot_floor_waits_out_the_upscale_delay() -> None:
    cfg = dataclasses.replace(CFG, upscale_delay_s=30.0)
    hot = [unit("a", tpot_ms=90.0)]
    n, state = decide(AutoscaleObservation(0.0, 1, hot), AutoscaleState(), cfg)
    assert n == 1
    n, state = decide(AutoscaleObservation(20.0, 1, hot), state, cfg)
    assert n == 1
    n, _ = decide(AutoscaleObservation(30.0, 1, hot), state, cfg)
    assert n == 2


def test_a_warm_unit_holds_scale_down_and_cold_units_allow_it() -> None:
    # Arrival demand 3 x 0.1 / 0.5 = 0.6 units: the rate alone says drop to one.
    warm = [unit("a", 0.1, tpot_ms=75.0), unit("b", 0.1, tpot_ms=50.0), unit("c", 0.1, tpot_ms=50.0)]
    assert step(warm, 3) == 3
    cold = [unit("a", 0.1, tpot_ms=65.0), unit("b", 0.1, tpot_ms=50.0), unit("c", 0.1, tpot_ms=50.0)]
    assert step(cold, 3) == 2  # one at a time
    idle = [unit("a", 0.1, tpot_ms=0.0), unit("b", 0.1, tpot_ms=0.0), unit("c", 0.1, tpot_ms=0.0)]
    assert step(idle, 3) == 2  # no decode measured: nothing is warm


def test_without_the_step_time_signal_only_the_arrival_rate_counts() -> None:
    off = dataclasses.replace(CFG, hot_tpot_fraction=None)
    assert step([unit("a", tpot_ms=95.0), unit("b", tpot_ms=95.0)], 2, off) == 2
    assert step([unit("a", 0.1, tpot_ms=95.0), unit("b", 0.1, tpot_ms=95.0)], 2, off) == 1


def test_a_unit_without_a_tpot_target_is_never_hot() -> None:
    no_target = dataclasses.replace(unit("a", tpot_ms=95.0), target_tpot_s=0.0)
    assert read_signals([no_target], CFG).hot_floor == 0


def test_batch_load_is_left_out_of_demand_unless_batch_counts() -> None:
    # 0.9 load of which 0.6 is batch arrivals: 0.3 interactive -> 0.6 units, 0.9 -> 1.8 units.
    units = [unit("a", 0.9, batch_load=0.6)]
    assert demand_units(units, 0.5) == pytest.approx(0.6)
    assert demand_units(units, 0.5, scale_for_batch=True) == pytest.approx(1.8)
    assert step(units, 1) == 1
    assert step(units, 1, dataclasses.replace(CFG, scale_for_batch=True)) == 2


def test_a_batch_backlog_alone_never_scales_up() -> None:
    # A unit in OVERLOAD with a deep batch queue, hot steps and batch decodes running, but
    # little interactive traffic: the valley is being filled, not paid for.
    busy = dataclasses.replace(unit("a", 0.35, tpot_ms=92.0, batch_load=0.1, batch_running=40),
                               num_waiting=500, regime=Regime.OVERLOAD)
    busy = dataclasses.replace(busy, batch_waiting=500, batch_backlog_tokens=2_000_000)
    assert step([busy], 1) == 1
    assert step([busy], 1, dataclasses.replace(CFG, scale_for_batch=True)) == 2


def test_interactive_requests_waiting_in_overload_still_scale_up() -> None:
    overloaded = dataclasses.replace(unit("a", 0.35, batch_waiting=500), num_waiting=520, regime=Regime.OVERLOAD)
    assert step([overloaded], 1) == 2  # 20 interactive requests queue behind nothing but capacity
    rate_over = dataclasses.replace(unit("a", 1.2, batch_waiting=500), num_waiting=500, regime=Regime.OVERLOAD)
    assert step([rate_over], 1) >= 2  # interactive arrivals alone exceed the unit's capacity


def test_a_hot_unit_running_only_interactive_work_counts_though_batch_is_queued() -> None:
    hot = unit("a", 0.3, tpot_ms=90.0, batch_waiting=100, batch_backlog_tokens=50_000)
    assert step([hot], 1) == 2  # batch queued but none running: the step time is interactive


def test_scale_down_on_the_projected_demand_leaves_earlier_on_a_falling_day() -> None:
    """The demand falls by 0.05 units every 10 s from 4 units: projecting the trend 300 s ahead
    lets the fleet shrink sooner than the smoothed demand alone."""
    units_by = {}
    for lead in (0.0, 300.0):
        cfg = dataclasses.replace(CFG, smoothing_s=60.0, down_lead_s=lead, downscale_delay_s=30.0,
                                  hot_tpot_fraction=None)
        state, n = AutoscaleState(), 4
        for k in range(30):
            load = (4.0 - 0.05 * k) * 0.5 / n  # per unit, spread over the n units serving
            n, state = decide(AutoscaleObservation(10.0 * k, n, [unit(str(i), load) for i in range(n)]), state, cfg)
        units_by[lead] = n
    assert units_by[300.0] < units_by[0.0]


@pytest.mark.parametrize(("fields", "match"), [
    ({"hot_tpot_fraction": 0.7, "cool_tpot_fraction": 0.8}, "cool_tpot_fraction=0.8"),
    ({"hot_tpot_fraction": 2.0}, "hot_tpot_fraction=2.0"),
    ({"down_lead_s": -1.0}, "down_lead_s=-1.0"),
])
def test_step_time_knobs_are_validated_with_the_value_named(fields: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AutoscaleConfig(**fields)  # type: ignore[arg-type]


def test_the_defaults_scale_on_step_time_and_never_for_batch() -> None:
    cfg = AutoscaleConfig()
    assert cfg.hot_tpot_fraction is not None and cfg.cool_tpot_fraction <= cfg.hot_tpot_fraction
    assert cfg.scale_for_batch is False
