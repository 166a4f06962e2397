"""Soak (issue 8, item 5), the 60 s version (`-m slow`; the 10-minute run is benchmarks/soak.py).

The sharp tidal day compressed into 60 s against the simulated unit, peaking at 1.3x its capacity
(night, ramp, a peak past capacity, evening decline), replayed open loop, twice in a row with new
prompts. The first day is the warm-up: it leaves the replicas at their high-water mark for that
peak's concurrency (docs/reliability.md, section 5: the first day grows the Ingress by 16-32%, a
second one by < 1%). Asserted on both days: every request completed or was turned away with a
429 (none stuck, none failed), the scheduler's integrity held at every poll, `/health` answered,
and after the drain every KV block is free with no request or stream left; on the second day,
each replica's RSS grew by < 5% (a leak grows every day; a high-water mark does not).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.integration.reliability.cluster import is_drained, replicas_rss, wait_drained
from tests.integration.reliability.load import run_soak, sim_capacity_rps, soak_figures, soak_trace

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SOAK_S = 60.0


def test_soak_a_compressed_tidal_day_twice_leaks_nothing(sim_server_url: str, tmp_path: Path) -> None:
    capacity = sim_capacity_rps()
    before = replicas_rss("sim")
    for day in range(2):
        trace = soak_trace(SOAK_S, 1.3, capacity, seed=5 + day)
        run, rss = asyncio.run(run_soak(sim_server_url, "sim", trace, tmp_path / f"day{day}"))
        state, _ = wait_drained("sim", timeout_s=120.0)
        after = replicas_rss("sim")
        figures = soak_figures(run, before, after, state)
        print(json.dumps({"day": day, **figures, "rss_samples_mb": [
            {k: round(v / 2**20, 1) for k, v in s.items() if k != "t"} for s in rss]}, indent=1))

        assert {r["status"] for r in run.records} <= {"ok", "rejected"}, figures["statuses"]
        assert figures["load"]["unit_state_errors"] == [] and figures["load"]["health_not_200"] == 0
        assert is_drained(state), state
        assert set(before) == {"ServingUnit", "Ingress"} and set(after) == set(before)
        before = after
    assert all(g < 0.05 for g in figures["rss_growth"].values()), figures["rss_growth"]
