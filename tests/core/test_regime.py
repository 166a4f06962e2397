from __future__ import annotations

import random

import pytest

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


def test_invalid_thresholds_are_rejected_with_the_value_named() -> None:
    with pytest.raises(ValueError, match="light_enter"):
        RegimeConfig(light_enter=0.5, light_exit=0.2)
    with pytest.raises(ValueError, match="overload"):
        RegimeConfig(overload_enter=0.5, overload_exit=0.9)
