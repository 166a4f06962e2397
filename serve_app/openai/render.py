"""Text steps -> OpenAI response objects, for both endpoints, streamed or aggregated.

Owns: `CompletionRenderer` and `ChatRenderer` (same four methods: `preamble` chunks, one stream
`chunk` per text step, the `usage_chunk`, and the aggregated `response`; one renderer per choice,
each with its `index`), `merge_responses` (the choices of `n` > 1 in one response, usage summed),
the logprobs formats of both APIs, and `sse_event` (the `data: <json>\\n\\n` framing).

Logprobs: the engine sends, per token, the sampled token first and then the most likely others.
Chat shows exactly `top_logprobs` alternatives (OpenAI's semantics); completions show the
`logprobs` most likely plus the sampled token (vLLM's convention, as the legacy API did).

Must not import: ray, torch, fastapi, tidal_core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

from pydantic import BaseModel

from serve_app.openai.detokenizer import TokenStrings
from serve_app.openai.errors import OpenAIError
from serve_app.openai.output_text import TextStep, TokenLogprob
from serve_app.openai.responses import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

DONE_EVENT = "data: [DONE]\n\n"
Finish = Literal["stop", "length"] | None


def sse_event(payload: BaseModel, include_usage: bool = True) -> str:
    # OpenAI sends `"usage": null` on every chunk only when the client asked for usage.
    body = payload.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {body}\n\n"


def error_event(err: OpenAIError) -> str:
    """An error after the stream started: OpenAI's error body as one event (then `[DONE]`)."""
    return f"data: {err.body().model_dump_json()}\n\n"


def _finish(reason: str | None) -> Finish:
    return cast(Finish, reason)


def _top(record: TokenLogprob, num: int) -> list[tuple[int, float]]:
    seen: dict[int, float] = {record.token_id: record.logprob}
    for token_id, logprob in record.alternatives:
        seen.setdefault(token_id, logprob)
    return sorted(seen.items(), key=lambda item: item[1], reverse=True)[:num]


def completion_logprobs(records: Sequence[TokenLogprob], strings: TokenStrings, num: int,
                        offset_base: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for record in records:
        out.tokens.append(strings.text(record.token_id))
        out.token_logprobs.append(record.logprob)
        out.text_offset.append(offset_base + record.text_offset)
        top: dict[str, float] = {}
        for token_id, logprob in _top(record, num):
            top.setdefault(strings.text(token_id), logprob)
        top.setdefault(strings.text(record.token_id), record.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(records: Sequence[TokenLogprob], strings: TokenStrings, num: int) -> ChatChoiceLogprobs:
    content = [
        ChatTokenLogprob(
            token=strings.text(r.token_id), logprob=r.logprob, bytes=strings.bytes(r.token_id),
            top_logprobs=[TopLogprob(token=strings.text(t), logprob=lp, bytes=strings.bytes(t))
                          for t, lp in _top(r, num)],
        )
        for r in records
    ]
    return ChatChoiceLogprobs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def merge_responses(responses: Sequence[CompletionResponse | ChatCompletionResponse], prompt_tokens: int,
                    cached_tokens: int) -> CompletionResponse | ChatCompletionResponse:
    """One response holding every choice (each renderer set its own `index`); the prompt (and
    its cached part) is counted once, the completion tokens of every choice are added up
    (OpenAI's usage for n > 1)."""
    first = responses[0]
    choices = [choice for r in responses for choice in r.choices]
    completion = sum(r.usage.completion_tokens for r in responses if r.usage is not None)
    return first.model_copy(update={"choices": choices, "usage": _usage(prompt_tokens, completion, cached_tokens)})


class CompletionRenderer:
    def __init__(self, request_id: str, model: str, created: int, strings: TokenStrings,
                 num_logprobs: int | None = None, echo_text: str | None = None, index: int = 0,
                 service_tier: str | None = None) -> None:
        self.request_id, self.model, self.created, self.index = request_id, model, created, index
        self.service_tier = service_tier
        self.strings = strings
        self.num_logprobs = num_logprobs
        self.echo_text = echo_text

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage, service_tier=self.service_tier)

    def preamble(self) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=self.index, text=self.echo_text)])] if self.echo_text else []

    def chunk(self, step: TextStep) -> BaseModel | None:
        if not step.text and not step.logprobs and step.finish_reason is None:
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(step.logprobs, self.strings, self.num_logprobs)
        choice = CompletionChoice(index=self.index, text=step.text, logprobs=logprobs,
                                  finish_reason=_finish(step.finish_reason))
        return self._chunk([choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> BaseModel:
        return self._chunk([], _usage(prompt_tokens, completion_tokens, cached_tokens))

    def response(self, text: str, records: Sequence[TokenLogprob], finish_reason: str | None, prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int) -> CompletionResponse:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(records, self.strings, self.num_logprobs)
        choice = CompletionChoice(index=self.index, text=(self.echo_text or "") + text, logprobs=logprobs,
                                  finish_reason=_finish(finish_reason))
        return self._chunk([choice], _usage(prompt_tokens, completion_tokens, cached_tokens))


class ChatRenderer:
    def __init__(self, request_id: str, model: str, created: int, strings: TokenStrings,
                 num_logprobs: int | None = None, index: int = 0, service_tier: str | None = None) -> None:
        self.request_id, self.model, self.created, self.index = request_id, model, created, index
        self.service_tier = service_tier
        self.strings = strings
        self.num_logprobs = num_logprobs  # None: logprobs off; else how many alternatives per token

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> BaseModel:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=choices, usage=usage, service_tier=self.service_tier)

    def preamble(self) -> list[BaseModel]:
        # OpenAI's first chunk announces the role with empty content.
        return [self._chunk([ChatCompletionStreamChoice(index=self.index,
                                                        delta=DeltaMessage(role="assistant", content=""))])]

    def chunk(self, step: TextStep) -> BaseModel | None:
        if not step.text and not step.logprobs and step.finish_reason is None:
            return None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = chat_logprobs(step.logprobs, self.strings, self.num_logprobs)
        delta = DeltaMessage(content=step.text) if step.text else DeltaMessage()
        return self._chunk([ChatCompletionStreamChoice(index=self.index, delta=delta, logprobs=logprobs,
                                                       finish_reason=_finish(step.finish_reason))])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> BaseModel:
        return self._chunk([], _usage(prompt_tokens, completion_tokens, cached_tokens))

    def response(self, text: str, records: Sequence[TokenLogprob], finish_reason: str | None, prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int) -> ChatCompletionResponse:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = chat_logprobs(records, self.strings, self.num_logprobs)
        choice = ChatCompletionChoice(index=self.index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                                      finish_reason=_finish(finish_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                      usage=_usage(prompt_tokens, completion_tokens, cached_tokens),
                                      service_tier=self.service_tier)
