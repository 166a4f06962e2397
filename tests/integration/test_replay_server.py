"""`tidal replay` against our own Serve application on configs/sim.yaml (a simulated A100 unit).

The `sim_server_url` fixture (tests/integration/conftest.py) starts the application once per
session and yields its base URL. The replay is a short compressed night of the sharp day: the
checks are that every request is accounted for, the server honours max_tokens + ignore_eos, the
percentiles are ordered and the client kept to its schedule.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from loadgen.client import ClientConfig, discover_model
from loadgen.replay import ReplayConfig, replay
from loadgen.report import SUMMARY_KEYS
from loadgen.traces import load_trace

pytestmark = pytest.mark.ray


async def _served_model(url: str) -> str:
    async with httpx.AsyncClient() as client:
        model = await discover_model(client, url)
    assert model is not None, f"{url}/v1/models lists no model"
    return model


def test_replay_a_compressed_night_against_the_sim_server(sim_server_url: str, tmp_path: Path) -> None:
    # Four trace hours (00:00-04:00, the night side of the sharp day) in 36 wall seconds, ~3 req/s:
    # compressed 400x, the night is still well below one simulated A100 unit's capacity.
    trace = load_trace("day-in-life-sharp", hours=4, peak_rps=0.03, seed=3, time_scale=0.0025, max_input=1024,
                       max_output=48)
    assert 50 <= len(trace) <= 200
    client = ClientConfig(sim_server_url, model=asyncio.run(_served_model(sim_server_url)))
    report = replay(trace, client, ReplayConfig(time_scale=0.0025, progress=False, drain_timeout_s=60.0), tmp_path)
    s = report.summary
    assert report.sent == s["arrived"] == len(trace)
    assert s["completed"] + s["rejected"] + s["errors"] + s["incomplete"] == report.sent
    assert s["errors"] == 0 and s["incomplete"] == 0, [json.loads(line)["error"] for line in
                                                        (tmp_path / "requests.jsonl").read_text().splitlines()
                                                        if json.loads(line)["error"]][:5]
    assert s["completed"] > 0.9 * report.sent  # a night well below one unit's capacity: little to reject
    for metric in ("ttft", "tpot", "e2e"):
        assert 0 < s[f"{metric}_p50_ms"] <= s[f"{metric}_p99_ms"]
    assert s["ttft_p99_ms"] <= s["e2e_p99_ms"]
    assert set(SUMMARY_KEYS) <= set(s)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    done = [r for r in rows if r["status"] == "ok"]
    assert all(r["usage_reported"] and r["output_tokens"] == r["requested_output_tokens"] for r in done)
    assert all(r["input_tokens"] > 0 for r in done)
    # Drift: a loose sanity bound (the client sends ~6 req/s; it is normally a few ms).
    assert s["drift"]["n"] == report.sent and s["drift"]["p99_ms"] < 250.0
    hours = json.loads((tmp_path / "per_hour.json").read_text())["replay"]
    assert [h["hour"] for h in hours] == [0, 1, 2, 3] and sum(h["arrived"] for h in hours) == report.sent
