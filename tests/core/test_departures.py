"""The slot wait of a full running batch (core/departures.py): forecast from where each running
request is in its output, so a young batch (a burst's, started together) is not promised the
slots a steady one would free."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import FakeExecutor
from tidal_core import AdmissionConfig, Request, Run, SamplingParams, Scheduler, SchedulerConfig, ServicePrior, preset
from tidal_core.departures import DepartureForecast, steps_until
from tidal_core.load import LENGTHS_KEPT, MIN_FINISHED, OutputLengths


def test_lengths_wait_for_enough_finishes_then_keep_the_latest() -> None:
    lengths = OutputLengths()
    for n in range(1, MIN_FINISHED):
        lengths.on_finish(n)
    assert lengths.sorted is None  # too few to stand for a distribution
    lengths.on_finish(MIN_FINISHED)
    assert lengths.sorted == list(range(1, MIN_FINISHED + 1))
    for n in range(MIN_FINISHED + 1, 2000 + 1):
        lengths.on_finish(n)
    assert lengths.sorted == list(range(2000 - LENGTHS_KEPT + 1, 2000 + 1))


def test_with_one_length_the_wait_is_what_the_running_requests_have_left() -> None:
    lengths = [128] * 32
    assert steps_until(1, [40] * 76, lengths) == 88  # a burst's batch, 40 tokens in: nothing leaves for 88 steps
    assert steps_until(2, [40, 100, 120], lengths) == 28
    assert steps_until(3, [40, 100, 120], lengths) == 88


def test_in_steady_state_the_forecast_is_the_departure_rate() -> None:
    # One request of each length 1..100 arrives every step: the running requests are every
    # (length, age) pair, and sum(min(s, length)) of them leave within s steps (100 a step).
    lengths = list(range(1, 101))
    produced = [k for n in lengths for k in range(n)]
    for j in (1, 50, 100, 150, 250, 700):
        expected = next(s for s in range(1, 101) if sum(min(s, n) for n in lengths) >= j)
        assert steps_until(j, produced, lengths) == expected
        assert abs(steps_until(j, produced, lengths) - j / 100) <= 1  # the departure rate's answer, within a step


def test_a_young_batch_waits_for_the_shortest_recorded_output() -> None:
    lengths = list(range(100, 301))  # every finished request produced 100-300 tokens
    # 76 requests 10 tokens in: within s steps each leaves with P = (s - 89) / 201, and one
    # departure is expected once 76 P >= 1, at s = 92 (the measured rate would say: at once)
    assert steps_until(1, [10] * 76, lengths) == 92
    assert steps_until(76, [10] * 76, lengths) == 290  # all of them: the longest
    assert steps_until(1, [500], lengths) == 1  # past every recorded length: about to leave


def _cohort(max_tokens: int | list[int], steps: int) -> tuple[Scheduler, float]:
    """A unit whose running cap (4) is held by four requests that arrived together, `steps`
    steps ago (each with its `max_tokens`, or all with one); no request has finished yet."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * 4
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=4, max_num_batched_tokens=512, num_kv_blocks=512,
                                             block_size=16, max_model_len=2048,
                                             service_prior=ServicePrior(0.005, 0.0001, 0.0002)),
                 admission=AdmissionConfig(target_ttft_s=1.0))
    s, ex, now = Scheduler(cfg), FakeExecutor(time_fn=lambda plan: 0.01), 0.0
    for i in range(4):
        assert s.add_request(Request(f"r{i}", 32, SamplingParams(max_tokens=lengths[i], ignore_eos=True), now),
                             now) is None
    for _ in range(steps):
        d = s.schedule(now)
        now += 0.01
        s.on_step_done(d.plan, ex.execute(d.plan), now)  # type: ignore[union-attr]
    assert s.num_running == 4 and not s.stats.finished
    return s, now


@pytest.mark.parametrize(("max_tokens", "admitted"), [(30, True), (200, False), (4000, False)])
def test_a_request_behind_a_young_full_batch_waits_for_it(max_tokens: int, admitted: bool) -> None:
    # 10 ms steps, the batch 5 tokens in: its first slot frees after max_tokens - 5 more steps
    # (200 -> 1.95 s, past the 1 s target; 4000 -> the 256-token guess, 2.5 s), or 0.25 s at 30.
    s, now = _cohort(max_tokens, 5)
    wait = s.predicted_queue_delay_s(now, corrected=False)  # the correction learned from the four first tokens
    assert wait == pytest.approx((min(max_tokens, 256) - 5) * 0.01, rel=0.01)
    assert (s.add_request(Request("late", 16, SamplingParams(), now), now) is None) is admitted


def test_once_requests_finish_their_lengths_drive_the_forecast() -> None:
    s, now = _cohort(4000, 5)
    for _ in range(MIN_FINISHED):
        s.load.on_finish(now, 12)  # what finished requests actually produced: 12 tokens each
    # the running requests are 5 tokens in and past no recorded length: 7 more steps
    assert s.predicted_queue_delay_s(now, corrected=False) == pytest.approx(7 * 0.01, rel=0.01)


def test_the_backlog_ahead_drains_while_the_queue_waits_for_its_slot() -> None:
    # One running request leaves in 0.05 s (10 tokens, 5 in), the others in 1.95 s. A 1,500-token
    # prompt takes the first slot and prefills while the next request waits for the second: that
    # request's TTFT is its own slot's wait plus its own prefill, not the backlog's drain on top.
    s, now = _cohort([10, 200, 200, 200], 5)
    assert s.add_request(Request("long", 1500, SamplingParams(max_tokens=8), now), now) is None
    backlog_s = s.load.service.drain_time(1500 + 16, 4, 4, 512)
    assert 0.1 < backlog_s < 1.9
    predicted = s.predicted_queue_delay_s(now, 16, corrected=False)
    assert predicted == pytest.approx(1.95 + s.view.alone_prefill_s(16), rel=0.02)
    assert predicted < 1.95 + backlog_s - 0.05


def test_behind_a_batch_that_leaves_at_once_the_backlog_drains_after_the_slots_free() -> None:
    # All four leave in 0.25 s: the 1,500-token prompt and the next request start together then,
    # and the next one's prompt is prefilled behind the long one.
    s, now = _cohort(30, 5)
    assert s.add_request(Request("long", 1500, SamplingParams(max_tokens=8), now), now) is None
    backlog_s = s.load.service.drain_time(1500 + 16, 4, 4, 512)
    assert s.predicted_queue_delay_s(now, 16, corrected=False) == pytest.approx(0.25 + backlog_s, rel=0.02)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([4, 16, 48]), finished=st.booleans())
def test_the_bounds_that_spare_the_forecast_never_change_a_reading(seed: int, cap: int, finished: bool) -> None:
    # A unit kept past its running cap (a queue short of slots), with every request's length its
    # own: at every step the first slot's bound is at least the forecast (equal where it says one
    # step), and the regime reads the lazily formed delay ratio as it reads the exact one.
    rng = random.Random(seed)
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=cap, max_num_batched_tokens=512, num_kv_blocks=4096,
                                             block_size=16, max_model_len=4096,
                                             service_prior=ServicePrior(0.005, 0.0001, 0.0002)),
                 admission=AdmissionConfig(target_ttft_s=rng.choice([0.05, 0.5, 5.0]), max_queue_len=10**6))
    s, ex, now, n = Scheduler(cfg), FakeExecutor(), 0.0, 0
    if finished:  # a recorded distribution, else each request's guess
        for _ in range(MIN_FINISHED):
            s.load.on_finish(now, rng.randint(1, 120))
    checked = 0
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 1, 3])):
            s.add_request(Request(f"r{n}", rng.randint(8, 300), SamplingParams(max_tokens=rng.randint(1, 150),
                                                                                 ignore_eos=True), now), now)
            n += 1
        view = s.view
        fresh = DepartureForecast(view.queues, view.load, view.tpot)
        if s.num_running > 1:
            exact = DepartureForecast(view.queues, view.load, view.tpot).wait_s(now, 1)
            bound = fresh.first_wait_bound_s(now)
            assert bound >= exact
            assert fresh.wait_s(now, 1) == exact  # what the bound memoized
            checked += 1
        target = cfg.admission.target_ttft_s
        lazy, ratio = view.regime_delay_ratio(now), s.predicted_queue_delay_s(now) / target
        assert lazy <= ratio + 1e-12 and s.regime.target(1.0, lazy, 0.0) is s.regime.target(1.0, ratio, 0.0)
        d = s.schedule(now)
        now += 0.01
        if isinstance(d, Run):
            s.on_step_done(d.plan, ex.execute(d.plan), now)
    assert checked > 20
