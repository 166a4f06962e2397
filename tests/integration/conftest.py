"""One real Ray cluster and Serve instance for the whole integration session.

Both shipped configs are deployed through Serve's own config path (the controller builds
each application from its `import_path` and `args`, applying the `deployments:` options), as
`serve deploy` would: configs/local.yaml (SmolLM2 on CPU) at `/` and configs/sim.yaml (the
simulated A100 unit) at `/sim`. The only changes are the application names, the route prefix
of the second, and the HTTP port (a free one, so a developer's `make serve` is not disturbed).
A third application, `/keyed`, is configs/sim.yaml with API keys required: one key from
`TIDAL_API_KEYS` (the application's runtime_env), the others from a keys file the tests rewrite
(rotation), and a per-key RPM limit on one of them (tests/integration/test_api_keys.py).
Ray's metrics export port is fixed here so the Prometheus test can scrape it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
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


def shipped_controller_options() -> dict:
    """configs/sim.yaml's `controller_options`: the environment Serve's processes start with (the proxy
    gate, the gRPC data plane; serve_app/cluster_env.py), given to Serve as `serve run` gives it, so
    the tests run the path a user's `serve run` takes (tests/test_cluster_env.py holds every shipped
    config to it)."""
    return yaml.safe_load((ROOT / "configs" / "sim.yaml").read_text())["controller_options"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The keyed application's keys (test-only values) and its keys file.
ENV_KEY = "tk-env-5b0c1f8e2d7a4b69"
FILE_KEYS = ("tk-file-a41e9c07d3b2", "tk-file-stable-77f0e2c9")
BURST_KEY = "tk-burst-3c9d01aa7e55"
BURST_RPM = 5
KEYS_FILE = Path(tempfile.mkdtemp(prefix="tidal-keys-")) / "keys"


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
    apps.append(keyed_app(sim))
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": apps}


def keyed_app(sim: dict) -> dict:
    """configs/sim.yaml's application with API keys required (keys file written here)."""
    from serve_app.api_keys import key_id

    KEYS_FILE.write_text("\n".join([*FILE_KEYS, BURST_KEY]) + "\n")
    (app,) = yaml.safe_load(yaml.safe_dump(sim))["applications"]
    app["args"]["auth"] = {"required": True, "keys_file": str(KEYS_FILE), "reload_period_s": 2.0,
                           "per_key": {key_id(BURST_KEY): {"rpm": BURST_RPM}}}
    # These tests are about keys and per-key limits: admission refuses only a full queue here, so a
    # slow shared box cannot turn a burst's valid requests into overload 429s (the proxy's gate
    # answers those before the ingress's RPM check).
    app["args"]["scheduler"]["admission"]["mode"] = "protect"
    env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env.update({"TIDAL_API_KEYS": ENV_KEY, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"})
    return {**app, "name": "keyed", "route_prefix": "/keyed"}


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


@contextlib.contextmanager
def deployed_beside(cluster: ServeCluster, app: dict, timeout_s: float = 240.0) -> Iterator[str]:
    """`app` deployed beside the session's applications (which are unchanged, so not restarted);
    yields its base URL once healthy; on exit the session's applications as they were, without it."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    def deploy(config: dict) -> None:
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))

    base = combined_config(cluster.http_port)
    deploy({**base, "applications": [*base["applications"], app]})
    try:
        url = cluster.base_url + app["route_prefix"].rstrip("/")
        wait_healthy(url, timeout_s)
        yield url
    finally:
        deploy(base)
        deadline = time.monotonic() + 120
        while app["name"] in serve.status().applications and time.monotonic() < deadline:
            time.sleep(1.0)


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
        client = serve_start(http_options={"host": "127.0.0.1", "port": cluster.http_port},
                             controller_options=shipped_controller_options())
        client.deploy_apps(ServeDeploySchema.model_validate(combined_config(cluster.http_port)))
        wait_healthy(cluster.base_url, 300)
        wait_healthy(cluster.base_url + "/sim", 120)
        wait_healthy(cluster.base_url + "/keyed", 120)  # /health is open
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


@pytest.fixture(scope="session")
def keyed_server_url(serve_cluster: ServeCluster) -> str:
    return serve_cluster.base_url + "/keyed"


def unit_state(app: str, check: bool = True) -> dict:
    """The ServingUnit's own view (and integrity check) of its serving unit."""
    from ray import serve

    handle = serve.get_deployment_handle("ServingUnit", app_name=app)
    return handle.unit_state.remote(check).result(timeout_s=30)
