"""Serve's autoscaler grows the units in an overload the front door turns away.

configs/sim.yaml's application with its ServingUnit autoscaled as configs/prod.yaml autoscales it
(`serve_app.autoscaling:TidalAutoscalingPolicy`, prod's request router; the policy's time constants
shortened so the test takes a minute), deployed beside the session's applications for this module
and removed after it. Real Serve, real HTTP: Poisson arrivals at three times one unit's capacity.
The gates refuse most of the overload before a unit sees it, so what scales the deployment is the
demand they pass on (`absorb_door_refusals`). A policy that decided from the running replicas alone
undid each scale-up on its next call while the new replica started, and the deployment never grew
(benchmarks/autoscale_serve.py). No timing is asserted beyond a generous bound for the growth.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from loadgen.client import ClientConfig
from loadgen.replay import ReplayConfig, replay_async
from tests.integration.conftest import ServeCluster, deployed_beside
from tests.integration.reliability.cluster import app_from_config, autoscaled
from tests.integration.reliability.load import poisson_trace, sim_capacity_rps

pytestmark = pytest.mark.ray
APP, PREFIX, SIM_MODEL = "autoscaled", "/autoscaled", "sim-llama-70b-a100"
POLICY = {"target_load": 0.65, "smoothing_s": 10.0, "lead_s": 0.0, "upscale_delay_s": 5.0,
          "downscale_delay_s": 3600.0, "max_step_up": 4, "hot_tpot_fraction": 0.85, "cool_tpot_fraction": 0.76}
GROWTH_BOUND_S = 120.0


def _running_units() -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments["ServingUnit"]
    return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def test_an_overload_refused_at_the_door_scales_the_units_up(serve_cluster: ServeCluster, tmp_path: Path) -> None:
    app = autoscaled(app_from_config("sim", APP, PREFIX), max_units=2, policy_kwargs=POLICY)
    with deployed_beside(serve_cluster, app) as url:
        assert _running_units() == 1
        trace = poisson_trace(3.0 * sim_capacity_rps(), GROWTH_BOUND_S, seed=5)

        async def overload_until_grown() -> float | None:
            stop = asyncio.Event()
            replay = asyncio.create_task(replay_async(
                trace, ClientConfig(url, model=SIM_MODEL, read_timeout_s=60.0),
                ReplayConfig(run_name=APP, drain_timeout_s=30.0, progress=False, plots=False), tmp_path, stop=stop))
            t0, grown = time.monotonic(), None
            while not replay.done() and grown is None:
                await asyncio.sleep(1.0)
                if await asyncio.to_thread(_running_units) >= 2:
                    grown = time.monotonic() - t0
            stop.set()
            await replay
            return grown

        grown_after = asyncio.run(overload_until_grown())
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    refused = [r for r in records if r["status"] == "rejected"]
    at_door = sum(1 for r in refused if r.get("refused_by") in ("proxy", "ingress"))
    assert grown_after is not None, f"still one unit after {GROWTH_BOUND_S:g} s at 3x its capacity"
    assert not [r for r in records if (r["http_status"] or 0) >= 500]
    assert refused and all(r["http_status"] == 429 and r["retry_after_s"] for r in refused)
    assert at_door > len(refused) / 2, "the door decided most refusals: its demand is what scaled the units"
