from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal_core.config import MICROWAIT_HARD_CAP_S, BatchingConfig
from tidal_core.microwait import BatchingPolicy, microwait_s
from tidal_core.regime import Regime

CFG = BatchingConfig(mode="adaptive", t_min_s=0.0005, t_max_s=0.003)


def test_seed_formula() -> None:
    assert microwait_s(CFG, load=0.10, num_waiting=1, max_batch_size=64) == 0.0  # light
    assert microwait_s(CFG, load=0.5, num_waiting=64, max_batch_size=64) == 0.0  # queue >= B_max
    assert microwait_s(CFG, load=0.5, num_waiting=1, max_batch_size=64) == pytest.approx(0.0015)
    assert microwait_s(CFG, load=0.95, num_waiting=1, max_batch_size=64) == pytest.approx(0.0005)  # t_min clamp
    assert microwait_s(CFG, load=0.15, num_waiting=1, max_batch_size=64) == pytest.approx(0.00255)


@given(st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.floats(-1.0, 3.0), st.integers(0, 200))
def test_hard_cap_holds_whatever_the_config(t_min: float, extra: float, load: float, waiting: int) -> None:
    cfg = BatchingConfig(mode="adaptive", t_min_s=t_min, t_max_s=t_min + extra)
    assert 0.0 <= microwait_s(cfg, load, waiting, 64) <= MICROWAIT_HARD_CAP_S


def _policy(**kw: object) -> BatchingPolicy:
    return BatchingPolicy(BatchingConfig(**kw), max_batch_size=8, max_num_batched_tokens=1024)  # type: ignore[arg-type]


def test_adaptive_waits_only_when_idle_and_steady() -> None:
    p = _policy(mode="adaptive")
    d = p.decide(now=10.0, oldest_arrival_s=10.0, num_waiting=1, waiting_prompt_tokens=50, has_running=False,
                 load=0.5, regime=Regime.STEADY)
    assert not d.admit and d.deadline_s == pytest.approx(10.0015) and d.reason == "microwait"
    later = p.decide(now=10.002, oldest_arrival_s=10.0, num_waiting=1, waiting_prompt_tokens=50,
                     has_running=False, load=0.5, regime=Regime.STEADY)
    assert later.admit and later.reason == "microwait_expired"
    # Running decodes are never stalled: new requests join the next step at once.
    assert p.decide(10.0, 10.0, 1, 50, True, 0.5, Regime.STEADY).reason == "join"
    assert p.decide(10.0, 10.0, 1, 50, False, 0.5, Regime.LIGHT).reason == "immediate"
    assert p.decide(10.0, 10.0, 1, 50, False, 0.5, Regime.OVERLOAD).reason == "immediate"
    # Pending prompt tokens already fill a step: aggregating more buys nothing.
    assert p.decide(10.0, 10.0, 2, 600, False, 0.5, Regime.STEADY).reason == "budget"
    assert p.decide(10.0, 10.0, 8, 50, False, 0.5, Regime.STEADY).reason == "full"


def test_fixed_wait_holds_new_prefills_for_the_delay() -> None:
    p = _policy(mode="fixed", fixed_wait_s=0.01)
    d = p.decide(1.0, 1.0, 1, 10, True, 0.0, Regime.LIGHT)
    assert not d.admit and d.deadline_s == pytest.approx(1.01)
    assert p.decide(1.011, 1.0, 1, 10, True, 0.0, Regime.LIGHT).reason == "wait_expired"
    assert p.decide(1.0, 1.0, 8, 10, True, 0.0, Regime.LIGHT).reason == "full"


def test_static_waits_for_full_batch_or_timeout_and_never_joins() -> None:
    p = _policy(mode="static", static_batch_size=4, static_timeout_s=0.2)
    assert p.decide(0.0, 0.0, 10, 10, True, 0.0, Regime.LIGHT).admit is False
    held = p.decide(0.1, 0.0, 2, 10, False, 0.0, Regime.LIGHT)
    assert not held.admit and held.deadline_s == pytest.approx(0.2)
    assert p.decide(0.1, 0.0, 4, 10, False, 0.0, Regime.LIGHT).reason == "full"
    assert p.decide(0.25, 0.0, 2, 10, False, 0.0, Regime.LIGHT).reason == "wait_expired"


def test_none_mode_launches_immediately() -> None:
    assert _policy(mode="none").decide(0.0, 0.0, 1, 1, False, 0.5, Regime.STEADY).reason == "immediate"
