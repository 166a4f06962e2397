"""The OpenAI API over an `EngineClient`, without any web framework or Ray.

Owns: `OpenAIServer` (validate against the served model, tokenize, build `SamplingParams`, run the
request, detokenize and apply stop strings, render the response or the SSE event stream) and
`EventStream` (the SSE body; closing it cancels the engine request). A request with `n` > 1 is `n`
engine requests with the same prompt ids (choice `i` seeded `seed + i`), started together and read
side by side; their choices carry `index`, the usage counts the prompt once. A /v1/completions
request with a batch of prompts is, for each prompt `p`, its `n` choices at `index` `p x n + i`
(seeded as a request with that prompt alone would be), every prompt checked (length, context)
before any starts, all started together (serve_app/openai/runs.py); the usage adds up the
prompts. The usage reports the prompt's prefix-cache hit (`prompt_tokens_details.cached_tokens`)
as the unit's chunks carry it. When the unit caches prefixes (`ModelInfo.hash_scheme`), the
prompt's block hashes are computed here, once per prompt (for all its `n` choices), and travel in
the `GenerateRequest`: the request router and the unit read them instead of hashing the prompt
again.

Order of work for one request: model name -> prompt ids -> context length -> SamplingParams ->
first engine chunk. Everything up to and including the first chunk raises `OpenAIError`, so a
stream that fails before its first token is a plain HTTP error, never a 200 event stream. After
that, errors become an SSE `error` event followed by `[DONE]`.

Must not import: ray, torch, fastapi.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from serve_app.openai.detokenizer import TokenStrings
from serve_app.openai.errors import OpenAIError, bad_request, server_error
from serve_app.openai.interleave import interleave
from serve_app.openai.output_text import OutputText, TokenLogprob
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.render import (
    DONE_EVENT,
    ChatRenderer,
    CompletionRenderer,
    error_event,
    merge_responses,
    sse_event,
)
from serve_app.openai.requests import MAX_SEQUENCES, ChatCompletionRequest, CompletionRequest, SamplingFields
from serve_app.openai.responses import ChatCompletionResponse, CompletionResponse, ModelCard, ModelList
from serve_app.openai.runs import Renderer, Run, all_or_none, one, prompt_usage
from serve_app.openai.sampling_defaults import SamplingDefaults
from serve_app.unit_api import GenerateRequest
from serve_app.unit_stream import EngineClient, open_stream
from tidal_core.block_hash import PromptHashes
from tidal_core.request import SamplingParams
from tidal_core.service_class import ServiceClass, service_class_of

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Inputs longer than this are tokenized off the event loop (a 2,000-character chat prompt takes
# about 5 ms of tokenizer work here) so that, in a burst, the front gate's refusals and the other
# streams of this replica do not wait behind it (the tokenizer releases the GIL while it works).
OFFLOAD_CHARS = 1024
# Prompts at least this long are hashed off the event loop too (~4 us per 16-token block).
OFFLOAD_HASH_TOKENS = 1024


def _service_class(request: SamplingFields) -> ServiceClass:
    """The class `service_tier` / `priority` ask for (both validated by the request model)."""
    try:
        return service_class_of(request.service_tier, request.priority)
    except ValueError as err:
        raise bad_request(str(err), "service_tier" if request.service_tier is not None else "priority") from err


@dataclass(frozen=True)
class _Budget:
    """How many tokens a request may generate: what it asked (under which name) and the default."""

    asked: int | None
    param: str  # "max_tokens" or "max_completion_tokens": named in errors
    default: int | None  # None: whatever context is left
    prompt_param: str  # "prompt" or "messages"


class EventStream:
    """The SSE body. `aclose` closes the engine stream even if iteration never started."""

    def __init__(self, server: OpenAIServer, runs: list[Run]) -> None:
        self._runs = runs
        self._events = server._events(runs)

    @property
    def request_id(self) -> str:
        return self._runs[0].renderer.request_id

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            for run in self._runs:
                await run.stream.close()


class OpenAIServer:
    def __init__(self, engine: EngineClient, tokenizer: Any, model_aliases: Sequence[str] = (),
                 default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
                 health_timeout_s: float = 5.0, request_timeout_s: float | None = None,
                 sampling_defaults: SamplingDefaults | None = None) -> None:
        self.engine = engine
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.info = engine.model_info
        self.model_id = self.info.model_id
        self.served_names = list(dict.fromkeys([self.model_id, *model_aliases]))
        self.default_completion_max_tokens = default_completion_max_tokens
        self.health_timeout_s = health_timeout_s
        self.request_timeout_s = request_timeout_s
        self.prompts = PromptBuilder(tokenizer)
        self.strings = TokenStrings(tokenizer)
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    # ---- endpoints ---------------------------------------------------------------------------

    def list_models(self) -> ModelList:
        return ModelList(data=[self._card(name) for name in self.served_names])

    def retrieve_model(self, model_id: str) -> ModelCard:
        """`GET /v1/models/{model_id}`: the card of a served name, else OpenAI's 404."""
        if model_id not in self.served_names:
            raise OpenAIError(404, f"The model {model_id!r} does not exist; this server serves "
                              f"{', '.join(repr(n) for n in self.served_names)}.", "invalid_request_error", "model",
                              "model_not_found")
        return self._card(model_id)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, root=self.model_id, max_model_len=self.info.max_model_len)

    async def health(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.engine.health(), self.health_timeout_s))
        except Exception:  # timeouts, dead actors, anything: unhealthy, never a 500
            logger.warning("engine health check failed", exc_info=True)
            return False

    async def create_completion(self, request: CompletionRequest,
                                arrival_s: float | None = None) -> CompletionResponse | EventStream:
        arrival_s = time.time() if arrival_s is None else arrival_s
        self._check_model(request)
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo",
                              "unsupported_value")
        prompts, n = request.prompt_inputs(), request.n
        if len(prompts) * n > MAX_SEQUENCES:
            raise bad_request(f"{len(prompts)} prompts x n={n} ask for {len(prompts) * n} choices; at most "
                              f"{MAX_SEQUENCES} fit in one request", "n")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        budget = _Budget(request.max_tokens, "max_tokens", self.default_completion_max_tokens, "prompt")
        batch: list[tuple[list[int], list[Renderer]]] = []
        for p, prompt in enumerate(prompts):  # every prompt checked before any starts
            try:
                ids = await self._tokenize(len(prompt) if isinstance(prompt, str) else 0,
                                           self.prompts.completion_ids, prompt)
                self._max_tokens(len(ids), budget)
            except OpenAIError as err:
                if len(prompts) > 1:  # say which prompt of the batch
                    err.message = f"prompt[{p}]: {err.message}"
                raise
            echo_text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if request.echo else None
            batch.append((ids, [CompletionRenderer(request_id, self.model_id, int(arrival_s), self.strings,
                                                   request.logprobs, echo_text, index=p * n + j) for j in range(n)]))
        if len(batch) == 1:
            runs = await self._start(request, ids, budget, request.logprobs, batch[0][1], arrival_s)
        else:  # a batch of prompts: each its own requests, started together
            runs = await all_or_none([self._start(request, ids, budget, request.logprobs, renderers, arrival_s,
                                                   many=True) for ids, renderers in batch])
        return cast(CompletionResponse | EventStream, await self._finish(runs, request.stream))

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     arrival_s: float | None = None) -> ChatCompletionResponse | EventStream:
        arrival_s = time.time() if arrival_s is None else arrival_s
        self._check_model(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        size = sum(len(m.text()) for m in request.messages)
        ids = await self._tokenize(size, self.prompts.chat_ids, request.messages, request.add_generation_prompt)
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        renderers = [ChatRenderer(request_id, self.model_id, int(arrival_s), self.strings, num_logprobs, index=i)
                     for i in range(request.n)]
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        budget = _Budget(request.max_new_tokens(), param, self.sampling_defaults.max_tokens, "messages")
        runs = await self._start(request, ids, budget, num_logprobs, renderers, arrival_s)
        return cast(ChatCompletionResponse | EventStream, await self._finish(runs, request.stream))

    # ---- request preparation -------------------------------------------------------------------

    def _check_model(self, request: SamplingFields) -> None:
        if request.model is not None and request.model not in self.served_names:
            served = ", ".join(repr(n) for n in self.served_names)
            raise bad_request(f"The model {request.model!r} does not exist; this server serves {served} "
                              "(see GET /v1/models).", "model", "model_not_found")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    async def _tokenize(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """Tokenize (`fn`) a prompt of `size` characters; long ones off the event loop, and ones
        that cannot fit the context refused before any tokenizer work."""
        if self.prompts.min_tokens(size) >= self.info.max_model_len:
            raise bad_request(f"The prompt is {size} characters long, which is more than this model's maximum "
                              f"context length of {self.info.max_model_len} tokens can hold. Please shorten it.",
                              None, "context_length_exceeded")
        if size < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _prompt_hashes(self, ids: list[int]) -> PromptHashes | None:
        """The prompt's block hashes under the unit's scheme (None when the unit does not cache)."""
        scheme = self.info.hash_scheme
        if scheme is None:
            return None
        if len(ids) < OFFLOAD_HASH_TOKENS:
            return scheme.hash(ids)
        return await asyncio.get_running_loop().run_in_executor(self._pool, scheme.hash, ids)

    def _max_tokens(self, num_prompt: int, budget: _Budget) -> int:
        asked, param, prompt_param = budget.asked, budget.param, budget.prompt_param
        limit = self.info.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"The prompt is {num_prompt} tokens long, but this model's maximum context length is "
                              f"{limit} tokens, and at least one token must be left to generate. Please shorten the "
                              f"{prompt_param}.", prompt_param, "context_length_exceeded")
        room = limit - num_prompt
        if asked is None:
            return room if budget.default is None else min(budget.default, room)
        if num_prompt + asked > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{num_prompt + asked} tokens ({num_prompt} in the {prompt_param}, {asked} in "
                              f"{param}). Please reduce the {prompt_param} or {param}.", param,
                              "context_length_exceeded")
        return asked

    def _sampling(self, request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop_ids = set(request.stop_token_ids or ())
        bad = [t for t in stop_ids if t >= self.prompts.vocab_size]
        if bad:
            raise bad_request(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {self.prompts.vocab_size})",
                              "stop_token_ids")
        if not request.ignore_eos:
            stop_ids.update(self.info.eos_token_ids)
        defaults = self.sampling_defaults  # a request's own values always win
        top_k = defaults.top_k if request.top_k is None else request.top_k
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.temperature if request.temperature is None else request.temperature,
                top_p=defaults.top_p if request.top_p is None else request.top_p,
                top_k=-1 if top_k == 0 else top_k,
                seed=request.seed, stop_token_ids=frozenset(stop_ids), ignore_eos=request.ignore_eos,
                logprobs=logprobs, min_tokens=request.min_tokens,
                presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty)
        except ValueError as err:  # SamplingParams names the value: "min_tokens=9 must be ..."
            message = str(err)
            raise bad_request(message, message.split("=", 1)[0] if "=" in message else None) from err

    async def _start(self, request: SamplingFields, ids: list[int], budget: _Budget, logprobs: int | None,
                     renderers: Sequence[Renderer], arrival_s: float, many: bool = False) -> list[Run]:
        """Start one engine request per choice of one prompt, all at once, and read each one's first
        chunk. If any fails before its first token, the others are closed and its error is raised.
        The first choice's run counts the prompt in the usage (`counts_prompt`); with `many` (or n
        > 1) each engine request's id ends with its choice's index."""
        max_tokens = self._max_tokens(len(ids), budget)
        sampling = self._sampling(request, max_tokens, logprobs)
        deadline = None
        if self.request_timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        many = many or len(renderers) > 1
        asked = _service_class(request)
        hashes = await self._prompt_hashes(ids)

        async def start(index: int, renderer: Renderer) -> Run:
            rid = f"{renderer.request_id}-{renderer.index}" if many else renderer.request_id
            params = sampling if not many or sampling.seed is None else \
                replace(sampling, seed=sampling.seed + index)
            gen = GenerateRequest(rid, ids, params, arrival_s, service_class=asked, prompt_hashes=hashes)
            stream, first = await open_stream(self.engine, gen, deadline)
            if first.service_class is not None:  # the tier that serves it, as the unit says (not the one asked)
                renderer.service_tier = first.service_class.tier_name
            output = OutputText(self.tokenizer, ids, request.stop_strings(),
                                include_stop=request.include_stop_str_in_output, min_tokens=request.min_tokens,
                                skip_special_tokens=request.skip_special_tokens)
            return Run(stream, first, output, renderer, len(ids), request.include_usage, deadline,
                       first.num_cached_tokens, counts_prompt=index == 0)

        if len(renderers) == 1:
            return [await start(0, renderers[0])]
        return await all_or_none([one(start(i, r)) for i, r in enumerate(renderers)])

    # ---- running -------------------------------------------------------------------------------

    async def _finish(self, runs: list[Run], stream: bool) -> BaseModel | EventStream:
        if stream:
            return EventStream(self, runs)
        try:
            if len(runs) == 1:
                return await self._aggregate(runs[0])
            responses = await asyncio.gather(*(self._aggregate(run) for run in runs))
            return merge_responses(responses, *prompt_usage(runs))
        finally:
            for run in runs:
                await run.stream.close()

    async def _aggregate(self, run: Run) -> CompletionResponse | ChatCompletionResponse:
        parts: list[str] = []
        records: list[TokenLogprob] = []
        chunk = run.first
        while True:
            step = run.output.on_chunk(chunk.token_ids, chunk.logprobs, chunk.finish_reason)
            parts.append(step.text)
            records.extend(step.logprobs)
            if step.finish_reason is not None:
                return run.renderer.response("".join(parts), records, step.finish_reason, run.num_prompt_tokens,
                                             run.output.num_tokens, run.cached_tokens)
            chunk = await run.next()

    async def _choice_events(self, run: Run) -> AsyncGenerator[BaseModel, None]:
        """One choice's rendered chunks, up to and including its finish."""
        try:
            chunk = run.first
            while True:
                step = run.output.on_chunk(chunk.token_ids, chunk.logprobs, chunk.finish_reason)
                rendered = run.renderer.chunk(step)
                if rendered is not None:
                    yield rendered
                if step.finish_reason is not None:
                    return
                chunk = await run.next()
        finally:
            await run.stream.close()  # stop string matched, finished or failed: cancel in the router

    async def _events(self, runs: list[Run]) -> AsyncGenerator[str, None]:
        first = runs[0]
        try:
            for run in runs:
                for event in run.renderer.preamble():
                    yield sse_event(event, first.include_usage)
            async for rendered in interleave([self._choice_events(run) for run in runs]):
                yield sse_event(rendered, first.include_usage)
            if first.include_usage:
                completion_tokens = sum(run.output.num_tokens for run in runs)
                prompt_tokens, cached_tokens = prompt_usage(runs)
                yield sse_event(first.renderer.usage_chunk(prompt_tokens, completion_tokens, cached_tokens))
        except OpenAIError as err:
            yield error_event(err)
        except Exception:  # a bug after the 200 went out: tell the client in-band, keep the traceback
            logger.exception("stream %s failed", first.renderer.request_id)
            yield error_event(server_error("internal error while streaming"))
        finally:
            # Finished, failed or the client went away: cancel every choice still running in the router.
            for run in runs:
                await run.stream.close()
        yield DONE_EVENT
