"""The batch service class's configuration: frozen, validated, no I/O.

Owns: `BatchClassConfig` (`SchedulerConfig.batch`; reachable from YAML as `scheduler.batch.*`
and from `tidal simulate --set batch.*`). The policy that reads it is core/batch_lane.py.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class BatchClassConfig:
    """How the batch class (`service_tier="flex"`, `priority > 0`) uses a unit's headroom.

    With `enabled`, batch requests bypass the TTFT rules of admission and queue in their own
    queue of at most `max_queue_tokens` prompt tokens (past it: 429 `batch_queue_full` with a
    Retry-After from the measured batch drain rate, within [`min_retry_after_s`,
    `max_retry_after_s`]). They run only in what interactive requests leave: a step's batch
    tokens keep its predicted time within `step_fraction` x the step sizer's TPOT aim, and a step
    takes batch tokens only while every interactive decode in it has banked `bank_reserve_steps`
    aims (the time its next prompt's prefill may borrow; core/step_sizer.py), a reserve
    scaled by the interactive load over `reserve_full_load` (capped at 1; 0: never scaled),
    so a quiet unit, whose next prompt is further away, keeps less; batch requests
    start only while KV usage is below `max_kv_usage`, and they are preempted first when
    interactive requests need the batch slot or its KV. With `predict_wait`, the TTFT
    prediction adds what the batch work in the step in flight delays the next step (False, an
    ablation: the learned correction ratio absorbs it). Off (`enabled=False`), a batch
    request is served as an interactive one (the "no batch class" comparison).
    """

    enabled: bool = True
    max_queue_tokens: int = 4_194_304
    max_kv_usage: float = 0.9
    step_fraction: float = 1.0
    bank_reserve_steps: float = 20.0
    reserve_full_load: float = 1.25
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 3600.0
    drain_tau_s: float = 60.0
    predict_wait: bool = True

    def __post_init__(self) -> None:
        _require(self.max_queue_tokens >= 1,
                 f"batch.max_queue_tokens={self.max_queue_tokens} must be >= 1 (prompt tokens the batch queue holds)")
        _require(0.0 < self.max_kv_usage <= 1.0,
                 f"batch.max_kv_usage={self.max_kv_usage} must be in (0, 1] (KV usage above which no batch "
                 "request starts)")
        _require(0.1 <= self.step_fraction <= 1.0,
                 f"batch.step_fraction={self.step_fraction} must be in [0.1, 1] (share of the TPOT aim batch "
                 "work may fill)")
        _require(0.0 < self.min_retry_after_s <= self.max_retry_after_s,
                 f"batch.min_retry_after_s={self.min_retry_after_s} must be > 0 and <= max_retry_after_s="
                 f"{self.max_retry_after_s}")
        _require(self.bank_reserve_steps >= 0.0,
                 f"batch.bank_reserve_steps={self.bank_reserve_steps} must be >= 0 (TPOT aims of bank every "
                 "interactive decode keeps before batch work may share its steps)")
        _require(self.reserve_full_load >= 0.0,
                 f"batch.reserve_full_load={self.reserve_full_load} must be >= 0 (interactive load at which "
                 "the whole bank reserve applies; 0: always the whole reserve)")
        _require(self.drain_tau_s > 0.0, f"batch.drain_tau_s={self.drain_tau_s} must be > 0 seconds")
