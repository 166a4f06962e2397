"""The Serve autoscaling policy: Serve's own AutoscalingContext in, the core decision out.

The context is Ray Serve's real `AutoscalingContext`, filled as the controller fills it: one
entry per running replica in `aggregated_metrics`, each a `record_autoscaling_stats` key (the
`UnitLoad` wire form). The policy must reach the same decision as `tidal_core.decide` on the
same snapshots, so the simulator's fleet and the Serve app scale alike.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from serve_app.autoscaling import TidalAutoscalingPolicy
from tidal_core import AutoscaleConfig, AutoscaleObservation, AutoscaleState, Regime, UnitLoad, decide

DEP = DeploymentID("ServingUnit", "tidal")
KWARGS = {"target_load": 0.5, "smoothing_s": 0.0, "lead_s": 0.0, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}


def context(loads: list[UnitLoad], current: int, state: dict[str, Any] | None = None, now: float = 100.0,
            max_replicas: int = 8, target: int | None = None) -> AutoscalingContext:
    """Serve's context with `loads` from the running replicas; `current` running, `target` the
    count the deployment is heading for (replicas starting included; default: `current`)."""
    replicas = [ReplicaID(u.unit_id, DEP) for u in loads]
    metrics: dict[str, dict[ReplicaID, float]] = {}
    for rid, load in zip(replicas, loads, strict=True):
        for key, value in load.to_stats().items():
            metrics.setdefault(key, {})[rid] = value
    return AutoscalingContext(deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
                              current_num_replicas=current, target_num_replicas=current if target is None else target,
                              running_replicas=replicas,
                              total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics,
                              raw_metrics={}, capacity_adjusted_min_replicas=1,
                              capacity_adjusted_max_replicas=max_replicas, policy_state=state or {},
                              last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None)


def unit(uid: str, load: float = 0.4, tpot_ms: float = 60.0, **extra: Any) -> UnitLoad:
    return UnitLoad(uid, 8, 0, 0.0, 0.2, load, 2.0, Regime.STEADY, tpot_s=tpot_ms / 1000, target_tpot_s=0.1, **extra)


def test_a_hot_replica_gets_one_more_unit_through_serve() -> None:
    policy = TidalAutoscalingPolicy(**KWARGS)
    n, _ = policy(context([unit("a"), unit("b")], 2))
    assert n == 2
    n, state = policy(context([unit("a", tpot_ms=88.0), unit("b")], 2))
    assert n == 3
    assert state["last_demand"] == pytest.approx(1.6)  # 2 x 0.4 / 0.5: the rate alone asks for 2


def test_a_scale_up_holds_while_its_replicas_start() -> None:
    """Serve calls the policy several times a second; a replica takes seconds to start. The next
    call sees one replica running and two targeted: the decision stands (it once fell back to the
    running count, and Serve stopped each new replica while it started: the deployment never grew)."""
    policy = TidalAutoscalingPolicy(**{**KWARGS, "upscale_delay_s": 5.0, "downscale_delay_s": 60.0})
    hot = [unit("a", 1.2)]  # 1.2 / 0.5: demand for 3 units
    n, state = policy(context(hot, 1, now=0.0))
    assert n == 1  # the upscale delay starts
    n, state = policy(context(hot, 1, state, now=5.0))
    assert n == 3
    for t in (5.1, 5.2, 8.0, 20.0):  # the two new replicas still starting: the target stands
        n, state = policy(context(hot, 1, state, now=t, target=3))
        assert n == 3
    n, _ = policy(context([unit("a", 0.2)], 1, state, now=21.0, target=3))
    assert n == 3  # demand fell: the downscale delay starts, nothing is undone at once


def test_a_batch_backlog_does_not_scale_the_deployment() -> None:
    policy = TidalAutoscalingPolicy(**KWARGS)
    filled = unit("a", 0.45, tpot_ms=93.0, batch_load=0.2, batch_waiting=900, batch_backlog_tokens=3_000_000,
                  batch_running=30)
    n, _ = policy(context([filled], 1))
    assert n == 1
    n, _ = TidalAutoscalingPolicy(**KWARGS, scale_for_batch=True)(context([filled], 1))
    assert n == 2


def test_the_policy_makes_the_core_decision_on_the_replicas_snapshots() -> None:
    loads = [unit("a", 0.9, tpot_ms=70.0), unit("b", 0.7, tpot_ms=76.0), unit("c", 0.2, tpot_ms=55.0)]
    policy = TidalAutoscalingPolicy(**KWARGS, cool_tpot_fraction=0.75)
    state: dict[str, Any] = {}
    core_state = AutoscaleState()
    for t in (0.0, 10.0, 20.0):
        n, state = policy(context(loads, 3, state, now=t))
        want, core_state = decide(AutoscaleObservation(t, 3, loads), core_state,
                                  AutoscaleConfig(min_units=1, max_units=8, cool_tpot_fraction=0.75, **KWARGS))
        assert n == want
        assert state == core_state.to_dict()
    assert n == 4  # demand (1.8 + 1.4 + 0.4) / 1.0 = 3.6 units


def test_serve_bounds_clamp_the_count() -> None:
    hot = [unit(str(i), 1.5, tpot_ms=95.0) for i in range(3)]
    n, _ = TidalAutoscalingPolicy(**KWARGS)(context(hot, 3, max_replicas=4))
    assert n == 4


def test_the_prod_config_s_policy_kwargs_are_core_autoscale_fields() -> None:
    """A misspelt or out-of-range key in configs/prod.yaml fails here, not in the controller."""
    from pathlib import Path

    import yaml

    prod = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "prod.yaml").read_text())
    (unit_dep,) = [d for app in prod["applications"] for d in app["deployments"] if "autoscaling_config" in d]
    policy = unit_dep["autoscaling_config"]["policy"]
    assert policy["policy_function"] == "serve_app.autoscaling:TidalAutoscalingPolicy"
    built = TidalAutoscalingPolicy(**policy["policy_kwargs"])
    assert built.config.hot_tpot_fraction is not None and built.config.scale_for_batch is False
