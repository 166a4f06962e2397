"""Property-based tests: random arrivals, aborts and step results through the real Scheduler on a
virtual clock, with every invariant checked after every operation."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import FakeExecutor
from tidal_core import (
    MICROWAIT_HARD_CAP_S,
    POLICIES,
    BatchingConfig,
    Idle,
    RegimeConfig,
    Request,
    Run,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    WaitUntil,
    preset,
)

STOP = 7


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    policy = draw(st.sampled_from(POLICIES))
    batch = draw(st.integers(1, 16))
    block = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 160))
    chunked = draw(st.booleans())
    tokens = draw(st.integers(batch, 96)) if chunked else draw(st.integers(max(batch, max_model_len), 256))
    blocks_needed = -(-max_model_len // block)
    num_blocks = draw(st.integers(blocks_needed, blocks_needed * 6))
    t_min = draw(st.floats(0.0, 0.02))
    batching = BatchingConfig(t_min_s=t_min, t_max_s=t_min + draw(st.floats(0.0, 0.05)),
                              static_batch_size=draw(st.integers(1, 16)), static_timeout_s=draw(st.floats(0.0, 0.3)))
    # Short time constants so every regime occurs within a test's few simulated seconds.
    regime = RegimeConfig(min_dwell_s=draw(st.floats(0.0, 0.05)))
    base = SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=tokens, max_model_len=max_model_len,
                           block_size=block, num_kv_blocks=num_blocks, enable_chunked_prefill=chunked,
                           kv_watermark=draw(st.sampled_from([0.0, 0.01, 0.1])), batching=batching,
                           cuda_graph_buckets=(1, 2, 4, 8), load_tau_s=draw(st.floats(0.01, 0.5)),
                           regime=regime)
    cfg = preset(policy, base)
    if cfg.admission.enabled:
        cfg = dataclasses.replace(cfg, admission=dataclasses.replace(
            cfg.admission, max_queue_len=draw(st.integers(1, 40)), target_ttft_s=draw(st.floats(0.01, 2.0)),
            target_tpot_s=draw(st.one_of(st.none(), st.floats(0.002, 0.5)))))
    return cfg


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 170), st.integers(1, 40), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("burst"), st.integers(2, 30), st.integers(1, 170), st.integers(1, 40)),
        st.tuples(st.just("abort"), st.integers(0, 200)),
        st.tuples(st.just("step"), st.floats(0.0, 0.5)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.3)),
    ),
    min_size=1, max_size=120,
)


class Harness:
    def __init__(self, cfg: SchedulerConfig, seed: int) -> None:
        self.cfg = cfg
        self.s = Scheduler(cfg)
        self.rng = random.Random(seed)
        self.stop_prob = 0.1
        self.ex = FakeExecutor(token_fn=lambda rid: STOP if self.rng.random() < self.stop_prob else 100)
        self.now = 0.0
        self.accepted: list[str] = []
        self.ended: list[str] = []
        self.saw_regimes: set[str] = set()

    def arrive(self, prompt: int, max_tokens: int, stop: bool, min_tokens: int) -> None:
        rid = f"r{len(self.accepted)}-{self.s.stats.num_arrived}"
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset({STOP}) if stop else frozenset(),
                            min_tokens=min(min_tokens, max_tokens))
        rej = self.s.add_request(Request(rid, prompt, sp, self.now), self.now)
        if rej is None:
            self.accepted.append(rid)
        else:
            assert rej.retry_after_s >= 0 and rej.reason in {"too_long", "queue_full", "prefill_backlog", "kv_pressure",
                                                             "costly_prompt"}
            assert rej.reason != "too_long" or prompt >= self.cfg.max_model_len

    def burst(self, count: int, prompt: int, max_tokens: int) -> None:
        for i in range(count):
            self.arrive(1 + (prompt * (i + 1)) % 170, max_tokens, i % 2 == 0, 0)

    def abort(self, idx: int) -> None:
        if self.accepted:
            rid = self.accepted[idx % len(self.accepted)]
            if self.s.abort(rid, self.now) is not None:
                self.ended.append(rid)

    def step(self) -> bool:
        s, cfg = self.s, self.cfg
        decision = s.schedule(self.now)
        if isinstance(decision, Idle):
            assert not s.waiting and not s.prefilling and not s.decodes
            return False
        if isinstance(decision, WaitUntil):
            wait = decision.deadline_s - self.now
            assert wait > 0
            assert not s.decodes, "a wait stalled running decodes"
            if cfg.batching.mode == "adaptive":
                assert wait <= MICROWAIT_HARD_CAP_S + 1e-12
                assert s.current_regime.value == "steady", "micro-wait outside STEADY"
            self.now = decision.deadline_s
            return True
        assert isinstance(decision, Run)
        plan = decision.plan
        assert plan.total_tokens <= cfg.max_num_batched_tokens
        assert plan.num_seqs <= cfg.max_batch_size
        assert set(s.decodes.reqs) <= set(plan.num_scheduled_tokens), "a running decode was left out"
        if not cfg.enable_chunked_prefill:
            known = {n.request_id: (n.num_tokens, n.num_computed_tokens) for n in plan.new_requests}
            for rid, ctx in plan.prefill_context.items():
                num_tokens, cached = known[rid]
                assert ctx == cached and plan.num_scheduled_tokens[rid] == num_tokens - cached, "chunked while disabled"
        stats = s.stats.last_step
        assert stats is not None
        if cfg.batching.mode == "adaptive":
            assert stats.wait_s <= MICROWAIT_HARD_CAP_S
            if stats.regime == "light":
                assert stats.wait_s == 0.0
        result = self.ex.execute(plan)
        self.now += result.device_time_s
        out = s.on_step_done(plan, result, self.now)
        self.ended.extend(r.request_id for r in out.finished)
        for r in out.finished:
            assert r.num_output_tokens <= r.sampling.max_tokens
            assert r.num_tokens <= cfg.max_model_len
        return True

    def apply(self, op: tuple) -> None:  # type: ignore[type-arg]
        """One generated operation (an arrival, a burst, an abort, a step, time passing), then check."""
        kind = op[0]
        if kind == "arrive":
            self.arrive(*op[1:])
        elif kind == "burst":
            self.burst(*op[1:])
        elif kind == "abort":
            self.abort(op[1])
        elif kind == "step":
            self.stop_prob = op[1]
            self.step()
            self.saw_regimes.add(self.s.current_regime.value)
        else:
            self.now += op[1]
        self.check()

    def drain(self, max_steps: int) -> None:
        """Step until nothing is left (at most `max_steps`), checking after every step."""
        for _ in range(max_steps):
            if not self.step():
                break
            self.check()

    def check(self) -> None:
        self.s.check_integrity()
        assert len(self.ended) == len(set(self.ended)), "a request ended twice"
        assert 0.0 <= self.s.kv_usage() <= 1.0


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), OPS, st.integers(0, 2**16))
def test_random_traffic_keeps_every_invariant(cfg: SchedulerConfig, ops: list[tuple], seed: int) -> None:
    h = Harness(cfg, seed)
    for op in ops:
        h.apply(op)
    h.drain(20_000)
    assert not h.s.has_unfinished
    assert sorted(h.ended) == sorted(h.accepted), "every accepted request ends exactly once"
    assert h.s.blocks.num_free_blocks == h.s.blocks.num_blocks, "KV leaked"


def test_the_harness_operations_reach_every_regime() -> None:
    """Guards the property test's power: its operations (bursts, steps, time advances) on a
    config drawn from the same space must be able to drive a unit through all three regimes."""
    base = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=160, block_size=4,
                           num_kv_blocks=120, load_tau_s=0.2, regime=RegimeConfig(min_dwell_s=0.02))
    cfg = preset("adaptive", base)
    h = Harness(cfg, seed=5)
    seen: set[str] = set()
    for phase_rate, phase_len in ((0.5, 200), (40.0, 300), (400.0, 300), (0.5, 600)):
        for _ in range(phase_len):
            if h.rng.random() < min(1.0, phase_rate * 0.01):
                h.burst(1 + int(phase_rate // 40), 20 + h.rng.randint(0, 100), 8)
            h.step()
            h.now += 0.01
            seen.add(h.s.current_regime.value)
            h.check()
    assert seen == {"light", "steady", "overload"}
