"""The cluster side of the reliability harness: the unit's own view, actors, processes, a cluster.

Owns: `unit_state` / `wait_drained` (the ServingUnit's `unit_state(check=True)`: KV, requests, streams,
integrity), Serve replica and TP worker lookup (for fault injection), replica PIDs, RSS and CPU
(`CpuMeter`), and `serve_cluster` (Ray + Serve with chosen applications, for the benchmark
scripts; the tests use the session fixture of tests/integration/conftest.py).

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIM_MODEL = "sim-llama-70b-a100"
LOCAL_MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[3]


def router_handle(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("ServingUnit", app_name=app)


def wait_until(predicate: Callable[[], bool], timeout_s: float, period_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return predicate()


def unit_state(app: str, check: bool = True, timeout_s: float = 30.0) -> dict[str, Any]:
    return dict(router_handle(app).unit_state.remote(check).result(timeout_s=timeout_s))


async def unit_state_async(app: str, check: bool = True, timeout_s: float = 30.0) -> dict[str, Any]:
    return dict(await asyncio.wait_for(router_handle(app).unit_state.remote(check), timeout_s))


def is_drained(state: dict[str, Any]) -> bool:
    return (state["num_free_blocks"] == state["num_blocks"] and state["num_requests"] == 0
            and state["num_streams"] == 0)


def wait_drained(app: str, timeout_s: float = 60.0) -> tuple[dict[str, Any], float]:
    """Poll until the unit holds no request, stream or KV block (integrity-checked each time);
    returns the last state and the seconds it took (the state may still be busy on timeout)."""
    t0 = time.monotonic()
    state = unit_state(app)
    while not is_drained(state) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        state = unit_state(app)
    return state, time.monotonic() - t0


def replica_actor_names(app: str, deployment: str) -> list[str]:
    """Named Serve replica actors of one deployment (namespace "serve"), e.g.
    'SERVE_REPLICA::sim#ServingUnit#dixvijpv'; the suffix is the replica id (the unit id)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def tp_worker_actor_names(unit: str | None = None) -> list[tuple[str, str]]:
    """(namespace, name) of the TP worker actors named `tidal-tp-<unit>-r<rank>`. Workers are
    created from inside the ServingUnit replica and land in the namespace of the job that deployed the
    application (not Serve's "serve"), so every namespace is searched."""
    import ray

    prefix = f"tidal-tp-{unit}-r" if unit else "tidal-tp-"
    return sorted((a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))


def alive_actors(class_name: str) -> list[dict[str, Any]]:
    """Live actors of this Ray cluster whose class is `class_name` (Serve replicas are
    `ServeReplica:<app>:<deployment>`), with name and PID, from the GCS actor table.

    The public state API (`ray.util.state`) needs the dashboard, which the test cluster does not
    run; the GCS table is what it reads. Going through the cluster (not a `ps` scan) matters on a
    shared machine: another developer's cluster has processes with the very same titles."""
    import ray._private.state

    actors = ray._private.state.actors()
    return [{"name": a.get("Name") or "", "pid": int(a["Pid"]), "class": a["ActorClassName"]}
            for a in actors.values() if a.get("State") == "ALIVE" and a.get("ActorClassName") == class_name]


def replica_pids(app: str, deployment: str) -> list[int]:
    return sorted(a["pid"] for a in alive_actors(f"ServeReplica:{app}:{deployment}"))


def rss_bytes(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


class CpuMeter:
    """CPU seconds spent by named processes (and the whole machine) between `start` and `stop`:
    where the time goes when the box is saturated."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        import os

        self.pids = {**pids, "client (this process)": [os.getpid()]}
        self._start: dict[str, float] = {}
        self._t0 = 0.0
        self._sys0: Any = None

    @staticmethod
    def _cpu(pids: list[int]) -> float:
        import psutil

        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        return total

    def start(self) -> None:
        import psutil

        self._start = {name: self._cpu(pids) for name, pids in self.pids.items()}
        self._t0, self._sys0 = time.perf_counter(), psutil.cpu_times()

    def stop(self) -> dict[str, Any]:
        """Cores used on average by each process and by the machine (busy = not idle/iowait)."""
        import psutil

        wall = time.perf_counter() - self._t0
        sys1 = psutil.cpu_times()
        busy = sum(getattr(sys1, f) - getattr(self._sys0, f) for f in ("user", "system", "nice", "irq", "softirq"))
        cores = {name: round((self._cpu(pids) - self._start[name]) / wall, 3) for name, pids in self.pids.items()}
        return {"wall_s": round(wall, 2), "cores_by_process": cores, "machine_busy_cores": round(busy / wall, 3),
                "machine_cores": psutil.cpu_count()}


def replicas_rss(app: str) -> dict[str, int]:
    """RSS in bytes of the app's ServingUnit and Ingress replica processes (one replica each here)."""
    out: dict[str, int] = {}
    for deployment in ("ServingUnit", "Ingress"):
        for i, pid in enumerate(replica_pids(app, deployment)):
            out[f"{deployment}{'' if i == 0 else i}"] = rss_bytes(pid)
    return out



def app_from_config(config: str, name: str, route_prefix: str, *, streaming: dict[str, Any] | None = None,
                    **scheduler: Any) -> dict[str, Any]:
    """The one application of configs/<config>.yaml, renamed and re-routed, with scheduler overrides
    (e.g. `policy="continuous"`) and `args.streaming` overrides: deployed through Serve's config
    path as `serve deploy` would."""
    import copy

    import yaml

    (app,) = yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())["applications"]
    app = copy.deepcopy(app)
    app["args"]["scheduler"].update(scheduler)
    if streaming:
        app["args"]["streaming"] = {**app["args"].get("streaming", {}), **streaming}
    return {**app, "name": name, "route_prefix": route_prefix}


def prod_unit_deployment() -> dict[str, Any]:
    """configs/prod.yaml's ServingUnit deployment, as written."""
    import yaml

    prod = yaml.safe_load((ROOT / "configs" / "prod.yaml").read_text())
    (unit,) = [d for a in prod["applications"] for d in a["deployments"] if d["name"] == "ServingUnit"]
    return dict(unit)


def routed_fleet(app: dict[str, Any], units: int, router_kwargs: dict[str, Any] | None = None,
                 stats_period_s: float | None = None) -> dict[str, Any]:
    """`app` with `units` ServingUnit replicas behind configs/prod.yaml's request router
    (`TidalRequestRouter`, its routing-stats period unless `stats_period_s`), with
    `request_router_kwargs` if given (e.g. `{"prefix_routing": False}` for least-loaded routing)."""
    import copy

    deployments = copy.deepcopy(app["deployments"])
    (unit,) = [d for d in deployments if d["name"] == "ServingUnit"]
    unit["num_replicas"] = units
    unit["request_router_config"] = copy.deepcopy(prod_unit_deployment()["request_router_config"])
    if router_kwargs:
        unit["request_router_config"]["request_router_kwargs"] = dict(router_kwargs)
    if stats_period_s is not None:
        unit["request_router_config"]["request_routing_stats_period_s"] = stats_period_s
    return {**app, "deployments": deployments}


def autoscaled(app: dict[str, Any], max_units: int, policy_kwargs: dict[str, Any],
               look_back_period_s: float = 15.0) -> dict[str, Any]:
    """`app` with its ServingUnit deployment autoscaled as configs/prod.yaml autoscales it (the
    tidalserve policy with `policy_kwargs`, prod's request router, Serve's own delays zeroed), one
    unit at the start."""
    prod_unit = prod_unit_deployment()
    app = routed_fleet(app, 1)
    (unit,) = [d for d in app["deployments"] if d["name"] == "ServingUnit"]
    unit.pop("num_replicas")
    policy = {**prod_unit["autoscaling_config"]["policy"], "policy_kwargs": policy_kwargs}
    unit["autoscaling_config"] = {**prod_unit["autoscaling_config"], "min_replicas": 1, "initial_replicas": 1,
                                  "max_replicas": max_units, "look_back_period_s": look_back_period_s,
                                  "policy": policy}
    return app


@contextlib.contextmanager
def serve_cluster(applications: list[dict[str, Any]], *, num_cpus: int = 8,
                  healthy_timeout_s: float = 300.0) -> Any:
    """Ray + Serve in this process with `applications` on a free port (as tests/integration/conftest.py
    does); yields the base URL; shuts everything down on exit."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from tests.integration.conftest import free_port, shipped_controller_options, wait_healthy

    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, namespace="tidal-bench",
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}})
    try:
        client = serve_start(http_options={"host": "127.0.0.1", "port": port},
                             controller_options=shipped_controller_options())  # as `serve run` starts it
        config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
                  "applications": applications}
        client.deploy_apps(ServeDeploySchema.model_validate(config))
        base = f"http://127.0.0.1:{port}"
        for app in applications:
            wait_healthy(base + app["route_prefix"].rstrip("/"), healthy_timeout_s)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def machine() -> dict[str, Any]:
    import os
    import platform

    import psutil

    return {"cpus": psutil.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def session_dir() -> str:
    """This Ray session's directory (Serve's access logs are under logs/serve)."""
    import ray._private.worker

    return str(ray._private.worker._global_node.get_session_dir_path())
