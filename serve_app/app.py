"""The Serve application: `serve run configs/prod.yaml` calls `build_app(args)`.

Owns: turning a config's `args:` block into the deployment graph Ingress -> ServingUnit. Deployment
options set here are sane defaults for an LLM server (Serve's own defaults of
`max_ongoing_requests=5` and one CPU per replica are wrong for it); a config's `deployments:`
section overrides them by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.config_loader import load_app_args
from serve_app.ingress import Ingress
from serve_app.openai.arrival_stamp import ArrivalKey
from serve_app.unit import ServingUnit

UNIT_DEFAULTS: dict[str, Any] = {
    "max_ongoing_requests": 2048,  # every streaming request holds a slot while it queues in the scheduler
    "health_check_period_s": 2.0,
    "health_check_timeout_s": 30.0,
    "graceful_shutdown_timeout_s": 60.0,
    "ray_actor_options": {"num_cpus": 0},
}
INGRESS_DEFAULTS: dict[str, Any] = {
    "max_ongoing_requests": 4096,
    "ray_actor_options": {"num_cpus": 0},
}


def build_app(args: dict[str, Any] | None = None) -> Application:
    app_args = load_app_args(args)
    plain = app_args.model_dump(mode="json")
    unit = ServingUnit.options(**UNIT_DEFAULTS).bind(plain)
    # One arrival-stamp key per build, shared by every Ingress replica (serve_app/openai/arrival_stamp.py).
    return Ingress.options(**INGRESS_DEFAULTS).bind(unit, plain, arrival_key=ArrivalKey().hex)
