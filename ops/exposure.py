"""What the tidalserve cluster exposes and to whom: the API-key Secret's mount and the NetworkPolicy.

Owns: `api_keys_mount(config)` (the Secret volume and mount every Ray pod gets when the Serve
config's `args.auth.keys_file` is set: the Secret `tidal-api-keys` mounted read-only at the
file's folder, its key named after the file, never with `subPath`, because only whole-volume
Secret mounts are updated in place when the Secret changes, which is how keys rotate without a
restart), `network_policy(serve_port)` and `check_exposure(rayservice, policy)` (the policy
publishes the Serve port, lets the metrics port be scraped from inside the cluster, gives the
KubeRay operator the dashboard, and leaves every other Ray port (GCS 6379, dashboard 8265,
client 10001, agent 52365, raylet and worker ports) to the Ray pods themselves; the API keys are
required and mounted where the config reads them).

The Ray dashboard keeps `dashboard-host: 0.0.0.0`: the KubeRay operator deploys `serveConfigV2`
and reads Serve's status through the dashboard's port on the head Service, so a loopback-only
dashboard would leave the RayService never deployed. The policy (and Ray's token auth) are what
keep it from clients. Must not import ray.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ops.targets import tidal_app

API_KEYS_SECRET = "tidal-api-keys"
API_KEYS_VOLUME = "api-keys"
POLICY_NAME = "tidal-ray"
OPERATOR_LABEL = {"app.kubernetes.io/name": "kuberay-operator"}
"""The label the KubeRay Helm chart puts on the operator pod."""
DASHBOARD_PORT = 8265
AGENT_PORT = 52365


def auth_args(config: dict[str, Any]) -> dict[str, Any]:
    return dict((tidal_app(config).get("args") or {}).get("auth") or {})


def api_keys_mount(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) for the keys file of the config, or None when it names none."""
    keys_file = auth_args(config).get("keys_file")
    if not keys_file:
        return None
    path = PurePosixPath(keys_file)
    volume = {"name": API_KEYS_VOLUME, "secret": {"secretName": API_KEYS_SECRET, "defaultMode": 0o440,
                                                  "items": [{"key": path.name, "path": path.name}]}}
    mount = {"name": API_KEYS_VOLUME, "mountPath": str(path.parent), "readOnly": True}
    return volume, mount


def network_policy(labels: dict[str, str], serve_port: int, metrics_port: int) -> dict[str, Any]:
    def pods() -> dict[str, Any]:
        return {"podSelector": {"matchLabels": dict(labels)}}

    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABEL)}}
    ingress = [
        {"ports": [{"protocol": "TCP", "port": serve_port}]},  # clients: the OpenAI API (keys required)
        {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": metrics_port}]},
        {"from": [operator], "ports": [{"protocol": "TCP", "port": p} for p in (DASHBOARD_PORT, AGENT_PORT)]},
        {"from": [pods()]},  # GCS, dashboard, client, agent, raylet, object manager, workers: Ray pods only
    ]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": POLICY_NAME, "labels": dict(labels)},
            "spec": {**pods(), "policyTypes": ["Ingress"], "ingress": ingress}}


def _open_ports(policy: dict[str, Any]) -> dict[int, str]:
    """Port -> who may reach it, for the rules that are not Ray-pods-only."""
    out: dict[int, str] = {}
    for rule in (policy.get("spec") or {}).get("ingress") or []:
        sources = rule.get("from")
        who = "anyone" if not sources else ("cluster" if sources == [{"namespaceSelector": {}}] else "selected")
        for port in rule.get("ports") or []:
            out[int(port["port"])] = who
        if not rule.get("ports") and who != "selected":
            out[-1] = who  # every port open to someone outside the Ray pods
    return out


def check_exposure(rayservice: dict[str, Any], policy: dict[str, Any] | None, serve_port: int,
                   metrics_port: int, require_keys: bool = True) -> list[str]:
    """The policy and the RayService agree with the Serve config: see the module docstring.
    `require_keys` is False only for the kind smoke test (configs/sim.yaml, a dev config)."""
    import yaml

    config = yaml.safe_load((rayservice.get("spec") or {}).get("serveConfigV2") or "") or {}
    errors: list[str] = []
    if policy is None:
        errors.append(f"no NetworkPolicy {POLICY_NAME}: every Ray port (dashboard, GCS, client) is reachable")
    else:
        labels = ((rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"].get("metadata") or {})
                  .get("labels") or {})
        selector = (policy["spec"].get("podSelector") or {}).get("matchLabels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            errors.append(f"NetworkPolicy {POLICY_NAME} does not select the Ray pods ({selector})")
        opened = _open_ports(policy)
        if opened.get(serve_port) != "anyone":
            errors.append(f"NetworkPolicy {POLICY_NAME} does not publish the Serve port {serve_port}")
        if opened.get(metrics_port) not in ("anyone", "cluster"):
            errors.append(f"NetworkPolicy {POLICY_NAME} does not let Prometheus scrape port {metrics_port}")
        extra = sorted(p for p, who in opened.items() if who == "anyone" and p != serve_port)
        if extra:
            errors.append(f"NetworkPolicy {POLICY_NAME} opens ports other than Serve's to anyone: "
                          f"{['all' if p == -1 else p for p in extra]}")
    auth = auth_args(config)
    if not require_keys and not auth.get("keys_file"):
        return errors
    if require_keys and not auth.get("required"):
        errors.append("serveConfigV2: args.auth.required is not true; the RayService must require API keys")
    mount = api_keys_mount(config)
    if mount is None:
        return [*errors, "serveConfigV2: args.auth.keys_file is not set; keys come from the tidal-api-keys Secret"]
    errors += _check_mounts(rayservice, mount[1]["mountPath"])
    return errors


def _check_mounts(rayservice: dict[str, Any], folder: str) -> list[str]:
    errors: list[str] = []
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"]), *((g["groupName"], g) for g in cluster["workerGroupSpecs"])]
    for where, group in groups:
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts") or [] if m["mountPath"] == folder]
        secret = [m for m in mounts if (volumes.get(m["name"]) or {}).get("secret", {}).get("secretName")
                  == API_KEYS_SECRET]
        if not secret:
            errors.append(f"{where}: the {API_KEYS_SECRET} Secret is not mounted at {folder} (args.auth.keys_file)")
        elif any("subPath" in m for m in secret):
            errors.append(f"{where}: the {API_KEYS_SECRET} mount uses subPath: Kubernetes never updates such a "
                          "mount, so rotated keys would not reach the server")
    return errors
