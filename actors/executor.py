"""The seam between a step driver and whatever computes a step.

Owns: `LocalExecutor`, a TP=1 model runner in this process with no Ray at all. The protocols
it implements (`Executor`, `AsyncExecutor`) are the step contract's, in tidal_core/plan.py;
`actors.replica.ReplicaGroup` is the multi-worker implementation of both forms.

Must not import: ray.
"""

from __future__ import annotations

from actors.worker_setup import EngineInfo, EngineSpec, build_local_runner
from tidal_core.plan import StepPlan, StepResult


class LocalExecutor:
    """The real model in this process (TP=1): what `tidal generate` and the CPU benchmark use."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.runner, self.info = build_local_runner(spec)

    @property
    def engine_info(self) -> EngineInfo:
        return self.info

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        self.runner.states.clear()
