"""The runner's half of prefix caching, driven by hand-made plans (no scheduler): a new request
whose first blocks were computed by another request (`NewRequestData.num_computed_tokens`)
starts there, attends over those blocks' KV, writes nothing into them, and samples the same
greedy tokens as a run of it with no cache. On the tiny random-weight model (portable
attention, and the Triton kernel under its interpreter when Triton is installed) and on
SmolLM2 with a long shared system prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.executor import LocalExecutor
from actors.llm_engine import LLMEngine
from actors.paged_attention import HAVE_TRITON
from tests.actors.conftest import TRITON_READY
from tests.model_helpers import GREEDY, local_executor, make_engine, save_tiny_checkpoint, smollm2_path
from tidal_core import SamplingParams
from tidal_core.plan import NewRequestData, StepPlan

BS = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-prefix"), seed=3)


class Driver:
    """Steps an executor with hand-made plans: every request's prompt in chunks, then decodes."""

    def __init__(self, ex: LocalExecutor) -> None:
        self.ex = ex
        self.step = 0
        self.pending: list[NewRequestData] = []
        self.prefill: dict[str, list[int]] = {}  # rid -> chunk sizes still to run
        self.context: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], blocks: list[int], cached: int = 0,
            chunks: list[int] | None = None) -> None:
        self.pending.append(NewRequestData(rid, prompt, len(prompt), GREEDY, blocks, cached))
        self.prefill[rid] = list(chunks or [len(prompt) - cached])
        self.context[rid] = cached
        self.outputs[rid] = []

    def run(self, decodes: int, finish: list[str] | None = None) -> None:
        """One step (decodes of every request past its prompt, next chunks of the others), then
        `decodes - 1` decode-only steps; finished requests are dropped on the first."""
        for i in range(decodes):
            sched: dict[str, int] = {r: 1 for r, c in self.prefill.items() if not c and r in self.outputs}
            ctx: dict[str, int] = {}
            for rid, chunks in self.prefill.items():
                if chunks:
                    sched[rid] = chunks.pop(0)
                    ctx[rid] = self.context[rid]
            done = finish if i == 0 else None
            for rid in done or []:
                sched.pop(rid, None)
                self.outputs.pop(rid, None)
            self.step += 1
            n_dec = len(sched) - len(ctx)
            plan = StepPlan(self.step, sched, ctx, self.pending, {}, done or [], n_dec, sum(ctx.values()), 0, None)
            self.pending = []
            result = self.ex.execute(plan)
            for rid, n in sched.items():
                self.context[rid] += n
            for rid, tok in result.sampled_token_ids.items():
                self.outputs[rid].append(tok)


def _kv_of(ex: LocalExecutor, blocks: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(blocks, device=ex.runner.device)
    return [t.index_select(0, index).clone() for layer in ex.runner.kv_caches for t in layer]


def _alone(path: Path, prompt: list[int], decodes: int, **kw: object) -> list[int]:
    d = Driver(local_executor(path, block_size=BS, max_model_len=128, **kw))
    d.add("x", prompt, list(range(50, 50 + -(-(len(prompt) + decodes) // BS))))
    d.run(decodes)
    return d.outputs["x"]


def check_reuse(path: Path, chunks: list[int] | None, **kw: object) -> None:
    """A reads its prompt and decodes; B arrives sharing A's first 4 blocks (cached), runs beside
    A, outlives it; both give their uncached runs' tokens, and A's blocks are never written."""
    a_prompt = list(range(10, 32))  # 22 tokens: 5 full blocks + 2
    b_prompt = [*a_prompt[:16], 200, 201, 7, 9, 40, 41, 42, 43, 44]  # shares A's first 4 blocks
    want_a, want_b = _alone(path, a_prompt, 10, **kw), _alone(path, b_prompt, 9, **kw)
    d = Driver(local_executor(path, block_size=BS, max_model_len=128, **kw))
    a_blocks = [3, 9, 4, 12, 6, 0, 7, 1]  # shuffled ids: the table, not the order, says where KV is
    d.add("a", a_prompt, a_blocks)
    d.run(2)
    shared = a_blocks[:4]
    before = _kv_of(d.ex, shared)
    d.add("b", b_prompt, [*shared, 20, 21, 22, 23, 24], cached=16, chunks=chunks)
    d.run(8)  # B's prefill chunks run beside A's decodes
    assert d.outputs["a"] == want_a, "the reader changed the request whose blocks it shares"
    d.run(1, finish=["a"])  # A leaves: B goes on reading the blocks A computed
    assert set(d.ex.runner.states) == {"b"}
    assert d.ex.runner.context_len("b") == len(b_prompt) + 9 - (len(chunks or [0]))
    assert d.outputs["b"] == want_b[:10 - len(chunks or [0])]
    assert all(torch.equal(x, y) for x, y in zip(before, _kv_of(d.ex, shared), strict=True)), "shared KV written"


def test_cached_prefix_gives_the_tokens_of_an_uncached_run(tiny_path: Path) -> None:
    check_reuse(tiny_path, None)


def test_cached_prefix_then_chunked_suffix(tiny_path: Path) -> None:
    check_reuse(tiny_path, [3, 6])


@pytest.mark.skipif(not (HAVE_TRITON and TRITON_READY), reason="Triton not installed")
def test_cached_prefix_triton_kernel(tiny_path: Path) -> None:
    check_reuse(tiny_path, [5, 4], attention="triton")


def test_a_cache_hit_outside_the_contract_is_refused(tiny_path: Path) -> None:
    prompt = list(range(10, 30))
    for cached, blocks, why in [(6, [0, 1, 2, 3, 4], "not a whole block"), (20, [0, 1, 2, 3, 4], "the whole prompt"),
                                (12, [0, 1], "beyond its blocks")]:
        d = Driver(local_executor(tiny_path, block_size=BS, max_model_len=128))
        d.add("b", prompt, blocks, cached=cached, chunks=[max(1, len(prompt) - cached)])
        with pytest.raises(AssertionError, match="cached tokens"):
            d.run(1)
        assert "b" not in d.ex.runner.states, why


def test_smollm2_long_system_prompt_reused() -> None:
    """A ~600-token shared prefix on the real model: the second request computes only its own tail."""
    path = smollm2_path()
    system = [(i * 37) % 4000 + 100 for i in range(608)]  # 38 blocks of 16
    first, second = [*system, 504, 3458, 282, 4649], [*system, 1000, 1001, 1002, 42, 43]
    bs, decodes = 16, 6
    kw: dict[str, object] = dict(block_size=bs, max_model_len=1024, kv_cache_gb=0.2)
    solo = Driver(local_executor(path, **kw))
    solo.add("x", second, list(range(60, 60 + 40)))
    solo.run(decodes)
    d = Driver(local_executor(path, **kw))
    d.add("a", first, list(range(0, 40)))
    d.run(1)
    shared = list(range(0, 38))
    before = _kv_of(d.ex, shared[-2:])
    d.add("b", second, [*shared, 45, 46], cached=len(system))
    d.run(decodes, finish=["a"])
    assert d.outputs["b"] == solo.outputs["x"]
    assert all(torch.equal(x, y) for x, y in zip(before, _kv_of(d.ex, shared[-2:]), strict=True))


# ---- through the real core Scheduler with prefix caching on -------------------------------------
SHARED = list(range(30, 63))  # 33 tokens: 8 full blocks of 4 and one token
FAMILY = [[*SHARED, 7, 8, 9], [*SHARED, 100, 101], [*SHARED[:20], 5, 6, 7, 8, 9, 10], [*SHARED, 7, 8, 9]]
LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(path: Path, cache: bool, **kw: object) -> LLMEngine:
    ex = local_executor(path, block_size=BS, max_model_len=96, **kw)
    return make_engine(ex, enable_prefix_caching=cache)


def test_scheduler_driven_reuse_is_token_identical(tiny_path: Path) -> None:
    """One after another (each hits the blocks the previous ones left cached), then all at once."""
    off = _engine(tiny_path, False)
    want = [c.token_ids for c in off.generate(FAMILY, LONG)]
    on = _engine(tiny_path, True)
    got = []
    for prompt in FAMILY:
        got += [c.token_ids for c in on.generate([prompt], LONG)]
    stats = on.scheduler.stats
    assert got == want
    assert stats.prefix_cache_hit_requests == 3 and stats.prefix_cache_hit_tokens == 32 + 20 + 32
    assert off.scheduler.stats.prefix_cache_hit_tokens == 0
    assert [c.token_ids for c in on.generate(FAMILY, LONG)] == want  # a batch over the warm cache
    on.scheduler.check_integrity()


def test_reuse_survives_preemption(tiny_path: Path) -> None:
    want = [c.token_ids for c in _engine(tiny_path, False).generate(FAMILY, LONG)]
    tight = _engine(tiny_path, True, max_num_blocks=24)
    got = [c.token_ids for c in tight.generate(FAMILY, LONG)]
    stats = tight.scheduler.stats
    assert sum(stats.preempted.values()) > 0, "the tiny pool must force a preemption"
    assert stats.prefix_cache_hit_requests > 0, "a resumed or later request must reuse cached blocks"
    assert got == want
    tight.scheduler.check_integrity()
