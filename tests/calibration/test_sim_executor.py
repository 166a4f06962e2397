"""SimExecutor drives the real Scheduler on a virtual clock and honours the step contract."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from calibration.cost_model import CostModel
from calibration.sim_executor import SimExecutor
from tidal_core import (
    FinishReason,
    Idle,
    Request,
    Run,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    VirtualClock,
    WaitUntil,
    preset,
)

EOS = 2
BASE = SchedulerConfig(max_batch_size=32, max_num_batched_tokens=256, max_model_len=2048, block_size=16,
                       num_kv_blocks=4096, cuda_graph_buckets=(1, 2, 4, 8, 16, 32))


@dataclass
class Drive:
    rejected: set[str] = field(default_factory=set)
    finished: dict[str, Request] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_partial_chunks: int = 0
    num_steps: int = 0


def make_requests(n: int, seed: int, eos_for: set[str] | None = None) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(20.0)
        stops = frozenset({EOS}) if eos_for is not None and f"r{i}" in eos_for else frozenset()
        out.append(Request(f"r{i}", rng.randint(1, 700), SamplingParams(max_tokens=rng.randint(1, 40),
                                                                        stop_token_ids=stops), t))
    return out


def check_sampling(plan: StepPlan, sched: Scheduler, sampled: dict[str, int], log: Drive) -> None:
    """Exactly the requests whose scheduled tokens reach the end of their known tokens sample."""
    for rid, n in plan.num_scheduled_tokens.items():
        if rid in plan.prefill_context:
            req = sched.requests[rid]
            completes = plan.prefill_context[rid] + n == req.num_tokens
            assert (rid in sampled) == completes, f"{rid}: chunk {plan.prefill_context[rid]}+{n} of {req.num_tokens}"
            log.num_partial_chunks += not completes
        else:
            assert rid in sampled, f"decode {rid} sampled nothing"
    assert set(sampled) <= set(plan.num_scheduled_tokens)


def drive(sched: Scheduler, ex: SimExecutor, cost: CostModel, requests: list[Request]) -> Drive:
    clock, log, pending = VirtualClock(), Drive(), list(reversed(requests))
    while pending or sched.has_unfinished:
        while pending and pending[-1].arrival_s <= clock.now():
            req = pending.pop()
            if sched.add_request(req, clock.now()) is not None:  # admission control (adaptive) may say no
                log.rejected.add(req.request_id)
        decision = sched.schedule(clock.now())
        next_arrival = pending[-1].arrival_s if pending else None
        if isinstance(decision, Idle):
            assert next_arrival is not None, "idle with requests unfinished"
            clock.advance_to(next_arrival)
            continue
        if isinstance(decision, WaitUntil):
            clock.advance_to(min(decision.deadline_s, next_arrival or decision.deadline_s))
            continue
        assert isinstance(decision, Run)
        plan = decision.plan
        result = ex.execute(plan)
        assert result.step_id == plan.step_id
        assert result.device_time_s == cost.plan_time_s(plan) > 0
        check_sampling(plan, sched, result.sampled_token_ids, log)
        clock.advance_by(result.device_time_s)
        out = sched.on_step_done(plan, result, clock.now())
        for rid, tok in out.tokens.items():
            log.tokens.setdefault(rid, []).append(tok)
        for req in out.finished:
            log.finished[req.request_id] = req
        sched.check_integrity()
        log.num_steps += 1
    return log


@pytest.mark.parametrize("policy", ["continuous", "eager", "adaptive", "static"])
def test_every_request_finishes_with_exactly_its_max_tokens(cost: CostModel, policy: str) -> None:
    sched = Scheduler(preset(policy, BASE))
    ex = SimExecutor(cost)
    requests = make_requests(300, seed=1)
    log = drive(sched, ex, cost, requests)
    served = [r for r in requests if r.request_id not in log.rejected]
    assert not log.rejected or policy == "adaptive"  # the workload overloads the unit on purpose
    assert len(served) >= 100
    assert len(log.finished) == len(served) and sched.stats.num_steps == log.num_steps
    for req in served:
        assert req.finish_reason is FinishReason.LENGTH, req
        assert len(req.output_token_ids) == req.sampling.max_tokens == len(log.tokens[req.request_id])
        assert set(req.output_token_ids) == {ex.placeholder_token_id}
    assert log.num_partial_chunks > 0, "the workload should exercise chunked prefill"
    assert ex.num_tracked_requests == 0, "executor state leaked"
    assert ex.num_steps == log.num_steps


def test_expected_eos_stops_the_request_at_that_output(cost: CostModel) -> None:
    stopping = {f"r{i}" for i in range(0, 300, 3)}
    requests = make_requests(300, seed=2, eos_for=stopping)
    sched = Scheduler(preset("continuous", BASE))
    ex = SimExecutor(cost, placeholder_token_id=7, eos_token_id=EOS)
    target = {}
    for req in requests:
        if req.request_id in stopping and req.sampling.max_tokens > 1:
            target[req.request_id] = random.Random(req.request_id).randint(1, req.sampling.max_tokens - 1)
            ex.expect(req.request_id, target[req.request_id])
    assert not drive(sched, ex, cost, requests).rejected
    assert target, "some requests should stop early"
    for req in requests:
        n = target.get(req.request_id)
        if n is None:
            assert req.finish_reason is FinishReason.LENGTH and len(req.output_token_ids) == req.sampling.max_tokens
        else:
            assert req.finish_reason is FinishReason.STOP, req
            assert req.output_token_ids == [7] * (n - 1) + [EOS]
    assert ex.num_tracked_requests == 0


def test_preemption_and_resume_keep_the_contract(cost: CostModel) -> None:
    """A KV pool too small for the load forces recompute preemption; resumed requests re-prefill."""
    tight = preset("continuous", BASE, num_kv_blocks=160)
    sched = Scheduler(tight)
    ex = SimExecutor(cost, eos_token_id=EOS)
    requests = make_requests(200, seed=3, eos_for={f"r{i}" for i in range(0, 200, 7)})
    expect_eos = {r.request_id: r.sampling.max_tokens for r in requests if r.stop_ids}
    requests = [Request(r.request_id, r.num_prompt_tokens, SamplingParams(max_tokens=r.sampling.max_tokens + 5,
                                                                            stop_token_ids=r.stop_ids), r.arrival_s)
                if r.stop_ids else r for r in requests]  # EOS comes 5 tokens before the length limit
    for rid, n in expect_eos.items():
        ex.expect(rid, n)
    log = drive(sched, ex, cost, requests)
    assert not log.rejected
    assert sum(sched.stats.preempted.values()) > 0, "the scenario should preempt"
    assert len(log.finished) == len(requests)
    for r in requests:
        want = expect_eos.get(r.request_id, r.sampling.max_tokens)
        assert len(r.output_token_ids) == want, r
    assert ex.num_tracked_requests == 0


def test_contract_violations_are_loud(cost: CostModel) -> None:
    ex = SimExecutor(cost)
    stray = StepPlan(1, {"x": 10}, {"x": 0}, [], {}, [], 0, 10, 0, None)
    with pytest.raises(RuntimeError, match="never announced"):
        ex.execute(stray)
    with pytest.raises(ValueError, match="eos_token_id"):
        ex.expect("x", 3)
    with pytest.raises(ValueError, match="placeholder"):
        SimExecutor(cost, placeholder_token_id=5, eos_token_id=5)
    sched = Scheduler(preset("continuous", BASE))
    sched.add_request(Request("a", 600, SamplingParams(max_tokens=3), 0.0), 0.0)  # longer than one step's budget
    decision = sched.schedule(0.0)
    assert isinstance(decision, Run)
    ex.execute(decision.plan)
    with pytest.raises(RuntimeError, match="announced twice"):
        ex.execute(decision.plan)
    ex.forget("a")
