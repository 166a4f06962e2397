"""tidalserve's pure scheduling core: policy as data in, decisions out.

Standard library only. No ray, torch, transformers, fastapi or asyncio, and no wall clock:
time is an argument (`now`) and waits are returned as deadlines (`WaitUntil`). The same
`Scheduler` is driven by the Serve router (wall clock), the simulated-GPU replica and the
discrete-event simulator (virtual clock). tests/unit/test_purity.py enforces this.
"""

from serve_app.core.autoscale import AutoscaleConfig, AutoscaleObservation, AutoscaleState, decide
from serve_app.core.buckets import CudaGraphBuckets
from serve_app.core.clock import Clock, VirtualClock
from serve_app.core.config import (
    MICROWAIT_HARD_CAP_S,
    AdmissionConfig,
    BatchingConfig,
    RegimeConfig,
    SchedulerConfig,
    ServicePrior,
)
from serve_app.core.kv_blocks import BlockManager
from serve_app.core.plan import (
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
from serve_app.core.presets import POLICIES, PRESET_DESCRIPTIONS, preset
from serve_app.core.regime import Regime
from serve_app.core.request import FinishReason, Request, RequestStatus, SamplingParams
from serve_app.core.routing import UnitLoad, choose_unit
from serve_app.core.scheduler import Scheduler
from serve_app.core.stats import RequestTimes, SchedulerStats

__all__ = [
    "MICROWAIT_HARD_CAP_S", "POLICIES", "PRESET_DESCRIPTIONS", "AdmissionConfig", "AutoscaleConfig",
    "AutoscaleObservation", "AutoscaleState", "BatchingConfig", "BlockManager", "Clock", "CudaGraphBuckets",
    "Decision", "FinishReason", "Idle", "NewRequestData", "Regime", "RegimeConfig", "Rejection", "Request",
    "RequestStatus", "RequestTimes", "Run", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerStats",
    "ServicePrior", "StepOutputs", "StepPlan", "StepResult", "StepStats", "UnitLoad", "VirtualClock",
    "WaitUntil", "choose_unit", "decide", "preset",
]
