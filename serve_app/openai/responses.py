"""The OpenAI API's responses on the wire: pydantic v2 models in OpenAI's shapes for completions,
chat completions and their stream chunks, `/v1/models`, the error body and the health answer.

Owns: what the server sends; what it accepts is `serve_app.openai.requests`.

Must not import: ray, torch, transformers, fastapi, tidal_core.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the server's prefix cache already held


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None  # "flex" (batch class) or "default" (interactive)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ..., "content": ""}, {"content": "x"}, {}.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tidalserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]
