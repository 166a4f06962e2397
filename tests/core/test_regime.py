from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import OK, Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from tidal_core.config import RegimeConfig
from tidal_core.regime import Regime, RegimeDetector


def test_transitions_with_dwell() -> None:
    det = RegimeDetector(RegimeConfig(min_dwell_s=1.0))
    assert det.update(0.0, load=0.5, queue_delay_ratio=0.0, kv_usage=0.1) is Regime.LIGHT  # not confirmed yet
    assert det.update(0.5, 0.5, 0.0, 0.1) is Regime.LIGHT
    assert det.update(1.0, 0.5, 0.0, 0.1) is Regime.STEADY
    assert det.update(1.5, 1.2, 0.0, 0.1) is Regime.STEADY
    assert det.update(1.8, 0.5, 0.0, 0.1) is Regime.STEADY  # the burst broke off: confirmation restarts
    assert det.update(2.0, 1.2, 0.0, 0.1) is Regime.STEADY
    assert det.update(3.0, 1.2, 0.0, 0.1) is Regime.OVERLOAD
    # Below the enter mark but above the exit mark: stays overloaded (hysteresis).
    assert det.update(5.0, 0.9, 0.0, 0.1) is Regime.OVERLOAD
    det.update(6.0, 0.5, 0.0, 0.1)
    assert det.update(7.0, 0.5, 0.0, 0.1) is Regime.STEADY
    det.update(8.0, 0.1, 0.0, 0.1)
    assert det.update(9.0, 0.1, 0.0, 0.1) is Regime.LIGHT
    assert det.num_transitions == 4


@pytest.mark.parametrize("kv, qdr", [(0.96, 0.0), (0.2, 1.5)])
def test_kv_pressure_or_backlog_alone_means_overload(kv: float, qdr: float) -> None:
    det = RegimeDetector(RegimeConfig(min_dwell_s=0.0))
    assert det.update(1.0, 0.3, qdr, kv) is Regime.OVERLOAD
    assert det.update(2.0, 0.3, 0.0, 0.2) is Regime.STEADY


def test_stationary_noise_does_not_flap() -> None:
    """Noisy load hovering around every threshold: transitions stay rare."""
    rng = random.Random(7)
    cfg = RegimeConfig()
    for centre in (cfg.light_enter, (cfg.light_exit + cfg.overload_exit) / 2, cfg.overload_enter):
        det = RegimeDetector(cfg)
        t = 0.0
        for _ in range(10_000):  # 1000 s at 10 updates/s
            t += 0.1
            det.update(t, max(0.0, rng.gauss(centre, 0.04)), 0.0, 0.2)
        assert det.num_transitions <= 6, (centre, det.num_transitions)


@given(low=st.floats(0.0, 3.0), width=st.floats(0.0, 3.0), share=st.floats(0.0, 1.0), load=st.floats(0.0, 1.5),
       kv=st.floats(0.0, 1.0), regime=st.sampled_from(list(Regime)))
def test_delay_ratios_it_reads_alike_lead_to_the_same_regime(low: float, width: float, share: float, load: float,
                                                             kv: float, regime: Regime) -> None:
    # `reads_alike` lets the TTFT predictor stop at bounds (core/unit_view.py): any ratio between
    # bounds it reads alike must call for the regime either bound does, from every regime.
    det = RegimeDetector(RegimeConfig())
    det.regime = regime
    high = low + width
    if det.reads_alike(low, high):
        x = low + share * width
        assert det.target(load, x, kv) is det.target(load, low, kv) is det.target(load, high, kv)
    c = det.config
    assert det.reads_alike(0.0, c.queue_delay_exit / 2) and det.reads_alike(c.queue_delay_overload, 1e9)
    assert not det.reads_alike(c.queue_delay_exit / 2, c.queue_delay_exit)  # they straddle a mark
    assert not det.reads_alike(c.queue_delay_exit, c.queue_delay_overload)


def test_invalid_thresholds_are_rejected_with_the_value_named() -> None:
    with pytest.raises(ValueError, match="light_enter"):
        RegimeConfig(light_enter=0.5, light_exit=0.2)
    with pytest.raises(ValueError, match="overload"):
        RegimeConfig(overload_enter=0.5, overload_exit=0.9)


def test_refusals_for_the_work_ahead_alone_mean_overload_and_their_end_leaves_it() -> None:
    """A unit with GPU time to spare (load 0.6) that turns a third of its arrivals away for the work
    ahead of them is over what its SLO lets it serve; refusals of a request's own prompt do not
    count (they happen in OVERLOAD and would hold it there)."""
    cfg = RegimeConfig(min_dwell_s=0.0)
    det, own = RegimeDetector(cfg), RegimeDetector(cfg)
    t = 0.0
    for i in range(300):  # 30 s at 10 arrivals/s, one in three refused
        t += 0.1
        det.on_arrival(t, "prefill_backlog" if i % 3 == 0 else None)
        own.on_arrival(t, "prompt_over_target" if i % 3 == 0 else None)
        det.update(t, 0.6, 0.0, 0.2)
        own.update(t, 0.6, 0.0, 0.2)
    assert det.regime is Regime.OVERLOAD and det.refusals.fraction(t) == pytest.approx(1 / 3, abs=0.02)
    assert own.regime is Regime.STEADY and own.refusals.fraction(t) == 0.0
    # Every arrival admitted again: OVERLOAD holds until the share falls below the exit mark.
    left = None
    while left is None:
        t += 0.1
        det.on_arrival(t, None)
        if det.update(t, 0.6, 0.0, 0.2) is Regime.STEADY:
            left = t - 30.0
            assert det.refusals.fraction(t) < cfg.refused_exit
        else:
            assert det.refusals.fraction(t) >= cfg.refused_exit
    assert 0.5 * cfg.refused_tau_s < left < 2 * cfg.refused_tau_s  # about tau x ln(share / exit mark)


def test_a_unit_nothing_arrives_at_leaves_overload_after_one_time_constant() -> None:
    """The share of refusals does not decay without arrivals (both counts decay alike), and an idle
    unit is not overloaded: after `refused_tau_s` with no arrival it reads 0."""
    cfg = RegimeConfig(min_dwell_s=0.0)
    det = RegimeDetector(cfg)
    for i in range(100):  # a burst: 10 s, nine in ten refused
        det.on_arrival(i * 0.1, "prefill_backlog" if i % 10 else None)
        det.update(i * 0.1, 0.3, 0.0, 0.1)
    assert det.regime is Regime.OVERLOAD
    assert det.update(9.9 + 0.9 * cfg.refused_tau_s, 0.3, 0.0, 0.1) is Regime.OVERLOAD
    assert det.refusals.fraction(9.9 + 0.9 * cfg.refused_tau_s) == pytest.approx(0.9, abs=0.01)
    assert det.update(9.9 + 1.1 * cfg.refused_tau_s, 0.3, 0.0, 0.1) is Regime.STEADY


def test_refusal_marks_are_validated_and_above_one_turn_the_signal_off() -> None:
    with pytest.raises(ValueError, match="refused_exit"):
        RegimeConfig(refused_overload=0.1, refused_exit=0.2)
    with pytest.raises(ValueError, match="refused_tau_s"):
        RegimeConfig(refused_tau_s=0.0)
    det = RegimeDetector(RegimeConfig(min_dwell_s=0.0, refused_overload=1.01, refused_exit=1.01))
    for i in range(100):
        det.on_arrival(i * 0.1, "prefill_backlog")
        det.update(i * 0.1, 0.6, 0.0, 0.2)
    assert det.regime is Regime.STEADY


def test_on_the_simulator_bursts_of_long_prompts_below_capacity_call_for_overload() -> None:
    """One A100 70B TP8 unit, three requests at once every 5 s on average (0.6 req/s, GPU time to
    spare), 40% of the prompts 7,500-8,100 tokens (about 1.2 s of prefill alone against the 1 s
    target). The groups refuse each other (`prefill_backlog`) while the load reads below 1: with
    the refusals as a signal the unit is in OVERLOAD, refuses the prompts too slow even alone
    (`prompt_over_target`) instead of serving them late in the place of requests that could meet
    the target, and serves more within the SLO; with the signal off it rarely is."""
    cost = CostModel.load("a100-llama70b-tp8")
    rng = np.random.default_rng(3)
    groups = np.cumsum(rng.exponential(5.0, 200))
    arrival = np.repeat(groups[groups < 600.0], 3)
    n = arrival.size
    prompts = np.where(rng.random(n) < 0.4, rng.integers(7500, 8100, n), rng.integers(300, 2500, n))
    trace = Trace("groups", arrival, prompts, rng.integers(32, 400, n), duration_s=660.0)
    slo = Slo(1.0, 0.1)
    base = unit_config(cost, max_batch_size=128, max_num_batched_tokens=2048, max_model_len=8192)
    figures = {}
    for name, overrides in (("on", {}), ("off", {"regime.refused_overload": "1.01", "regime.refused_exit": "1.01"})):
        run = run_policy(RunSpec(trace, base, cost, slo, overrides=overrides), "adaptive", progress=False).run
        o = run.outcomes
        ok = o.status == OK
        late = int((ok & (np.nan_to_num(o.ttft_s, nan=np.inf) > slo.ttft_s)).sum())
        figures[name] = (int(o.meets_slo(slo).sum()), late, run.counters["rejected"].get("prompt_over_target", 0))
    (good_on, late_on, slow_on), (good_off, late_off, slow_off) = figures["on"], figures["off"]
    assert slow_off < 10 and slow_on > 30, figures
    assert late_on < 0.5 * late_off, figures
    assert good_on > 1.2 * good_off, figures
