"""What one simulation run is: the unit's scheduler config, its executor factory, the fleet.

Owns: `SimConfig`, a frozen record read by the unit, the fleet and the event loop. It names
no simulator module, so any of them may import it; it must not import loadgen.sim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadgen.report import Slo
from loadgen.retry_policy import RetryPolicy
from tidal_core import AutoscaleConfig, SchedulerConfig

ROUTINGS = ("load", "prefix", "load-blind")
"""Fleet routing: "load" (`choose_unit` with the prompt's size: the lower predicted TTFT of two,
or the best unit when both would refuse it), "prefix" (cache-aware, core/prefix_routing.py) or
"load-blind" (the previous rule, kept for comparison: the lower queueing delay of two, blind to
the prompt's size and to admission)."""


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    make_executor: Callable[[], Any]
    slo: Slo = field(default_factory=Slo)
    num_units: int = 1
    gpus_per_unit: int = 8
    autoscale: AutoscaleConfig | None = None
    autoscale_interval_s: float = 10.0
    provisioning_s: float = 300.0
    sample_interval_s: float = 60.0
    seed: int = 0
    retries: RetryPolicy | None = None  # clients retry refusals (loadgen/sim/retries.py); None: never
    routing: str = "load"
    # with routing "prefix": `PrefixRoutingConfig` fields other than the unit's size (e.g. max_extra_delay_s)
    prefix_routing: dict[str, float] = field(default_factory=dict)
    batch_ids: frozenset[int] = frozenset()  # trace indices sent as the batch class (loadgen/sim/backlog.py)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is unknown; use one of {ROUTINGS}")
