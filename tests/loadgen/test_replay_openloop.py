"""loadgen.replay: open-loop sending, drift, accounting and the shared summary schema.

The fake server listens on a real 127.0.0.1 socket; the replay drives it over HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.client import ClientConfig
from loadgen.records import Trace
from loadgen.replay import ReplayConfig, ReplayReport, pool_shards_for, replay, replay_async
from loadgen.report import SUMMARY_KEYS, RunOutcomes, Slo, per_hour, summarize
from tests.loadgen.replay_fake_server import Behavior, FakeServer


def _trace(n: int, rps: float, output_tokens: int | list[int] = 4) -> Trace:
    return Trace("test", np.arange(n) / rps, [30] * n, output_tokens if isinstance(output_tokens, list)
                 else [output_tokens] * n, duration_s=n / rps)


def _run(server: FakeServer, behavior: Behavior, trace: Trace, out: Path, **cfg: Any) -> ReplayReport:
    server.reset(behavior)
    config = ReplayConfig(progress=False, plots=cfg.pop("plots", False), **cfg)
    return replay(trace, ClientConfig(server.url, model="fake-model"), config, out)


def _records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["index"])


def test_slow_responses_never_delay_sends(server: FakeServer, tmp_path: Path) -> None:
    # 20 requests at 20/s; the server holds each for 3 s. A closed-loop client would have one in
    # flight at a time; open loop, all 20 are in flight before the first one finishes.
    report = _run(server, Behavior(first_token_delay_s=3.0), _trace(20, 20.0, 2), tmp_path)
    assert server.log.max_in_flight == 20
    arrivals = np.array(server.log.arrivals)
    # The server saw the schedule's spacing, within 1.5 s: half of one response's 3 s, the least a
    # send waiting on a response would be late by (a loaded machine has stalled the loop 0.54 s).
    assert np.all(np.abs((arrivals - arrivals[0]) - np.arange(20) / 20.0) < 1.5)
    assert report.summary["completed"] == 20
    rows = _records(tmp_path)
    assert [r["scheduled_s"] for r in rows] == pytest.approx(list(np.arange(20) / 20.0))
    for r in rows:
        assert r["drift_s"] == pytest.approx(r["sent_s"] - r["scheduled_s"], abs=1e-5)
        assert r["ttft_s"] >= 3.0 and r["e2e_s"] >= r["ttft_s"]
    drift = report.summary["drift"]
    assert drift["n"] == 20 and drift["p50_ms"] <= drift["p99_ms"] <= drift["max_ms"]
    assert drift["max_ms"] < 1000.0  # sanity: far below the 3 s a closed loop would have added


def test_every_request_is_accounted_for(server: FakeServer, tmp_path: Path) -> None:
    # Arrival n (1-based): every 13th hangs, 5th gets 429, 7th gets 500, 11th an SSE error event.
    behavior = Behavior(token_delay_s=0.005, reject_every=5, fail_every=7, sse_error_every=11, hang_every=13,
                        retry_after="3")
    report = _run(server, behavior, _trace(30, 60.0), tmp_path, drain_timeout_s=0.5)
    s = report.summary
    assert report.sent == s["arrived"] == 30 == len(server.log.arrivals)
    assert (s["completed"], s["rejected"], s["errors"], s["incomplete"]) == (16, 6, 6, 2)
    assert s["completed"] + s["rejected"] + s["errors"] + s["incomplete"] == report.sent
    rows = _records(tmp_path)
    assert [r["index"] for r in rows] == list(range(30))
    by_status: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(r)
    assert all(r["http_status"] == 429 and r["retry_after_s"] == 3.0 for r in by_status["rejected"])
    assert sorted(r["http_status"] for r in by_status["error"]) == [200, 200, 500, 500, 500, 500]
    assert all("cancelled" in r["error"] for r in by_status["incomplete"])
    assert all(r["output_tokens"] == 4 and r["tpot_s"] is not None for r in by_status["ok"])


def test_percentiles_are_ordered_and_the_schema_is_the_simulators(server: FakeServer, tmp_path: Path) -> None:
    lengths = [2, 5, 9, 3, 12, 7] * 5
    report = _run(server, Behavior(first_token_delay_s=0.02, token_delay_s=0.004), _trace(30, 40.0, lengths),
                  tmp_path, run_name="mine", time_scale=0.5, gpus=2.0, plots=True)
    s = report.summary
    for metric in ("ttft", "tpot", "e2e"):
        assert 0 < s[f"{metric}_p50_ms"] <= s[f"{metric}_p99_ms"]
    assert s["ttft_p99_ms"] <= s["e2e_p99_ms"]
    # The simulator's entry, from the same functions, has exactly these keys (and in this order).
    sim_entry = summarize(RunOutcomes.empty(3, 1.0), Slo())
    assert list(s)[: len(sim_entry)] == list(sim_entry) and set(SUMMARY_KEYS) <= set(s)
    assert set(s) - set(sim_entry) == {"drift", "client", "replay"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["mine"] and summary["mine"]["arrived"] == 30
    hours = json.loads((tmp_path / "per_hour.json").read_text())["mine"]
    sim_rows = per_hour(RunOutcomes.empty(3, 1.0), Slo())
    assert [set(r) for r in hours] == [set(sim_rows[0])] * len(hours)
    # 0.75 s of wall time at time_scale 0.5 is 1.5 trace seconds: one (trace) hour.
    assert len(hours) == 1 and hours[0]["arrived"] == 30
    assert s["gpu_hours"] == pytest.approx(2.0 * 0.75 / 3600, abs=1e-4)
    assert s["client"]["max_connections"] is None and s["client"]["max_keepalive"] == 32  # no cap
    assert s["replay"]["pool_shards"] == 2  # 30 requests in 0.75 s: two clients of ~16 connections
    for png in ("timeline.png", "ttft_p99_per_hour.png", "latency_cdf.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_per_hour_rows_are_trace_hours(server: FakeServer, tmp_path: Path) -> None:
    # 3 trace hours compressed 10,000x: 1.08 s of wall time, one request every 0.06 s (none on an edge).
    trace = Trace("day", 0.03 + np.arange(18) * 0.06, [10] * 18, [2] * 18, duration_s=1.08)
    report = _run(server, Behavior(), trace, tmp_path, time_scale=1e-4)
    hours = json.loads((tmp_path / "per_hour.json").read_text())["replay"]
    assert [r["hour"] for r in hours] == [0, 1, 2] and [r["arrived"] for r in hours] == [6, 6, 6]
    assert [r["trace_s"] for r in _records(tmp_path)] == pytest.approx(list(trace.arrival_s / 1e-4))
    assert report.summary["completed"] == 18


def test_duration_cuts_the_schedule(server: FakeServer, tmp_path: Path) -> None:
    report = _run(server, Behavior(), _trace(40, 40.0, 2), tmp_path, duration_s=0.5)
    assert report.sent == 20 == report.summary["arrived"] and report.summary["duration_s"] == 0.5
    assert report.summary["replay"]["scheduled"] == 20


def test_stopping_early_cancels_in_flight_and_still_writes_everything(server: FakeServer, tmp_path: Path) -> None:
    server.reset(Behavior(first_token_delay_s=5.0))

    async def go() -> ReplayReport:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await replay_async(_trace(40, 20.0), ClientConfig(server.url, model="m"),
                                  ReplayConfig(progress=False, plots=False), tmp_path, stop=stop)

    report = asyncio.run(go())
    s = report.summary
    assert report.interrupted and s["replay"]["interrupted"]
    assert 0 < report.sent < 40 and s["arrived"] == report.sent == s["incomplete"]
    assert len(_records(tmp_path)) == report.sent


def test_long_streams_store_itl_summary_stats(server: FakeServer, tmp_path: Path) -> None:
    _run(server, Behavior(), _trace(2, 20.0, [3, 400]), tmp_path)
    short, long = _records(tmp_path)
    assert isinstance(short["itl_ms"], list) and len(short["itl_ms"]) == 2
    assert long["itl_ms"]["n"] == 399 and long["itl_ms"]["p50"] <= long["itl_ms"]["p99"] <= long["itl_ms"]["max"]


def test_connections_are_kept_alive_and_reused(server: FakeServer, tmp_path: Path) -> None:
    # 20 quick requests, one every 50 ms, one pool: each finds the previous one's connection idle.
    report = _run(server, Behavior(), _trace(20, 20.0, 3), tmp_path, pool_shards=1)
    assert report.summary["completed"] == 20
    # Not one connection per request (that would be 20). A few more than one: a response a busy
    # box stalls past the next send's 50 ms makes that send open a second connection.
    assert len(set(server.log.client_ports)) <= 6


def test_a_server_nobody_runs_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ConnectionError, match="cannot connect"):
        replay(_trace(5, 10.0), ClientConfig(url), ReplayConfig(progress=False, plots=False), tmp_path)


def test_pool_shards_follow_the_busiest_window() -> None:
    assert pool_shards_for(_trace(100, 20.0)) == 7  # all 100 within 10 s: 16 per client
    assert pool_shards_for(_trace(3000, 100.0)) in (63, 64)  # 100/s for 10 s (an arrival may sit on the edge)
    assert pool_shards_for(_trace(10, 1.0)) == 1
    assert pool_shards_for(_trace(60000, 1000.0)) == 256  # ceiling


def test_a_trace_with_prefix_ids_shares_prompts_and_reports_the_cache(server: FakeServer, tmp_path: Path) -> None:
    # Three turns of one conversation (each extends the one before) and one unrelated prompt.
    ids = [(1,), (1, 2), (1, 2, 3), (9,)]
    trace = Trace("turns", np.arange(4) / 20.0, [40, 80, 120, 40], [2] * 4, duration_s=0.2, prefix_ids=ids,
                  prefix_block_size=40)
    report = _run(server, Behavior(prefix_cache=True), trace, tmp_path)
    rows = _records(tmp_path)
    words = [r["input_tokens"] for r in rows]  # the fake server counts words
    assert [r["cached_tokens"] for r in rows] == [0, words[0], words[1], 0]
    cache = report.summary["prefix_cache"]
    assert cache == {"requests": 4, "requests_with_hits": 2, "cached_tokens": words[0] + words[1],
                     "prompt_tokens": sum(words), "hit_rate": round((words[0] + words[1]) / sum(words), 4)}
    server.reset(Behavior(prefix_cache=True))
    replay(trace, ClientConfig(server.url, model="fake-model", prefix_prompts=False),
           ReplayConfig(progress=False, plots=False), tmp_path / "plain")
    # Unrelated prompts: at most a chance first word or two in common.
    assert max(r["cached_tokens"] for r in _records(tmp_path / "plain")) <= 2


def test_no_prefix_cache_figures_without_the_field(server: FakeServer, tmp_path: Path) -> None:
    report = _run(server, Behavior(), _trace(3, 20.0), tmp_path)
    assert "prefix_cache" not in report.summary and _records(tmp_path)[0]["cached_tokens"] is None
