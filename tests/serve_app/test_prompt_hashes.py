"""A prompt's block hashes are computed once per request, at the ingress, and read by the request
router and the unit; a request without them (an older client, a direct handle call) or with
hashes of another scheme (namespace, block size) is hashed by the unit itself.

The normal path runs in-process: the official `openai` client over the ingress app (ASGI), the
Serve router's choice, the `GenerateRequest` pickled across as Serve sends it, and the unit's
`EngineLoop` on the real core Scheduler with prefix caching on. The executor models the KV store
(tests/core/test_prefix_cache_properties.py's): a hit that hands a request blocks not holding
exactly its own prefix fails the step. Hash calls are counted by wrapping `block_hashes` in every
module that holds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

import tidal_core.block_hash as block_hash
from serve_app.engine_loop import EngineLoop
from serve_app.ingress import build_app
from serve_app.openai.server import OpenAIServer
from serve_app.request_router import TidalRequestRouter
from serve_app.unit_api import GenerateChunk, GenerateRequest, ModelInfo
from tests.core.test_prefix_cache_properties import KvModelExecutor
from tests.serve_app.openai_fakes import EOS, MODEL
from tests.serve_app.test_request_router import replica
from tidal_core import SamplingParams, Scheduler, SchedulerConfig, StepPlan, StepResult, preset
from tidal_core.block_hash import HashScheme, PromptHashes

BS = 16
CFG = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512, max_model_len=2048, block_size=BS,
                      num_kv_blocks=512, enable_prefix_caching=True)
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one line. " * 30}


class KvExecutor:
    """`KvModelExecutor` behind the async executor interface; a broken check fails the step and is
    kept in `failures`. The sampled token depends on the prompt, so outputs show what was run."""

    def __init__(self) -> None:
        self.inner = KvModelExecutor(BS, lambda rid: 300 + sum(self.inner.tokens[rid]) % 97)
        self.failures: list[str] = []

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        try:
            return self.inner.execute(plan)
        except AssertionError as err:
            self.failures.append(str(err))
            raise


def make_loop(namespace: str = "") -> EngineLoop:
    cfg = dataclasses.replace(CFG, prefix_cache_namespace=namespace)
    return EngineLoop(Scheduler(preset("continuous", cfg)), KvExecutor())


class InProcessUnit:
    """An `EngineClient` for the normal path without Ray: the router's choice in the ingress's
    process, then the request pickled across to the unit's engine loop."""

    def __init__(self, loop: EngineLoop, ingress_hashes: bool = True) -> None:
        self.loop = loop
        self.model_info = ModelInfo(MODEL, 2048, (EOS,), "hf",
                                    hash_scheme=loop.hash_scheme if ingress_hashes else None)
        self.router = TidalRequestRouter.__new__(TidalRequestRouter)
        self.router.initialize_state(seed=0, block_size=BS, index_blocks=4096)
        self.replicas = [replica("u0"), replica("u1")]
        self.sent: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        await self.router.choose_replicas(self.replicas, SimpleNamespace(args=[request], kwargs={}))
        self.sent.append(request)
        async for chunk in self.loop.generate(pickle.loads(pickle.dumps(request))):
            yield chunk

    async def health(self) -> bool:
        return True


@pytest.fixture
def hash_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every `block_hashes` call (its prompt length), wherever the function was imported."""
    calls: list[int] = []
    original = block_hash.block_hashes

    def counted(token_ids: Any, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(token_ids))
        return original(token_ids, *args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "block_hashes", None) is original:
            monkeypatch.setattr(module, "block_hashes", counted)
    yield calls


async def _conversation(tok: Any, unit: InProcessUnit) -> list[tuple[list[str], int, int]]:
    """Four chat requests sharing the system prompt (one with n=2): each one's texts, prompt
    tokens and cached tokens."""
    app = build_app(OpenAIServer(unit, tok))
    oai = openai.AsyncOpenAI(base_url="http://ingress/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))
    out = []
    for question, n in (("Is it raining?", 1), ("Is it raining?", 1), ("Who wrote it?", 2), ("Why?", 1)):
        r = await oai.chat.completions.create(model=MODEL, max_completion_tokens=4, n=n,  # type: ignore[call-overload]
                                              messages=[SYSTEM, {"role": "user", "content": question}])
        details = r.usage.prompt_tokens_details
        out.append(([c.message.content for c in r.choices], r.usage.prompt_tokens,
                    details.cached_tokens if details else -1))
    await unit.loop.stop()
    return out


@pytest.mark.anyio
async def test_the_normal_path_hashes_each_prompt_once_with_the_same_results(
        tok: Any, hash_calls: list[int]) -> None:
    unit = InProcessUnit(make_loop())
    once = await _conversation(tok, unit)
    assert len(hash_calls) == 4, f"one hash per request (n=2 included), got {hash_calls}"
    assert all(r.prompt_hashes is not None for r in unit.sent)
    assert unit.router._prefix is not None and unit.router._prefix.num_affinity >= 3  # the router read them
    ex = unit.loop.executor
    assert isinstance(ex, KvExecutor) and not ex.failures and ex.inner.num_hits >= 4
    # The control: an ingress that does not hash (no scheme from the unit): the router and the
    # unit each hash every prompt again; what the client gets is the same.
    hash_calls.clear()
    before = await _conversation(tok, InProcessUnit(make_loop(), ingress_hashes=False))
    assert len(hash_calls) == 5 + 5, hash_calls  # the router and the unit, each once per engine request
    assert once == before
    (_, prompt, first), (_, _, again), *others = once
    assert prompt > 300 and first == 0 and again == (prompt - 1) // BS * BS
    assert all(256 <= cached < prompt for _, _, cached in others), once


def _gen(rid: str, ids: list[int], hashes: PromptHashes | None = None) -> GenerateRequest:
    return GenerateRequest(rid, ids, SamplingParams(max_tokens=2), time.time(), prompt_hashes=hashes)


async def _cached(loop: EngineLoop, gen: GenerateRequest) -> int:
    chunks = [c async for c in loop.generate(gen)]
    assert all(c.error is None for c in chunks), chunks
    return chunks[-1].num_cached_tokens


def _run(fn: Callable[[], Any]) -> Any:
    return asyncio.run(fn())


PROMPT_P = list(range(1000, 1100))  # 100 tokens: 6 full blocks, 96 tokens cacheable
PROMPT_Q = list(range(2000, 2100))
OTHERS = [list(range(3000 + 100 * k, 3100 + 100 * k)) for k in range(3)]  # unrelated to P and to each other


def test_a_request_without_hashes_is_hashed_by_the_unit(hash_calls: list[int]) -> None:
    async def main() -> list[int]:
        loop = make_loop()
        assert loop.hash_scheme is not None
        cached = [await _cached(loop, _gen("a", PROMPT_P)), await _cached(loop, _gen("b", [*PROMPT_P, 5]))]
        with_hashes = await _cached(loop, _gen("c", [*PROMPT_P, 6], loop.hash_scheme.hash([*PROMPT_P, 6])))
        loop.sched.check_integrity()
        await loop.stop()
        return [*cached, with_hashes]

    assert _run(main) == [0, 96, 96]
    assert hash_calls == [100, 101, 101]  # the unit's two, then the caller's one (the unit reused it)


def test_hashes_of_another_namespace_or_block_size_are_never_looked_up(hash_calls: list[int]) -> None:
    unit_scheme = HashScheme(BS, "model:adapter-b")
    p_here = unit_scheme.hash(PROMPT_P).hashes  # what the unit will have cached for P

    async def main() -> tuple[list[int], KvExecutor]:
        loop = make_loop("model:adapter-b")
        assert loop.hash_scheme == unit_scheme
        cached = [await _cached(loop, _gen("p", PROMPT_P))]
        # Other prompts carrying values that match P's cached blocks, labelled with other schemes: a
        # unit that looked them up would hand them the KV of P (the executor's check would fail).
        for rid, ids, scheme in (("q-ns", OTHERS[0], HashScheme(BS, "model:adapter-a")),
                                 ("q-bs", OTHERS[1], HashScheme(8, "model:adapter-b"))):
            cached.append(await _cached(loop, _gen(rid, ids, PromptHashes(scheme, p_here))))
        # P labelled with another namespace: ignored and rehashed here, so the true hit is found.
        other = HashScheme(BS, "model:adapter-a").hash(PROMPT_P)
        cached.append(await _cached(loop, _gen("p-ns", [*PROMPT_P, 7], other)))
        # The right label but a count that does not fit the prompt: not used either.
        cached.append(await _cached(loop, _gen("q-short", OTHERS[2], PromptHashes(unit_scheme, p_here[:2]))))
        loop.sched.check_integrity()
        await loop.stop()
        ex = loop.executor
        assert isinstance(ex, KvExecutor)
        return cached, ex

    cached, ex = _run(main)
    assert cached == [0, 0, 0, 96, 0] and not ex.failures
    assert ex.inner.num_hits == 1
    # Each foreign label cost the unit a hash of its own (besides the test's two `hash` calls).
    assert hash_calls.count(100) == 2 + 1 + 3 and hash_calls.count(101) == 1


def test_the_kv_check_catches_a_wrong_prefix_hit() -> None:
    """The detector the test above relies on: hashes with the unit's own label are trusted (the
    ingress hashes the tokens it sends), so values of P sent with Q's tokens hand Q P's KV."""
    async def main() -> KvExecutor:
        loop = make_loop()
        await _cached(loop, _gen("p", PROMPT_P))
        assert loop.hash_scheme is not None
        forged = PromptHashes(loop.hash_scheme, loop.hash_scheme.hash(PROMPT_P).hashes)
        chunks = [c async for c in loop.generate(_gen("q", PROMPT_Q, forged))]
        assert chunks[-1].error is not None and chunks[-1].error.code == "engine_failed"
        await loop.stop()
        ex = loop.executor
        assert isinstance(ex, KvExecutor)
        return ex

    ex = _run(main)
    assert ex.failures and "does not hold its prefix" in ex.failures[0]
