"""The TTFT predictor on its own: the step model draining the backlog as decodes grow, the measured
prefill speed, batch slots, its error."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from tidal_core import Request, SamplingParams, ServicePrior
from tidal_core.load import LoadEstimator
from tidal_core.predictor import TtftPredictor

PRIOR = ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001, prefill_step_s=0.0)


def _predictor() -> TtftPredictor:
    return TtftPredictor(LoadEstimator(10.0, PRIOR, 64, 100_000))


def test_before_any_measurement_the_step_model_drains_the_backlog() -> None:
    p = _predictor()
    # 2000 tokens in steps of 1000 less the 4 decodes: each token pays 0.1 ms and its share of a
    # step's fixed 24 ms (20 ms + 4 decodes x 1 ms) spread over the step's 996 prompt tokens
    assert p.predict(0.0, 2000, 4, 0, 1000) == pytest.approx(2000 * (0.024 / 996 + 0.0001))
    assert p.predict(0.0, 0, 4, 0, 1000) == 0.0


def _integral(tokens: int, d0: float, d1: float, budget: int, aim_s: float | None = None) -> float:
    """The same drain, integrated finely: the step holds more decodes as the backlog drains."""
    n, total = 10_000, 0.0
    for j in range(n):
        d = d0 + (d1 - d0) * (j + 0.5) / n
        per_step = budget - d if aim_s is None else min(budget - d, (aim_s - 0.020 - 0.001 * d) / 0.0001)
        total += (0.020 + 0.001 * d) / per_step + 0.0001
    return tokens * total / n


def test_the_decodes_the_backlog_will_start_slow_its_drain() -> None:
    p = _predictor()
    # 40 prompts ahead will each start decoding when their prefill finishes: the later steps
    # hold up to 44 decodes, each costing 1 ms of every step, with fewer prompt tokens beside them.
    steady = p.predict(0.0, 8000, 4, 0, 1000)
    growing = p.predict(0.0, 8000, 4, 0, 1000, decodes_after=44)
    assert growing > steady
    assert growing == pytest.approx(_integral(8000, 4, 44, 1000), rel=0.01)


def test_under_the_step_sizer_a_step_holds_what_fits_its_aim() -> None:
    p = _predictor()
    # A 50 ms aim with 4 decodes leaves (50 - 20 - 4) ms for prompt tokens: 260 a step, not 996.
    assert p.predict(0.0, 2000, 4, 0, 1000, aim_s=0.05) == pytest.approx(2000 * (0.024 / 260 + 0.0001))
    assert p.predict(0.0, 2000, 4, 0, 1000, decodes_after=20, aim_s=0.05) == pytest.approx(
        _integral(2000, 4, 20, 1000, aim_s=0.05), rel=0.01)


def test_a_measured_prefill_speed_counts_when_it_is_slower_than_the_model() -> None:
    p = _predictor()
    for i in range(20):  # 5000 tokens/s measured while prompts were queued
        p.load.prefill.on_step(0.1 * (i + 1), 0.1, 500)
    assert p.predict(2.0, 1000, 4, 0, 1000) == pytest.approx(0.2)  # the model says 0.124 s
    fast = _predictor()
    for i in range(20):  # 50,000 tokens/s: measured with fewer decodes than the steps ahead will hold
        fast.load.prefill.on_step(0.1 * (i + 1), 0.1, 5000)
    assert fast.predict(2.0, 1000, 4, 0, 1000) == pytest.approx(1000 * (0.024 / 996 + 0.0001))


def test_a_full_batch_adds_the_wait_for_slots() -> None:
    p = _predictor()
    for i in range(50):
        p.load.on_finish(0.1 * i, 10)
    rate = p.load.departure_rate(5.0)
    assert p.predict(5.0, 0, 64, 3, 1000) == pytest.approx(3 / rate)


def test_the_slot_wait_and_the_backlog_overlap() -> None:
    # The prompts ahead prefill while the queue waits for slots: the longer wait rules, and the
    # request's own prefill follows its slot.
    p = _predictor()
    backlog = p.predict(0.0, 8000, 64, 0, 1000)
    assert p.predict(0.0, 8000, 64, 5, 1000, slot_s=0.01) == pytest.approx(backlog)  # slots free first
    assert p.predict(0.0, 8000, 64, 5, 1000, slot_s=0.01, own_s=backlog) == pytest.approx(0.01 + backlog)
    assert p.predict(0.0, 8000, 64, 5, 1000, slot_s=2.0, own_s=0.1) == pytest.approx(2.1)  # the slot rules
    assert p.predict(0.0, 8000, 64, 0, 1000, slot_s=2.0, own_s=0.1) == pytest.approx(backlog)  # no slot short


def test_prompts_short_of_a_slot_prefill_after_the_first_frees() -> None:
    # The first queued prompt short of a slot starts at 1 s; the 6,000 tokens from it on (of the
    # 8,000) prefill behind it, past the new request's own slot at 1.2 s.
    p = _predictor()
    backlog = p.predict(0.0, 8000, 64, 0, 1000)
    assert p.predict(0.0, 8000, 64, 5, 1000, slot_s=1.2, own_s=0.05, first_slot_s=1.0, slot_tokens=6000) == \
        pytest.approx(1.0 + 0.75 * backlog)
    assert p.predict(0.0, 8000, 64, 5, 1000, slot_s=1.2, own_s=0.05, first_slot_s=0.01, slot_tokens=6000) == \
        pytest.approx(max(backlog, 1.25))  # slots free early: the backlog or the own slot rules


def test_the_first_slot_forecast_is_asked_for_only_where_it_could_rule() -> None:
    p = _predictor()
    for _ in range(50):
        p.observe(1.0, 0.5, 0.5, 1.0)  # a correction other than 1, so both bounds are checked
    calls: list[float] = []

    def forecast(value: float) -> Callable[[], float]:
        def wait_s() -> float:
            calls.append(value)
            return value
        return wait_s

    def pair(slot_s: float, first: float | Callable[[], float], bound_s: float = math.inf,
             reads_alike: Callable[[float, float], bool] | None = None) -> tuple[float, float]:
        return p.predict_pair(1.0, 8000, 64, 5, 1000, slot_s=slot_s, own_s=0.05, slot_tokens=6000, first_slot_s=first,
                              first_slot_bound_s=bound_s, reads_alike=reads_alike)

    assert pair(1.2, forecast(1.0), 3.0) == pair(1.2, 1.0) and calls == [1.0]  # the bound could rule: asked for
    assert pair(100.0, forecast(1.0), 3.0) == pair(100.0, 1.0) and calls == [1.0]  # a deep queue's own slot rules
    assert pair(1.2, forecast(1.0), 1.0) == pair(1.2, 1.0) and calls == [1.0, 1.0]  # an exact bound that could rule

    # A reader of marks: asked for only where the bounds read differently.
    read: list[tuple[float, float]] = []

    def alike(lo: float, hi: float) -> bool:
        read.append((lo, hi))
        return True

    low = pair(1.2, forecast(2.0), 3.0, alike)
    assert calls == [1.0, 1.0] and low == p.predict_pair(1.0, 8000, 64, 5, 1000, slot_s=1.2, own_s=0.05)  # lower bounds
    assert read[0][0] == low[1] < read[0][1]
    assert pair(1.2, forecast(2.0), 3.0, lambda lo, hi: False) == pair(1.2, 2.0) and calls == [1.0, 1.0, 2.0]


def test_the_correction_scales_the_prefill_not_the_slot_wait() -> None:
    p = _predictor()
    for _ in range(200):  # the model keeps predicting half of what is measured
        p.observe(1.0, 0.5, 0.5, 1.0)
    raw, corrected = p.predict_pair(1.0, 1000, 64, 3, 1000, slot_s=2.0, own_s=0.1)
    assert raw == pytest.approx(2.1)
    assert corrected == pytest.approx(2.0 + 0.1 * p.load.ttft_correction.factor(1.0))


def test_the_error_is_kept_and_trains_the_correction() -> None:
    p = _predictor()
    assert p.observe(1.0, raw_predicted_s=0.5, predicted_s=0.5, measured_s=1.0) == pytest.approx(0.5)
    assert p.observe(1.0, raw_predicted_s=0.5, predicted_s=None, measured_s=1.0) is None
    assert p.num_observed == 1
    for _ in range(200):  # the model keeps predicting half of what is measured
        p.observe(1.0, 0.5, 0.5, 1.0)
    assert p.load.ttft_correction.factor(1.0) == pytest.approx(2.0, rel=0.05)
    assert p.predict(1.0, 1000, 0, 0, 1000, corrected=True) == pytest.approx(
        2.0 * p.predict(1.0, 1000, 0, 0, 1000, corrected=False), rel=0.05)


def test_a_first_token_stamps_the_request_and_trains_on_the_raw_prediction() -> None:
    p = _predictor()
    req = Request("a", 100, SamplingParams(max_tokens=4), arrival_s=0.0)
    req.raw_predicted_ttft_s, req.predicted_ttft_s = 0.5, 0.8  # the model's, and the corrected one admission used
    p.on_first_token(req, 1.0)
    assert req.first_token_s == 1.0
    assert req.ttft_prediction_ratio == pytest.approx(0.8)  # the error of what admission acted on
    assert p.num_observed == 1 and p.ratio_sum == pytest.approx(0.8)
    assert p.load.ttft_correction.factor(1.0) == pytest.approx(2.0)  # measured / raw, not / corrected (1.25)


def test_a_request_without_a_prediction_is_stamped_but_teaches_nothing() -> None:
    p = _predictor()
    req = Request("b", 100, SamplingParams(max_tokens=4), arrival_s=0.0)  # e.g. batch work: never predicted
    p.on_first_token(req, 3.0)
    assert req.first_token_s == 3.0 and req.ttft_prediction_ratio is None
    assert p.num_observed == 0 and p.load.ttft_correction.factor(3.0) == 1.0


def test_a_stale_prefill_measurement_falls_back_to_the_model() -> None:
    p = _predictor()
    for i in range(20):  # 5000 tokens/s measured, far faster than the model's 1000 per 0.124 s
        p.load.prefill.on_step(0.1 * (i + 1), 0.1, 500)
    model = 1000 * (0.024 / 996 + 0.0001)  # 1000 tokens in steps of 996 beside 4 decodes
    assert p.predict(2.0, 1000, 4, 0, 1000) == pytest.approx(0.2)
    assert p.predict(2.0 + 31.0, 1000, 4, 0, 1000) == pytest.approx(model)  # older than 3 x tau (10 s)


def test_free_slots_add_no_wait() -> None:
    p = _predictor()
    assert p.predict(0.0, 0, 4, 0, 1000) == 0.0
    assert p.predict(0.0, 0, 4, -5, 1000) == 0.0  # more room than requests waiting
    assert p.predict(0.0, 0, 4, 1, 1000) == pytest.approx(1 / p.load.departure_rate(0.0))
