"""The KubeRay RayService for tidalserve, built from a Serve config file.

Owns: `ClusterProfile` (the node shapes: 8xA100 GPU workers for production, small CPU pods
for the kind/minikube smoke test) and `rayservice(config_text, profile)`. Everything that
must agree with the Serve config is derived from it, never typed twice: `serveConfigV2` is
the config file's text verbatim; the worker group's GPUs per pod are the ServingUnit's GPU
placement-group bundles (one unit = one node); min/initial/max worker replicas are the
ServingUnit's autoscaling bounds; the Serve port, the worker readiness probe (proxy health only
where proxies run on every node), the head's exclusion from the serve Service and the old
cluster's deletion delay (the HTTP request timeout, so an upgrade never cuts a stream) too.
The Ray version and image tag come from pyproject.toml. Must not import ray.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from ops.exposure import api_keys_mount
from ops.targets import REPO_ROOT, deployment, tidal_app
from serve_app.cluster_env import CLUSTER_ENV

NAME = "tidal"
IMAGE = "tidalserve"
APP_LABEL = {"app.kubernetes.io/name": "tidalserve"}
AUTH_SECRET = "tidal-ray-auth"
AUTH_SECRET_KEY = "auth_token"  # the key KubeRay's authOptions.secretName expects
METRICS_PORT = 8080
AGENT_PORT = 52365  # dashboard agent: /api/healthz (raylet, and GCS on the head), no auth needed
MODEL_MOUNT = "/models"
MODEL_CLAIM = "tidal-models"
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
"""RayService spec.upgradeStrategy.type values in KubeRay 1.7 (Go constants; the CRD has no enum)."""
UPGRADE_TYPE = "NewCluster"


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    head_cpu: str
    head_memory: str
    worker_group: str
    worker_cpu: str
    worker_memory: str
    shm: str
    object_store_bytes: int
    model_volume: bool
    autoscaling: bool
    cpu_workers: int = 0  # worker pods when units need no GPU node (the simulated-GPU unit)


PROD = ClusterProfile("prod", head_cpu="8", head_memory="32Gi", worker_group="gpu-a100x8", worker_cpu="88",
                      worker_memory="800Gi", shm="64Gi", object_store_bytes=32 * 2**30, model_volume=True,
                      autoscaling=True)
"""An 8xA100-80GB node (96 vCPU, >= 1 TiB on p4de / a2-ultragpu / ND A100 v4) less system reserve."""
SIM_CPU = ClusterProfile("sim-cpu", head_cpu="1", head_memory="3Gi", worker_group="cpu", worker_cpu="1",
                         worker_memory="3Gi", shm="1Gi", object_store_bytes=512 * 2**20, model_volume=False,
                         autoscaling=False, cpu_workers=1)
"""Fits a laptop kind/minikube cluster: one simulated unit needs well under a core."""


def project_versions() -> tuple[str, str]:
    """(tidalserve version, pinned Ray version) from pyproject.toml."""
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    ray_pin = next(d for d in data["project"]["dependencies"] if d.startswith("ray["))
    return data["project"]["version"], ray_pin.split("==", 1)[1]


@dataclass(frozen=True)
class Units:
    """What the ServingUnit deployment says about serving units (ServingUnit replicas)."""

    min: int
    initial: int
    max: int
    gpus: int  # GPUs per unit = per node
    bundle_cpus: float

    @classmethod
    def of(cls, router: dict[str, Any]) -> Units:
        auto = router.get("autoscaling_config") or {}
        fixed = router.get("num_replicas", 1)
        lo, hi = auto.get("min_replicas", fixed), auto.get("max_replicas", fixed)
        bundles = router.get("placement_group_bundles") or []
        return cls(lo, auto.get("initial_replicas", lo), hi, int(sum(b.get("GPU", 0) for b in bundles)),
                   float(sum(b.get("CPU", 0) for b in bundles)))


def _probe(path: str, port: int, *, initial: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "initialDelaySeconds": initial, "periodSeconds": 5,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _env(model_path: str | None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": AUTH_SECRET, "key": AUTH_SECRET_KEY}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # What Serve's processes read when they start (the proxy gate, the gRPC data plane), as
        # `make serve` and the test clusters set it.
        *({"name": k, "value": v} for k, v in CLUSTER_ENV.items()),
    ]
    if model_path:
        env.append({"name": "TIDAL_MODEL", "value": model_path})
    return env


def _resources(cpu: str, memory: str, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(name: str, image: str, env: list[dict[str, Any]], ports: dict[str, int], resources: dict[str, Any],
               probes: tuple[dict[str, Any], dict[str, Any]], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name, "image": image, "imagePullPolicy": "IfNotPresent", "env": env,
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()], "resources": resources,
        "livenessProbe": probes[0], "readinessProbe": probes[1]}
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _template(component: str, container: dict[str, Any], volumes: list[dict[str, Any]],
              grace_s: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if grace_s is not None:
        spec["terminationGracePeriodSeconds"] = grace_s
    return {"metadata": {"labels": {**APP_LABEL, "app.kubernetes.io/component": component}}, "spec": spec}


Keys = tuple[dict[str, Any], dict[str, Any]] | None  # the API-key Secret's (volume, mount), ops/exposure.py


def _head(p: ClusterProfile, image: str, serve_port: int, model_path: str | None, keys: Keys) -> dict[str, Any]:
    alive = _probe("/api/healthz", AGENT_PORT, initial=30, failures=120)
    ready = _probe("/api/healthz", AGENT_PORT, initial=10, failures=10)
    ports = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": serve_port, "metrics": METRICS_PORT}
    container = _container("ray-head", image, _env(model_path), ports, _resources(p.head_cpu, p.head_memory, 0),
                           (alive, ready), [copy.deepcopy(keys[1])] if keys else [])
    # The operator reaches the dashboard through the head Service: it cannot listen on loopback only
    # (ops/exposure.py); the NetworkPolicy limits who reaches it.
    return {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0",
                               "metrics-export-port": str(METRICS_PORT)},
            "template": _template("ray-head", container, [copy.deepcopy(keys[0])] if keys else [])}


def _worker(p: ClusterProfile, units: Units, image: str, serve_port: int, model_path: str | None,
            proxies_on_workers: bool, grace_s: int, keys: Keys) -> dict[str, Any]:
    alive = _probe("/api/healthz", AGENT_PORT, initial=30, failures=120)
    # Serve drains the proxy of a node without replicas (503 on /-/healthz): not ready = no traffic.
    ready = (_probe("/-/healthz", serve_port, initial=10, failures=10) if proxies_on_workers
             else _probe("/api/healthz", AGENT_PORT, initial=10, failures=10))
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": p.shm}}]
    if p.model_volume:
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": MODEL_CLAIM, "readOnly": True}})
    if keys:  # Ingress replicas may run on any node
        volumes.append(copy.deepcopy(keys[0]))
        mounts.append(copy.deepcopy(keys[1]))
    ports = {"serve": serve_port, "metrics": METRICS_PORT} if proxies_on_workers else {"metrics": METRICS_PORT}
    container = _container("ray-worker", image, _env(model_path), ports,
                           _resources(p.worker_cpu, p.worker_memory, units.gpus), (alive, ready), mounts)
    # One unit per GPU node: the worker group's bounds are the ServingUnit's replica bounds.
    lo, init, hi = (units.min, units.initial, units.max) if units.gpus else (p.cpu_workers,) * 3
    return {"groupName": p.worker_group, "replicas": init, "minReplicas": lo, "maxReplicas": hi,
            "rayStartParams": {"metrics-export-port": str(METRICS_PORT),
                               "object-store-memory": str(p.object_store_bytes)},
            "template": _template("ray-worker", container, volumes, grace_s)}


def model_path(app: dict[str, Any], p: ClusterProfile) -> str | None:
    """TIDAL_MODEL: the checkpoint on the model volume, named after the config's HF id."""
    if not p.model_volume:
        return None
    model = ((app.get("args") or {}).get("engine") or {}).get("model", "")
    return str(PurePosixPath(MODEL_MOUNT) / PurePosixPath(model).name)


def rayservice(config_text: str, p: ClusterProfile) -> dict[str, Any]:
    config = yaml.safe_load(config_text)
    app = tidal_app(config)
    router = deployment(app, "ServingUnit")
    units = Units.of(router)
    version, ray_version = project_versions()
    image = f"{IMAGE}:{version}"
    http = config.get("http_options") or {}
    serve_port = int(http.get("port", 8000))
    proxies_on_workers = config.get("proxy_location", "EveryNode") == "EveryNode"
    path = model_path(app, p)
    grace = int(router.get("graceful_shutdown_timeout_s", 60)) + 30
    cluster: dict[str, Any] = {
        "rayVersion": ray_version,
        "enableInTreeAutoscaling": p.autoscaling,
    }
    if p.autoscaling:
        cluster["autoscalerOptions"] = {"version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 300}
    cluster["authOptions"] = {"mode": "token", "secretName": AUTH_SECRET}
    keys = api_keys_mount(config)
    cluster["headGroupSpec"] = _head(p, image, serve_port, path, keys)
    cluster["workerGroupSpecs"] = [_worker(p, units, image, serve_port, path, proxies_on_workers, grace, keys)]
    spec: dict[str, Any] = {
        "upgradeStrategy": {"type": UPGRADE_TYPE},
        "rayClusterDeletionDelaySeconds": int(http.get("request_timeout_s", 60)),
        "excludeHeadPodFromServeSvc": proxies_on_workers,
        "serveConfigV2": config_text,
        "rayClusterConfig": cluster,
    }
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": {"name": NAME, "labels": dict(APP_LABEL)}, "spec": spec}
