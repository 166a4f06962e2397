"""One simulated serving unit: a core `Scheduler` and a simulated executor on the virtual clock.

Owns: `Unit` (its scheduler, executor, in-flight step, lifetime and busy time) and `unit_load`
(its state as the core's `UnitLoad`, via `Scheduler.snapshot`, the record routing and
autoscaling read). Imports only `loadgen.sim.config` and tidal_core; must not import the fleet
or the event loop.
"""

from __future__ import annotations

from loadgen.sim.config import SimConfig
from tidal_core import Scheduler, StepPlan, StepResult, UnitLoad


class Unit:
    """A serving unit in the simulation: its scheduler, executor and engine state."""

    __slots__ = ("busy_s", "draining", "end_s", "executor", "inflight", "ready_s", "sched", "start_s", "token", "uid")

    def __init__(self, uid: int, config: SimConfig, start_s: float, ready_s: float) -> None:
        self.uid = uid
        self.sched = Scheduler(config.scheduler, now=ready_s)
        self.executor = config.make_executor()
        self.inflight: tuple[StepPlan, StepResult] | None = None
        self.token = 0  # invalidates a superseded engine event in the heap
        self.start_s = start_s
        self.ready_s = ready_s
        self.end_s: float | None = None
        self.draining = False
        self.busy_s = 0.0

    @property
    def idle(self) -> bool:
        return self.inflight is None and not self.sched.has_unfinished


def unit_load(unit: Unit, now: float) -> UnitLoad:
    return unit.sched.snapshot(now, str(unit.uid))
