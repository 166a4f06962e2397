"""Test seams: a tiny executor and a driver loop for the pure core (no model, virtual clock)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal_core import Idle, Run, Scheduler, StepOutputs, StepPlan, StepResult, WaitUntil


class FakeExecutor:
    """Samples tokens for every request whose scheduled tokens reach the end of its known tokens.

    Tracks known lengths the way a real executor must (from new_requests, finished_ids and its
    own samples), so it also checks the plan contract: it raises on any inconsistency.
    """

    def __init__(self, token_fn: Callable[[str], int] | None = None,
                 time_fn: Callable[[StepPlan], float] | None = None) -> None:
        self.known: dict[str, int] = {}
        self.context: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.token_fn = token_fn or (lambda rid: 1)
        self.time_fn = time_fn or (
            lambda plan: 0.005 + 0.0001 * plan.num_prefill_tokens + 0.0002 * plan.num_decode_seqs)

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids:
            self.known.pop(rid, None)
            self.context.pop(rid, None)
            self.tables.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.known, f"{new.request_id} announced twice"
            self.known[new.request_id] = new.num_tokens
            self.context[new.request_id] = new.num_computed_tokens  # a prefix-cache hit starts later
            self.tables[new.request_id] = list(new.block_ids)
        for rid, blocks in plan.new_block_ids.items():
            self.tables[rid].extend(blocks)
        sampled: dict[str, int] = {}
        for rid, n in plan.num_scheduled_tokens.items():
            ctx = self.context[rid]
            if rid in plan.prefill_context:
                assert plan.prefill_context[rid] == ctx, f"{rid}: plan context {plan.prefill_context[rid]} != {ctx}"
            end = ctx + n
            assert end <= self.known[rid], f"{rid}: scheduled past its known tokens"
            self.context[rid] = end
            if end == self.known[rid]:
                tok = self.token_fn(rid)
                sampled[rid] = tok
                self.known[rid] += 1
        return StepResult(plan.step_id, sampled, self.time_fn(plan))


@dataclass
class DriveLog:
    plans: list[StepPlan] = field(default_factory=list)
    outputs: list[StepOutputs] = field(default_factory=list)
    waits: list[WaitUntil] = field(default_factory=list)


def run_until_idle(sched: Scheduler, executor: FakeExecutor, now: float, max_steps: int = 100_000,
                   check: bool = True, log: DriveLog | None = None) -> float:
    """Step the scheduler on a virtual clock until it has nothing left; returns the final time."""
    for _ in range(max_steps):
        decision = sched.schedule(now)
        if isinstance(decision, Idle):
            return now
        if isinstance(decision, WaitUntil):
            assert decision.deadline_s > now
            if log is not None:
                log.waits.append(decision)
            now = decision.deadline_s
            continue
        assert isinstance(decision, Run)
        result = executor.execute(decision.plan)
        now += result.device_time_s
        out = sched.on_step_done(decision.plan, result, now)
        if log is not None:
            log.plans.append(decision.plan)
            log.outputs.append(out)
        if check:
            sched.check_integrity()
    raise AssertionError("scheduler did not drain")


def random_token_fn(seed: int, stop_token: int, stop_prob: float) -> Callable[[str], int]:
    rng = random.Random(seed)
    return lambda rid: stop_token if rng.random() < stop_prob else rng.randint(100, 200)
