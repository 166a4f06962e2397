"""The simulated GPU: runs a `StepPlan` against the cost model instead of a model.

Owns: `SimExecutor`. It keeps the per-request state the plan contract requires (from
`plan.new_requests`, dropped for `plan.finished_ids`), samples a token for every request
whose scheduled tokens reach the end of its known tokens (a prefill that completes, or a
decode) and nothing for a partial prefill chunk, and reports the modelled device time.

Cost per step: Python work proportional to the prefill chunks (few) plus one C-level
`dict.fromkeys` over the scheduled requests; decodes are never visited one by one, which is
why only prefilling requests have their known length tracked (a request that is not in
`prefill_context` is a decode by the contract, and a decode always samples).

It never sleeps: the discrete-event simulator advances a virtual clock by `device_time_s`,
and the Serve "sim" backend (calibration/simulated_replica.py) sleeps that time itself.

Must not import: ray, torch, numpy, asyncio, or read the wall clock.
"""

from __future__ import annotations

from calibration.cost_model import CostModel
from tidal_core.plan import StepPlan, StepResult


class SimExecutor:
    """Executes plans with placeholder tokens; optionally ends chosen requests with EOS.

    `expect(rid, n)` makes the n-th output of `rid` the EOS token (a stop before max_tokens);
    the scheduler ends it with reason "stop" if EOS is among the request's stop tokens. The
    expectation is dropped once EOS is emitted; `forget` drops it earlier (an abort).
    """

    __slots__ = ("_expected", "_prefilling", "cost_model", "eos_token_id", "num_steps", "placeholder_token_id")

    def __init__(self, cost_model: CostModel, placeholder_token_id: int = 1,
                 eos_token_id: int | None = None) -> None:
        if eos_token_id is not None and eos_token_id == placeholder_token_id:
            raise ValueError(f"eos_token_id={eos_token_id} equals placeholder_token_id; every token would stop")
        self.cost_model = cost_model
        self.placeholder_token_id = placeholder_token_id
        self.eos_token_id = eos_token_id
        self.num_steps = 0
        self._prefilling: dict[str, int] = {}  # request id -> known tokens, while its prompt is computed
        self._expected: dict[str, list[int]] = {}  # request id -> [outputs at which EOS comes, outputs so far]

    @property
    def num_tracked_requests(self) -> int:
        """Requests holding executor state (prefilling, or with an expectation): 0 when drained."""
        return len(self._prefilling) + len(self._expected)

    def expect(self, request_id: str, num_output_tokens: int) -> None:
        """Emit EOS as output number `num_output_tokens` of `request_id` (call before it first runs)."""
        if self.eos_token_id is None:
            raise ValueError("expect() needs an eos_token_id; pass one to SimExecutor(...)")
        if num_output_tokens < 1:
            raise ValueError(f"num_output_tokens={num_output_tokens} must be >= 1")
        self._expected[request_id] = [num_output_tokens, 0]

    def forget(self, request_id: str) -> None:
        """Drop an expectation that will never be reached (the request ended some other way)."""
        self._expected.pop(request_id, None)

    def execute(self, plan: StepPlan) -> StepResult:
        prefilling = self._prefilling
        for rid in plan.finished_ids:  # first: a preempted request may be re-announced in this plan
            prefilling.pop(rid, None)
        for new in plan.new_requests:
            if new.request_id in prefilling:
                raise RuntimeError(f"request {new.request_id!r} announced twice without being finished")
            prefilling[new.request_id] = new.num_tokens
        sched = plan.num_scheduled_tokens
        prefill_ctx = plan.prefill_context
        if len(sched) - len(prefill_ctx) != plan.num_decode_seqs:
            raise RuntimeError(f"step {plan.step_id}: {len(sched) - len(prefill_ctx)} decodes scheduled but "
                               f"num_decode_seqs={plan.num_decode_seqs}")
        sampled = dict.fromkeys(sched, self.placeholder_token_id)
        for rid, ctx in prefill_ctx.items():
            known = prefilling.get(rid)
            if known is None:
                raise RuntimeError(f"step {plan.step_id}: prefill chunk for {rid!r}, which was never announced")
            end = ctx + sched[rid]
            if end < known:
                del sampled[rid]  # a partial chunk samples nothing
            elif end == known:
                del prefilling[rid]  # decodes from the next step on
            else:
                raise RuntimeError(f"step {plan.step_id}: {rid!r} scheduled up to token {end}, past its {known}")
        if self._expected:
            self._apply_expectations(sampled)
        self.num_steps += 1
        return StepResult(plan.step_id, sampled, self.cost_model.plan_time_s(plan))

    def _apply_expectations(self, sampled: dict[str, int]) -> None:
        reached = []
        for rid, state in self._expected.items():
            if rid in sampled:
                state[1] += 1
                if state[1] >= state[0]:
                    sampled[rid] = self.eos_token_id  # type: ignore[assignment]  # checked in expect()
                    reached.append(rid)
        for rid in reached:
            del self._expected[rid]
