"""OpenAI wire models: what is accepted, what is refused with a message naming the parameter, and
that our responses are in OpenAI's shapes (the official client's own types parse them)."""

from __future__ import annotations

import json
import re
from typing import Any

import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from pydantic import ValidationError

from serve_app.openai.requests import ChatCompletionRequest, CompletionRequest
from serve_app.openai.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
)
from serve_app.openai.validation import format_validation_errors

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def rejection(model: type[Any], body: dict[str, Any]) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return format_validation_errors(info.value.errors(include_url=False))


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.01}, "top_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "top_k=-2"),
    ({"n": 17}, "n", "n=17 must be between 1 and 16"),
    ({"n": 0}, "n", "n=0 must be between 1 and 16"),
    ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "less than or equal to 2"),
    ({"logit_bias": {"42": 5}}, "logit_bias", "not supported"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"seed": 2**64}, "seed", "less than or equal to"),
    ({"stop": ["a", 3]}, "stop", "string or a list of strings"),
    ({"stop": [""]}, "stop", "must not be empty"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
])
def test_completion_bad_parameters_name_the_parameter(extra: dict[str, Any], param: str, needle: str) -> None:
    message, got_param, _ = rejection(CompletionRequest, {"prompt": "hi", **extra})
    assert got_param == param
    assert f"'{param}'" in message and needle in message


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "5"), ("max_tokens", 5.5), ("max_tokens", True), ("seed", 1e19), ("temperature", "0.5"),
    ("stream", 1), ("stream", "true"), ("model", 7), ("echo", "no"), ("user", 3),
])
def test_wrong_types_are_not_coerced(field: str, value: Any) -> None:
    message, param, code = rejection(CompletionRequest, {"prompt": "hi", field: value})
    assert param == field and code.endswith("_type") and repr(value) in message


def test_an_integral_number_is_an_integer() -> None:
    # JSON has one number type and JSON Schema calls 5.0 an integer (typed clients may send it).
    req = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 5.0, "seed": -3.0, "stop_token_ids": [2.0]})
    assert (req.max_tokens, req.seed, req.stop_token_ids) == (5, -3, [2])
    assert type(req.max_tokens) is int


@pytest.mark.parametrize(("prompt", "needle"), [
    ("", "must not be empty"), ([], "must not be empty"), ([[]], "must not be empty"),
    (["a"] * 65, "65 prompts; at most 64"), (["a", ""], "prompt[1] must not be empty"), (5, "must be a string"),
    ([[1], [2, "x"]], "prompt[1]: token ids must be integers"), (["a", [1]], "must be a string"),
    ([1, True], "must be a string"), ([[1, "x"]], "integers"), ({"text": "x"}, "must be a string"),
])
def test_bad_prompts(prompt: Any, needle: str) -> None:
    message, param, _ = rejection(CompletionRequest, {"prompt": prompt})
    assert param == "prompt" and needle in message


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ["hi"]), (["hi"], ["hi"]), ([1, 2, 3], [[1, 2, 3]]), ([[4, 5]], [[4, 5]]), (["a", "b"], ["a", "b"]),
    ([[1], [2, 3.0]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt_inputs() == expected


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, {"prompt": "a\ud800b"}, "prompt"),
    (CompletionRequest, {"prompt": ["\udfff"]}, "prompt"),
    (CompletionRequest, {"prompt": "x", "stop": ["\ud800"]}, "stop"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content"),
])
def test_lone_surrogates_are_refused(model: type[Any], body: dict[str, Any], param: str) -> None:
    # Valid JSON ("\\ud800"), but not text: the tokenizer would raise, and that must not be a 500.
    message, got_param, _ = rejection(model, body)
    assert got_param == param and "lone surrogate" in message


def test_missing_prompt_and_body() -> None:
    message, param, code = rejection(CompletionRequest, {})
    assert (param, code) == ("prompt", "missing") and "Missing required parameter 'prompt'" in message


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "tool calling is not implemented"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "Missing required parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content",
     "'image_url' is not supported"),
    ({**CHAT, "top_logprobs": 25}, "top_logprobs", "less than or equal to 20"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice", "not supported"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({**CHAT, "logprobs": 3}, "logprobs", "valid boolean"),
])
def test_chat_bad_parameters(body: dict[str, Any], param: str, needle: str) -> None:
    message, got_param, _ = rejection(ChatCompletionRequest, body)
    assert got_param == param and needle in message


def test_unknown_fields_are_ignored_and_extensions_accepted() -> None:
    req = ChatCompletionRequest.model_validate({
        **CHAT, "metadata": {"a": 1}, "store": False, "parallel_tool_calls": True, "top_k": 20, "min_tokens": 2,
        "ignore_eos": True, "tool_choice": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
        "logit_bias": {}, "user": "u1", "seed": -3})
    assert req.top_k == 20 and req.min_tokens == 2 and req.ignore_eos and req.seed == -3
    assert not hasattr(req, "metadata")


def test_content_parts_are_joined() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "a\nb"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5}).max_new_tokens() == 5
    both = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5, "max_completion_tokens": 7})
    assert both.max_new_tokens() == 7


def test_stop_forms() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "\n"}).stop_strings() == ["\n"]
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["a", "b"]}).stop_strings() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": "x"}).stop_strings() == []


def test_malformed_json_error_message() -> None:
    errors = [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error", "input": {},
               "ctx": {"error": "Expecting value"}}]
    assert format_validation_errors(errors) == (
        "Malformed JSON in the request body: Expecting value at position 7.", None, "invalid_json")
    # json's message for a raw control character already ends in "at".
    errors = [{"type": "json_invalid", "loc": ("body", 13), "msg": "JSON decode error", "input": {},
               "ctx": {"error": "Invalid control character at"}}]
    assert format_validation_errors(errors)[0] == \
        "Malformed JSON in the request body: Invalid control character at position 13."


def test_delta_carries_only_what_changed() -> None:
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    assert DeltaMessage(content="x").model_dump_json() == '{"content":"x"}'
    assert DeltaMessage().model_dump_json() == "{}"


def test_stream_chunk_parses_with_the_official_types() -> None:
    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", created=1, model="m", choices=[
        ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
    parsed = oai_chat.ChatCompletionChunk.model_validate(json.loads(chunk.model_dump_json()))
    assert parsed.choices[0].delta.role == "assistant" and parsed.choices[0].finish_reason is None
    assert oai.Completion.model_validate({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                                          "choices": [{"index": 0, "text": "", "finish_reason": "stop",
                                                       "logprobs": None}]})


def test_error_body_shape() -> None:
    body = ErrorResponse(error=ErrorInfo(message="m", type="invalid_request_error", param="n", code="x"))
    assert body.model_dump() == {"error": {"message": "m", "type": "invalid_request_error", "param": "n",
                                           "code": "x"}}


def test_the_schema_uses_only_json_schema_keywords() -> None:
    # pydantic writes a bound it could not place on a type as a bare "ge"/"le", which no JSON
    # Schema tool understands (the bound would silently vanish from generated clients).
    for model in (CompletionRequest, ChatCompletionRequest):
        text = json.dumps(model.model_json_schema())
        assert not re.findall(r'"(ge|le|gt|lt)":', text), model.__name__


def test_prompt_token_ids_may_be_integral_numbers() -> None:
    assert CompletionRequest.model_validate({"prompt": [1.0, 2]}).prompt_inputs() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[3.0]]}).prompt_inputs() == [[3]]
    message, param, _ = rejection(CompletionRequest, {"prompt": [1.5]})
    assert param == "prompt" and "must be" in message
