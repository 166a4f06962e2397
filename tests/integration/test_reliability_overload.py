"""Overload (issue 8, item 1), short version: configs/sim.yaml at 3x its capacity for 15 s.

Open-loop Poisson arrivals with Azure-conversation lengths (outputs clipped to 300 tokens so the
drain stays short; the rate is 3x the capacity the simulator measures for that very mix). While
the load runs, `/health` and `unit_state(check=True)` are polled every 0.25 s. Asserted: every
request ends with a complete response or a 429 carrying Retry-After; the KV pool is never
over-allocated and the scheduler's integrity check holds at every poll; `/health` answers 200
throughout; a request sent once the arrivals stop is served; afterwards every KV block is free.
Latencies (429 p50/p99/max, SLO attainment of the admitted, recovery) are printed and recorded
as test properties, never asserted: the timed figures come from `benchmarks/overload.py`
(60 s, with the `continuous` policy beside it) and are written down in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.reliability.cluster import is_drained, wait_drained
from tests.integration.reliability.load import Probe, load_figures, poisson_trace, run_load, sim_capacity_rps

pytestmark = pytest.mark.ray
DURATION_S = 15.0
MAX_OUTPUT = 300


def test_sim_unit_at_3x_capacity_rejects_fast_stays_healthy_and_leaks_nothing(
        sim_server_url: str, tmp_path: Path, record_property: Callable[[str, Any], None]) -> None:
    rate = 3.0 * sim_capacity_rps(max_output=MAX_OUTPUT)
    trace = poisson_trace(rate, DURATION_S, seed=8, max_output=MAX_OUTPUT)
    run = asyncio.run(run_load(sim_server_url, "sim", trace, tmp_path, probe=Probe(), drain_timeout_s=90.0))
    figures = load_figures(run)
    record_property("overload_figures", json.dumps(figures))
    print(json.dumps({"rate_rps": round(rate, 3), **figures}, indent=1))

    records = run.records
    assert len(records) == len(trace)
    outcomes = {(r["status"], r["http_status"]) for r in records}
    assert outcomes <= {("ok", 200), ("rejected", 429)}, [r for r in records if r["status"] not in ("ok", "rejected")]
    completed = [r for r in records if r["status"] == "ok"]
    rejected = [r for r in records if r["status"] == "rejected"]
    assert completed and rejected, "3x capacity must both serve and turn requests away"
    # A complete response: exactly the tokens asked for (ignore_eos), as the usage says.
    assert all(r["usage_reported"] and r["output_tokens"] == r["requested_output_tokens"] for r in completed)
    assert all(r["retry_after_s"] is not None and r["retry_after_s"] >= 1 for r in rejected)

    samples = run.samples
    assert len(samples) >= DURATION_S * 2, "the unit was not watched throughout"
    assert figures["unit_state_errors"] == []
    assert all(s.num_free_blocks is not None and 0 <= s.num_free_blocks <= (s.num_blocks or 0) for s in samples)
    assert figures["min_free_blocks"] < figures["num_blocks"], "the watch never saw the load"
    assert figures["health_not_200"] == 0, [s for s in samples if s.health_status != 200]

    assert run.probe is not None and run.probe["served"], run.probe
    state, _ = wait_drained("sim", timeout_s=60.0)
    assert is_drained(state), state
