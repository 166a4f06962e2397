"""Soak (issue 8, item 5), the 60 s version (`-m slow`; the 10-minute run is benchmarks/soak.py).

The sharp tidal day compressed into 60 s against the simulated unit, peaking at 1.3x its capacity
(night, ramp, a peak past capacity, evening decline), replayed open loop. After a short warm-up
(first-use allocations are not a leak) the Router and Ingress replicas' RSS is taken, the day is
played, the unit drained, and the RSS taken again. Asserted: every request completed or was
turned away with a 429 (none stuck, none failed), the scheduler's integrity held throughout, all
KV blocks are free afterwards with no request or stream left, and each replica grew by < 5%.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.integration.reliability.cluster import is_drained, replicas_rss, wait_drained
from tests.integration.reliability.load import (
    azure_trace,
    run_load,
    run_soak,
    sim_capacity_rps,
    soak_figures,
    soak_trace,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SOAK_S = 60.0


def test_soak_a_compressed_tidal_day_leaks_nothing(sim_server_url: str, tmp_path: Path) -> None:
    asyncio.run(run_load(sim_server_url, "sim", azure_trace(2.0, 10.0, seed=2, max_output=64), tmp_path / "warm"))
    wait_drained("sim")
    before = replicas_rss("sim")
    trace = soak_trace(SOAK_S, 1.3, sim_capacity_rps(), seed=5)
    run, rss = asyncio.run(run_soak(sim_server_url, "sim", trace, tmp_path / "soak"))
    state, _ = wait_drained("sim", timeout_s=120.0)
    after = replicas_rss("sim")
    figures = soak_figures(run, before, after, state)
    print(json.dumps({**figures, "rss_samples": rss}, indent=1))

    assert {r["status"] for r in run.records} <= {"ok", "rejected"}, figures["statuses"]
    assert figures["load"]["unit_state_errors"] == [] and figures["load"]["health_not_200"] == 0
    assert is_drained(state), state
    assert set(before) == {"Router", "Ingress"} and set(after) == set(before)
    assert all(g < 0.05 for g in figures["rss_growth"].values()), figures["rss_growth"]
