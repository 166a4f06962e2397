"""Two simulated units behind tidalserve's request router, routed as configs/prod.yaml routes its
units: configs/sim.yaml's application with two ServingUnit replicas and prod.yaml's
`request_router_config` (`TidalRequestRouter`, its routing-stats period), at /fleet, deployed
beside the session's applications for this module and removed after it. Real Serve, real HTTP,
the official `openai` client. Which unit served what is read from Ray's metrics export, as
Prometheus scrapes it: Serve's `replica_healthy` names the application's units, and each unit's
`tidal_requests_arrived` and prefix-cache counters say what reached it. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.system_prompts import system_prompt
from loadgen.client import ClientConfig
from loadgen.records import Trace
from loadgen.replay import ReplayConfig, replay_async
from tests.integration.conftest import ServeCluster, deployed_beside
from tests.integration.reliability.cluster import app_from_config, routed_fleet
from tests.integration.reliability.load import read_records

pytestmark = pytest.mark.ray
APP, PREFIX, UNITS = "fleet", "/fleet", 2
SIM_MODEL = "sim-llama-70b-a100"
BLOCK = 16  # the simulated unit's KV block size (engine.block_size's default)


def fleet_app() -> dict[str, Any]:
    """configs/sim.yaml's application with two units and configs/prod.yaml's request router."""
    app = routed_fleet(app_from_config("sim", APP, PREFIX), UNITS)
    (unit,) = [d for d in app["deployments"] if d["name"] == "ServingUnit"]
    assert unit["request_router_config"]["request_router_class"].endswith(":TidalRequestRouter")
    return app


@pytest.fixture(scope="module")
def fleet(serve_cluster: ServeCluster) -> Iterator[str]:
    with deployed_beside(serve_cluster, fleet_app()) as url:
        yield url


def _scrape(serve_cluster: ServeCluster) -> list[Any]:
    text = httpx.get(f"http://127.0.0.1:{serve_cluster.metrics_port}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _fleet_units(samples: list[Any]) -> set[str]:
    return {s.labels["replica"] for s in samples if s.name == "ray_serve_deployment_replica_healthy"
            and s.labels.get("application") == APP and s.labels.get("deployment") == "ServingUnit" and s.value == 1}


def _per_unit(serve_cluster: ServeCluster, name: str, want: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """{fleet unit: value of counter `name`} once `want(that dict)` holds (Ray exports about every
    10 s), or the last scrape's values after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _scrape(serve_cluster)
        units = _fleet_units(samples)
        values = dict.fromkeys(units, 0.0)
        for s in samples:
            if s.name == name and s.labels.get("unit") in units:
                values[s.labels["unit"]] += s.value
        if (len(units) == UNITS and want(values)) or time.monotonic() > deadline:
            return values
        time.sleep(1.0)


def test_a_burst_is_spread_over_both_units(fleet: str, serve_cluster: ServeCluster) -> None:
    # Every request of the burst is routed before any unit reports again (a report a second):
    # on the reports alone all of them would go to the one unit that looked best at the last.
    n = 32

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post(f"{fleet}/v1/completions", json={
            "model": SIM_MODEL, "prompt": f"request {i}: " + "word " * 200, "max_tokens": 8, "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(n))))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert all(s in (200, 429) for s in statuses), statuses
    assert all("retry-after" in r.headers for r in responses if r.status_code == 429)
    reached = sum(1 for r in responses if r.status_code == 200 or r.headers.get("x-tidal-refused-by") == "unit")
    assert reached >= n // 2, statuses  # the door let most through: the units are far from full
    arrived = _per_unit(serve_cluster, "ray_tidal_requests_arrived_total", lambda v: sum(v.values()) >= reached)
    assert len(arrived) == UNITS and sum(arrived.values()) >= reached, arrived
    assert min(arrived.values()) >= reached // 4, arrived  # both units took a fair part of it


def test_each_prefix_goes_back_to_the_unit_that_holds_it(fleet: str, serve_cluster: ServeCluster) -> None:
    # Four fresh ~600-token system prompts, sent together (so spread over both units), then each
    # again, together, once the units have reported since (a report a second): every repeat must
    # find its whole prefix cached, i.e. reach its first unit. (Sent at once after the first round,
    # a repeat can lose its unit: a match is worth the prefill it saves, ~0.09 s for 600 tokens on
    # this unit, and a report still showing the first round's queue there can outweigh that.)
    client = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0, timeout=120)
    systems = [system_prompt(950 + i) for i in range(4)]

    async def ask(system: str, question: str) -> Any:
        r = await client.chat.completions.create(model=SIM_MODEL, max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage

    async def rounds() -> tuple[list[Any], list[Any]]:
        first = await asyncio.gather(*(ask(s, "Can a refund be escalated?") for s in systems))
        await asyncio.sleep(2.5)
        again = await asyncio.gather(*(ask(s, "Who approves a replacement?") for s in systems))
        await client.close()
        return list(first), list(again)

    before = _per_unit(serve_cluster, "ray_tidal_prefix_cache_hit_requests_total", lambda v: True, 0)
    first, again = asyncio.run(rounds())
    assert all(u.prompt_tokens_details.cached_tokens == 0 for u in first), first
    for u in again:  # the system prompt's full blocks, up to where the question differs
        assert 512 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens, again
    hits = _per_unit(serve_cluster, "ray_tidal_prefix_cache_hit_requests_total",
                     lambda v: all(v.get(u, 0) > before.get(u, 0) for u in v))
    assert all(hits[u] > before.get(u, 0) for u in hits), (before, hits)  # prefixes on both units, each kept


def test_a_replayed_trace_with_prefix_ids_meets_its_own_reuse(fleet: str, tmp_path: Any) -> None:
    # What `tidal replay` sends for a trace with prefix ids (Mooncake's hash_ids): three
    # conversations of three turns, each turn repeating the one before and adding a block, sent
    # 1.5 s apart (the units report once a second, so each turn's router sees its history's unit).
    # Every later turn must be told (usage.prompt_tokens_details.cached_tokens) that the history
    # was cached: the prompts share the trace's prefixes, and the router sent the turn to its KV.
    block = 512  # tokens per prefix id, as in Mooncake (the router's index keeps every 256th token's hash)
    ids = [tuple(range(100 * c, 100 * c + t + 1)) for t in range(3) for c in range(3)]
    trace = Trace("turns", np.arange(9) * 1.5, [block * len(i) for i in ids], [2] * 9, duration_s=13.5,
                  prefix_ids=ids, prefix_block_size=block)
    report = asyncio.run(replay_async(trace, ClientConfig(fleet, model=SIM_MODEL), ReplayConfig(
        progress=False, plots=False, retries=None), tmp_path))
    rows = read_records(tmp_path)
    assert [r["status"] for r in rows] == ["ok"] * 9, rows
    for r in rows[3:]:  # the turn before is this one's start: all of it but its last partial block is cached
        previous = rows[r["index"] - 3]
        assert previous["input_tokens"] - 2 * BLOCK <= r["cached_tokens"] < r["input_tokens"], (previous, r)
    assert report.summary["prefix_cache"]["requests_with_hits"] >= 6
