"""The step contract between the scheduler and every executor (real model, simulated GPU).

Owns: `StepPlan` (what one engine step computes), `StepResult` (what it produced),
`Decision` (`Run | WaitUntil | Idle`), `StepOutputs` (what a driver streams out) and
`Rejection` (admission control's answer, with a reason and a retry-after estimate).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.

A plan carries only ids, token counts and block ids; the prompt token ids and sampling
parameters of a request travel once, in `new_requests`, the step it is admitted or resumed.
Executors keep per-request state from those and apply the diffs of later plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar, dataclass_transform

from tidal_core.request import Request, SamplingParams

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def step_message(cls: type[_T]) -> type[_T]:
    """The messages built every step (`StepPlan`, `NewRequestData`, `StepResult`, `Run`): slotted
    dataclasses, read-only by contract. The type checker sees them frozen (assigning a field is
    an error); at run time they are plain slotted dataclasses, because a frozen dataclass sets
    every field through `object.__setattr__` and its constructor costs ~4x as much."""
    return dataclass(slots=True)(cls)


@step_message
class NewRequestData:
    """A request an executor has not seen (admitted, or resumed after preemption).

    `token_ids` is prompt plus any tokens generated before a preemption (None in simulation);
    `block_ids` is its whole block table so far. `num_computed_tokens` is how many leading
    tokens already have KV in the first blocks of `block_ids` (a prefix-cache hit: blocks
    another request computed); the executor computes nothing for them and starts there.
    `num_prompt_tokens` is how many of the tokens are the prompt (the rest were generated:
    what the sampler's presence and frequency penalties count); None: all of them.
    """

    request_id: str
    token_ids: list[int] | None
    num_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    num_prompt_tokens: int | None = None


@step_message
class StepPlan:
    """One engine step.

    `num_scheduled_tokens` maps request id -> tokens computed this step: every running
    decode (1 token each, in running order) first, then prefill chunks. It is the scheduler's
    own dict, reused from step to step (core/decode_set.py): read it, never write it, and copy
    it to keep it past the next `schedule()` call, which updates it in place. Executors track
    each request's context themselves (from `new_requests` and the tokens of earlier plans);
    `prefill_context` repeats it for the prefill chunks (few per step, and what a cost
    model needs) and `decode_context_tokens` sums the KV length the decodes attend over.
    `new_block_ids` holds blocks appended to tables the executor already knows.
    `finished_ids` are requests (finished, aborted or preempted) whose executor state must
    be dropped before this step runs. `padded_batch_size` is the CUDA-graph bucket of a
    pure-decode step, or None to run eager.
    """

    step_id: int
    num_scheduled_tokens: dict[str, int]
    prefill_context: dict[str, int]
    new_requests: list[NewRequestData]
    new_block_ids: dict[str, list[int]]
    finished_ids: list[str]
    num_decode_seqs: int
    num_prefill_tokens: int
    decode_context_tokens: int
    padded_batch_size: int | None

    @property
    def total_tokens(self) -> int:
        return self.num_decode_seqs + self.num_prefill_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@step_message
class StepResult:
    """What an executor returns for a plan.

    `sampled_token_ids` has one token for each request whose scheduled tokens reached the end
    of its known tokens (a finished prefill or a decode); partial prefill chunks sample
    nothing. `device_time_s` is the measured (or modelled) time of the step on the device.
    """

    step_id: int
    sampled_token_ids: dict[str, int]
    device_time_s: float
    logprobs: dict[str, list[tuple[int, float]]] | None = None


@step_message
class Run:
    plan: StepPlan
    reason: str


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Sleep (or jump the virtual clock) until `deadline_s` or until the next arrival."""

    deadline_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do until a request arrives."""


Decision = Run | WaitUntil | Idle


@dataclass(slots=True)
class StepOutputs:
    """What a finished step means for requests; drivers fan it out to streams.

    `tokens` maps request id -> the token it gained this step (requests aborted during the
    step are left out). `first_token_ids` got their first token; `finished` ended this step
    (each carries its finish reason and timestamps). Bulk fields, not one object per token:
    this runs every step for every running request.
    """

    tokens: dict[str, int]
    first_token_ids: list[str]
    finished: list[Request]
    logprobs: dict[str, list[tuple[int, float]]] | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """Admission control turned a request away. `reason` is a stable metric label.

    Reasons: "concurrency_limit", "queue_full", "prefill_backlog", "prompt_over_target",
    "kv_pressure" (retry later: HTTP 429) and "too_long" (can never fit: HTTP 400).
    """

    request_id: str
    reason: str
    retry_after_s: float
    message: str
    retryable: bool = True


@dataclass(slots=True)
class StepStats:
    """What one scheduling decision looked like; drivers turn these into metrics."""

    now_s: float
    step_id: int
    batch_size: int
    num_tokens: int
    num_decode_seqs: int
    num_prefill_tokens: int
    num_new_requests: int
    padded_batch_size: int | None
    num_waiting: int
    num_running: int
    kv_usage: float
    regime: str
    load: float
    wait_s: float
    dispatch_reason: str
    num_preempted: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Executor(Protocol):
    """Whatever computes a step: the offline engine and the simulator call this form."""

    def execute(self, plan: StepPlan) -> StepResult: ...


class AsyncExecutor(Protocol):
    """The awaitable form the Serve engine loop drives (a replica group, the simulated GPU)."""

    async def execute(self, plan: StepPlan) -> StepResult: ...
