"""Offline generation over the core scheduler, without Serve (like vLLM's `LLM.generate`).

Owns: `LLMEngine` (add_request / step / generate: tokenization, the schedule -> execute ->
on_step_done loop on the wall clock, detokenization) and `Completion`. The Serve router
drives the same three calls asynchronously; this class is the synchronous reference.

Stop strings are not handled here: they belong where text is detokenized incrementally (the
ingress). EOS ids are added to each request's stop ids unless `ignore_eos`.

Must not import: ray, fastapi.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.worker_setup import EngineInfo
from tidal_core import Request, SamplingParams, Scheduler, SchedulerConfig, preset
from tidal_core.plan import Executor, Idle, Run, WaitUntil

# Request ids stay unique across engines sharing one executor: a finished request's worker
# state is only dropped by the *next* plan's finished_ids, which an engine that went idle
# never sends.
_ENGINE_IDS = itertools.count()


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    arrival_s: float
    first_token_s: float | None
    finished_s: float | None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason}


def scheduler_config(info: EngineInfo, policy: str = "continuous", **overrides: Any) -> SchedulerConfig:
    base = SchedulerConfig(num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                           max_model_len=info.max_model_len, cuda_graph_buckets=info.cuda_graph_buckets)
    return preset(policy, base, **overrides)


class LLMEngine:
    def __init__(self, executor: Executor, info: EngineInfo, tokenizer: Any | None = None,
                 config: SchedulerConfig | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.executor = executor
        self.info = info
        self.tokenizer = tokenizer
        self.clock = clock
        self.scheduler = Scheduler(config or scheduler_config(info), now=clock())
        self._ids = itertools.count()
        self._prefix = f"e{next(_ENGINE_IDS)}"
        self._prompts: dict[str, str | None] = {}
        self.completions: dict[str, Completion] = {}

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        if chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                     add_generation_prompt=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams, request_id: str | None = None,
                    chat: bool = False) -> str:
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not sampling.ignore_eos and self.info.eos_token_ids:
            sampling = dataclasses.replace(sampling,
                                           stop_token_ids=sampling.stop_token_ids | frozenset(self.info.eos_token_ids))
        rejection = self.scheduler.add_request(Request(rid, len(ids), sampling, self.clock(), ids), self.clock())
        if rejection is not None:
            raise ValueError(f"request {rid} rejected: {rejection.reason}: {rejection.message}")
        self._prompts[rid] = prompt if isinstance(prompt, str) else None
        return rid

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id, self.clock())
        if req is not None:
            self._complete(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Completion]:
        """One engine step; returns the requests that finished in it."""
        decision = self.scheduler.schedule(self.clock())
        if isinstance(decision, Idle):
            return []
        if isinstance(decision, WaitUntil):
            time.sleep(max(0.0, min(decision.deadline_s - self.clock(), 0.01)))
            return []
        assert isinstance(decision, Run)
        result = self.executor.execute(decision.plan)
        outputs = self.scheduler.on_step_done(decision.plan, result, self.clock())
        return [self._complete(req) for req in outputs.finished]

    def _complete(self, req: Request) -> Completion:
        rid = req.request_id
        out = list(req.output_token_ids)
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""
        done = Completion(rid, self._prompts.pop(rid, None), list(req.prompt_token_ids or []), out, text,
                          req.finish_reason.value if req.finish_reason else "abort", req.arrival_s,
                          req.first_token_s, req.finished_s)
        self.completions[rid] = done
        return done

    def run_until_done(self) -> None:
        while self.has_unfinished:
            self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 chat: bool = False) -> list[Completion]:
        """Run every prompt to completion; results in prompt order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        rids = [self.add_request(p, s, chat=chat) for p, s in zip(prompts, params, strict=True)]
        self.run_until_done()
        return [self.completions.pop(rid) for rid in rids]
