"""The step limits on their own: the running cap and the prefill allowance a step gets."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tidal_core import AdmissionConfig, Regime, Request, SamplingParams, SchedulerConfig, ServicePrior
from tidal_core import StepSizingConfig as Sizing
from tidal_core.load import LoadEstimator
from tidal_core.queues import UnitQueues
from tidal_core.regime import RegimeDetector
from tidal_core.step_limits import StepLimits

# 20 ms per step, 1 ms per decode, 0.1 ms per prefill token: the sizer's cap at a 100 ms aim is
# (0.9 x 100 - 20) / 1 = 70 decodes, and a fresh decode allows 790 prefill tokens.
PRIOR = ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001, prefill_step_s=0.0)
TPOT = AdmissionConfig(target_ttft_s=1.0, target_tpot_s=0.1)
SIZING = Sizing(headroom=1.0, decode_share=0.9, borrow_quantile=0.01, pressure_quantile=0.6, pressure_fraction=0.5)


def _limits(**kw: object) -> StepLimits:
    fields: dict[str, object] = {"max_batch_size": 128, "max_num_batched_tokens": 4096, "service_prior": PRIOR, **kw}
    cfg = SchedulerConfig(**fields)  # type: ignore[arg-type]
    queues = UnitQueues(cfg)
    queues.enqueue(Request("old", 100, SamplingParams(max_tokens=8), arrival_s=0.0))
    return StepLimits(cfg, queues, LoadEstimator(10.0, PRIOR, cfg.max_batch_size, 10**6), RegimeDetector(cfg.regime))


def _decoding(limits: StepLimits) -> StepLimits:
    """Teach the sizer 16 output lengths (6 decode 1 token after the first, 10 decode 20: the 1%
    quantile borrows against 1 token, the 50% and 60% ones against 20) and start one decode."""
    assert limits.sizer is not None
    for n in range(16):
        limits.sizer.on_finished(2 if n < 6 else 21)
    limits.sizer.on_decode_start("a")
    return limits


def test_without_a_tpot_target_only_the_configured_caps_apply() -> None:
    plain = _limits()
    assert plain.sizer is None and plain.running_cap == 128 and plain.load.batch_cap == 128
    assert plain.prefill_allowance(0.0, 10) == math.inf and plain.room(100) == math.inf
    capped = _limits(max_prefill_tokens=300)
    assert capped.prefill_allowance(0.0, 10) == 300
    off = _limits(admission=TPOT, step_sizing=Sizing(enabled=False))
    assert off.sizer is None and off.running_cap == 128


def test_the_sizer_caps_the_running_batch_and_tells_the_load_estimate() -> None:
    limits = _limits(admission=TPOT, step_sizing=SIZING)
    assert limits.running_cap == 70 and limits.load.batch_cap == 70
    assert limits.room(65) == 5
    assert _limits(admission=TPOT, step_sizing=SIZING, max_batch_size=32).running_cap == 32  # still bounds it


def test_the_running_cap_follows_the_learned_step_model() -> None:
    limits = _limits(admission=TPOT, step_sizing=SIZING)
    for i in range(400):  # decodes measure 2 ms each, not 1: the model moves towards a cap of 35
        n = 16 if i % 2 else 64
        limits.load.on_step(0, n, 0.020 + 0.002 * n)
    assert limits.running_cap == 70  # not refreshed yet
    limits.on_step_done(1.0, 64)
    svc = limits.load.service
    assert limits.running_cap == int((0.9 * 0.1 - svc.overhead_s) / svc.decode_s_per_seq) < 50
    assert limits.load.batch_cap == limits.running_cap


def test_pressure_after_the_oldest_prompt_waited_half_the_ttft_target() -> None:
    limits = _decoding(_limits(admission=TPOT, step_sizing=SIZING))
    assert limits.prefill_allowance(0.49, 1) == pytest.approx(790, abs=2)  # 1% quantile: nothing to borrow
    assert limits.prefill_allowance(0.50, 1) == pytest.approx(20 * 790, abs=2)  # 60%: 20 more tokens


def _after_decode_steps(interval_s: float) -> StepLimits:
    """Limits whose sizer saw 40 decode steps of `interval_s` (one decode, since ended), then
    learned the lengths above and started a decode that just got its first token."""
    limits = _limits(admission=TPOT, step_sizing=dataclasses.replace(SIZING, repay_steps=4.0, aim_gain=0.0))
    assert limits.sizer is not None
    limits.sizer.on_decode_start("old")
    for i in range(40):
        limits.on_step_done((i + 1) * interval_s, 1)
    limits.sizer.on_decode_end("old")
    return _decoding(limits)


def test_overload_borrows_against_the_repayment_decode_steps_measurably_made() -> None:
    full = _after_decode_steps(0.100)  # every step ran at the aim: nothing was repaid
    assert full.prefill_allowance(0.9, 1) == pytest.approx(20 * 790, abs=2)  # pressure, not OVERLOAD
    full.regime.regime = Regime.OVERLOAD
    assert full.prefill_allowance(0.9, 1) == pytest.approx(790, abs=2)  # pressure borrows nothing here
    idle = _after_decode_steps(0.021)  # decode-only steps repaid the full 79 ms each
    idle.regime.regime = Regime.OVERLOAD
    assert idle.prefill_allowance(0.49, 1) == pytest.approx(790, abs=2)  # 1% quantile: nothing to borrow
    assert idle.prefill_allowance(0.9, 1) == pytest.approx(20 * 790, abs=2)  # TTFT pressure in OVERLOAD too


def test_the_prefill_cap_bounds_the_sizer_allowance() -> None:
    limits = _decoding(_limits(admission=TPOT, step_sizing=SIZING, max_prefill_tokens=500))
    assert limits.prefill_allowance(0.0, 1) == 500
