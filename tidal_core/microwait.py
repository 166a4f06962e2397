"""When to launch new prefills: the adaptive micro-wait and the baselines' batching rules.

Owns: `microwait_s` (the seed's formula) and `LaunchPolicy.decide`, which answers, at a step
boundary, "admit waiting requests now, or hold them until a deadline?".

The adaptive micro-wait, from the oldest waiting request's arrival at this unit (`queued_s`:
in Serve the front end's arrival is earlier, and a wait counted from it would always have
expired by the time the unit sees the request):

    wait = 0                                    if load < light_load or waiting >= max_batch_size
    wait = clamp(t_max * (1 - load), t_min, t_max)   otherwise, and never above 5 ms

It is only ever taken when the device would otherwise be idle: with decodes running, the step
boundary already aggregates whatever arrived during the last step, and holding the step would
stall every running decode (the TensorRT-LLM bug DESIGN.md warns of). It is also skipped in
LIGHT and OVERLOAD, and when the pending prompt tokens already fill a step (aggregating more
prefill past the point where one prefill saturates the device buys nothing).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal_core.config import MICROWAIT_HARD_CAP_S, BatchingConfig
from tidal_core.regime import Regime


def microwait_s(config: BatchingConfig, load: float, num_waiting: int, max_batch_size: int) -> float:
    """The seed's formula, with the 5 ms hard cap applied whatever the config says."""
    if load < config.light_load or num_waiting >= max_batch_size:
        return 0.0
    t_max = min(config.t_max_s, MICROWAIT_HARD_CAP_S)
    t_min = min(config.t_min_s, t_max)
    return max(t_min, min(t_max, t_max * (1.0 - load)))


@dataclass(frozen=True, slots=True)
class BatchingDecision:
    """`admit`: take waiting requests into this step. Otherwise hold them until `deadline_s`
    (None: until running work finishes). `wait_s` is the wait chosen, for stats."""

    admit: bool
    reason: str
    deadline_s: float | None = None
    wait_s: float = 0.0


_ADMIT_IMMEDIATE = BatchingDecision(True, "immediate")
_ADMIT_FULL = BatchingDecision(True, "full")
_ADMIT_BUDGET = BatchingDecision(True, "budget")
_ADMIT_JOIN = BatchingDecision(True, "join")
_HOLD_RUNNING = BatchingDecision(False, "batch_running")


class LaunchPolicy:
    __slots__ = ("config", "max_batch_size", "saturation_tokens")

    def __init__(self, config: BatchingConfig, max_batch_size: int, max_num_batched_tokens: int) -> None:
        self.config = config
        self.max_batch_size = max_batch_size
        self.saturation_tokens = min(config.saturation_prompt_tokens, max_num_batched_tokens)

    def decide(
        self,
        now: float,
        oldest_arrival_s: float,
        num_waiting: int,
        waiting_prompt_tokens: int,
        has_running: bool,
        load: float,
        regime: Regime,
    ) -> BatchingDecision:
        """Called only when requests are waiting."""
        mode = self.config.mode
        if mode == "none":
            return _ADMIT_IMMEDIATE
        if mode == "static":
            return self._static(now, oldest_arrival_s, num_waiting, has_running)
        if num_waiting >= self.max_batch_size:
            return _ADMIT_FULL
        if mode == "fixed":
            deadline = oldest_arrival_s + self.config.fixed_wait_s
            if now >= deadline:
                return BatchingDecision(True, "wait_expired", wait_s=self.config.fixed_wait_s)
            return BatchingDecision(False, "fixed_wait", deadline, self.config.fixed_wait_s)
        return self._adaptive(now, oldest_arrival_s, num_waiting, waiting_prompt_tokens, has_running, load, regime)

    def _adaptive(self, now: float, oldest_arrival_s: float, num_waiting: int, waiting_prompt_tokens: int,
                  has_running: bool, load: float, regime: Regime) -> BatchingDecision:
        if has_running:
            return _ADMIT_JOIN
        if regime is not Regime.STEADY:
            return _ADMIT_IMMEDIATE
        if waiting_prompt_tokens >= self.saturation_tokens:
            return _ADMIT_BUDGET
        wait = microwait_s(self.config, load, num_waiting, self.max_batch_size)
        if wait <= 0.0:
            return _ADMIT_IMMEDIATE
        deadline = oldest_arrival_s + wait
        if now >= deadline:
            return BatchingDecision(True, "microwait_expired", wait_s=wait)
        return BatchingDecision(False, "microwait", deadline, wait)

    def _static(self, now: float, oldest_arrival_s: float, num_waiting: int, has_running: bool) -> BatchingDecision:
        if has_running:
            return _HOLD_RUNNING
        cfg = self.config
        if num_waiting >= cfg.static_batch_size:
            return _ADMIT_FULL
        deadline = oldest_arrival_s + cfg.static_timeout_s
        if now >= deadline:
            return BatchingDecision(True, "wait_expired", wait_s=cfg.static_timeout_s)
        return BatchingDecision(False, "static_batch", deadline, cfg.static_timeout_s)


BatchingPolicy = LaunchPolicy
"""The former name, kept for callers that still use it."""
