"""Every config file validates (Ray's schema + our strict checks), builds an application, and
every knob is documented."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.config_check import check_serve_config
from serve_app.config_loader import (
    EngineArgs,
    IngressArgs,
    SchedulerArgs,
    StreamingArgs,
    load_app_args,
    scheduler_config,
)
from tidal_core import AdmissionConfig, BatchingConfig, RegimeConfig, SchedulerConfig, StepSizingConfig
from tidal_core.overrides import apply_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_three_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"local.yaml", "sim.yaml", "prod.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_strictly(path: Path) -> None:
    data = load(path)
    ServeDeploySchema.model_validate(data)
    assert check_serve_config(data) == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_builds_an_application_without_starting_anything(path: Path) -> None:
    from ray.serve import Application

    from serve_app.app import build_app

    for app in load(path)["applications"]:
        built = build_app(app["args"])
        assert isinstance(built, Application)
        args = load_app_args(app["args"], environ={})
        cfg = scheduler_config(args.scheduler, num_kv_blocks=100_000, block_size=args.engine.block_size,
                               max_model_len=args.engine.max_model_len)
        assert cfg.policy == args.scheduler.policy


def _prod() -> dict:
    return load(ROOT / "configs" / "prod.yaml")


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d["applications"][0]["deployments"][1]["autoscaling_config"].update(min_replicas=9), "min_replicas"),
    (lambda d: d["applications"][0]["deployments"][1].update(max_ongoing_request=3), "max_ongoing_request"),
    (lambda d: d["http_options"].update(prot=8000), "prot"),
    (lambda d: d["applications"][0]["args"]["scheduler"].update(polcy="x"), "polcy"),
    (lambda d: d["applications"][0]["args"]["scheduler"].update(policy="magic"), "magic"),
    (lambda d: d["applications"][0]["args"]["engine"].update(tp=4), "GPU bundles"),
    (lambda d: d["applications"][0]["deployments"][1]["ray_actor_options"].update(num_cpu=1), "num_cpu"),
    (lambda d: d["applications"][0]["args"].update(streaming={"interval": 0.1}), "interval"),
    (lambda d: d["applications"][0]["args"].update(streaming={"interval_s": -1}), "interval_s"),
])
def test_strict_check_catches_what_ray_accepts(mutate, fragment: str) -> None:
    data = copy.deepcopy(_prod())
    mutate(data)
    errors = check_serve_config(data)
    assert any(fragment in e for e in errors), errors


def test_env_override_and_unknown_core_override() -> None:
    args = load_app_args({"engine": {"model": "a"}}, environ={"TIDAL_MODEL": "/models/llama"})
    assert args.engine.model == "/models/llama"
    bad = load_app_args({"scheduler": {"batching": {"t_maxx_s": 1}}}, environ={})
    with pytest.raises(ValueError, match="t_maxx_s"):
        scheduler_config(bad.scheduler, num_kv_blocks=1000, block_size=16, max_model_len=2048)
    with pytest.raises(ValueError, match="cost_model"):
        EngineArgs(backend="sim")


def test_every_knob_is_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    names = (set(EngineArgs.model_fields) | set(SchedulerArgs.model_fields) | set(IngressArgs.model_fields)
             | set(StreamingArgs.model_fields))
    for cls in (BatchingConfig, RegimeConfig, AdmissionConfig, StepSizingConfig):
        names |= {f.name for f in dataclasses.fields(cls)} - {"mode"}
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"undocumented knobs: {missing}"


def _admission(name: str) -> AdmissionConfig:
    app = load(ROOT / "configs" / name)["applications"][0]
    args = load_app_args(app["args"], environ={})
    return scheduler_config(args.scheduler, num_kv_blocks=100_000, block_size=16, max_model_len=2048).admission


def test_the_dev_config_queues_and_production_keeps_slo_admission() -> None:
    # `make serve` must not refuse a burst a developer sends (only a full queue is a 429);
    # production and the load-test config turn requests away to keep their TTFT target.
    local = _admission("local.yaml")
    assert local.enabled and local.mode == "protect" and local.max_queue_len >= 64
    for name in ("prod.yaml", "sim.yaml"):
        assert _admission(name).mode == "slo"
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert "`mode`" in doc and "protect" in doc
    bad = load_app_args({"scheduler": {"admission": {"mode": "lenient"}}}, environ={})
    with pytest.raises(ValueError, match=r"admission\.mode='lenient'"):
        scheduler_config(bad.scheduler, num_kv_blocks=1000, block_size=16, max_model_len=2048)


def test_prefix_caching_is_on_in_the_shipped_configs_and_can_be_turned_off() -> None:
    for path in CONFIGS:
        for app in load(path)["applications"]:
            args = load_app_args(app["args"], environ={})
            cfg = scheduler_config(args.scheduler, num_kv_blocks=100_000, block_size=16, max_model_len=2048)
            assert cfg.enable_prefix_caching, path.name
    off = load_app_args({"scheduler": {"enable_prefix_caching": False}}, environ={})
    assert not scheduler_config(off.scheduler, num_kv_blocks=1000, block_size=16,
                                max_model_len=2048).enable_prefix_caching
    words = load_app_args({"scheduler": {"enable_prefix_caching": "off"}}, environ={})
    assert words.scheduler.enable_prefix_caching is False
    with pytest.raises(ValueError, match=r"enable_prefix_caching='maybe' is not a switch: write true, or false"):
        load_app_args({"scheduler": {"enable_prefix_caching": "maybe"}}, environ={})
    data = copy.deepcopy(_prod())
    data["applications"][0]["args"]["scheduler"]["enable_prefix_caching"] = 2
    assert any("enable_prefix_caching=2" in e for e in check_serve_config(data))
    assert not apply_overrides(SchedulerConfig(enable_prefix_caching=True),
                               {"enable_prefix_caching": "false"}).enable_prefix_caching
