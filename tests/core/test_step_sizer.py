"""The step sizer on its own: per-decode TPOT banks, the prefill allowance, the batch cap."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_core import ServicePrior, StepSizingConfig
from tidal_core.load import ServiceModel
from tidal_core.step_sizer import UNLIMITED, StepSizer, _past_this_step, remaining_quantiles

# 20 ms per step, 1 ms per decode, 0.1 ms per prefill token, no fixed prefill cost.
SVC = ServiceModel(ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001,
                                prefill_step_s=0.0))
CFG = StepSizingConfig(headroom=1.0, decode_share=0.9, max_bank_steps=50.0)


def test_nothing_running_means_no_limit_and_no_bank() -> None:
    sizer = StepSizer(CFG, 0.1)
    assert sizer.prefill_allowance(SVC, 0) == UNLIMITED
    assert sizer.min_bank_s() == math.inf


def test_a_fresh_decode_allows_only_what_fits_one_aim() -> None:
    sizer = StepSizer(CFG, 0.1)
    sizer.on_decode_start("a")
    # aim 100 ms - (20 ms + 1 decode x 1 ms) = 79 ms of prefill = 790 tokens.
    assert sizer.prefill_allowance(SVC, 1) == pytest.approx(790, abs=1)


def test_fast_steps_bank_time_and_a_slow_one_spends_it() -> None:
    sizer = StepSizer(CFG, 0.1, now=0.0)
    sizer.on_decode_start("a")
    now = 0.0
    for _ in range(4):  # four 40 ms steps: 60 ms under the aim each
        now += 0.040
        sizer.on_step_done(now, 1)
    assert sizer.bank_s("a") == pytest.approx(0.240)
    assert sizer.prefill_allowance(SVC, 1) == pytest.approx(790 + 2400, abs=2)
    now += 0.300  # a long step: 200 ms over the aim
    sizer.on_step_done(now, 1)
    assert sizer.bank_s("a") == pytest.approx(0.040)
    # a's mean time per token stays under the aim: 5 tokens in 0.46 s
    assert (now - 0.0) / 5 <= 0.1


def test_the_poorest_decode_sets_the_allowance() -> None:
    sizer = StepSizer(CFG, 0.1, now=0.0)
    sizer.on_decode_start("old")
    sizer.on_step_done(0.05, 1)
    sizer.on_step_done(0.10, 1)
    sizer.on_decode_start("new")  # empty bank while "old" holds 100 ms
    assert sizer.min_bank_s() == pytest.approx(0.0)
    sizer.on_decode_end("new")
    assert sizer.min_bank_s() == pytest.approx(0.100)
    sizer.on_decode_end("old")
    assert sizer.min_bank_s() == math.inf


def test_an_overdrawn_decode_blocks_prefill_until_it_recovers() -> None:
    sizer = StepSizer(CFG, 0.1, now=0.0)
    sizer.on_decode_start("a")
    sizer.on_step_done(0.5, 1)  # 400 ms over
    assert sizer.prefill_allowance(SVC, 1) == 0


def test_the_bank_is_capped() -> None:
    sizer = StepSizer(StepSizingConfig(headroom=1.0, max_bank_steps=2.0), 0.1, now=0.0)
    sizer.on_decode_start("a")
    now = 0.0
    for _ in range(100):
        now += 0.021
        sizer.on_step_done(now, 1)
    # bank ~7.9 s, but a step may spend at most 2 aims of it: (0.1 + 0.2 - 0.021) / 0.1 ms
    assert sizer.prefill_allowance(SVC, 1) == pytest.approx(2790, abs=2)


def test_the_batch_cap_leaves_room_under_the_aim() -> None:
    sizer = StepSizer(CFG, 0.1)
    # 0.9 x 100 ms - 20 ms overhead = 70 ms at 1 ms per decode
    assert sizer.max_running(SVC) == 70
    assert StepSizer(CFG, 0.01).max_running(SVC) == 1  # never below one


def test_borrow_tables_read_what_requests_went_on_to_produce() -> None:
    # outputs of 2, 11 and 101 tokens decode 1, 10 and 100 tokens after their first one
    table = remaining_quantiles([2, 11, 101], 0.0)
    assert table[0] == 1 and table[1] == 9 and table[10] == 90 and len(table) == 100
    assert remaining_quantiles([], 0.1) == ()


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 4), st.integers(1, 3000)), max_size=80),
       quantile=st.sampled_from([0.0, 0.01, 0.2, 0.5, 0.999]), less=st.integers(0, 1))
def test_the_borrow_table_is_each_tokens_quantile_of_what_the_survivors_had_left(lengths: list[int], quantile: float,
                                                                                 less: int) -> None:
    # The table is built a run per recorded length; read token by token, it is the definition.
    decoded = sorted(n - 1 for n in lengths)
    expected = []
    for k in range(decoded[-1] if decoded else 0):
        left = [d - k for d in decoded if d > k]
        expected.append(left[int(quantile * (len(left) - 1))] - less)
    assert remaining_quantiles(lengths, quantile, less) == tuple(expected)
    # The sizer's two tables come from one pass; a quantile of 0 lends nothing.
    borrow, pressure = _past_this_step(lengths, quantile, 0.5)
    assert borrow == (remaining_quantiles(lengths, quantile, 1) if quantile else ())
    assert pressure == remaining_quantiles(lengths, 0.5, 1)


def test_a_young_decode_borrows_against_what_requests_like_it_produce() -> None:
    sizer = StepSizer(StepSizingConfig(headroom=1.0, borrow_quantile=0.01, pressure_quantile=0.5), 0.1)
    for _ in range(16):
        sizer.on_finished(11)  # every request decodes 10 tokens after its first
    sizer.on_decode_start("a")
    # gain per decode-only step: 100 - 21 = 79 ms; 10 tokens to repay: 790 ms of credit,
    # so the step may hold (21 + 790 - 21) ms of prefill = 7900 tokens.
    assert sizer.prefill_allowance(SVC, 1) == pytest.approx(7900, abs=2)
    now = 0.0
    for _ in range(9):  # nine short steps later, one token left to borrow against
        now += 0.021
        sizer.on_step_done(now, 1)
    assert sizer.prefill_allowance(SVC, 1) == pytest.approx((9 * 0.079 + 0.079) / 0.0001, abs=2)


def test_pressure_borrows_more_than_the_plain_table() -> None:
    sizer = StepSizer(StepSizingConfig(headroom=1.0, borrow_quantile=0.01, pressure_quantile=0.6), 0.1)
    for n in range(16):
        sizer.on_finished(2 if n < 8 else 21)  # half decode 1 token after the first, half 20
    sizer.on_decode_start("a")
    normal = sizer.prefill_allowance(SVC, 1)
    pressed = sizer.prefill_allowance(SVC, 1, pressure=True)
    assert normal == 790  # the 1% quantile is the 1-token request: nothing to borrow
    assert pressed == pytest.approx(20 * 790, abs=2)  # the 60% quantile decodes 20 more tokens


def test_an_abort_closes_the_bank_but_teaches_no_length() -> None:
    sizer = StepSizer(CFG, 0.1)
    sizer.on_decode_start("a")
    sizer.on_request_end("a", None)
    assert sizer.bank_s("a") is None and sizer.prefill_allowance(SVC, 1) == UNLIMITED
    for _ in range(15):
        sizer.on_request_end("x", 11)
    assert sizer.borrow == ()  # 15 finished (the abort does not count): no table yet
    sizer.on_request_end("x", 11)
    assert len(sizer.borrow) == 10  # the 16th builds it: 10 decode tokens after the first


def test_the_tables_refresh_every_64_finishes_from_the_last_512() -> None:
    sizer = StepSizer(StepSizingConfig(borrow_quantile=0.01, pressure_quantile=0.5), 0.1)
    for _ in range(16):
        sizer.on_finished(11)
    for _ in range(47):
        sizer.on_finished(101)
    assert len(sizer.borrow) == 10  # 63 finished: still the table built at 16
    sizer.on_finished(101)
    # 64th: rebuilt, 1% quantile of 10/100 -> 10; the tables hold the tokens past this step (m - 1)
    assert len(sizer.borrow) == 100 and sizer.borrow[0] == 9
    assert sizer.pressure[0] == 99  # the median of 16 x 10 and 48 x 100 decode tokens, less this step's
    for _ in range(512):  # a whole window of short requests replaces every long one
        sizer.on_finished(3)
    assert sizer.borrow == (1, 0) and sizer.pressure == (1, 0)


def test_an_idle_gap_is_not_charged_to_the_next_decode_step() -> None:
    sizer = StepSizer(CFG, 0.1, now=0.0)
    sizer.on_step_done(5.0, 0)  # a prefill-only step after 5 s of idling
    sizer.on_decode_start("a")
    sizer.on_step_done(5.04, 1)
    assert sizer.bank_s("a") == pytest.approx(0.06) and sizer.decode_steps == 1


def test_decodes_without_a_bank_set_no_limit() -> None:
    sizer = StepSizer(CFG, 0.1)
    assert sizer.prefill_allowance(SVC, 8) == UNLIMITED  # e.g. batch decodes only: they keep no bank


def test_a_fixed_prefill_cost_comes_out_of_the_allowance() -> None:
    svc = ServiceModel(ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001,
                                    prefill_step_s=0.010))
    sizer = StepSizer(CFG, 0.1)
    sizer.on_decode_start("a")
    assert sizer.prefill_allowance(svc, 1) == pytest.approx(690, abs=1)  # (100 - 21 - 10) ms at 0.1 ms


def test_free_decodes_leave_the_batch_uncapped() -> None:
    svc = ServiceModel(ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.0))
    assert StepSizer(CFG, 0.1).max_running(svc) == UNLIMITED


def _young_decode_after(interval_s: float, steps: int) -> StepSizer:
    """A sizer whose decodes saw `steps` steps of `interval_s`, then a decode that just got its
    first token; every finished request decoded 10 tokens after its first (as above)."""
    sizer = StepSizer(StepSizingConfig(headroom=1.0, borrow_quantile=0.01, pressure_quantile=0.5, repay_steps=4.0,
                                       aim_gain=0.0), 0.1)
    for _ in range(16):
        sizer.on_finished(11)
    sizer.on_decode_start("old")
    now = 0.0
    for _ in range(steps):
        now += interval_s
        sizer.on_step_done(now, 1)
    sizer.on_decode_end("old")
    sizer.on_decode_start("young")
    return sizer


def test_in_overload_future_tokens_earn_what_steps_measurably_repaid() -> None:
    # Every step ran at the aim (a unit that fills each step): nothing was repaid, so in
    # OVERLOAD the young decode borrows nothing and the step may last one aim (790 tokens);
    # outside OVERLOAD it still borrows 9 tokens x the 79 ms a decode-only step would repay.
    full = _young_decode_after(0.100, 40)
    assert full.repay_s == pytest.approx(0.0, abs=1e-9)
    assert full.prefill_allowance(SVC, 1, overload=True) == pytest.approx(790, abs=1)
    assert full.prefill_allowance(SVC, 1) == pytest.approx(7900, abs=2)
    # Decode-only steps between bursts repaid the full 79 ms each: OVERLOAD borrows as much.
    idle = _young_decode_after(0.021, 40)
    assert idle.repay_s == pytest.approx(0.079, rel=1e-3)
    assert idle.prefill_allowance(SVC, 1, overload=True) == pytest.approx(7900, abs=2)
    # Half of that measured (60.5 ms steps): each further token is worth 39.5 ms.
    half = _young_decode_after(0.0605, 40)
    assert half.prefill_allowance(SVC, 1, overload=True) == pytest.approx((0.079 + 9 * 0.0395) / 0.0001, abs=3)


def _finish(sizer: StepSizer, rid: str, start_s: float, interval_s: float, steps: int) -> float:
    """`rid` decodes `steps` tokens at `interval_s` from `start_s` and finishes; returns the time."""
    sizer.on_step_done(start_s, 0)
    sizer.on_decode_start(rid)
    now = start_s
    for _ in range(steps):
        now += interval_s
        sizer.on_step_done(now, 1)
    sizer.on_request_end(rid, steps + 1)
    return now


def test_the_aim_falls_for_requests_that_finish_near_the_target_and_rises_for_others() -> None:
    cfg = StepSizingConfig(headroom=0.95, aim_gain=0.01, aim_band=0.02, aim_tail=0.01, aim_floor=0.8)
    sizer = StepSizer(cfg, 0.1)
    now = _finish(sizer, "near", 0.0, 0.099, 4)  # TPOT 99 ms: within 2% of the target
    assert sizer.aim_s == pytest.approx(0.1 * (0.95 - 0.01 * 0.99))
    _finish(sizer, "fast", now, 0.050, 4)  # TPOT 50 ms
    assert sizer.aim_s == pytest.approx(0.1 * (0.95 - 0.01 * 0.99 + 0.01 * 0.01))
    before = sizer.aim_s
    sizer.on_decode_start("gone")
    sizer.on_request_end("gone", None)  # an abort says nothing about TPOT
    assert sizer.aim_s == before


def test_the_learned_aim_stays_within_its_bounds_and_a_zero_gain_keeps_it_fixed() -> None:
    sizer = StepSizer(StepSizingConfig(headroom=0.95, aim_gain=0.05, aim_floor=0.8), 0.1)
    now = 0.0
    for i in range(100):
        now = _finish(sizer, f"slow{i}", now, 0.2, 2)
    assert sizer.aim_s == pytest.approx(0.08)
    for i in range(10_000):
        now = _finish(sizer, f"fast{i}", now, 0.01, 2)
    assert sizer.aim_s == pytest.approx(0.1)  # never past the target itself
    fixed = StepSizer(StepSizingConfig(headroom=0.95, aim_gain=0.0), 0.1)
    _finish(fixed, "slow", 0.0, 0.2, 2)
    assert fixed.aim_s == pytest.approx(0.095)


def test_a_learned_aim_needs_a_headroom_inside_its_bounds() -> None:
    with pytest.raises(ValueError, match=r"headroom=1\.2 must be in"):
        StepSizingConfig(headroom=1.2)
    assert StepSizingConfig(headroom=1.2, aim_gain=0.0).headroom == 1.2
    with pytest.raises(ValueError, match=r"repay_steps=0\.5"):
        StepSizingConfig(repay_steps=0.5)


def _feed(sizer: StepSizer, lengths: list[int], interval_s: float, now: float = 0.0) -> float:
    """Requests of `lengths` tokens finish one after another at `interval_s` a token."""
    for i, n in enumerate(lengths):
        now = _finish(sizer, f"r{now}-{i}", now, interval_s, n - 1)
    return now


def test_requests_that_miss_the_target_make_the_unit_lend_less_until_it_holds_again() -> None:
    # Half the answers are 2 tokens, half 21: under TTFT pressure the 90% quantile lends a young
    # decode 19 tokens of credit. Three 2-token answers then miss the target (150 ms between tokens). A sizer
    # that learns its borrowing lends nothing to a young decode after them; one that does not
    # (borrow_gain 0) lends as before.
    def sizer(gain: float) -> StepSizer:
        return StepSizer(StepSizingConfig(headroom=1.0, aim_gain=0.0, borrow_quantile=0.01, pressure_quantile=0.9,
                                          borrow_gain=gain, borrow_tail=0.01), 0.1)

    learning, fixed = sizer(0.2), sizer(0.0)
    for s in (learning, fixed):
        now = _feed(s, [2] * 8 + [21] * 8, 0.05)  # every one on target: nothing to learn
        assert s.borrow_scale == 1.0
        s.on_decode_start("a")
        assert s.prefill_allowance(SVC, 1, pressure=True) == pytest.approx(20 * 790, abs=2)
        s.on_decode_end("a")
        now = _feed(s, [2] * 3, 0.15, now)
    assert fixed.borrow_scale == 1.0
    assert learning.borrow_scale == pytest.approx(1.0 - 3 * 0.2 * 0.99)
    for s in (learning, fixed):
        s.on_decode_start("a")
    assert fixed.prefill_allowance(SVC, 1, pressure=True) == pytest.approx(20 * 790, abs=2)
    assert learning.prefill_allowance(SVC, 1, pressure=True) == 790  # one aim: nothing borrowed
    # On target again, it lends again: up by gain x tail for each request that kept the target.
    learning.on_decode_end("a")
    _feed(learning, [2, 21] * 160, 0.05, now)
    assert learning.borrow_scale == 1.0
    learning.on_decode_start("a")
    assert learning.prefill_allowance(SVC, 1, pressure=True) == pytest.approx(20 * 790, abs=2)


def test_the_borrow_scale_stays_within_zero_and_one_and_its_settings_are_checked() -> None:
    sizer = StepSizer(StepSizingConfig(borrow_gain=0.2, borrow_tail=0.01), 0.1)
    _feed(sizer, [5] * 10, 0.3)
    assert sizer.borrow_scale == 0.0
    with pytest.raises(ValueError, match=r"borrow_gain=0\.3 must be in"):
        StepSizingConfig(borrow_gain=0.3)
    with pytest.raises(ValueError, match=r"borrow_tail=0\.0 must be in"):
        StepSizingConfig(borrow_tail=0.0)
