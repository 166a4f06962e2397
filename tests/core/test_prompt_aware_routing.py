"""Routing with the request's prompt size: a long prompt goes where it will be admitted."""

from __future__ import annotations

import random

import pytest

from tidal_core import AdmissionConfig, Regime, Request, SamplingParams, Scheduler, SchedulerConfig, UnitLoad
from tidal_core.front_admission import published_load
from tidal_core.prefix_routing import PrefixAwareRouter, PrefixRoutingConfig
from tidal_core.routing import choose_unit, unit_score, would_refuse

PER_TOKEN = 1e-4  # 4,000 prompt tokens add 0.4 s of prefill


def unit(uid: str, delay: float, limit: float = 1.0, regime: Regime = Regime.STEADY, kv: float = 0.1) -> UnitLoad:
    return UnitLoad(uid, 4, 2, delay, kv, 0.5, 10.0, regime, prefill_s_per_token=PER_TOKEN, ttft_limit_s=limit)


FLEET = [unit("busy1", 0.8), unit("busy2", 0.9), unit("free", 0.25)]


def test_two_busy_units_sampled_while_a_third_would_admit_sends_the_long_prompt_there() -> None:
    # 4,000 tokens: 1.2 s and 1.3 s at the busy units (past the 1 s limit), 0.65 s at the free one.
    assert would_refuse(FLEET[0], 4000) and would_refuse(FLEET[1], 4000) and not would_refuse(FLEET[2], 4000)
    picks = {choose_unit(FLEET, random.Random(seed), 4000) for seed in range(60)}
    assert picks == {"free"}
    # The prompt-blind rule sends it to a busy unit whenever the free one is not sampled.
    blind = {choose_unit(FLEET, random.Random(seed)) for seed in range(60)}
    assert blind & {"busy1", "busy2"}


def test_a_short_prompt_keeps_power_of_two_choices() -> None:
    # 100 tokens fit everywhere: the same choice as the prompt-blind rule (no herding onto the best unit).
    for seed in range(60):
        assert choose_unit(FLEET, random.Random(seed), 100) == choose_unit(FLEET, random.Random(seed))
    assert {choose_unit(FLEET, random.Random(seed), 100) for seed in range(60)} >= {"busy1", "free"}


def test_of_two_sampled_the_one_that_admits_wins_even_at_a_higher_score() -> None:
    # The overloaded unit's limit is the target (1 s); the steady one may queue to 2 s (burst_factor 2).
    tight, loose = unit("tight", 0.7, limit=1.0, regime=Regime.OVERLOAD), unit("loose", 0.9, limit=2.0)
    assert unit_score(tight, 4000) < unit_score(loose, 4000)
    assert choose_unit([tight, loose], random.Random(0), 4000) == "loose"
    assert choose_unit([tight, loose], random.Random(0)) == "tight"


def test_when_every_unit_would_refuse_the_lowest_predicted_ttft_wins() -> None:
    units = [unit("a", 3.0), unit("b", 2.0), unit("c", 4.0), unit("d", 5.0)]
    assert {choose_unit(units, random.Random(seed), 4000) for seed in range(40)} == {"b"}


def test_no_published_limit_never_refuses_and_no_work_ahead_always_admits() -> None:
    assert not would_refuse(unit("a", 5.0, limit=0.0), 10**6)
    assert not would_refuse(unit("a", 0.0), 10**6)  # nothing ahead: the unit starts it at once
    assert would_refuse(unit("a", 0.1), 10**6)


def test_the_score_with_a_prompt_is_the_predicted_ttft_plus_the_kv_penalty() -> None:
    u = unit("a", 0.5, kv=0.9)
    assert unit_score(u, 1000) - unit_score(u) == pytest.approx(1000 * PER_TOKEN)
    assert unit_score(u) == pytest.approx(0.5 + 10.0 * (0.9 - 0.8) + 1e-4 * 6)


def test_the_prefix_router_falls_back_to_the_admission_aware_choice() -> None:
    router = PrefixAwareRouter(PrefixRoutingConfig(), random.Random(0))
    assert {router.choose(FLEET, None, 4000) for _ in range(40)} == {"free"}
    assert {router.choose(FLEET, list(range(250)), 4000) for _ in range(5)} == {"free"}  # nothing indexed yet


def test_a_unit_publishes_its_admission_limit_by_regime_and_mode() -> None:
    cfg = SchedulerConfig(admission=AdmissionConfig(target_ttft_s=0.8, burst_factor=2.0))
    sched = Scheduler(cfg)
    load = published_load(sched, 0.0, "u")
    assert load.regime is not Regime.OVERLOAD and load.ttft_limit_s == 1.6
    assert UnitLoad.from_stats("u", load.to_stats()).ttft_limit_s == 1.6
    protect = Scheduler(SchedulerConfig(admission=AdmissionConfig(mode="protect")))
    assert published_load(protect, 0.0).ttft_limit_s == 0.0
    off = Scheduler(SchedulerConfig(admission=AdmissionConfig(enabled=False)))
    assert published_load(off, 0.0).ttft_limit_s == 0.0


def _backlogged(n: int) -> Scheduler:
    sched = Scheduler(SchedulerConfig())
    for i in range(n):  # a backlog of 2,000-token prompts, none started
        sched.add_request(Request(f"q{i}", 2000, SamplingParams(max_tokens=50), 0.0), 0.0)
    return sched


def test_the_published_bound_agrees_with_the_units_own_admission() -> None:
    verdicts = []
    for tokens in (10, 1000, 2000, 4000):
        sched = _backlogged(3)
        load = published_load(sched, 0.0)
        rejection = sched.add_request(Request("t", tokens, SamplingParams(max_tokens=50), 0.0), 0.0)
        verdicts.append((would_refuse(load, tokens), rejection.reason if rejection else None))
    assert verdicts[0] == (False, None) and verdicts[-1] == (True, "prefill_backlog")
    assert all(reason == "prefill_backlog" for refuse, reason in verdicts if refuse)
