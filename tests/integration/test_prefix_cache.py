"""Prefix caching end to end on SmolLM2 (configs/local.yaml as Serve deploys it, real HTTP, the
official `openai` client): a repeated ~600-token system prompt is reported as cached on the
second request (`usage.prompt_tokens_details.cached_tokens`), in chat, completions and the final
stream chunk, the greedy output is the same, and the unit's counters saw the hits. No timing is
asserted; benchmarks/prefix_cache_serve.py measures the TTFT ratio."""

from __future__ import annotations

import openai
import pytest

from benchmarks.system_prompts import system_prompt
from tests.integration.conftest import unit_state

pytestmark = pytest.mark.ray
MODEL = "smollm2-135m-instruct"
BLOCK = 16  # configs/local.yaml's engine.block_size (the default)


@pytest.fixture(scope="module")
def client(local_server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _cached(usage: object) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    assert details is not None, "usage has no prompt_tokens_details"
    return int(details.cached_tokens)


def _chat(client: openai.OpenAI, system: str, question: str) -> tuple[str, int, int]:
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, _cached(r.usage)


def test_a_repeated_system_prompt_is_cached_and_answers_the_same(client: openai.OpenAI) -> None:
    before = unit_state("local")["prefix_cache"]
    system = system_prompt(901)  # an index no other test or benchmark run uses: a cold prefix
    first, prompt_tokens, cached_first = _chat(client, system, "Can a refund be escalated?")
    assert 550 <= prompt_tokens <= 700 and cached_first == 0
    again, prompt_again, cached_again = _chat(client, system, "Can a refund be escalated?")
    assert prompt_again == prompt_tokens and again == first
    # Every full block but the one holding the last prompt token (always computed).
    assert cached_again == (prompt_tokens - 1) // BLOCK * BLOCK
    _, prompt_other, cached_other = _chat(client, system, "Who approves a replacement?")
    assert 512 <= cached_other < prompt_other and cached_other % BLOCK == 0
    after = unit_state("local")["prefix_cache"]
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= cached_again + cached_other
    assert after["prefix_cache_query_requests"] - before["prefix_cache_query_requests"] >= 3


def test_stream_and_completions_report_the_hit(client: openai.OpenAI) -> None:
    system = system_prompt(902)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise rule 3."}]
    full = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=messages)
    assert full.usage is not None and _cached(full.usage) == 0
    chunks = list(client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=messages,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert _cached(last.usage) == (full.usage.prompt_tokens - 1) // BLOCK * BLOCK
    prompt = system_prompt(903) + "\nRule 1 means"
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert _cached(one.usage) == 0 and two.choices[0].text == one.choices[0].text
    assert _cached(two.usage) == (one.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
