"""The session cluster starts Serve as `serve run configs/sim.yaml` does: with the config's
`controller_options` and no exported variable (tests/integration/conftest.py). Serve's proxy and
every replica must then run with the cluster's environment (serve_app/cluster_env.py): the proxy's
front gate installed, the gRPC data plane on. Checked by behaviour (the proxy's gate exports its
aim for the simulated application once a request has woken it) and, on Linux, by each process's
environment, an application with its own `runtime_env.env_vars` (/keyed) included.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.cluster_env import CLUSTER_ENV
from tests.integration.conftest import ServeCluster
from tests.integration.reliability.cluster import SIM_MODEL

pytestmark = pytest.mark.ray


def _proxy_aims(serve_cluster: ServeCluster) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{serve_cluster.metrics_port}/metrics", timeout=10).text
    return {s.labels.get("application", ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "ray_tidal_front_aim" and s.labels.get("where") == "proxy"}


def test_the_proxy_gate_runs_in_a_cluster_started_from_the_config(serve_cluster: ServeCluster,
                                                                 sim_server_url: str) -> None:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    deadline = time.monotonic() + 90  # the gate finds the applications within 2 s; Ray exports every ~10 s
    aims: dict[str, float] = {}
    while time.monotonic() < deadline:
        r = httpx.post(f"{sim_server_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code in (200, 429), r.text
        aims = _proxy_aims(serve_cluster)
        if "sim" in aims:
            break
        time.sleep(2.0)
    assert "sim" in aims, aims
    assert 0.5 <= aims["sim"] <= 1.0  # DoorAim's share of the unit's limit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")
def test_the_proxy_and_every_replica_inherit_the_cluster_env(serve_cluster: ServeCluster) -> None:
    wanted = {"ProxyActor", "ServeReplica:sim:Ingress", "ServeReplica:sim:ServingUnit",
              "ServeReplica:keyed:Ingress", "ServeReplica:keyed:ServingUnit"}
    found: dict[str, dict[str, str]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        name = next((w for w in wanted if cmd.startswith(f"ray::{w}")), None)
        if name is None:
            continue
        try:
            raw = Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
            env = dict(line.split("=", 1) for line in raw.split("\0") if "=" in line)
        except OSError:
            continue
        found[name] = {k: env.get(k, "") for k in CLUSTER_ENV}
    assert set(found) == wanted, sorted(found)
    for name, env in found.items():
        assert env == CLUSTER_ENV, (name, env)
