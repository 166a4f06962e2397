"""Property-based tests of the batch class: random interactive and batch arrivals, aborts and
steps through the real Scheduler, every invariant checked after every operation."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.test_scheduler_properties import STOP, Harness, configs
from tidal_core import Idle, Request, Run, SamplingParams, SchedulerConfig, WaitUntil
from tidal_core.batch_config import BatchClassConfig
from tidal_core.service_class import ServiceClass

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 170), st.integers(1, 40), st.booleans(), st.booleans()),
        st.tuples(st.just("backlog"), st.integers(2, 30), st.integers(1, 170), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 200)),
        st.tuples(st.just("step"), st.floats(0.0, 0.5)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.3)),
    ),
    min_size=1, max_size=120,
)


class ClassHarness(Harness):
    def __init__(self, cfg: SchedulerConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        self.batch_ids: set[str] = set()

    def arrive_class(self, prompt: int, max_tokens: int, stop: bool, batch: bool) -> None:
        rid = f"c{self.s.stats.num_arrived}"
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset({STOP}) if stop else frozenset())
        cls = ServiceClass.BATCH if batch else ServiceClass.INTERACTIVE
        rej = self.s.add_request(Request(rid, prompt, sp, self.now, service_class=cls), self.now)
        if rej is None:
            self.accepted.append(rid)
            if batch:
                self.batch_ids.add(rid)
            return
        if batch:  # a batch request is refused only for its queue's bound or its length, with a retry time
            assert rej.reason in {"batch_queue_full", "too_long"}, rej
            assert rej.reason == "too_long" or rej.retry_after_s >= self.cfg.batch.min_retry_after_s

    def step_checked(self) -> bool:
        s = self.s
        queued_batch = {r.request_id for r in s.q.batch.reqs}
        decision = s.schedule(self.now)
        if isinstance(decision, Idle):
            assert not s.q.batch, "idle with batch work queued"
        if isinstance(decision, Run):
            started = [n.request_id for n in decision.plan.new_requests if n.request_id in queued_batch]
            assert not started or not s.waiting, "a batch request started while interactive ones wait"
            if s.waiting and s.q.num_batch_running:
                assert s.num_running < s.max_running(), "batch requests kept slots interactive ones wait for"
        # Hand the decision back through the base harness's checks (it re-schedules from scratch).
        if isinstance(decision, Run):
            plan = decision.plan
            result = self.ex.execute(plan)
            self.now += result.device_time_s
            out = s.on_step_done(plan, result, self.now)
            self.ended.extend(r.request_id for r in out.finished)
            return True
        if isinstance(decision, WaitUntil):
            self.now = decision.deadline_s
            return True
        return False


def _with_batch(cfg: SchedulerConfig, queue_tokens: int) -> SchedulerConfig:
    return dataclasses.replace(cfg, batch=BatchClassConfig(max_queue_tokens=queue_tokens, max_kv_usage=0.8))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), OPS, st.integers(0, 2**16), st.integers(1, 2000))
def test_mixed_classes_keep_every_invariant_and_lose_no_batch_request(cfg: SchedulerConfig, ops: list[tuple],
                                                                      seed: int, queue_tokens: int) -> None:
    h = ClassHarness(_with_batch(cfg, queue_tokens), seed)
    for op in ops:
        kind = op[0]
        if kind == "arrive":
            h.arrive_class(*op[1:])
        elif kind == "backlog":
            for i in range(op[1]):
                h.arrive_class(1 + (op[2] * (i + 1)) % 170, op[3], False, True)
        elif kind == "abort":
            h.abort(op[1])
        elif kind == "step":
            h.stop_prob = op[1]
            h.step_checked()
        else:
            h.now += op[1]
        h.check()
    for _ in range(40_000):
        if not h.step_checked():
            break
        h.check()
    assert not h.s.has_unfinished
    assert sorted(h.ended) == sorted(h.accepted), "every accepted request, batch ones too, ends exactly once"
    assert h.s.blocks.num_free_blocks == h.s.blocks.num_blocks, "KV leaked"
    stats = h.s.stats
    assert sum(stats.preempted_by_class.values()) == stats.num_preempted
    if stats.preempted["batch_yield"]:
        assert stats.preempted_by_class["batch"] >= stats.preempted["batch_yield"]
