"""Prompts too slow to meet the TTFT target even alone (tidal_core/admission.py, `prompt_over_target`):
served when the unit has room, refused while it is over capacity, judged by a lower bound of their
TTFT and the learned ratio of what such requests took against it (`AloneFit`)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import OK, Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from tests.helpers import FakeExecutor
from tidal_core import (
    AdmissionConfig,
    Regime,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    ServicePrior,
    StepSizingConfig,
    UnitLoad,
    preset,
)
from tidal_core.admission import AdmissionController, AloneFit
from tidal_core.front_admission import FrontAdmission, OnTheWay, Sighting, published_load
from tidal_core.load import ServiceModel
from tidal_core.plan import Run


def _unit(**admission: object) -> Scheduler:
    # 1 ms per prompt token and 50 ms per step of at most 512 tokens: the bound of a prompt of n
    # tokens alone is n x (1 ms + 50 ms / 512), each token with its share of a step's fixed cost.
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512, num_kv_blocks=256,
                                             block_size=16, max_model_len=4096,
                                             service_prior=ServicePrior(0.05, 0.001, 0.001)),
                 admission=AdmissionConfig(target_ttft_s=1.0, **admission))  # type: ignore[arg-type]
    return Scheduler(cfg)


def _overloaded(**admission: object) -> Scheduler:
    unit = _unit(**admission)
    unit.regime.regime = Regime.OVERLOAD  # as the detector calls it when arrivals pass capacity
    return unit


def test_in_overload_a_prompt_too_slow_even_alone_is_refused_with_a_retry_after() -> None:
    unit = _overloaded()
    rejection = unit.add_request(Request("long", 2000, SamplingParams(), 0.0), 0.0)  # ~2.2 s alone
    assert rejection is not None and rejection.reason == "prompt_over_target" and rejection.retryable
    cfg = unit.config.admission
    assert rejection.retry_after_s == pytest.approx(2.2, rel=0.05)  # its own time, within the clamp
    assert cfg.min_retry_after_s <= rejection.retry_after_s <= cfg.max_retry_after_s
    assert "over capacity" in rejection.message and unit.stats.rejected["prompt_over_target"] == 1
    # A prompt that fits the target alone is admitted in the same state.
    assert unit.add_request(Request("short", 600, SamplingParams(), 0.0), 0.0) is None


def test_outside_overload_or_with_the_rule_off_it_is_served() -> None:
    light = _unit()
    assert light.current_regime is not Regime.OVERLOAD
    assert light.add_request(Request("long", 2000, SamplingParams(), 0.0), 0.0) is None
    off = _overloaded(refuse_slow_prompts_in_overload=False)
    assert off.add_request(Request("long", 2000, SamplingParams(), 0.0), 0.0) is None


def test_the_bound_counts_the_time_already_spent_before_the_unit() -> None:
    # 700 tokens take ~0.8 s alone: in time when fresh, not after 0.5 s in the front end.
    fresh, late = _overloaded(), _overloaded()
    assert fresh.add_request(Request("x", 700, SamplingParams(), 10.0), 10.0) is None
    rejection = late.add_request(Request("x", 700, SamplingParams(), 9.5), 10.0)
    assert rejection is not None and rejection.reason == "prompt_over_target"


def test_with_work_ahead_the_backlog_rule_judges_as_before() -> None:
    unit = _overloaded()
    assert unit.add_request(Request("a", 500, SamplingParams(), 0.0), 0.0) is None
    rejection = unit.add_request(Request("b", 2000, SamplingParams(), 0.0), 0.0)
    assert rejection is not None and rejection.reason == "prefill_backlog"


def test_only_long_prompts_admitted_with_nothing_ahead_teach_the_fit_and_it_moves_the_verdict() -> None:
    unit = _unit()
    first = Request("first", 600, SamplingParams(), 0.0)
    second = Request("second", 200, SamplingParams(), 0.0)
    assert unit.add_request(first, 0.0) is None and unit.add_request(second, 0.0) is None
    assert first.alone_ttft_s == pytest.approx(600 * (0.001 + 0.05 / 512)) and second.alone_ttft_s == 0.0
    unit.predictor.on_first_token(second, 2.0)  # work was ahead: the backlog rule's business
    assert unit.admission.alone.num_observed == 0
    unit.predictor.on_first_token(first, 1.3)  # twice its bound
    assert unit.admission.alone.num_observed == 1 and unit.admission.alone.value > 1.0
    short = _unit()
    brief = Request("brief", 100, SamplingParams(), 0.0)  # a bound of 0.11 s: under half the target
    assert short.add_request(brief, 0.0) is None
    short.predictor.on_first_token(brief, 0.5)  # mostly the wait for a step in flight
    assert short.admission.alone.num_observed == 0 and short.admission.alone.value == 1.0
    # Taught that such requests take twice their bound, the unit refuses a 600-token prompt (~0.66 s
    # bound) in overload that it admitted before.
    taught = _overloaded()
    taught.admission.alone.value = 2.0
    rejection = taught.add_request(Request("p", 600, SamplingParams(), 0.0), 0.0)
    assert rejection is not None and rejection.reason == "prompt_over_target"
    assert _overloaded().add_request(Request("p", 600, SamplingParams(), 0.0), 0.0) is None


def test_the_fit_settles_at_its_quantile_within_its_bounds() -> None:
    fit, rng = AloneFit(1.0), random.Random(3)
    assert fit.value == 1.0
    for _ in range(20_000):
        fit.observe(0.8, 0.8 * rng.uniform(1.2, 1.6))
    assert fit.value == pytest.approx(1.2 + 0.4 * AloneFit.QUANTILE, abs=0.03)
    for _ in range(2000):  # up by GAIN x QUANTILE for a ratio above it
        fit.observe(0.8, 80.0)
    assert fit.value == AloneFit.CEILING
    for _ in range(1000):
        fit.observe(0.8, 0.0)
    assert fit.value == AloneFit.FLOOR
    observed = fit.num_observed
    fit.observe(AloneFit.FROM * 0.99, 80.0)  # a bound under FROM x the target teaches nothing
    assert (fit.num_observed, fit.value) == (observed, AloneFit.FLOOR)


def test_on_the_simulator_overload_serves_prompts_that_can_meet_the_target_instead(monkeypatch) -> None:
    """One A100 70B TP8 unit at about twice its capacity, a third of the prompts 7,000-8,000 tokens
    (1.0-1.2 s of prefill alone against the 1 s target), the rest 100-1,500. With the rule off,
    most of the requests it would have refused miss the target when served (its verdicts are
    recorded, not acted on). With it on, every refusal `prompt_over_target` is a prompt whose
    prefill alone (in whole-budget steps, no decode beside it: the cost model's least) passes the
    target or comes within 10% of it, the admitted miss the TTFT target far less often, and
    goodput rises."""
    cost = CostModel.load("a100-llama70b-tp8")
    rng = np.random.default_rng(1)
    arrival = np.cumsum(rng.exponential(1 / 3.0, 2000))
    arrival = arrival[arrival < 300.0]
    n = arrival.size
    long = rng.random(n) < 1 / 3
    prompts = np.where(long, rng.integers(7000, 8000, n), rng.integers(100, 1500, n))
    trace = Trace("long-and-short", arrival, prompts, rng.integers(16, 256, n), duration_s=360.0)
    slo = Slo(1.0, 0.1)
    base = unit_config(cost, max_batch_size=128, max_num_batched_tokens=2048, max_model_len=8192)

    def alone_s(tokens: int) -> float:
        t = done = 0
        while done < tokens:
            c = min(2048, tokens - done)
            t += cost.step_time_s([(c, done)], 0, 0, None)
            done += c
        return t

    refused: list[int] = []
    would_refuse: list[int] = []
    check, reject = AdmissionController.check, AdmissionController._reject

    def judged(self, req, state, load):  # type: ignore[no-untyped-def]
        verdict = check(self, req, state, load)
        if verdict is None and self.too_slow_alone(state):
            would_refuse.append(int(req.request_id))
        return verdict

    def record(self, req, reason, retry_after_s, message):  # type: ignore[no-untyped-def]
        if reason == "prompt_over_target":
            refused.append(req.num_prompt_tokens)
        return reject(self, req, reason, retry_after_s, message)

    monkeypatch.setattr(AdmissionController, "check", judged)
    monkeypatch.setattr(AdmissionController, "_reject", record)
    figures = {}
    for on in ("false", "true"):
        refused.clear()
        run = run_policy(RunSpec(trace, base, cost, slo, overrides={"admission.refuse_slow_prompts_in_overload": on}),
                         "adaptive", progress=False)
        o = run.run.outcomes
        ok = o.status == OK
        missed = ok & (np.nan_to_num(o.ttft_s, nan=np.inf) > slo.ttft_s)
        figures[on] = (int(o.meets_slo(slo).sum()), float(missed.sum() / max(1, ok.sum())), list(refused))
        if on == "false":
            judged_ids = np.array(would_refuse, dtype=np.int64)
            late_share = float(missed[judged_ids].mean()) if judged_ids.size else 0.0
    (good_off, missed_off, refused_off), (good_on, missed_on, refused_on) = figures["false"], figures["true"]
    assert len(would_refuse) > 20 and late_share >= 0.8, (len(would_refuse), late_share)
    assert refused_off == [] and len(refused_on) > 20, figures
    assert all(alone_s(t) > 0.9 * slo.ttft_s for t in refused_on), sorted(refused_on)[:5]
    assert missed_on < 0.5 * missed_off, (missed_on, missed_off)
    assert good_on > 1.1 * good_off, (good_on, good_off)


def test_the_published_limit_is_the_units_own_verdict_for_the_front_gates() -> None:
    """A unit publishes the rule inverted: the longest prompt it would start now
    (`UnitLoad.alone_limit_tokens`). The front gate's verdict on that snapshot agrees with the
    unit's own on prompts either side of it; outside OVERLOAD, or with the rule off, there is no
    limit; a learned ratio of 2 halves it."""
    load = published_load(_overloaded(), 0.0, "u")
    limit = load.alone_limit_tokens
    assert limit == int(1.0 / (0.001 + 0.05 / 512))  # the target over the bound per token (test 5)
    assert UnitLoad.from_stats("u", load.to_stats()).alone_limit_tokens == limit
    front = FrontAdmission(_unit().config.admission)
    for tokens in (limit - 3, limit + 3, 2 * limit):
        rejection = _overloaded().add_request(Request("x", tokens, SamplingParams(), 0.0), 0.0)
        refused = rejection is not None and rejection.reason == "prompt_over_target"
        assert refused == (tokens > limit) == (rejection is not None)
        verdict = front.check([Sighting(load, 0.0)], 0.0, tokens)
        assert (verdict is not None and verdict.reason == "prompt_over_target") == refused
    long_one = front.check([Sighting(load, 0.0)], 0.0, 2 * limit)
    assert long_one is not None and long_one.retry_after_s == pytest.approx(2.0, rel=0.01)  # its own time
    taught = _overloaded()
    taught.admission.alone.value = 2.0
    assert published_load(taught, 0.0).alone_limit_tokens == pytest.approx(limit / 2, abs=1)
    assert published_load(_unit(), 0.0).alone_limit_tokens == 0
    assert published_load(_overloaded(refuse_slow_prompts_in_overload=False), 0.0).alone_limit_tokens == 0
    assert published_load(_overloaded(mode="protect"), 0.0).alone_limit_tokens == 0


def test_the_front_gate_scales_by_the_cached_share_and_leaves_work_ahead_to_the_backlog_rule() -> None:
    load = dataclasses.replace(published_load(_overloaded(), 0.0, "u"), cached_share=0.5)
    front, limit = FrontAdmission(_unit().config.admission), load.alone_limit_tokens
    # Half of a prompt's tokens are found cached there, on average: 1.5 x the limit is let through.
    assert front.check([Sighting(load, 0.0)], 0.0, int(1.5 * limit)) is None
    assert front.check([Sighting(load, 0.0)], 0.0, int(2.5 * limit)) is not None
    # With work ahead when it arrives the unit judges by its backlog: a prompt over the limit that
    # fits the backlog's limit is let through, as the unit would admit it.
    ahead = dataclasses.replace(load, cached_share=0.0, queue_delay_s=0.01, prefill_s_per_token=1e-6,
                                ttft_limit_s=1.0)
    assert front.check([Sighting(ahead, 0.0)], 0.0, 2 * limit) is None
    # With several units, one that would admit it (not over capacity: no limit) lets it through.
    calm = dataclasses.replace(load, unit_id="v", cached_share=0.0, alone_limit_tokens=0, regime=Regime.STEADY)
    assert front.check([Sighting(load, 0.0), Sighting(calm, 0.0)], 0.0, 3 * limit) is None


def test_a_prompt_let_through_on_the_cached_share_alone_puts_nothing_ahead_of_the_burst_behind_it() -> None:
    # Mooncake's bursts in Serve: a 7,000-token prompt at a burst's head passed the door on the
    # unit's average cached share, its unit then refused it (its own hit was small), and counted
    # whole on its way it had the door refuse the short prompts behind it that the unit served.
    load = dataclasses.replace(published_load(_overloaded(), 0.0, "u"), cached_share=0.25)
    front, limit = FrontAdmission(_unit().config.admission), load.alone_limit_tokens
    seen, head, short = [Sighting(load, 0.0)], int(1.25 * limit), limit // 4
    assert front.check(seen, 0.0, head) is None  # let through on the average share
    assert front.on_the_way_tokens(seen, 0.0, head) == 0
    assert front.on_the_way_tokens(seen, 0.0, short) == short  # one it would start: counted whole
    whole = front.check(seen, 0.0, short, on_the_way=OnTheWay(head, 1))
    assert whole is not None and whole.reason == "prefill_backlog"  # as it was (its uncached estimate ahead)
    assert front.check(seen, 0.0, short, on_the_way=OnTheWay(front.on_the_way_tokens(seen, 0.0, head), 1)) is None
    # A unit that would start the whole prompt (not over capacity: no limit), or a stale snapshot
    # (not believed), leaves it counted whole.
    calm = dataclasses.replace(load, unit_id="v", alone_limit_tokens=0, regime=Regime.STEADY)
    assert front.on_the_way_tokens([*seen, Sighting(calm, 0.0)], 0.0, head) == head
    assert front.on_the_way_tokens(seen, 60.0, head) == head


def test_beside_decodes_held_to_a_tpot_target_a_lone_prompt_is_judged_by_the_chunks_the_sizer_allows() -> None:
    """Eight decodes hold a 100 ms TPOT target: a lone prompt's chunks are what their banks allow
    now, then what steps at the aim hold (`ServiceModel.drain_time` with `aim_s`), not whole-budget
    steps. Run beside them, the prompt's first token comes within 5% of that bound and well past
    the whole-budget one. In OVERLOAD a prompt whose whole-budget prefill fits the 1 s target but
    whose bound does not is refused; one whose bound fits is admitted; the published limit says
    the same."""
    prior = ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001,
                         prefill_step_s=0.020)
    svc = ServiceModel(prior)
    sizing = StepSizingConfig(headroom=1.0, borrow_quantile=0.0, pressure_quantile=0.0, aim_gain=0.0)

    def unit(regime: Regime = Regime.OVERLOAD) -> tuple[Scheduler, FakeExecutor, float]:
        cfg = preset("adaptive", SchedulerConfig(
            max_batch_size=64, max_num_batched_tokens=2048, max_model_len=16384, block_size=16, num_kv_blocks=4096,
            cuda_graph_buckets=(), service_prior=prior, step_sizing=sizing,
            admission=AdmissionConfig(target_ttft_s=1.0, target_tpot_s=0.1)))
        sched = Scheduler(cfg)
        ex = FakeExecutor(time_fn=lambda plan: svc.step_time(plan.num_prefill_tokens, plan.num_decode_seqs))
        for i in range(8):
            assert sched.add_request(Request(f"d{i}", 32, SamplingParams(max_tokens=300, ignore_eos=True), 0.0),
                                     0.0) is None
        decision = sched.schedule(0.0)  # the eight prompts in one step, then they decode
        assert isinstance(decision, Run)
        result = ex.execute(decision.plan)
        sched.on_step_done(decision.plan, result, result.device_time_s)
        assert len(sched.view.queues.decodes.reqs) == 8 and sched.num_waiting == 0
        sched.regime.regime = regime
        return sched, ex, result.device_time_s

    whole = svc.drain_time(10_000, 8, 8, 2048) / 10_000  # a token's share of whole-budget steps
    sched, ex, now = unit(Regime.STEADY)  # admitted whatever its bound: measure it
    long = Request("long", 4000, SamplingParams(max_tokens=2), now)
    assert sched.add_request(long, now) is None
    bound = long.alone_ttft_s
    while long.first_token_s is None:
        decision = sched.schedule(now)
        assert isinstance(decision, Run)
        result = ex.execute(decision.plan)
        now += result.device_time_s
        sched.on_step_done(decision.plan, result, now)
    measured = long.first_token_s - long.arrival_s
    assert measured == pytest.approx(bound, rel=0.05), (measured, bound)
    assert measured > 1.3 * 4000 * whole  # whole-budget steps would have promised far less
    per_token = bound / 4000
    fits, fits_whole_only = int(0.9 / per_token), int(0.95 / whole)
    assert unit()[0].view.alone_prefill_s(fits_whole_only) > 1.05  # past the target, within it in whole steps
    sched, _, now = unit()
    assert sched.add_request(Request("fits", fits, SamplingParams(), now), now) is None
    sched, _, now = unit()
    refused = sched.add_request(Request("slow", fits_whole_only, SamplingParams(), now), now)
    assert refused is not None and refused.reason == "prompt_over_target"
    sched, _, now = unit()
    assert fits <= published_load(sched, now).alone_limit_tokens < fits_whole_only


def test_a_lone_prompts_bound_reads_the_learned_overload_prefill_cap() -> None:
    """In OVERLOAD with the step limits' learned prefill cap below the budget, a lone prompt's
    bound counts the smaller chunks it would get, each paying a prefill step's fixed cost."""
    prior = ServicePrior(step_overhead_s=0.020, prefill_s_per_token=0.0001, decode_s_per_seq=0.001,
                         prefill_step_s=0.020)
    cfg = preset("adaptive", SchedulerConfig(
        max_batch_size=64, max_num_batched_tokens=2048, max_model_len=16384, block_size=16, num_kv_blocks=4096,
        cuda_graph_buckets=(), service_prior=prior,
        admission=AdmissionConfig(target_ttft_s=1.0, target_tpot_s=1.0)))  # a slack target: whole-budget chunks
    sched, svc = Scheduler(cfg), ServiceModel(prior)
    ex = FakeExecutor(time_fn=lambda plan: svc.step_time(plan.num_prefill_tokens, plan.num_decode_seqs))
    for i in range(8):
        decode = Request(f"d{i}", 32, SamplingParams(max_tokens=300, ignore_eos=True), 0.0)
        assert sched.add_request(decode, 0.0) is None
    decision = sched.schedule(0.0)
    assert isinstance(decision, Run)
    sched.on_step_done(decision.plan, ex.execute(decision.plan), 0.1)
    sched.regime.regime = Regime.OVERLOAD
    whole = sched.view.alone_prefill_s(4000)
    sched.limits.slot_cap = 128.0
    capped = sched.view.alone_prefill_s(4000)
    assert capped >= 4000 / 128 * (0.020 + 0.020 + 128 * 0.0001) > 2 * whole  # 32 steps of 128 tokens, not 2 of 2040
    sched.regime.regime = Regime.STEADY
    assert sched.view.alone_prefill_s(4000) == whole  # the cap holds in OVERLOAD only
