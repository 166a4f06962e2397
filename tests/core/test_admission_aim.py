"""The learned admission aim (tidal_core/admission.py `TtftAim`): admission acts on a fraction of
the TTFT limit, learned from the first tokens of the requests it judged."""

from __future__ import annotations

import random

import numpy as np
import pytest

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from tidal_core import (
    AdmissionConfig,
    Regime,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    ServicePrior,
    preset,
)
from tidal_core.admission import TtftAim
from tidal_core.front_admission import FrontAdmission, Sighting, published_load


def test_a_miss_lowers_the_aim_and_a_first_token_in_time_raises_it_within_its_bounds() -> None:
    aim = TtftAim(AdmissionConfig(target_ttft_s=1.0, aim_gain=0.02, aim_tail=0.05, aim_floor=0.5))
    assert aim.value == 1.0
    aim.observe(1.2)  # missed the 1 s target
    assert aim.value == pytest.approx(1.0 - 0.02 * 0.95)
    aim.observe(0.4)  # in time
    assert aim.value == pytest.approx(1.0 - 0.02 * 0.95 + 0.02 * 0.05)
    for _ in range(200):
        aim.observe(5.0)
    assert aim.value == 0.5  # the floor
    for _ in range(5000):
        aim.observe(0.1)
    assert aim.value == 1.0  # never above the limit itself
    assert (aim.num_observed, aim.num_missed) == (5202, 201)


def test_without_a_gain_the_aim_stays_where_it_starts() -> None:
    aim = TtftAim(AdmissionConfig(aim_gain=0.0, aim_start=0.8))
    for ttft in (0.1, 3.0, 9.0):
        aim.observe(ttft)
    assert aim.value == 0.8


def test_the_aim_settles_where_about_its_tail_of_the_judged_requests_miss() -> None:
    """A unit whose TTFT lands around its aimed limit with a +-30% spread: the aim comes down
    until about `aim_tail` of the judged requests miss the target."""
    cfg = AdmissionConfig(target_ttft_s=1.0, aim_tail=0.05)
    aim, rng = TtftAim(cfg), random.Random(7)
    misses = []
    for i in range(20_000):
        ttft = aim.value * cfg.target_ttft_s * rng.uniform(0.7, 1.3)
        aim.observe(ttft)
        if i >= 10_000:
            misses.append(ttft > cfg.target_ttft_s)
    assert 0.03 <= sum(misses) / len(misses) <= 0.08
    assert 0.7 < aim.value < 0.85  # 1 / 1.3 = 0.77 would let none miss


@pytest.mark.parametrize(("field", "value", "message"), [
    ("aim_gain", -0.1, "aim_gain"), ("aim_gain", 0.5, "aim_gain"), ("aim_tail", 0.0, "aim_tail"),
    ("aim_tail", 0.5, "aim_tail"), ("aim_floor", 0.05, "aim_floor"), ("aim_start", 0.3, "aim_start"),
    ("aim_start", 1.1, "aim_start"),
])
def test_bad_aim_settings_fail_clearly(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdmissionConfig(**{field: value})  # type: ignore[arg-type]


def _unit(**admission: float) -> Scheduler:
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=64, max_num_batched_tokens=512, num_kv_blocks=4096,
                                             block_size=16, max_model_len=4096,
                                             service_prior=ServicePrior(0.05, 0.001, 0.001)),
                 admission=AdmissionConfig(target_ttft_s=1.0, max_queue_len=1000, **admission))  # type: ignore[arg-type]
    return Scheduler(cfg)


def test_only_requests_admitted_with_work_ahead_teach_the_aim() -> None:
    unit = _unit()
    first = Request("first", 300, SamplingParams(), 0.0)
    second = Request("second", 300, SamplingParams(), 0.0)
    assert unit.add_request(first, 0.0) is None and unit.add_request(second, 0.0) is None
    assert (first.admitted_ahead, second.admitted_ahead) == (False, True)
    unit.predictor.on_first_token(first, 3.0)  # late, but admission did not judge it: nothing ahead
    assert unit.admission.aim.num_observed == 0 and unit.admission.aim.value == 1.0
    unit.predictor.on_first_token(second, 3.0)  # judged, and late
    assert unit.admission.aim.num_missed == 1 and unit.admission.aim.value < 1.0


def test_the_aimed_limit_is_what_the_unit_refuses_past_and_what_it_publishes() -> None:
    unit, lowered = _unit(aim_start=1.0), _unit(aim_start=1.0)
    for sched in (unit, lowered):  # the next 100-token arrival is predicted at 0.8 s
        for i in range(2):
            assert sched.add_request(Request(f"r{i}", 300, SamplingParams(), 0.0), 0.0) is None
    assert unit.add_request(Request("fits", 100, SamplingParams(), 0.0), 0.0) is None  # under 1 s
    lowered.admission.aim.value = 0.5  # as if misses had taught it
    rejection = lowered.add_request(Request("late", 100, SamplingParams(), 0.0), 0.0)
    assert rejection is not None and rejection.reason == "prefill_backlog"
    load = published_load(lowered, 0.0, "u")
    assert load.regime is not Regime.OVERLOAD and load.ttft_limit_s == pytest.approx(0.5)
    # The front end refuses past the unit's published (aimed) limit, not its own config's.
    front = FrontAdmission(lowered.config.admission)
    assert front.check([Sighting(load, 0.0)], 0.0, prompt_tokens=100) is not None
    assert published_load(unit, 0.0, "u").ttft_limit_s == pytest.approx(1.0)


def test_on_the_simulator_the_aim_keeps_the_admitted_within_the_target_at_the_same_admissions() -> None:
    """Steady overload (about twice one A100 70B unit's capacity, prompts 80-600 tokens): with the
    aim at the target itself 4.5% of the admitted miss the 1 s TTFT; learned, 3.7%, admitting as
    many (the queue is shorter, not the throughput lower). (Before deferred prefill made the
    prediction closer, 7.5% missed with the aim at the target.)"""
    cost = CostModel.load("a100-llama70b-tp8")
    rng = np.random.default_rng(0)
    arrival = np.cumsum(rng.exponential(1 / 8.0, 2000))
    arrival = arrival[arrival < 120.0]
    n = arrival.size
    trace = Trace("overload", arrival, rng.integers(80, 600, n), rng.integers(16, 256, n), duration_s=180.0)
    within, admitted = {}, {}
    for gain in ("0", "0.02"):
        run = run_policy(RunSpec(trace, unit_config(cost), cost, Slo(), overrides={"admission.aim_gain": gain}),
                         "adaptive", progress=False)
        ttft = run.run.outcomes.ttft_s[np.isfinite(run.run.outcomes.ttft_s)]
        within[gain], admitted[gain] = float(np.mean(ttft <= 1.0)), ttft.size
    assert within["0.02"] >= 0.96 and within["0.02"] - within["0"] >= 0.005, within
    assert abs(admitted["0.02"] - admitted["0"]) <= 0.02 * admitted["0"], admitted


def test_without_the_ttft_rule_nothing_teaches_the_aim() -> None:
    """In "protect" mode (a dev server) admission never refuses for TTFT: nothing it admits
    was judged by that rule, however much work was ahead."""
    unit = _unit(mode="protect")  # type: ignore[arg-type]
    first, second = Request("first", 300, SamplingParams(), 0.0), Request("second", 300, SamplingParams(), 0.0)
    assert unit.add_request(first, 0.0) is None and unit.add_request(second, 0.0) is None
    assert not second.admitted_ahead
    unit.predictor.on_first_token(second, 3.0)
    assert unit.admission.aim.num_observed == 0 and unit.admission.limit_s(Regime.OVERLOAD) == 0.0
