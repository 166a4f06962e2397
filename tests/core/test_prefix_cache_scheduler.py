"""The scheduler with prefix caching: cached prompt tokens count as computed, in every place."""

from __future__ import annotations

import dataclasses

from tests.helpers import FakeExecutor, run_until_idle
from tidal_core import Request, Run, SamplingParams, Scheduler, SchedulerConfig, preset

CACHED = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                         num_kv_blocks=64, cuda_graph_buckets=(1, 2, 4, 8), enable_prefix_caching=True)


def req(rid: str, tokens: list[int], max_tokens: int = 3, at: float = 0.0) -> Request:
    return Request(rid, len(tokens), SamplingParams(max_tokens=max_tokens), at, prompt_token_ids=tokens)


def step(s: Scheduler, ex: FakeExecutor, now: float) -> tuple[Run, float]:
    d = s.schedule(now)
    assert isinstance(d, Run), d
    r = ex.execute(d.plan)
    now += r.device_time_s
    s.on_step_done(d.plan, r, now)
    s.check_integrity()
    return d, now


def test_a_repeated_prompt_starts_at_its_first_uncached_token() -> None:
    s = Scheduler(preset("continuous", CACHED))
    ex = FakeExecutor()
    system = list(range(100, 140))  # 40 tokens = 10 full blocks
    assert s.add_request(req("a", [*system, 1, 2, 3]), 0.0) is None
    now = run_until_idle(s, ex, 0.0)
    assert s.add_request(req("b", [*system, 7, 8]), now) is None
    d, now = step(s, ex, now)
    new = {n.request_id: n for n in d.plan.new_requests}
    assert new["b"].num_computed_tokens == 40
    assert d.plan.prefill_context["b"] == 40 and d.plan.num_scheduled_tokens["b"] == 2
    b = s.requests["b"]
    assert b.num_cached_tokens == 40
    assert s.stats.prefix_cache_hit_tokens == 40 and s.stats.prefix_cache_hit_requests == 1
    assert s.stats.prefix_cache_query_requests == 2 and s.stats.prefix_cache_query_tokens == 43 + 42
    assert s.stats.num_prompt_tokens_computed == 43 + 2


def test_an_identical_prompt_still_computes_its_last_token() -> None:
    s = Scheduler(preset("continuous", CACHED))
    ex = FakeExecutor()
    prompt = list(range(32))  # exactly 8 blocks
    s.add_request(req("a", prompt), 0.0)
    now = run_until_idle(s, ex, 0.0)
    s.add_request(req("b", list(prompt)), now)
    d, _ = step(s, ex, now)
    # 7 blocks (28 tokens) at most: the 8th holds the last token, which samples the first output.
    assert d.plan.prefill_context["b"] == 28 and d.plan.num_scheduled_tokens["b"] == 4
    assert "b" in s.decodes


def test_requests_admitted_in_the_same_step_share_nothing_not_yet_computed() -> None:
    s = Scheduler(preset("continuous", CACHED))
    ex = FakeExecutor()
    shared = list(range(200, 220))
    s.add_request(req("a", [*shared, 1]), 0.0)
    s.add_request(req("b", [*shared, 2]), 0.0)
    d, now = step(s, ex, 0.0)
    assert {n.request_id: n.num_computed_tokens for n in d.plan.new_requests} == {"a": 0, "b": 0}
    s.add_request(req("c", [*shared, 3]), now)  # after the step that computed it: a hit
    d, _ = step(s, ex, now)
    assert d.plan.prefill_context["c"] == 20
    # Counted per request although recorded once per admission pass (a and b came in one).
    st = s.stats
    assert (st.prefix_cache_query_requests, st.prefix_cache_query_tokens) == (3, 3 * 21)
    assert (st.prefix_cache_hit_requests, st.prefix_cache_hit_tokens) == (1, 20)


def test_chunked_prefill_registers_blocks_as_each_chunk_completes() -> None:
    cfg = dataclasses.replace(CACHED, max_num_batched_tokens=16)
    s = Scheduler(preset("continuous", cfg))
    ex = FakeExecutor()
    long = list(range(300, 340))
    s.add_request(req("a", long), 0.0)
    _, now = step(s, ex, 0.0)  # first chunk: tokens 0-15 (4 blocks) computed
    peek = req("peek", [*long[:24], 9])
    s.add_request(peek, now)
    assert peek.expected_cached_tokens == 16  # only the computed chunk is findable
    s.abort("peek", now)
    s.add_request(req("b", [*long[:24], 9]), now)
    d, now = step(s, ex, now)  # a's second chunk takes the whole budget: b waits
    assert "b" not in d.plan.prefill_context and d.plan.prefill_context["a"] == 16
    d, now = step(s, ex, now)  # a's last 8 tokens; b joins with what a has computed by now
    assert d.plan.prefill_context["b"] == 24 and d.plan.num_scheduled_tokens["b"] == 1
    run_until_idle(s, ex, now)
    assert s.requests == {} and s.stats.prefix_cache_hit_tokens == 24


def test_the_ttft_prediction_and_backlog_see_uncached_tokens_only() -> None:
    s = Scheduler(preset("adaptive", CACHED))
    ex = FakeExecutor()
    system = list(range(1000, 1160))  # 160 tokens
    s.add_request(req("warm", [*system, 1]), 0.0)
    now = run_until_idle(s, ex, 0.0)
    base = s.predicted_queue_delay_s(now, 0)
    hit = req("hit", [*system, 2, 3])
    s.add_request(hit, now)
    assert hit.expected_cached_tokens == 160
    assert s.backlog_prefill_tokens() == 2
    miss = req("miss", list(range(5000, 5162)))
    s.add_request(miss, now)
    assert s.backlog_prefill_tokens() == 2 + 162
    assert hit.predicted_ttft_s is not None and miss.predicted_ttft_s is not None
    assert hit.predicted_ttft_s - base < miss.predicted_ttft_s - base
    s.check_integrity()


def test_preempted_request_finds_its_own_blocks_again() -> None:
    cfg = dataclasses.replace(CACHED, num_kv_blocks=16, kv_watermark=0.0, max_model_len=64)
    s = Scheduler(preset("continuous", cfg))
    ex = FakeExecutor()
    s.add_request(req("a", list(range(24)), max_tokens=30), 0.0)
    s.add_request(req("b", list(range(50, 74)), max_tokens=30), 0.0)
    now, preempted = 0.0, False
    for _ in range(200):
        d = s.schedule(now)
        if not isinstance(d, Run):
            break
        if any(n.request_id in ("a", "b") and n.num_computed_tokens for n in d.plan.new_requests):
            preempted = True
        r = ex.execute(d.plan)
        now += r.device_time_s
        s.on_step_done(d.plan, r, now)
        s.check_integrity()
    assert s.stats.num_preempted >= 1 and preempted, "the resumed request should reuse its cached blocks"
    assert s.requests == {} and s.blocks.num_free_blocks == s.blocks.num_blocks


def test_requests_without_hashes_or_ids_never_hit() -> None:
    s = Scheduler(preset("continuous", CACHED))
    ex = FakeExecutor()
    for i in range(4):
        s.add_request(Request(f"r{i}", 40, SamplingParams(max_tokens=2), 0.0), 0.0)
    run_until_idle(s, ex, 0.0)
    assert s.stats.prefix_cache_hit_tokens == 0 and s.stats.prefix_cache_query_requests == 4


def test_caching_off_takes_nothing_from_the_cache() -> None:
    s = Scheduler(preset("continuous", dataclasses.replace(CACHED, enable_prefix_caching=False)))
    ex = FakeExecutor()
    prompt = list(range(40))
    s.add_request(req("a", prompt), 0.0)
    now = run_until_idle(s, ex, 0.0)
    s.add_request(req("b", prompt), now)
    d, _ = step(s, ex, now)
    assert d.plan.prefill_context["b"] == 0 and s.stats.prefix_cache_query_requests == 0
