"""Property-based tests of prefix caching through the real Scheduler: random arrivals with shared
prefixes, aborts, preemptions and chunked prefill, with a model of the KV store riding along.

The executor here writes, for every token a plan computes, the whole prefix up to it into the
token's block slot. So a hit that hands out a block not holding exactly the request's prefix
(a block registered before its KV was written, a stale block after eviction, a hash collision)
is caught when the request is announced, and a write into a block another live request holds
(a shared block rewritten) is caught at the write.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.test_scheduler_properties import OPS, STOP, Harness, configs
from tidal_core import Request, SamplingParams, SchedulerConfig, StepPlan, StepResult, preset

FAMILIES = 3


class KvModelExecutor:
    """Tracks tables, tokens and the content of every KV slot; checks the caching contract."""

    def __init__(self, block_size: int, token_fn: object) -> None:
        self.bs = block_size
        self.token_fn = token_fn
        self.tokens: dict[str, list[int]] = {}
        self.context: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.owners: Counter[int] = Counter()
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.prefill_computed: Counter[str] = Counter()
        self.num_hits = 0

    def _drop(self, rid: str) -> None:
        self.owners.subtract(self.tables.pop(rid, []))
        self.tokens.pop(rid, None)
        self.context.pop(rid, None)

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.bs
        for rid in plan.finished_ids:
            self._drop(rid)
        for new in plan.new_requests:
            rid, c = new.request_id, new.num_computed_tokens
            assert rid not in self.tokens, f"{rid} announced twice"
            assert new.token_ids is not None
            assert c % bs == 0 and 0 <= c < new.num_tokens, f"{rid}: {c} cached tokens of {new.num_tokens}"
            table = list(new.block_ids)
            for pos in range(c):
                assert self.kv.get((table[pos // bs], pos % bs)) == tuple(new.token_ids[: pos + 1]), \
                    f"{rid}: cached block {table[pos // bs]} does not hold its prefix at {pos}"
            self.num_hits += c > 0
            self.tokens[rid], self.context[rid], self.tables[rid] = list(new.token_ids), c, table
            self.owners.update(table)
        for rid, blocks in plan.new_block_ids.items():
            self.tables[rid].extend(blocks)
            self.owners.update(blocks)
        sampled: dict[str, int] = {}
        for rid, n in plan.num_scheduled_tokens.items():
            ctx, toks, table = self.context[rid], self.tokens[rid], self.tables[rid]
            if rid in plan.prefill_context:
                assert plan.prefill_context[rid] == ctx
                self.prefill_computed[rid] += n
            for pos in range(ctx, ctx + n):
                block = table[pos // bs]
                assert self.owners[block] == 1, f"{rid} writes block {block}, which another request holds"
                self.kv[(block, pos % bs)] = tuple(toks[: pos + 1])
            self.context[rid] = ctx + n
            if ctx + n == len(toks):
                tok = self.token_fn(rid)  # type: ignore[operator]
                sampled[rid] = tok
                toks.append(tok)
        return StepResult(plan.step_id, sampled, 0.005 + 0.0001 * plan.num_prefill_tokens)


class CachingHarness(Harness):
    """The scheduler property harness with prompts drawn from a few shared prefixes."""

    def __init__(self, cfg: SchedulerConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        self.ex = KvModelExecutor(cfg.block_size, lambda rid: STOP if self.rng.random() < self.stop_prob else 100)
        self.by_id: dict[str, Request] = {}

    def arrive(self, prompt: int, max_tokens: int, stop: bool, min_tokens: int) -> None:
        family = self.rng.randrange(FAMILIES)
        shared = self.rng.randint(0, prompt)
        tokens = [1000 * (family + 1) + i for i in range(shared)]
        tokens += [100_000 + 1000 * len(self.by_id) + i for i in range(prompt - shared)]
        rid = f"r{len(self.accepted)}-{self.s.stats.num_arrived}"
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset({STOP}) if stop else frozenset(),
                            min_tokens=min(min_tokens, max_tokens))
        req = Request(rid, prompt, sp, self.now, prompt_token_ids=tokens)
        self.by_id[rid] = req
        if self.s.add_request(req, self.now) is None:
            self.accepted.append(rid)

    def step(self) -> bool:
        ran = super().step()
        for rid, req in self.by_id.items():
            if req.is_finished and req.finish_reason is not None and req.finish_reason.value != "abort" \
                    and req.num_preemptions == 0:
                # Every prompt token was either computed by a plan or taken from the cache, once.
                assert self.ex.prefill_computed[rid] + req.num_cached_tokens == req.num_prompt_tokens, rid
        return ran


def caching(cfg: SchedulerConfig) -> SchedulerConfig:
    return dataclasses.replace(cfg, enable_prefix_caching=True)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs().map(caching), OPS, st.integers(0, 2**16))
def test_random_traffic_with_shared_prefixes_keeps_every_invariant(cfg: SchedulerConfig, ops: list[tuple],
                                                                    seed: int) -> None:
    h = CachingHarness(cfg, seed)
    for op in ops:
        h.apply(op)
    h.drain(20_000)
    assert not h.s.has_unfinished
    assert sorted(h.ended) == sorted(h.accepted), "every accepted request ends exactly once"
    assert h.s.blocks.num_free_blocks == h.s.blocks.num_blocks, "KV leaked (cached blocks count as free)"
    stats = h.s.stats
    assert stats.prefix_cache_hit_tokens <= stats.prefix_cache_query_tokens


def test_the_caching_harness_produces_hits_preemptions_and_evictions() -> None:
    """Guards the property test's power: on a config from the same space, its operations must
    produce cache hits, preemptions with resumed hits, and evictions."""
    base = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=48, max_model_len=160, block_size=4,
                           num_kv_blocks=60, kv_watermark=0.0, enable_prefix_caching=True)
    h = CachingHarness(preset("continuous", base), seed=3)
    h.stop_prob = 0.02
    for i in range(400):
        if i % 3 == 0:
            h.arrive(20 + (i * 37) % 120, 30, True, 0)
        h.step()
        h.now += 0.01
        h.check()
    while h.step():
        h.check()
    cache = h.s.q.cache
    assert cache is not None
    assert h.ex.num_hits > 10 and h.s.stats.prefix_cache_hit_tokens > 0
    assert h.s.stats.num_preempted > 0 and cache.num_evictions > 0
