"""The step limits on their own: the running cap and the prefill allowance a step gets."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tidal_core import AdmissionConfig, FinishReason, Regime, Request, SamplingParams, SchedulerConfig, ServicePrior
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


NOW = 1.0


def _slot_bound(max_batch_size: int, gain: float = 0.1, tail: float = 0.25, arrivals: int = 5000,
                defer: bool = False) -> StepLimits:
    """Limits of a unit in OVERLOAD whose `max_batch_size` requests all run while "old" and one
    more prompt wait, `arrivals` requests having arrived in the last second."""
    sizing = dataclasses.replace(SIZING, slot_gain=gain, slot_tail=tail, defer=defer, pressure_fraction=10.0)
    limits = _decoding(_limits(admission=TPOT, step_sizing=sizing, max_batch_size=max_batch_size))
    for i in range(max_batch_size):
        req = Request(f"run{i}", 100, SamplingParams(max_tokens=8), arrival_s=0.0)
        limits.queues.enqueue(req)
        limits.queues.waiting.rotate(1)  # the new request is the head that starts; "old" waits on
        limits.queues.start_prefill(req, 0.0)
    limits.queues.enqueue(Request("new", 100, SamplingParams(max_tokens=8), arrival_s=0.0))
    for i in range(arrivals):
        limits.load.on_arrival(NOW * i / arrivals, 100, 8)
    limits.regime.regime = Regime.OVERLOAD
    assert limits.sizer is not None
    limits.sizer.repay_s = 0.08  # decode steps measured 20 ms against the 100 ms aim: the TPOT target is slack
    return limits


def test_overload_with_the_batch_full_and_prompts_waiting_lowers_the_prefill_cap() -> None:
    limits = _slot_bound(2)
    assert limits.load.overload(NOW)[0] >= 1.5  # far over capacity: which requests are refused matters
    assert limits.queues.num_running == 2 and len(limits.queues.waiting) == 2 and limits.slot_cap == 4096
    assert limits.prefill_allowance(NOW, 1) == pytest.approx(790, abs=2)  # the cap is not below the sizer's yet
    assert limits.slot_cap == pytest.approx(4096 * (1 - 0.1 * 0.75))
    for _ in range(40):
        limits.prefill_allowance(NOW, 1)
    assert limits.slot_cap == pytest.approx(4096 * (1 - 0.1 * 0.75) ** 41)
    cap = limits.slot_cap
    assert limits.prefill_allowance(NOW, 1) == cap < 790  # now it bounds the step
    for _ in range(100):
        limits.prefill_allowance(NOW, 1)
    assert limits.slot_cap == 64  # the floor: the queue's prefill never stops
    limits.regime.regime = Regime.STEADY
    assert limits.prefill_allowance(NOW, 1) == pytest.approx(790, abs=2)  # applied in OVERLOAD only
    assert limits.slot_cap == 64  # and learned there only


def test_a_full_batch_keeps_the_prefill_cap_where_the_tpot_target_binds_or_the_overload_is_mild() -> None:
    binding = _slot_bound(2)
    assert binding.sizer is not None
    binding.sizer.repay_s = 0.04  # steps at 60 ms of the 100 ms aim: the target binds, not the slots
    mild = _slot_bound(2, arrivals=0)  # nothing arrived lately: the load is not over 1.5
    assert mild.load.overload(NOW)[0] < 1.5
    for limits in (binding, mild):
        for _ in range(50):
            limits.prefill_allowance(NOW, 1)
        assert limits.slot_cap == 4096


def test_a_free_slot_and_a_cut_step_raise_the_prefill_cap_up_to_the_token_budget() -> None:
    limits = _slot_bound(3)
    limits.slot_cap = 100.0
    limits.queues.remove(limits.queues.prefilling["run0"], FinishReason.ABORT, 0.0)  # a slot frees
    assert limits.prefill_allowance(NOW, 1, wanted=4000) == 100  # the cap cut the prompts' 400 tokens
    assert limits.slot_cap == pytest.approx(100 * (1 + 0.1 * 0.25))
    before = limits.slot_cap
    limits.prefill_allowance(NOW, 1, wanted=50)  # the budget, not the allowance, held the step back
    assert limits.slot_cap == before
    for _ in range(200):
        limits.prefill_allowance(NOW, 1, wanted=4000)
    assert 400 < limits.slot_cap <= 400 * 1.025  # it rose until the prompts' 400 tokens fitted, and stopped
    limits.queues.enqueue(Request("long", 6000, SamplingParams(max_tokens=8), arrival_s=0.0))
    for _ in range(2000):
        limits.prefill_allowance(NOW, 1, wanted=4000)
    assert limits.slot_cap == 4096  # cut by the sizer's 790 tokens now: up to max_num_batched_tokens, no further


def test_a_step_the_prefill_cap_holds_is_not_deferred() -> None:
    # Deferring banks the decodes' time for a bigger chunk later; under the learned cap the next
    # chunk is no bigger, so a decode-only step would only pay a step's fixed cost for nothing.
    def unit(regime: Regime) -> StepLimits:
        limits = _slot_bound(3, gain=0.0, defer=True)  # the deferral on, as shipped
        limits.slot_cap = 300.0
        for i in range(3):  # the slots are free
            limits.queues.remove(limits.queues.prefilling[f"run{i}"], FinishReason.ABORT, 0.0)
        limits.queues.enqueue(Request("long", 6000, SamplingParams(max_tokens=8), arrival_s=0.0))
        limits.queues.waiting.rotate(1)  # the long prompt is the head
        limits.regime.regime = regime
        return limits

    steady = unit(Regime.STEADY)
    assert steady.prefill_allowance(NOW, 1, wanted=4000) == 0 and steady.deferred  # the banks grow the chunk
    capped = unit(Regime.OVERLOAD)
    assert capped.prefill_allowance(NOW, 1, wanted=4000) == 300 and not capped.deferred


def test_without_slot_gain_the_prefill_cap_never_moves() -> None:
    limits = _slot_bound(2, gain=0.0)
    for _ in range(50):
        limits.prefill_allowance(NOW, 1)
    assert limits.slot_cap == 4096


@pytest.mark.parametrize("field, value", [("slot_gain", -0.1), ("slot_gain", 0.2), ("slot_tail", 0.0),
                                          ("slot_tail", 0.5), ("slot_min_load", 0.9)])
def test_slot_learning_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"step_sizing.{field}"):
        Sizing(**{field: value})  # type: ignore[arg-type]
