"""The measured refusal rate: the meter, the scheduler's snapshot of it, and the autoscaler's rule."""

from __future__ import annotations

import dataclasses

import pytest

from tidal_core import (
    AdmissionConfig,
    AutoscaleConfig,
    AutoscaleObservation,
    AutoscaleState,
    Regime,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    UnitLoad,
    decide,
)
from tidal_core.autoscale import read_signals, refused_fraction
from tidal_core.refusal_meter import RefusalMeter
from tidal_core.request import Request

# Arrival demand read instantly and the step-time signal off: each test sees the refusal rule.
CFG = AutoscaleConfig(min_units=1, max_units=8, target_load=0.5, smoothing_s=0.0, lead_s=0.0, upscale_delay_s=0.0,
                      downscale_delay_s=0.0, hot_tpot_fraction=None, hot_refused_fraction=0.01,
                      cool_refused_fraction=0.005)


def unit(uid: str, load: float = 0.4, refused: float = 0.0) -> UnitLoad:
    """A unit at `load` of 2 req/s capacity (0.5 load is one unit's worth at the 0.5 target)."""
    return UnitLoad(uid, 8, 0, 0.0, 0.2, load, 2.0, Regime.STEADY, refused_fraction=refused)


def step(units: list[UnitLoad], num_units: int, cfg: AutoscaleConfig = CFG) -> int:
    n, _ = decide(AutoscaleObservation(0.0, num_units, units), AutoscaleState(), cfg)
    return n


def test_the_meter_is_the_recent_share_refused_and_forgets_old_arrivals() -> None:
    meter = RefusalMeter(tau_s=60.0)
    assert meter.fraction(0.0) == 0.0
    for i in range(200):  # one in twenty refused, 0.1 s apart
        meter.on_arrival(0.1 * i, refused=i % 20 == 0)
    assert meter.fraction(20.0) == pytest.approx(0.05, rel=0.1)
    t = 20.0
    for _ in range(3000):  # ten minutes with none refused: ten time constants
        t += 0.2
        meter.on_arrival(t, refused=False)
    assert meter.fraction(t) < 0.001
    assert meter.fraction(t + 179.0) > 0.0  # a figure, still
    assert meter.fraction(t + 181.0) == 0.0  # nothing arrived for 3 x tau: no figure


def test_the_meter_rejects_a_nonpositive_time_constant() -> None:
    with pytest.raises(ValueError, match="tau_s=0"):
        RefusalMeter(tau_s=0.0)


def test_the_snapshot_counts_slo_refusals_but_not_a_prompt_no_unit_could_serve() -> None:
    cfg = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16,
                          max_model_len=512, admission=AdmissionConfig(max_queued_requests=1))
    sched = Scheduler(cfg)
    params = SamplingParams(max_tokens=8)
    assert sched.add_request(Request("a", 64, params, 0.0), 0.0) is None
    refused = sched.add_request(Request("b", 64, params, 0.0), 0.0)  # one already queued: queue_full
    assert refused is not None and refused.retryable
    too_long = sched.add_request(Request("c", 600, params, 0.0), 0.0)
    assert too_long is not None and too_long.reason == "too_long"
    snap = sched.snapshot(0.0, "u")
    assert snap.refused_fraction == pytest.approx(1.0 / 3.0)  # three judged, one refused for the SLO
    assert UnitLoad.from_stats("u", snap.to_stats()) == snap


def test_refusals_ask_for_one_more_unit_though_the_arrival_rate_reads_low() -> None:
    assert step([unit("a", refused=0.002), unit("b", refused=0.002)], 2) == 2  # demand 1.6 units
    assert step([unit("a", refused=0.03), unit("b", refused=0.0)], 2) == 3  # fleet share 1.5%
    assert step([unit("a", refused=0.03), unit("b", refused=0.0)], 3) == 3  # one is already coming up
    off = dataclasses.replace(CFG, hot_refused_fraction=None)
    assert step([unit("a", refused=0.03), unit("b", refused=0.03)], 2, off) == 2


def test_the_fleet_share_weights_each_unit_by_its_arrivals() -> None:
    busy, quiet = unit("a", 0.8, refused=0.01), unit("b", 0.2, refused=0.05)
    assert refused_fraction([busy, quiet]) == pytest.approx((0.8 * 0.01 + 0.2 * 0.05) / 1.0)
    assert refused_fraction([]) == 0.0


def test_refusals_between_cool_and_hot_hold_scale_down() -> None:
    # Arrival demand 3 x 0.1 / 0.5 = 0.6 units: the rate alone says drop one.
    warm = [unit("a", 0.1, refused=0.008), unit("b", 0.1), unit("c", 0.1, refused=0.008)]  # fleet share 0.53%
    assert read_signals(warm, CFG).hot_floor == 0
    assert step(warm, 3) == 3
    assert step([unit("a", 0.1, refused=0.004), unit("b", 0.1), unit("c", 0.1)], 3) == 2


@pytest.mark.parametrize(("fields", "match"), [
    ({"hot_refused_fraction": 0.01, "cool_refused_fraction": 0.02}, "cool_refused_fraction=0.02"),
    ({"hot_refused_fraction": 1.0}, "hot_refused_fraction=1.0"),
    ({"hot_refused_fraction": 0.01, "cool_refused_fraction": 0.0}, "cool_refused_fraction=0.0"),
])
def test_refusal_knobs_are_validated_with_the_value_named(fields: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AutoscaleConfig(**fields)  # type: ignore[arg-type]
