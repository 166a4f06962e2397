"""The batch service class in the core: the API mapping, its bounded queue and Retry-After,
headroom-only steps, yielding to interactive requests, and the snapshot's batch fields."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import FakeExecutor, run_until_idle
from tidal_core import Request, Run, SamplingParams, Scheduler, SchedulerConfig, ServicePrior, UnitLoad, preset
from tidal_core.admission import AdmissionConfig
from tidal_core.batch_config import BatchClassConfig
from tidal_core.batch_lane import BatchLane
from tidal_core.service_class import ServiceClass, service_class_of

BATCH = ServiceClass.BATCH
PRIOR = ServicePrior(step_overhead_s=0.005, prefill_s_per_token=0.0001, decode_s_per_seq=0.0002)


def _time(plan) -> float:  # the FakeExecutor's default cost, written out so the prior matches it exactly
    return 0.005 + 0.0001 * plan.num_prefill_tokens + 0.0002 * plan.num_decode_seqs


def _config(**batch: object) -> SchedulerConfig:
    base = SchedulerConfig(max_batch_size=16, max_num_batched_tokens=512, max_model_len=1024, block_size=16,
                           num_kv_blocks=512, service_prior=PRIOR)
    cfg = preset("adaptive", base)
    return dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, target_ttft_s=0.5,
                                                                  target_tpot_s=0.02),
                               batch=BatchClassConfig(**batch))  # type: ignore[arg-type]


def _req(rid: str, prompt: int, out: int, now: float, cls: ServiceClass = ServiceClass.INTERACTIVE) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True), now, service_class=cls)


@pytest.mark.parametrize(("tier", "priority", "expected"), [
    (None, None, ServiceClass.INTERACTIVE), ("auto", None, ServiceClass.INTERACTIVE),
    ("default", None, ServiceClass.INTERACTIVE), ("flex", None, BATCH), (None, 1, BATCH), (None, 0,
    ServiceClass.INTERACTIVE), (None, -5, ServiceClass.INTERACTIVE), ("default", 3, ServiceClass.INTERACTIVE),
    ("flex", -1, BATCH)])
def test_service_tier_and_priority_map_to_a_class(tier: str | None, priority: int | None,
                                                  expected: ServiceClass) -> None:
    assert service_class_of(tier, priority) is expected
    assert expected.tier_name == ("flex" if expected is BATCH else "default")


@pytest.mark.parametrize(("tier", "priority"), [("scale", None), ("priority", None), (None, 1.5), (None, True),
                                                (None, "1")])
def test_bad_service_tier_or_priority_is_a_value_error(tier: object, priority: object) -> None:
    with pytest.raises(ValueError, match=r"service_tier|priority"):
        service_class_of(tier, priority)  # type: ignore[arg-type]


def test_batch_requests_skip_the_ttft_rules_but_not_their_queue_bound() -> None:
    s = Scheduler(_config(max_queue_tokens=3000))
    for i in range(20):  # an interactive backlog far past the TTFT target
        s.add_request(_req(f"i{i}", 900, 4, 0.0), 0.0)
    assert s.stats.rejected["prefill_backlog"] > 0
    assert s.add_request(_req("b0", 900, 4, 0.0, BATCH), 0.0) is None
    assert s.add_request(_req("b1", 900, 4, 0.0, BATCH), 0.0) is None
    assert s.add_request(_req("b2", 900, 4, 0.0, BATCH), 0.0) is None
    rej = s.add_request(_req("b3", 900, 4, 0.0, BATCH), 0.0)
    assert rej is not None and rej.reason == "batch_queue_full" and rej.retryable
    snap = s.snapshot(0.0)
    assert (snap.batch_waiting, snap.batch_backlog_tokens, snap.batch_running) == (3, 2700, 0)
    assert snap.num_waiting == len(s.waiting) and snap.num_waiting > 0
    s.check_integrity()


def _drain_rate_retry(step_fraction: float) -> float:
    """Retry-After of a refused batch request after a batch-only stretch drained the queue."""
    s = Scheduler(_config(max_queue_tokens=4000, step_fraction=step_fraction))
    ex, now = FakeExecutor(time_fn=_time), 0.0
    for i in range(4):
        s.add_request(_req(f"b{i}", 1000, 2, now, BATCH), now)
    for _ in range(30):
        decision = s.schedule(now)
        assert isinstance(decision, Run)
        result = ex.execute(decision.plan)
        now += result.device_time_s
        s.on_step_done(decision.plan, result, now)
    while s.q.batch.num_tokens + 1000 <= 4000:
        s.add_request(_req(f"f{s.stats.num_arrived}", 1000, 2, now, BATCH), now)
    rej = s.add_request(_req("over", 1000, 2, now, BATCH), now)
    assert rej is not None and rej.reason == "batch_queue_full"
    over = s.q.batch.num_tokens + 1000 - 4000
    assert rej.retry_after_s == pytest.approx(max(1.0, over / s.lane.drain_rate(now, s.load)))  # type: ignore[union-attr]
    return rej.retry_after_s


def test_batch_retry_after_follows_the_measured_drain_rate() -> None:
    # The same queue drains more slowly when batch work may fill less of each step: later retry.
    assert _drain_rate_retry(0.3) > 1.3 * _drain_rate_retry(1.0)


def test_batch_steps_stay_within_the_tpot_aim_beside_interactive_decodes() -> None:
    cfg = _config()
    s = Scheduler(cfg)
    ex, now = FakeExecutor(time_fn=_time), 0.0
    s.add_request(_req("i0", 64, 200, now), now)
    for i in range(6):
        s.add_request(_req(f"b{i}", 800, 3, now, BATCH), now)
    aim = cfg.admission.target_tpot_s * cfg.step_sizing.headroom  # type: ignore[operator]
    batch_in_steps = 0
    for _ in range(200):
        decision = s.schedule(now)
        if not isinstance(decision, Run):
            break
        plan = decision.plan
        if "i0" in plan.num_scheduled_tokens and plan.prefill_context.keys() - {"i0"}:
            batch_in_steps += 1
            assert _time(plan) <= cfg.batch.step_fraction * aim + 1e-9, "a batch chunk pushed the step past the aim"
        result = ex.execute(plan)
        now += result.device_time_s
        s.on_step_done(plan, result, now)
        s.check_integrity()
    assert batch_in_steps > 5
    assert s.stats.num_batch_prompt_tokens_computed > 0 and s.stats.num_batch_generated_tokens > 0


def test_batch_yields_its_slots_to_interactive_requests() -> None:
    cfg = dataclasses.replace(_config(), max_batch_size=4)
    s = Scheduler(cfg)
    ex, now = FakeExecutor(time_fn=_time), 0.0
    for i in range(8):
        s.add_request(_req(f"b{i}", 40, 400, now, BATCH), now)
    for _ in range(20):
        decision = s.schedule(now)
        assert isinstance(decision, Run)
        result = ex.execute(decision.plan)
        now += result.device_time_s
        s.on_step_done(decision.plan, result, now)
    assert s.q.num_batch_running == s.max_running() == s.num_running
    s.add_request(_req("i0", 40, 4, now), now)
    decision = s.schedule(now)
    assert isinstance(decision, Run) and "i0" in decision.plan.num_scheduled_tokens
    assert s.stats.preempted["batch_yield"] == 1 and s.stats.preempted_by_class["batch"] == 1
    s.on_step_done(decision.plan, ex.execute(decision.plan), now + 0.01)
    run_until_idle(s, ex, now + 0.01)
    assert s.stats.finished["length"] == 9, "every request, the preempted batch one too, completed"


def test_batch_yields_kv_to_an_interactive_request() -> None:
    cfg = dataclasses.replace(_config(max_kv_usage=1.0), num_kv_blocks=64)
    s = Scheduler(cfg)
    ex, now = FakeExecutor(time_fn=_time), 0.0
    for i in range(3):
        s.add_request(_req(f"b{i}", 300, 200, now, BATCH), now)
    for _ in range(10):
        decision = s.schedule(now)
        assert isinstance(decision, Run)
        result = ex.execute(decision.plan)
        now += result.device_time_s
        s.on_step_done(decision.plan, result, now)
    assert s.kv_usage() > 0.85
    assert s.snapshot(now).kv_usage < 0.05, "the interactive view of KV leaves out what batch work holds"
    s.add_request(_req("i0", 400, 4, now), now)
    decision = s.schedule(now)
    assert isinstance(decision, Run) and "i0" in decision.plan.num_scheduled_tokens
    assert s.stats.preempted["batch_yield"] >= 1
    s.check_integrity()


def test_without_the_batch_class_a_batch_request_is_served_as_interactive() -> None:
    s = Scheduler(_config(enabled=False))
    req = _req("b0", 100, 4, 0.0, BATCH)
    assert s.add_request(req, 0.0) is None
    assert req.service_class is ServiceClass.INTERACTIVE and list(s.waiting) == [req]
    run_until_idle(s, FakeExecutor(), 0.0)
    assert s.stats.finished["length"] == 1


def test_batch_fields_travel_in_the_snapshot_wire_form() -> None:
    load = UnitLoad("u", 3, 1, 0.2, 0.5, batch_waiting=7, batch_backlog_tokens=9000, batch_running=2,
                    batch_kv_usage=0.25)
    assert UnitLoad.from_stats("u", load.to_stats()) == load
    assert UnitLoad.from_stats("u", {"num_running": 1.0}).batch_waiting == 0


def test_batch_config_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"batch\.max_kv_usage=1\.5"):
        BatchClassConfig(max_kv_usage=1.5)
    with pytest.raises(ValueError, match=r"batch\.max_queue_tokens=0"):
        BatchClassConfig(max_queue_tokens=0)
    assert AdmissionConfig().target_ttft_s > 0  # the batch bound is its own, admission is untouched


def test_the_bank_reserve_scales_with_interactive_load() -> None:
    s = Scheduler(_config(bank_reserve_steps=20.0, reserve_full_load=0.5))
    lane, aim = s.lane, 0.02
    assert lane is not None
    assert lane.reserve_s(aim, 0.0) == 0.0
    assert lane.reserve_s(aim, 0.25) == pytest.approx(10 * aim)
    assert lane.reserve_s(aim, 0.5) == lane.reserve_s(aim, 3.0) == pytest.approx(20 * aim)
    fixed = Scheduler(_config(bank_reserve_steps=20.0, reserve_full_load=0.0)).lane
    assert fixed is not None and fixed.reserve_s(aim, 0.0) == pytest.approx(20 * aim)
    svc = s.load.service
    # A young decode's bank of 5 aims: below the reserve at load 0.5, enough at load 0.1.
    assert lane.token_allowance(svc, aim, 1, 0, False, 5 * aim, load=0.5) == 0
    assert lane.token_allowance(svc, aim, 1, 0, False, 5 * aim, load=0.1) > 0
    with pytest.raises(ValueError, match="reserve_full_load"):
        BatchClassConfig(reserve_full_load=-1.0)



def _batch_step_in_flight(interactive: bool, **batch: object) -> tuple[Scheduler, FakeExecutor, Run, float]:
    """A unit whose step in flight (planned at the returned time) holds batch prompt tokens,
    alone or beside an interactive decode."""
    s = Scheduler(_config(**batch))
    ex, now = FakeExecutor(time_fn=_time), 0.0
    if interactive:
        s.add_request(_req("i0", 64, 200, now), now)
    for i in range(3):
        s.add_request(_req(f"b{i}", 800, 3, now, BATCH), now)
    for _ in range(200):
        decision = s.schedule(now)
        assert isinstance(decision, Run)
        plan = decision.plan
        if plan.num_prefill_tokens and (not interactive or "i0" in s.decodes.reqs):
            return s, ex, decision, now
        result = ex.execute(plan)
        now += result.device_time_s
        s.on_step_done(plan, result, now)
    raise AssertionError("no batch chunk was scheduled")


@pytest.mark.parametrize("interactive", [False, True])
def test_a_prompt_arriving_during_a_batch_step_is_predicted_to_wait_for_its_batch_part(interactive: bool) -> None:
    s, ex, decision, start = _batch_step_in_flight(interactive)
    plan, svc, lane = decision.plan, s.load.service, s.lane
    assert lane is not None and all(s.requests[r].is_batch for r in plan.prefill_context)
    own_decodes = sum(not r.is_batch for r in s.decodes.reqs.values())
    assert own_decodes == int(interactive)
    end = start + svc.step_time(plan.num_prefill_tokens, plan.num_decode_seqs)
    own_end = start + svc.step_time(0, own_decodes) if own_decodes else start
    now = start + 0.001
    # Alone, the batch step delays a prompt by all its remaining time; beside an interactive
    # decode, by what its batch work adds to the step (the decode would run anyway).
    owed = (end - now) - max(0.0, own_end - now)
    assert owed > 0.002
    predicted = s.predicted_queue_delay_s(now, 100, corrected=False)
    with pytest.MonkeyPatch.context() as mp:  # the same prediction without the batch step's wait
        mp.setattr(BatchLane, "delay_s", lambda self, now: 0.0)
        queueing = s.predicted_queue_delay_s(now, 100, corrected=False)
    assert predicted - queueing == pytest.approx(owed)
    assert lane.delay_s(now) == pytest.approx(owed)
    result = ex.execute(plan)
    s.on_step_done(plan, result, start + result.device_time_s)
    assert lane.delay_s(start + result.device_time_s) == 0.0, "no batch work in flight: nothing to wait for"


def test_without_predict_wait_the_prediction_leaves_the_batch_wait_to_the_correction() -> None:
    s, _, _, start = _batch_step_in_flight(False, predict_wait=False)
    assert s.lane is not None and s.lane.delay_s(start + 0.001) == 0.0
    predicted = s.predicted_queue_delay_s(start + 0.001, 100, corrected=False)
    with pytest.MonkeyPatch.context() as mp:  # nothing to take out: the lane adds no wait
        mp.setattr(BatchLane, "delay_s", lambda self, now: 0.0)
        assert predicted == s.predicted_queue_delay_s(start + 0.001, 100, corrected=False)
