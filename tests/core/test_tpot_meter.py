"""The measured time per output token, alone and as the scheduler's snapshot reports it."""

from __future__ import annotations

import pytest

from tidal_core import AdmissionConfig, SchedulerConfig, UnitLoad
from tidal_core.tpot_meter import TpotMeter


def test_the_interval_between_decode_steps_is_the_tpot() -> None:
    meter = TpotMeter(tau_s=30.0)
    assert meter.tpot_s(0.0) == 0.0
    t = 0.0
    for _ in range(50):
        t += 0.080
        meter.on_step_done(t, 10)
    assert meter.tpot_s(t) == pytest.approx(0.080)


def test_it_weights_by_tokens_and_counts_a_step_without_decodes_only_as_a_boundary() -> None:
    meter = TpotMeter(tau_s=1e6)  # no decay: plain token-weighted mean
    meter.on_step_done(0.0, 0)      # a prefill-only step: the first decode's interval starts here
    meter.on_step_done(0.050, 1)    # 1 token after 50 ms
    meter.on_step_done(0.150, 3)    # 3 tokens after 100 ms
    assert meter.tpot_s(0.150) == pytest.approx((0.050 + 3 * 0.100) / 4)
    meter.on_step_done(10.0, 0)     # no decodes: no token waited, nothing counted
    assert meter.tpot_s(10.0) == pytest.approx((0.050 + 3 * 0.100) / 4)


def test_recent_steps_outweigh_old_ones_and_a_stale_figure_is_dropped() -> None:
    meter = TpotMeter(tau_s=10.0)
    t = 0.0
    for _ in range(100):
        t += 0.050
        meter.on_step_done(t, 4)
    for _ in range(600):  # 60 s of 100 ms steps: six time constants
        t += 0.100
        meter.on_step_done(t, 4)
    assert meter.tpot_s(t) == pytest.approx(0.100, rel=0.01)
    assert meter.tpot_s(t + 29.0) > 0.0
    assert meter.tpot_s(t + 31.0) == 0.0  # over 3 x tau without a decode step


def test_the_meter_rejects_a_nonpositive_time_constant() -> None:
    with pytest.raises(ValueError, match="tau_s=0"):
        TpotMeter(tau_s=0.0)


def test_the_snapshot_carries_the_measured_tpot_and_the_target_on_the_wire() -> None:
    from tidal_core import Scheduler

    cfg = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16,
                          max_model_len=512, admission=AdmissionConfig(target_tpot_s=0.1))
    sched = Scheduler(cfg)
    assert sched.snapshot(0.0).tpot_s == 0.0
    assert sched.snapshot(0.0).target_tpot_s == pytest.approx(0.1)
    sched.tpot.on_step_done(1.0, 2)
    sched.tpot.on_step_done(1.07, 2)
    snap = sched.snapshot(1.07, "u")
    assert snap.tpot_s == pytest.approx(0.07)
    assert UnitLoad.from_stats("u", snap.to_stats()) == snap
