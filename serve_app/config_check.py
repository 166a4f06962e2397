"""Strict validation of a Serve config file, on top of Ray's `ServeDeploySchema`.

Owns: `check_serve_config(data) -> list[str]` (empty when fine). Ray's schema accepts unknown
keys and inverted autoscaling bounds; a typo there silently does nothing in production. This
walks every level Serve defines with pydantic models and rejects unknown keys, checks
autoscaling bounds, placement-group bundles against the tensor-parallel degree, and validates
the application `args` with tidalserve's own strict models.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.config_loader import AppArgs

RAY_ACTOR_OPTION_KEYS = {"num_cpus", "num_gpus", "memory", "object_store_memory", "resources", "runtime_env",
                         "accelerator_type", "label_selector", "fallback_strategy"}
EXPECTED_DEPLOYMENTS = {"Ingress", "ServingUnit"}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like `Optional[X]`, `X | None`, `List[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _unknown_keys(data: Any, model: type[BaseModel], where: str) -> list[str]:
    errors: list[str] = []
    if isinstance(data, list):
        for i, item in enumerate(data):
            errors += _unknown_keys(item, model, f"{where}[{i}]")
        return errors
    if not isinstance(data, dict):
        return errors
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    for key, value in data.items():
        if key not in names:
            errors.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
            continue
        field = fields.get(key) or next(f for f in fields.values() if f.alias == key)
        if key == "ray_actor_options" and isinstance(value, dict):
            errors += [f"{where}.{key}.{k}: unknown Ray actor option" for k in value if k not in RAY_ACTOR_OPTION_KEYS]
        if key in ("args", "user_config", "runtime_env", "policy_kwargs", "request_router_kwargs"):
            continue  # free-form by design (args are checked by AppArgs below)
        sub = _model_of(field.annotation)
        if sub is not None:
            errors += _unknown_keys(value, sub, f"{where}.{key}")
    return errors


def _check_deployment(app_name: str, dep: dict[str, Any], tp: int | None) -> list[str]:
    where = f"applications[{app_name}].deployments[{dep.get('name')}]"
    errors: list[str] = []
    auto = dep.get("autoscaling_config")
    if auto:
        if "num_replicas" in dep and dep["num_replicas"] != "auto":
            errors.append(f"{where}: set num_replicas or autoscaling_config, not both")
        lo, hi = auto.get("min_replicas", 1), auto.get("max_replicas", 1)
        init = auto.get("initial_replicas", lo)
        if not lo <= init <= hi:
            errors.append(f"{where}.autoscaling_config: need min_replicas <= initial_replicas <= max_replicas, "
                          f"got {lo} <= {init} <= {hi}")
    bundles = dep.get("placement_group_bundles")
    if bundles and dep.get("name") == "ServingUnit" and tp:
        gpu_bundles = sum(1 for b in bundles if b.get("GPU", 0) > 0)
        if gpu_bundles and gpu_bundles != tp:
            errors.append(f"{where}.placement_group_bundles: {gpu_bundles} GPU bundles but engine.tp={tp}")
        first = bundles[0]
        actor = dep.get("ray_actor_options") or {}
        for res, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            if actor.get(key, 0) > first.get(res, 0):
                errors.append(f"{where}: ray_actor_options.{key}={actor.get(key)} does not fit the first "
                              f"placement-group bundle {first}")
    return errors


def check_serve_config(data: dict[str, Any]) -> list[str]:
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as exc:
        return [f"ServeDeploySchema: {exc}"]
    errors = _unknown_keys(data, ServeDeploySchema, "config")
    for app in data.get("applications") or []:
        name = app.get("name", "?")
        tp = None
        try:
            args = AppArgs.model_validate(app.get("args") or {})
            tp = args.engine.tp if args.engine.backend == "hf" else None
        except ValidationError as exc:
            errors.append(f"applications[{name}].args: {exc}")
        deployments = app.get("deployments") or []
        unknown = {d.get("name") for d in deployments} - EXPECTED_DEPLOYMENTS
        if app.get("import_path", "").startswith("serve_app.") and unknown:
            errors.append(f"applications[{name}].deployments: unknown deployment(s) {sorted(unknown)}; "
                          f"tidalserve has {sorted(EXPECTED_DEPLOYMENTS)}")
        for dep in deployments:
            errors += _check_deployment(name, dep, tp)
    return errors
