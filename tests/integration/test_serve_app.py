"""The Serve application end to end: real Ray Serve, real HTTP, the official `openai` client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.integration.conftest import unit_state

pytestmark = pytest.mark.ray
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(local_server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_server_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(local_server_url: str, sim_server_url: str) -> None:
    models = httpx.get(f"{local_server_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{sim_server_url}/health", timeout=10).status_code == 200


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 40


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=messages)
    chunks = list(client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=messages,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_stop_string_ends_early(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=40, temperature=0, stop=[" 8"])
    assert " 8" not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_penalties_through_the_official_client(client: openai.OpenAI) -> None:
    # Counting on, greedily, repeats ", " every other token: a frequency penalty must change that.
    plain = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=0.5)
    assert plain.choices[0].text.count(",") > penalized.choices[0].text.count(","), (plain, penalized)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, frequency_penalty=2.5)


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi " * 3000, "max_tokens": 4}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "temperature": 3.0}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0.0}, 400, "top_p"),
    ({"model": "gpt-9", "prompt": "hi"}, 400, "model"),
])
def test_bad_input_gets_a_clear_4xx(local_server_url: str, body: dict, status: int, fragment: str) -> None:
    r = httpx.post(f"{local_server_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in (err["message"] + str(err.get("param")))


def test_malformed_json_and_empty_messages(local_server_url: str) -> None:
    r = httpx.post(f"{local_server_url}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{local_server_url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_kv(local_server_url: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0.8, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{local_server_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream: closing the response drops the connection
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = unit_state("local")
        if state["num_free_blocks"] == state["num_blocks"] and state["num_requests"] == 0:
            break
        time.sleep(0.5)
    assert state["num_free_blocks"] == state["num_blocks"], state
    assert state["finished"].get("abort", 0) >= 1


def test_overload_on_the_simulated_unit_gets_429_and_every_request_ends(sim_server_url: str) -> None:
    """Several times the simulated A100's capacity at once: some requests complete, the rest are
    turned away at once with 429 + Retry-After; none hangs, none is a 5xx."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float, str | None]:
        t0 = time.perf_counter()
        r = await client.post(f"{sim_server_url}/v1/completions", json={
            "model": "sim-llama-70b-a100", "prompt": "word " * 1500, "max_tokens": 200, "ignore_eos": True})
        return r.status_code, time.perf_counter() - t0, r.headers.get("retry-after")

    async def burst() -> list[tuple[int, float, str | None]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(120)))

    results = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) > 0 and statuses.count(429) > 0
    for status, _, retry in results:
        if status == 429:
            assert retry is not None and int(retry) >= 1
    state = unit_state("sim")
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_requests"] == 0
