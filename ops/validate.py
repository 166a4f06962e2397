"""Offline validation of every manifest under k8s/, as strict as `kubectl --validate=strict`.

Owns: `validate_object(obj) -> list[str]` and `validate_tree(k8s_dir)` (every kustomization:
base, monitoring, each overlay, built with ops/kustomize.py). KubeRay kinds are
checked against the CRD's `openAPIV3Schema` from k8s/crds with `additionalProperties: false`
added wherever the schema lists properties and does not allow extra ones (the API server would
silently prune a typo), then by ops/k8s_checks.py; core kinds (and every pod
template inside a RayService) with `kubernetes-validate` in strict mode; PrometheusRule groups
with `promtool check rules` when Prometheus is installed; PodMonitor and the dashboards
ConfigMap by hand (no schema for monitoring.coreos.com ships here); the NetworkPolicy with
`kubernetes-validate`, and against its RayService by ops/exposure.py (what is published, keys
required and mounted; optional in the kind smoke test).
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ops import kustomize
from ops.exposure import POLICY_NAME, check_exposure
from ops.k8s import METRICS_PORT
from ops.k8s_checks import check_rayservice
from ops.targets import REPO_ROOT

CRD_DIR = REPO_ROOT / "k8s" / "crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml",
             "RayJob": "ray.io_rayjobs.yaml"}
K8S_VERSION = "1.32.0"
KUSTOMIZATIONS = ("base", "monitoring", "overlays/prod", "overlays/sim-cpu")
SMOKE_TESTS = ("overlays/sim-cpu",)
"""Kustomizations whose Serve config is a dev config: API keys optional (kind, no clients)."""


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema that rejects unknown fields wherever it names the known ones."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf")
           else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = strict(copy.deepcopy(ver["schema"]["openAPIV3Schema"]))
    return schema


@functools.cache
def _validator(kind: str, version: str) -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(crd_schema(kind, version))


def schema_errors(obj: dict[str, Any]) -> list[str]:
    validator = _validator(obj["kind"], obj.get("apiVersion", "").rpartition("/")[2])
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]


def core_errors(obj: dict[str, Any]) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes {K8S_VERSION} schema for {obj.get('apiVersion')} {obj.get('kind')}"]
    except kubernetes_validate.ValidationError as exc:
        return [exc.message if hasattr(exc, "message") else str(exc).splitlines()[0]]
    return []


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cluster = obj["spec"].get("rayClusterConfig") or {}
    found = [("head", cluster["headGroupSpec"]["template"])]
    return found + [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs") or []]


def rayservice_errors(obj: dict[str, Any]) -> list[str]:
    errors = schema_errors(obj)
    for name, template in pod_templates(obj):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        errors += [f"pod template {name}: {e}" for e in core_errors(wrapped)]
    return errors or check_rayservice(obj)


def promtool_errors(groups: dict[str, Any]) -> list[str]:
    """`promtool check rules` on a rule file; [] when fine or when promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return []
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump(groups, sort_keys=False))
        f.flush()
        run = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True, timeout=60)
    return [] if run.returncode == 0 else [f"promtool: {run.stdout.strip()} {run.stderr.strip()}"]


def podmonitor_errors(obj: dict[str, Any]) -> list[str]:
    spec = obj.get("spec") or {}
    errors = [] if (spec.get("selector") or {}).get("matchLabels") else ["spec.selector.matchLabels is empty"]
    endpoints = spec.get("podMetricsEndpoints") or []
    if not endpoints or any("port" not in e for e in endpoints):
        errors.append("spec.podMetricsEndpoints needs at least one endpoint, each with a port name")
    return errors


def dashboards_errors(obj: dict[str, Any]) -> list[str]:
    errors = core_errors(obj)
    for name, text in (obj.get("data") or {}).items():
        try:
            dash = json.loads(text)
        except json.JSONDecodeError as exc:
            errors.append(f"{name}: not JSON ({exc})")
            continue
        missing = {"uid", "title", "panels", "templating", "schemaVersion"} - set(dash)
        if missing:
            errors.append(f"{name}: not a Grafana dashboard (missing {sorted(missing)})")
    return errors


def validate_object(obj: dict[str, Any]) -> list[str]:
    kind, api = obj.get("kind"), obj.get("apiVersion", "")
    if api.startswith("ray.io/") and kind == "RayService":
        return rayservice_errors(obj)
    if api.startswith("ray.io/") and kind in CRD_FILES:
        return schema_errors(obj)
    if kind == "PrometheusRule":
        return promtool_errors(obj.get("spec") or {}) if (obj.get("spec") or {}).get("groups") else ["no groups"]
    if kind == "PodMonitor":
        return podmonitor_errors(obj)
    if kind == "ConfigMap" and (obj.get("metadata", {}).get("labels") or {}).get("grafana_dashboard") == "1":
        return dashboards_errors(obj)
    return core_errors(obj)


def validate_tree(k8s_dir: Path) -> dict[str, list[str]]:
    """Kustomization -> errors ('<Kind>/<name>: message'), for every kustomization under k8s/."""
    report: dict[str, list[str]] = {}
    for rel in KUSTOMIZATIONS:
        try:
            objects = kustomize.build(k8s_dir / rel)
        except (OSError, kustomize.KustomizeError, yaml.YAMLError) as exc:
            report[rel] = [f"kustomize: {exc}"]
            continue
        report[rel] = [f"{o.get('kind')}/{o.get('metadata', {}).get('name')}: {e}"
                       for o in objects for e in validate_object(o)]
        report[rel] += exposure_errors(objects, require_keys=rel not in SMOKE_TESTS)
    return report


def exposure_errors(objects: list[dict[str, Any]], require_keys: bool = True) -> list[str]:
    """Across objects: the RayService's NetworkPolicy and API-key Secret mount (ops/exposure.py)."""
    services = [o for o in objects if o.get("kind") == "RayService"]
    policies = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "NetworkPolicy"}
    errors: list[str] = []
    for rs in services:
        config = yaml.safe_load(rs["spec"].get("serveConfigV2") or "") or {}
        port = int((config.get("http_options") or {}).get("port", 8000))
        errors += [f"RayService/{rs['metadata']['name']}: {e}"
                   for e in check_exposure(rs, policies.get(POLICY_NAME), port, METRICS_PORT, require_keys)]
    return errors
