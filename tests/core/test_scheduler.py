"""Deterministic scenarios for the Scheduler, driven by a contract-checking fake executor."""

from __future__ import annotations

import pytest

from tests.helpers import DriveLog, FakeExecutor, run_until_idle
from tidal_core import (
    FinishReason,
    Idle,
    Request,
    RequestStatus,
    Run,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepResult,
    WaitUntil,
    preset,
)

SMALL = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                        num_kv_blocks=256, cuda_graph_buckets=(1, 2, 4, 8))


def req(rid: str, prompt: int, max_tokens: int = 4, at: float = 0.0, **kw: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), at)  # type: ignore[arg-type]


def run_plan(s: Scheduler, ex: FakeExecutor, now: float) -> tuple[Run, float]:
    d = s.schedule(now)
    assert isinstance(d, Run), d
    r = ex.execute(d.plan)
    s.on_step_done(d.plan, r, now + r.device_time_s)
    s.check_integrity()
    return d, now + r.device_time_s


def test_decode_first_then_chunked_prefill_within_budget() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor()
    for i in range(3):
        assert s.add_request(req(f"d{i}", 5, max_tokens=50), 0.0) is None
    _, now = run_plan(s, ex, 0.0)  # three prefills of 5
    assert len(s.decodes) == 3
    assert s.add_request(req("long", 200), now) is None
    d, now = run_plan(s, ex, now)
    plan = d.plan
    assert list(plan.num_scheduled_tokens)[:3] == ["d0", "d1", "d2"]  # decodes first
    assert plan.num_scheduled_tokens["long"] == 64 - 3  # chunk fills the rest of the budget
    assert plan.total_tokens == 64
    d, now = run_plan(s, ex, now)
    assert d.plan.prefill_context["long"] == 61 and d.plan.num_scheduled_tokens["long"] == 61
    assert all(d.plan.num_scheduled_tokens[f"d{i}"] == 1 for i in range(3))  # decodes never stalled


def test_every_request_finishes_once_with_its_tokens() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor()
    for i in range(20):
        s.add_request(req(f"r{i}", 3 + 7 * i % 90, max_tokens=1 + i % 9), 0.0)
    log = DriveLog()
    run_until_idle(s, ex, 0.0, log=log)
    done = [r for out in log.outputs for r in out.finished]
    assert sorted(r.request_id for r in done) == sorted(f"r{i}" for i in range(20))
    for r in done:
        assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == r.sampling.max_tokens
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert not s.requests and not s.q.announced


def test_stop_token_and_min_tokens() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor(token_fn=lambda rid: 7)
    s.add_request(req("stop", 4, max_tokens=10, stop_token_ids=frozenset({7})), 0.0)
    s.add_request(req("min", 4, max_tokens=10, stop_token_ids=frozenset({7}), min_tokens=3), 0.0)
    log = DriveLog()
    run_until_idle(s, ex, 0.0, log=log)
    by_id = {r.request_id: r for out in log.outputs for r in out.finished}
    assert by_id["stop"].finish_reason is FinishReason.STOP and by_id["stop"].num_output_tokens == 1
    assert by_id["min"].finish_reason is FinishReason.STOP and by_id["min"].num_output_tokens == 3


def test_max_model_len_ends_by_length() -> None:
    s = Scheduler(preset("continuous", SMALL))
    s.add_request(req("edge", 250, max_tokens=100), 0.0)
    log = DriveLog()
    run_until_idle(s, FakeExecutor(), 0.0, log=log)
    (r,) = [r for out in log.outputs for r in out.finished]
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 256


def test_prompt_too_long_is_rejected_not_retryable() -> None:
    s = Scheduler(preset("adaptive", SMALL))
    rej = s.add_request(req("huge", 256), 0.0)
    assert rej is not None and rej.reason == "too_long" and not rej.retryable
    assert s.stats.rejected["too_long"] == 1 and not s.requests


def test_preemption_when_kv_runs_out_then_recompute() -> None:
    cfg = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                          num_kv_blocks=16, kv_watermark=0.0, cuda_graph_buckets=())
    s = Scheduler(preset("continuous", cfg))
    ex = FakeExecutor()
    for i in range(4):
        s.add_request(req(f"r{i}", 12, max_tokens=40), 0.0)
    log = DriveLog()
    run_until_idle(s, ex, 0.0, log=log)
    assert s.stats.preempted["kv_exhausted"] > 0
    done = [r for out in log.outputs for r in out.finished]
    assert len(done) == 4 and all(r.num_output_tokens == 40 for r in done)
    assert any(r.num_preemptions for r in done)
    # A resumed request is re-announced with prompt + generated tokens to recompute.
    resumed = [n for p in log.plans for n in p.new_requests if n.num_tokens > 12]
    assert resumed


def test_abort_waiting_running_and_inflight() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor()
    for i in range(3):
        s.add_request(req(f"r{i}", 8, max_tokens=20), 0.0)
    _, now = run_plan(s, ex, 0.0)
    s.add_request(req("w", 8), now)
    assert s.abort("w", now) is not None and s.num_waiting == 0
    d = s.schedule(now)
    assert isinstance(d, Run)
    assert s.abort("r1", now) is not None  # while its step is in flight
    r = ex.execute(d.plan)
    out = s.on_step_done(d.plan, r, now + 0.01)
    assert "r1" not in out.tokens
    s.check_integrity()
    d2 = s.schedule(now + 0.01)
    assert isinstance(d2, Run) and "r1" in d2.plan.finished_ids and "r1" not in d2.plan.num_scheduled_tokens
    assert s.abort("nope", now) is None


def test_eager_launches_one_new_prefill_per_step() -> None:
    s = Scheduler(preset("eager", SMALL))
    for i in range(4):
        s.add_request(req(f"r{i}", 4), 0.0)
    d = s.schedule(0.0)
    assert isinstance(d, Run) and len(d.plan.new_requests) == 1 and d.reason == "immediate"


def test_static_batches_do_not_admit_mid_flight() -> None:
    cfg = preset("static", SMALL, batching=SMALL.batching.__class__(mode="static", static_batch_size=4,
                                                                     static_timeout_s=0.1))
    s = Scheduler(cfg)
    ex = FakeExecutor()
    s.add_request(req("a", 4, max_tokens=5), 0.0)
    d = s.schedule(0.0)
    assert isinstance(d, WaitUntil) and d.deadline_s == pytest.approx(0.1)
    for i in range(3):
        s.add_request(req(f"b{i}", 4, max_tokens=5), 0.05)
    d2, now = run_plan(s, ex, 0.05)  # batch of 4 is full: launch
    assert len(d2.plan.new_requests) == 4 and d2.reason == "full"
    s.add_request(req("late", 4), now)
    d3, now = run_plan(s, ex, now)
    assert "late" not in d3.plan.num_scheduled_tokens and d3.reason == "decode_only"


def test_adaptive_microwait_aggregates_when_idle() -> None:
    cfg = preset("adaptive", SMALL)
    s = Scheduler(cfg)
    s.regime.regime = s.regime.regime.__class__("steady")
    # 40 s of steady traffic at ~half the prior capacity, so load sits between light and 1.
    for i in range(1200):
        s.load.on_arrival(-40.0 + i / 30, 8, 4)
    s.add_request(req("a", 8), 0.0)
    assert 0.2 < s.load.load(0.0) < 0.9
    d = s.schedule(0.0)
    assert isinstance(d, WaitUntil) and 0.0 < d.deadline_s <= 0.005
    s.add_request(req("b", 8), d.deadline_s / 2)
    d2 = s.schedule(d.deadline_s)
    assert isinstance(d2, Run) and {n.request_id for n in d2.plan.new_requests} == {"a", "b"}
    assert d2.reason == "microwait_expired"


def test_pure_decode_steps_are_padded_to_buckets() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor()
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=10), 0.0)
    d, now = run_plan(s, ex, 0.0)
    assert d.plan.padded_batch_size is None  # prefill step runs eager
    d, now = run_plan(s, ex, now)
    assert d.plan.padded_batch_size == 4 and d.plan.num_decode_seqs == 3
    assert s.buckets.padded_slots == 1


def test_idle_and_step_contract_errors() -> None:
    s = Scheduler(preset("continuous", SMALL))
    assert isinstance(s.schedule(0.0), Idle)
    s.add_request(req("a", 4), 0.0)
    d = s.schedule(0.0)
    assert isinstance(d, Run)
    with pytest.raises(RuntimeError):
        s.schedule(0.0)
    with pytest.raises(ValueError):
        s.add_request(req("a", 4), 0.0)
    with pytest.raises(RuntimeError):
        s.on_step_done(d.plan.__class__(**{**{f: getattr(d.plan, f) for f in d.plan.__slots__}, "step_id": 99}),
                       StepResult(99, {}, 0.0), 0.0)


def test_abort_all_ends_everything() -> None:
    s = Scheduler(preset("continuous", SMALL))
    ex = FakeExecutor()
    for i in range(5):
        s.add_request(req(f"r{i}", 30), 0.0)
    run_plan(s, ex, 0.0)
    ended = s.abort_all(1.0)
    assert len(ended) == 5 and all(r.status is RequestStatus.FINISHED for r in ended)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks and not s.has_unfinished
    s.check_integrity()


def test_request_times_record_each_lifecycle_moment() -> None:
    from tidal_core import RequestTimes

    s = Scheduler(preset("continuous", SMALL))
    s.add_request(req("t", 10, max_tokens=3, at=1.0), 1.0)
    log = DriveLog()
    run_until_idle(s, FakeExecutor(), 1.0, log=log)
    (done,) = [r for out in log.outputs for r in out.finished]
    times = RequestTimes.of(done)
    assert times.arrival_s == 1.0 and times.admitted_s == 1.0
    assert times.queue_s == 0.0 and times.ttft_s is not None and times.ttft_s > 0
    assert times.e2e_s is not None and times.e2e_s > times.ttft_s
    assert times.tpot_s == pytest.approx((done.finished_s - done.first_token_s) / 2)
    assert times.finish_reason == "length" and times.num_output_tokens == 3
