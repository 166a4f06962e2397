"""One real Ray cluster and Serve instance for the whole integration session.

Both shipped configs are deployed through Serve's own config path (the controller builds
each application from its `import_path` and `args`, applying the `deployments:` options), as
`serve deploy` would: configs/local.yaml (SmolLM2 on CPU) at `/` and configs/sim.yaml (the
simulated A100 unit) at `/sim`. The only changes are the application names, the route prefix
of the second, and the HTTP port (a free one, so a developer's `make serve` is not disturbed).
Ray's metrics export port is fixed here so the Prometheus test can scrape it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Front-end admission in Serve's proxy (serve_app/proxy_gate.py): read by the proxy at its start.
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "serve_app.proxy_gate:middlewares")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServeCluster:
    http_port: int
    metrics_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def combined_config(http_port: int) -> dict:
    local = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    sim = yaml.safe_load((ROOT / "configs" / "sim.yaml").read_text())
    apps = []
    for name, prefix, cfg in (("local", "/", local), ("sim", "/sim", sim)):
        (app,) = cfg["applications"]
        apps.append({**app, "name": name, "route_prefix": prefix})
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": apps}


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s: {last}")


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    cluster = ServeCluster(free_port(), free_port())
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="tidal-tests",
             _metrics_export_port=cluster.metrics_port,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}})
    try:
        client = serve_start(http_options={"host": "127.0.0.1", "port": cluster.http_port})
        client.deploy_apps(ServeDeploySchema.model_validate(combined_config(cluster.http_port)))
        wait_healthy(cluster.base_url, 300)
        wait_healthy(cluster.base_url + "/sim", 120)
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def local_server_url(serve_cluster: ServeCluster) -> str:
    return serve_cluster.base_url


@pytest.fixture(scope="session")
def sim_server_url(serve_cluster: ServeCluster) -> str:
    return serve_cluster.base_url + "/sim"


def unit_state(app: str, check: bool = True) -> dict:
    """The ServingUnit's own view (and integrity check) of its serving unit."""
    from ray import serve

    handle = serve.get_deployment_handle("ServingUnit", app_name=app)
    return handle.unit_state.remote(check).result(timeout_s=30)
