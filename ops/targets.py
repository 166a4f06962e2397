"""SLO targets and alert thresholds, read from a Serve config file (default configs/prod.yaml).

Owns: `Targets`, the numbers dashboards draw as threshold lines and alert rules compare
against. They come from the tidalserve application's `args.scheduler` block (admission SLO
targets, regime KV mark) with the core's defaults underneath, so changing the config changes
the dashboards and alerts on the next `tidal k8s render`: the two cannot disagree.

Imports the pure core (config defaults) and pyyaml only; no ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tidal_core import MICROWAIT_HARD_CAP_S, AdmissionConfig, RegimeConfig
from tidal_core.regime import REGIME_LEVEL, Regime


def find_repo_root(start: Path | None = None) -> Path:
    """The checkout the ops commands work on: the nearest folder at or above `start` (default:
    the working directory) holding both k8s/ and configs/, else the one this package sits in."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "k8s").is_dir() and (folder / "configs").is_dir():
            return folder
    return Path(__file__).resolve().parents[1]


REPO_ROOT = find_repo_root(Path(__file__).resolve().parent)
PROD_CONFIG = REPO_ROOT / "configs" / "prod.yaml"
SIM_CONFIG = REPO_ROOT / "configs" / "sim.yaml"
TIDAL_IMPORT_PATH = "serve_app.app:build_app"

TTFT_OBJECTIVE = 0.99
"""SLO: 99% of requests get their first token within `target_ttft_s` (the p99 target)."""
REJECTION_RATIO_ALERT = 0.05
"""Alert when more than 5% of arrivals are turned away (sustained): capacity is short."""


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float | None
    kv_alert: float
    kv_reject: float
    overload_load: float
    light_load: float
    overload_level: int = REGIME_LEVEL[Regime.OVERLOAD]
    ttft_objective: float = TTFT_OBJECTIVE
    rejection_ratio: float = REJECTION_RATIO_ALERT
    microwait_cap_s: float = MICROWAIT_HARD_CAP_S

    @property
    def error_budget(self) -> float:
        return 1.0 - self.ttft_objective


def tidal_app(config: dict[str, Any]) -> dict[str, Any]:
    """The tidalserve application of a Serve config (the one built by serve_app.app)."""
    apps = [a for a in config.get("applications") or [] if a.get("import_path") == TIDAL_IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"expected exactly one application with import_path {TIDAL_IMPORT_PATH}, found {len(apps)}")
    app: dict[str, Any] = apps[0]
    return app


def deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    for dep in app.get("deployments") or []:
        if dep.get("name") == name:
            return dict(dep)
    return {}


def targets_from_config(config: dict[str, Any]) -> Targets:
    sched = (tidal_app(config).get("args") or {}).get("scheduler") or {}
    admission = dataclasses.replace(AdmissionConfig(), **(sched.get("admission") or {}))
    regime = dataclasses.replace(RegimeConfig(), **(sched.get("regime") or {}))
    return Targets(ttft_s=admission.target_ttft_s, tpot_s=admission.target_tpot_s, kv_alert=regime.kv_overload,
                   kv_reject=admission.kv_reject_usage, overload_load=regime.overload_enter,
                   light_load=regime.light_enter)


def load_config(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a Serve config (a mapping at the top level)")
    return data


def load_targets(path: Path = PROD_CONFIG) -> Targets:
    return targets_from_config(load_config(path))
