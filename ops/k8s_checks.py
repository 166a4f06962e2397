"""Consistency checks of a tidalserve RayService against its own embedded Serve config.

Owns: `check_rayservice(obj) -> list[str]` (empty when fine). The CRD schema says what fields
may exist; these say whether the values agree with each other: the serve config is valid
(strictly), GPU worker groups match the ServingUnit's units (GPUs per node, replica bounds), ports
and metrics ports line up, the head is only excluded from the serve Service when workers run
proxies, auth is on, /dev/shm holds the object store, probes exist, the Ray version is the one
the project pins, and the upgrade strategy is one KubeRay 1.7 knows.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ops.k8s import UPGRADE_TYPES, Units, project_versions
from ops.targets import deployment, tidal_app

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def quantity(value: Any) -> float:
    """A Kubernetes quantity ("64Gi", "500m", "8") as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|[kMGT]i?|)", str(value))
    if not m:
        raise ValueError(f"cannot read quantity {value!r}")
    number, suffix = float(m.group(1)), m.group(2)
    return number / 1000 if suffix == "m" else number * _UNITS[suffix]


def _groups(cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    head = [("head", cluster.get("headGroupSpec") or {})]
    return head + [(f"worker group {g.get('groupName')}", g) for g in cluster.get("workerGroupSpecs") or []]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = ((group.get("template") or {}).get("spec") or {}).get("containers", [{}])[0]
    return container


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}


def _check_units(units: Units, cluster: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    gpu_groups = [g for g in cluster.get("workerGroupSpecs") or []
                  if "nvidia.com/gpu" in (_container(g).get("resources") or {}).get("limits", {})]
    if not units.gpus:
        return [f"worker group {g['groupName']} has GPUs but the ServingUnit needs none" for g in gpu_groups]
    if len(gpu_groups) != 1:
        return [f"expected one GPU worker group for the ServingUnit's units, found {len(gpu_groups)}"]
    g = gpu_groups[0]
    res = _container(g).get("resources") or {}
    gpus = int(res["limits"]["nvidia.com/gpu"])
    if gpus != units.gpus or int(res.get("requests", {}).get("nvidia.com/gpu", gpus)) != gpus:
        errors.append(f"GPU workers have {gpus} GPUs (requests must equal limits) but a unit's placement group "
                      f"needs {units.gpus} on one node")
    if (g.get("minReplicas"), g.get("maxReplicas")) != (units.min, units.max):
        errors.append(f"GPU worker replicas [{g.get('minReplicas')}, {g.get('maxReplicas')}] differ from the "
                      f"ServingUnit's unit bounds [{units.min}, {units.max}] (one unit per GPU node)")
    if not units.min <= g.get("replicas", units.min) <= units.max:
        errors.append(f"GPU worker replicas={g.get('replicas')} outside [{units.min}, {units.max}]")
    if quantity(res["limits"].get("cpu", 0)) < units.bundle_cpus:
        errors.append(f"GPU workers have {res['limits'].get('cpu')} CPUs; a unit's bundles need {units.bundle_cpus:g}")
    if units.min != units.max and not cluster.get("enableInTreeAutoscaling"):
        errors.append("the ServingUnit autoscales but Ray autoscaling (enableInTreeAutoscaling) is off")
    return errors


def _check_group(where: str, group: dict[str, Any], serve_port: int) -> list[str]:
    errors: list[str] = []
    c = _container(group)
    ports = _ports(c)
    metrics = (group.get("rayStartParams") or {}).get("metrics-export-port")
    if metrics is None or ports.get("metrics") != int(metrics):
        errors.append(f"{where}: rayStartParams metrics-export-port={metrics} but container port "
                      f"'metrics'={ports.get('metrics')}")
    if "serve" in ports and ports["serve"] != serve_port:
        errors.append(f"{where}: container port 'serve'={ports['serve']} but http_options.port={serve_port}")
    for probe in ("livenessProbe", "readinessProbe"):
        if probe not in c:
            errors.append(f"{where}: no {probe}")
    env = {e["name"]: e for e in c.get("env") or []}
    if env.get("RAY_AUTH_MODE", {}).get("value", "token") != "token":
        errors.append(f"{where}: RAY_AUTH_MODE={env['RAY_AUTH_MODE'].get('value')}; keep token auth on")
    spec = (group.get("template") or {}).get("spec") or {}
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
    if where != "head":
        shm = volumes.get(mounts.get("/dev/shm", ""), {}).get("emptyDir") or {}
        if shm.get("medium") != "Memory":
            errors.append(f"{where}: /dev/shm must be an emptyDir with medium Memory")
        store = (group.get("rayStartParams") or {}).get("object-store-memory")
        if store and shm.get("sizeLimit") and int(store) > quantity(shm["sizeLimit"]):
            errors.append(f"{where}: object-store-memory {store} does not fit /dev/shm ({shm['sizeLimit']})")
    model = env.get("TIDAL_MODEL", {}).get("value")
    if model and where != "head" and not any(model.startswith(p.rstrip("/") + "/") for p in mounts):
        errors.append(f"{where}: TIDAL_MODEL={model} is not under a mounted volume")
    return errors


def _check_spec(spec: dict[str, Any], config: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    cluster = spec.get("rayClusterConfig") or {}
    kind = (spec.get("upgradeStrategy") or {}).get("type")
    if kind not in UPGRADE_TYPES:
        errors.append(f"upgradeStrategy.type={kind!r}; KubeRay 1.7 knows {', '.join(UPGRADE_TYPES)}")
    if kind == "NewClusterWithIncrementalUpgrade" and not (
            spec["upgradeStrategy"].get("clusterUpgradeOptions") and cluster.get("enableInTreeAutoscaling")):
        errors.append("NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions and Ray autoscaling")
    if (cluster.get("authOptions") or {}).get("mode") != "token":
        errors.append("rayClusterConfig.authOptions.mode must be 'token' (auth stays on in production)")
    if cluster.get("rayVersion") != project_versions()[1]:
        errors.append(f"rayVersion {cluster.get('rayVersion')} differs from the pinned Ray {project_versions()[1]}")
    if config.get("proxy_location") == "HeadOnly" and spec.get("excludeHeadPodFromServeSvc"):
        errors.append("proxy_location HeadOnly but excludeHeadPodFromServeSvc: no pod would serve traffic")
    return errors


def check_rayservice(obj: dict[str, Any]) -> list[str]:
    from serve_app.config_check import check_serve_config  # imports ray; only when validating

    spec = obj.get("spec") or {}
    config = yaml.safe_load(spec.get("serveConfigV2") or "") or {}
    errors = [f"serveConfigV2: {e}" for e in check_serve_config(config)]
    if errors:
        return errors
    errors += _check_spec(spec, config)
    serve_port = int((config.get("http_options") or {}).get("port", 8000))
    cluster = spec.get("rayClusterConfig") or {}
    for where, group in _groups(cluster):
        errors += _check_group(where, group, serve_port)
    if "serve" not in _ports(_container(cluster.get("headGroupSpec") or {})):
        errors.append("head: no container port named 'serve' (KubeRay's serve Service targets it)")
    errors += _check_units(Units.of(deployment(tidal_app(config), "ServingUnit")), cluster)
    return errors
