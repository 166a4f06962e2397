"""Serve autoscaling policy: the core autoscale decision over the units' own measurements.

Owns: `TidalAutoscalingPolicy`, a class-callable for `autoscaling_config.policy` (Serve
instantiates it once in the controller with `policy_kwargs`, then calls it about every 0.1 s
with an `AutoscalingContext`). Each ServingUnit replica reports `record_autoscaling_stats` (load,
capacity, queue delay, KV usage, regime, measured TPOT and its target, batch backlog: the
`UnitLoad` wire form); this adapter turns them into `UnitLoad`s and calls `tidal_core.decide`,
the decision the simulator's fleet makes, so both scale on the same signals (arrival demand,
hot units' step time, interactive demand only). The unit bounds are Serve's own `min_replicas`/`max_replicas`
(capacity-adjusted), so they live in one place: the deployment's `autoscaling_config`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tidal_core import AutoscaleConfig, AutoscaleObservation, AutoscaleState, UnitLoad, decide
from tidal_core.snapshot import STAT_KEYS


class TidalAutoscalingPolicy:
    def __init__(self, **kwargs: Any) -> None:
        # min/max come from the deployment's autoscaling_config at call time.
        self.config = AutoscaleConfig(**{k: v for k, v in kwargs.items() if k not in ("min_units", "max_units")})
        self._gauges: Any = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        units = []
        for replica_id in ctx.running_replicas:
            stats = {k: metrics[k][replica_id] for k in STAT_KEYS if replica_id in metrics.get(k, {})}
            units.append(UnitLoad.from_stats(str(replica_id), stats or None))
        config = dataclasses.replace(self.config, min_units=max(1, ctx.capacity_adjusted_min_replicas),
                                     max_units=max(1, ctx.capacity_adjusted_max_replicas))
        now = ctx.current_time if ctx.current_time is not None else time.time()
        # The count the deployment is heading for, its replicas still starting included, as the
        # simulator's fleet counts its units still provisioning (and as Serve's own policy decides
        # from): from the running count alone, a scale-up was undone on the very next call while
        # its replica started, and the deployment never grew (benchmarks/autoscale_serve.py).
        current = ctx.target_num_replicas if ctx.target_num_replicas is not None else ctx.current_num_replicas
        obs = AutoscaleObservation(now, current, [u for u in units if u.capacity_rps > 0])
        target, state = decide(obs, AutoscaleState.from_dict(ctx.policy_state), config)
        self._export(ctx.deployment_name, target, state.last_demand)
        return target, state.to_dict()

    def _export(self, deployment: str, target: int, demand: float) -> None:
        try:
            if self._gauges is None:
                from ray.util import metrics as ray_metrics

                from serve_app import metric_defs as M

                self._gauges = (
                    ray_metrics.Gauge(M.UNITS_DESIRED.name, M.UNITS_DESIRED.description, M.UNITS_DESIRED.tag_keys),
                    ray_metrics.Gauge(M.UNITS_DEMAND.name, M.UNITS_DEMAND.description, M.UNITS_DEMAND.tag_keys),
                )
            self._gauges[0].set(target, {"deployment": deployment})
            self._gauges[1].set(demand, {"deployment": deployment})
        except Exception:  # metrics must never break scaling decisions
            self._gauges = None
