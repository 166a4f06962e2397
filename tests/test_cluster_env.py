"""Every way a tidalserve cluster starts carries the environment Serve's processes read at their start.

serve_app/cluster_env.py: the front gate in Serve's proxy and Serve's data plane over gRPC. The
shipped configs carry it in `controller_options` (the controller starts with it, the proxy and the
replicas inherit it), so `serve run configs/X.yaml` and `make serve` need no exports; the test and
benchmark clusters start Serve with a config's block; the KubeRay manifests set it on every Ray
container. If one of them drifts, a user runs a server without the gate that was measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serve_app.cluster_env import CLUSTER_ENV, CONTROLLER_OPTIONS
from serve_app.config_check import check_serve_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_the_gate_and_the_grpc_data_plane_are_named() -> None:
    assert CLUSTER_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "serve_app.proxy_gate:middlewares"
    assert CLUSTER_ENV["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert CONTROLLER_OPTIONS == {"runtime_env": {"env_vars": CLUSTER_ENV}}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_carries_the_cluster_env(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    assert config.get("controller_options") == CONTROLLER_OPTIONS, path.name
    assert check_serve_config(config) == []  # Ray's schema takes the block; nothing else is off


def test_configs_are_found() -> None:
    assert {p.name for p in CONFIGS} >= {"local.yaml", "sim.yaml", "prod.yaml"}


def test_make_serve_is_serve_run_on_the_local_config_alone() -> None:
    """README: `make serve` runs `serve run configs/local.yaml`; no environment is set beside it."""
    lines = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()  # continued lines joined
    start = next(i for i, line in enumerate(lines) if line.startswith("serve:"))
    recipe = next(line for line in lines[start + 1:] if line.startswith("\t") and "serve run" in line)
    assert recipe.split() == ["$(VENV)/bin/serve", "run", "configs/local.yaml"]


def test_the_harnesses_take_the_block_from_the_shipped_config() -> None:
    from tests.integration.conftest import shipped_controller_options

    assert shipped_controller_options() == CONTROLLER_OPTIONS
