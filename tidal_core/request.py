"""Request lifecycle and per-request parameters, as plain data.

Owns: `SamplingParams` (what the client asked for, carried as data: the core never samples or
tokenizes), `Request` (one request's mutable progress through waiting -> running -> finished)
and the status / finish-reason vocabularies shared by every driver.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.

Token accounting follows one rule for prefill, chunked prefill, decode and recompute alike:
`num_tokens` is prompt plus generated tokens, `num_computed_tokens` is how many of those have
KV in the cache. A step schedules `min(num_tokens - num_computed_tokens, budget)` tokens; a
token is sampled exactly when a step brings `num_computed_tokens` up to `num_tokens`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from tidal_core.service_class import ServiceClass


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are the OpenAI `finish_reason` strings where one exists."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Generation parameters. Validated here so every driver rejects the same bad values.

    `max_tokens` counts generated tokens. `stop_token_ids` end the request with reason
    "stop" (the tokenizer's EOS ids are added by the edge unless `ignore_eos`). Stop *strings*
    are matched where text is detokenized (the ingress), which then aborts the request.
    Penalties (actors/sampler.py applies them before temperature, greedy included):
    `presence_penalty` and `frequency_penalty` as OpenAI defines them, over the tokens generated
    so far (-2 to 2); `repetition_penalty` as vLLM and transformers define it, over the prompt and
    the generated tokens (above 0; 1 is off).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (disabled) or a positive integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs={self.logprobs} must be between 0 and 20")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be between 0 and max_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value} must be between -2 and 2")
        if not math.isfinite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2] (1 is off)")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Request:
    """One request's progress. Owned by exactly one Scheduler; drivers read it, never write it.

    `prompt_token_ids` may be None in simulation, where only counts matter; then the
    generated ids are placeholders chosen by the executor. While a request decodes, its
    `num_computed_tokens` is `num_tokens - 1` by construction and the field is refreshed only
    when it stops decoding (the scheduler does not touch every decode every step).
    """

    __slots__ = (
        "admitted_ahead",
        "admitted_s",
        "alone_ttft_s",
        "arrival_s",
        "block_hashes",
        "expected_cached_tokens",
        "finish_reason",
        "finished_s",
        "first_token_s",
        "is_batch",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "predicted_ttft_s",
        "prompt_token_ids",
        "queued_s",
        "raw_predicted_ttft_s",
        "request_id",
        "sampling",
        "service_class",
        "status",
        "stop_ids",
        "ttft_prediction_ratio",
    )

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        sampling: SamplingParams,
        arrival_s: float,
        prompt_token_ids: list[int] | None = None,
        service_class: ServiceClass = ServiceClass.INTERACTIVE,
    ) -> None:
        if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError(
                f"request {request_id}: num_prompt_tokens={num_prompt_tokens} but "
                f"{len(prompt_token_ids)} prompt token ids were given"
            )
        if num_prompt_tokens < 1:
            raise ValueError(f"request {request_id}: the prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.sampling = sampling
        self.arrival_s = arrival_s
        # Batch requests run only in the headroom interactive ones leave (core/batch_lane.py).
        self.service_class = service_class
        self.is_batch = service_class is ServiceClass.BATCH
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens whose KV came from the prefix cache at admission (never recomputed).
        self.num_cached_tokens = 0
        # Chained hashes of the prompt's full blocks (core/block_hash.py): set by the scheduler
        # from the token ids, or given by the driver (the simulator has hashes but no ids).
        self.block_hashes: list[int] | None = None
        # While waiting: the cache hit peeked at arrival, what the backlog and TTFT predictor
        # leave out (the real hit is taken at admission, into `num_cached_tokens`).
        self.expected_cached_tokens = 0
        self.output_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.num_preemptions = 0
        # EOS handling is resolved once here so the per-token check is one set lookup.
        self.stop_ids: frozenset[int] = sampling.stop_token_ids
        self.queued_s = arrival_s  # when the unit got it (set by Scheduler.add_request)
        # Set at admission: the TTFT admission judged, the raw model's (its error trains the
        # correction), and at the first token predicted / measured.
        self.predicted_ttft_s: float | None = None
        self.raw_predicted_ttft_s: float | None = None
        self.ttft_prediction_ratio: float | None = None
        self.admitted_ahead = False  # admitted with work ahead: admission's TTFT rule judged it
        self.alone_ttft_s = 0.0  # admitted with nothing ahead: the bound of its TTFT (UnitState)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED or self.status is RequestStatus.REJECTED

    def all_token_ids(self) -> list[int] | None:
        """Prompt plus generated ids: what a worker needs to (re)compute this request."""
        if self.prompt_token_ids is None:
            return None
        return self.prompt_token_ids + self.output_token_ids

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
