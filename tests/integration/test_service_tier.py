"""The batch class through the real stack: the official openai client asks for `service_tier="flex"`
from the simulated A100 unit (configs/sim.yaml) and the response says which tier served it."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from loadgen.prompts import build_prompt


@pytest.fixture(scope="module")
def sim_client(sim_server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim_server_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_flex_is_served_by_the_batch_class_and_says_so(sim_client: openai.OpenAI) -> None:
    model = _model(sim_client)
    flex = sim_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, service_tier="flex")
    assert flex.service_tier == "flex" and flex.choices[0].finish_reason in ("stop", "length")
    plain = sim_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
    assert plain.service_tier == "default"
    done = sim_client.completions.create(model=model, prompt="hello", max_tokens=3,
                                         extra_body={"service_tier": "flex"})  # no kwarg on the legacy endpoint
    assert done.service_tier == "flex"


def test_flex_streaming_chunks_carry_the_tier(sim_client: openai.OpenAI) -> None:
    stream = sim_client.chat.completions.create(model=_model(sim_client), messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, service_tier="flex", stream=True)
    tiers = {chunk.service_tier for chunk in stream}
    assert tiers == {"flex"}


def test_a_backlog_sent_at_once_is_served_not_refused_at_the_door(sim_server_url: str,
                                                                  sim_client: openai.OpenAI) -> None:
    """A nightly job's backlog sent at once: the front gates refuse an interactive request whose
    predicted time to first token passes the target, which all but the first few of these would;
    a flex request is never held to it (serve_app/openai/body_peek.py), so each one is served."""
    model = _model(sim_client)

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(c.post(f"{sim_server_url}/v1/chat/completions", json={
                "model": model, "max_tokens": 2, "service_tier": "flex",
                "messages": [{"role": "user", "content": build_prompt(1500, seed=i)}]}) for i in range(60)))

    responses = asyncio.run(send_all())
    refused = [r.json()["error"]["code"] for r in responses if r.status_code != 200]
    assert not refused, f"{len(refused)} of 60 refused: {sorted(set(refused))}"
    assert {r.json()["service_tier"] for r in responses} == {"flex"}


@pytest.mark.parametrize(("field", "value"), [("service_tier", "scale"), ("service_tier", 3), ("priority", "high"),
                                              ("priority", 1.5)])
def test_a_bad_tier_or_priority_is_a_400(sim_server_url: str, sim_client: openai.OpenAI, field: str,
                                         value: object) -> None:
    body = {"model": _model(sim_client), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{sim_server_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and field in (error.get("param") or error["message"])


def test_priority_above_zero_is_the_batch_class(sim_server_url: str, sim_client: openai.OpenAI) -> None:
    body = {"model": _model(sim_client), "prompt": "hello", "max_tokens": 2, "priority": 5}
    r = httpx.post(f"{sim_server_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"
