"""Disconnect storm (issue 8, item 4): streaming clients leave at random points and nothing leaks.

200 streaming clients on the simulated unit and 20 on the real SmolLM2 unit, started over a
couple of seconds, each cut at a seeded random point: after a random time (possibly before the
response headers, while queued or mid-prefill) or after a random number of SSE lines
(mid-decode); short ones may finish first. Afterwards the unit must hold no request, no stream
and no KV block, and the scheduler's integrity check must pass (`unit_state(check=True)`); the
unit must still be healthy and serve a request.
"""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest

from tests.integration.reliability.cluster import LOCAL_MODEL, SIM_MODEL, is_drained, unit_state, wait_drained
from tests.integration.reliability.storm import Storm, disconnect_storm

pytestmark = pytest.mark.ray


def _storm_then_drained(url: str, app: str, model: str, storm: Storm) -> None:
    before = unit_state(app)
    results = asyncio.run(disconnect_storm(url, model, storm))
    kinds = collections.Counter((r["status"], "done" if r["done"] else "cut" if r["cut"] else "-") for r in results)
    print(app, dict(kinds))
    assert len(results) == storm.clients
    # Every client got an answer or left: 200 streams, 429 (admission) or nothing yet (cut before headers).
    assert {r["status"] for r in results} <= {200, 429, None}, [r for r in results if r["status"] not in (200, 429)]
    assert all(r["retry_after"] for r in results if r["status"] == 429)
    cut_streams = sum(1 for r in results if r["status"] == 200 and r["cut"])
    assert cut_streams > 0, "no stream was cut mid-way: the storm tested nothing"

    state, waited = wait_drained(app, timeout_s=60.0)
    print(app, f"drained in {waited:.2f} s", {k: state[k] for k in ("finished", "rejected", "num_steps")})
    assert is_drained(state), state
    assert state["healthy"] and state["unit"] == before["unit"], "the storm cost the unit its life"
    aborted = state["finished"].get("abort", 0) - before["finished"].get("abort", 0)
    assert aborted > 0, state["finished"]
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_storm_of_200_on_the_simulated_unit(sim_server_url: str) -> None:
    # Short prompts keep most clients admitted, so most cuts land on running streams.
    storm = Storm(200, seed=8, prompt_tokens=(16, 200), max_tokens=(16, 400), spread_s=4.0)
    _storm_then_drained(sim_server_url, "sim", SIM_MODEL, storm)


def test_storm_of_20_on_the_smollm2_unit(local_server_url: str) -> None:
    storm = Storm(20, seed=9, prompt_tokens=(8, 80), max_tokens=(8, 96), spread_s=1.0, cut_after_s=(0.0, 3.0),
                  cut_after_lines=(0, 30))
    _storm_then_drained(local_server_url, "local", LOCAL_MODEL, storm)
