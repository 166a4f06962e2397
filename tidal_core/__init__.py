"""tidalserve's pure scheduling core: policy as data in, decisions out.

Standard library only. No ray, torch, transformers, fastapi or asyncio, and no wall clock:
time is an argument (`now`) and waits are returned as deadlines (`WaitUntil`). The same
`Scheduler` is driven by the Serve router (wall clock), the simulated-GPU replica and the
discrete-event simulator (virtual clock). tests/test_layering.py enforces this.
"""

from tidal_core.autoscale import AutoscaleConfig, AutoscaleObservation, AutoscaleState, decide
from tidal_core.buckets import CudaGraphBuckets
from tidal_core.clock import Clock, VirtualClock
from tidal_core.config import (
    MICROWAIT_HARD_CAP_S,
    AdmissionConfig,
    BatchingConfig,
    RegimeConfig,
    SchedulerConfig,
    ServicePrior,
    StepSizingConfig,
)
from tidal_core.kv_blocks import BlockManager
from tidal_core.plan import (
    Decision,
    Idle,
    NewRequestData,
    Rejection,
    Run,
    StepOutputs,
    StepPlan,
    StepResult,
    StepStats,
    WaitUntil,
)
from tidal_core.presets import POLICIES, PRESET_DESCRIPTIONS, preset
from tidal_core.regime import Regime
from tidal_core.request import FinishReason, Request, RequestStatus, SamplingParams
from tidal_core.routing import choose_unit
from tidal_core.scheduler import Scheduler
from tidal_core.snapshot import UnitLoad
from tidal_core.stats import RequestTimes, SchedulerStats

__all__ = [
    "MICROWAIT_HARD_CAP_S",
    "POLICIES",
    "PRESET_DESCRIPTIONS",
    "AdmissionConfig",
    "AutoscaleConfig",
    "AutoscaleObservation",
    "AutoscaleState",
    "BatchingConfig",
    "BlockManager",
    "Clock",
    "CudaGraphBuckets",
    "Decision",
    "FinishReason",
    "Idle",
    "NewRequestData",
    "Regime",
    "RegimeConfig",
    "Rejection",
    "Request",
    "RequestStatus",
    "RequestTimes",
    "Run",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "ServicePrior",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "StepSizingConfig",
    "StepStats",
    "UnitLoad",
    "VirtualClock",
    "WaitUntil",
    "choose_unit",
    "decide",
    "preset",
]
