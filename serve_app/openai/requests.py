"""The OpenAI API's requests on the wire: pydantic v2 models for `/v1/completions` and
`/v1/chat/completions` and the field types they share.

Owns: request models (types, ranges, the parameters we refuse and why). The shape checks and error
messages live in `serve_app.openai.validation`; the response, stream-chunk, model-list and error
models in `serve_app.openai.responses`.

Field types are strict (a JSON string is not a number, 1 is not `true`) and floats reject
NaN/Infinity: OpenAI rejects these too, and silently coercing them hides client bugs. Unknown
fields are ignored, as OpenAI does. Checks that need the model (context length, model name, token
id range) or more than one field live in the server, not here.

Must not import: ray, torch, transformers, fastapi, tidal_core.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from serve_app.openai.validation import (
    MAX_PROMPTS,
    MAX_STOP_STRINGS,
    check_content,
    check_prompt,
    check_role,
    check_stop,
    is_json_integer,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # SamplingParams' bound; OpenAI's own limit is 20 for top_logprobs
MAX_CHOICES = 16  # n: each choice is one more sequence in the scheduler (OpenAI allows 128)
MAX_SEQUENCES = 128  # prompts x n in one /v1/completions request

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# Constraints the validators (serve_app/openai/validation.py) enforce first with their own
# messages, declared here as well so that the OpenAPI schema says what is accepted: client
# generators and fuzzers then produce valid requests (reliability finding 9).
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
# Token ids: the vocabulary check (with its message) is the server's; the schema says >= 0.
TokenIds = Annotated[list[Annotated[StrictInt, WithJsonSchema({"type": "integer", "minimum": 0})]], Field(min_length=1)]


def _only(**schema: Any) -> dict[str, Any]:
    """Schema keywords for a value the server accepts in one form only (it refuses others with 400)."""
    return {"json_schema_extra": schema}


def _json_integer(value: Any) -> Any:
    """An integral float as the int it is (`is_json_integer`); anything else is left for the
    strict int check to refuse (a float past int64 too: it cannot be an exact integer here)."""
    if type(value) is float and is_json_integer(value) and INT64_MIN <= value <= INT64_MAX:
        return int(value)
    return value


# The bounds go before the validator: so placed they become the schema's minimum / maximum.
_AsInt = BeforeValidator(_json_integer)
JsonInt = Annotated[StrictInt, _AsInt]
PositiveInt = Annotated[StrictInt, Field(ge=1), _AsInt]
NonNegativeInt = Annotated[StrictInt, Field(ge=0), _AsInt]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX), _AsInt]
LogprobCount = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), _AsInt]


def _unsupported(name: str, shown: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", "{name}={shown} is not supported: {why}",
                               {"name": name, "shown": shown, "why": why})


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI ignores unknown fields; so do we


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class SamplingFields(OpenAIModel):
    """Parameters shared by both endpoints. `None` means "the server default"."""

    model: StrictStr | None = Field(None, description="Served model id (or its alias); defaults to the served model")
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = Field(
        None, description="0 is greedy; default: the model's generation config, else the server's (else 1)")
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = Field(
        None, description="Default: the model's generation config, else the server's (else 1)")
    top_k: JsonInt | None = Field(None, description="Extension: keep the k most likely tokens; -1 or 0 disables; "
                                  "default: the model's, else the server's (else off)", **_only(minimum=-1))
    n: JsonInt = Field(1, description=f"Choices to generate (1 to {MAX_CHOICES}), each sampled on its own",
                       **_only(minimum=1, maximum=MAX_CHOICES))
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty stop strings")
    seed: Int64 | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = Field(
        None, description="-2 to 2: subtracted from the logit of every token already generated (default 0)")
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = Field(
        None, description="-2 to 2: subtracted, times its count, from the logit of each token generated (default 0)")
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=2.0)] | None = Field(
        None, description="Extension (vLLM's): above 1 discourages any token of the prompt or the output, below 1 "
        "favours them (default 1, off)")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (must be empty)",
                                                **_only(maxProperties=0))
    user: StrictStr | None = None
    service_tier: Literal["auto", "default", "flex"] | None = Field(
        None, description="'flex': the batch class (deferrable, runs in the headroom interactive traffic leaves, "
        "never refused for latency); 'auto'/'default': interactive")
    priority: Int64 | None = Field(None, description="Extension (vLLM's): above 0 is the batch class, 0 or below "
                                   "interactive; service_tier, when given, decides")
    ignore_eos: StrictBool = Field(False, description="Extension: do not stop at the model's EOS tokens")
    min_tokens: NonNegativeInt = Field(0, description="Extension: no EOS/stop before this many")
    stop_token_ids: list[NonNegativeInt] | None = Field(None, description="Extension")
    skip_special_tokens: StrictBool = Field(True, description="Extension: drop special tokens from the text")
    include_stop_str_in_output: StrictBool = Field(False, description="Extension: keep the matched stop string")

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise PydanticCustomError("invalid_value", "n={n} must be between 1 and {max} (choices per request)",
                                      {"n": n, "max": MAX_CHOICES})
        return n

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, k: int | None) -> int | None:
        if k is not None and k < -1:
            raise PydanticCustomError("invalid_value", "top_k={k} must be -1 or 0 (disabled) or a positive integer",
                                      {"k": k})
        return k

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias", "{...}", "logit bias is not implemented")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        return check_stop(value)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        ..., description=f"A string, a list of token ids, or a batch of up to {MAX_PROMPTS} of either (a list of "
        "strings or of lists of token ids): each prompt gets its own `n` choices, indexed prompt by prompt")
    max_tokens: PositiveInt | None = Field(None, description="Default 16 (capped to the context left)")
    logprobs: LogprobCount | None = None
    echo: StrictBool = Field(False, description="Prepend the prompt to the text (not with logprobs)")
    suffix: StrictStr | None = Field(None, description="Not supported", **_only(maxLength=0))
    best_of: JsonInt | None = Field(None, description="Only 1 is supported", **_only(minimum=1, maximum=1))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return check_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix", repr(value), "insertion (suffix) is not implemented")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported("best_of", repr(value), "only best_of=1 is supported")
        return value

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, each as text or token ids: one, or a batch (`check_prompt` has checked the
        shape and made every token id an int)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextContentPart]
    name: StrictStr | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role_supported(cls, value: Any) -> Any:
        return check_role(value)

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        return check_content(value)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM's joiner for text parts


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., **_only(minItems=1))
    max_tokens: PositiveInt | None = Field(None, description="Deprecated alias of max_completion_tokens")
    max_completion_tokens: PositiveInt | None = Field(None, description="Default: the context left")
    logprobs: StrictBool = False
    top_logprobs: LogprobCount | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported (must be empty)", **_only(maxItems=0))
    tool_choice: Any = Field(None, description="Only 'none' is accepted", **_only(enum=["none", None]))
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'}", **_only(
        properties={"type": {"const": "text"}}, required=["type"]))
    add_generation_prompt: StrictBool = Field(True, description="Extension: end the template with the "
                                              "assistant prefix")

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise PydanticCustomError("invalid_value", "messages must not be empty")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise _unsupported("tools", "[...]", "tool calling is not implemented")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise _unsupported("tool_choice", repr(value), "tool calling is not implemented")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise _unsupported("response_format", repr(value.get("type")), "only {'type': 'text'} is supported")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
