"""Bad input, hand matrix (issue 8, item 3): the cases every HTTP front door must survive.

Owns `CASES`, run here in-process against the FastAPI app (a fake engine behind the real
tokenizer: fast, no Ray) and by tests/integration/test_reliability_bad_input.py against the real
server through Ray Serve's proxy. Each case: huge numbers, negative / NaN / infinite sampling
values, invalid UTF-8, control characters, empty and truncated bodies, wrong content types, a
giant body (413, by Content-Length and chunked), 100k levels of nested JSON, unknown fields
(ignored, as OpenAI does). Every case must end with the listed status and, for errors, OpenAI's
error shape naming the problem: never a 5xx, a dropped connection or a hang.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

JSON = {"content-type": "application/json"}
OK = {"prompt": "Hi", "max_tokens": 2}
DEPTH = 100_000


def _chunked(total: int, piece: int = 64 * 1024) -> Iterator[bytes]:
    yield b'{"prompt": "'
    sent = 0
    while sent < total:
        yield b"a" * piece
        sent += piece
    yield b'", "max_tokens": 2}'


def _body(fields: dict[str, Any]) -> bytes:
    return json.dumps({**OK, **fields}).encode()


def _raw(text: str) -> bytes:
    return text.encode()


# (case id, path, headers, body, allowed statuses, fragment the error must mention)
CASES: list[tuple[str, str, dict[str, str], Any, set[int], str | None]] = [
    # sizes and numbers
    ("max_tokens 2**31", "/v1/completions", JSON, _body({"max_tokens": 2**31}), {400}, "max_tokens"),
    ("max_tokens 2**64", "/v1/completions", JSON, _body({"max_tokens": 2**64}), {400}, "max_tokens"),
    ("max_tokens 1e30", "/v1/completions", JSON, _raw('{"prompt": "Hi", "max_tokens": 1e30}'), {400}, "max_tokens"),
    ("max_tokens 5000 digits", "/v1/completions", JSON, _raw('{"prompt": "Hi", "max_tokens": 1' + "0" * 5000 + "}"),
     {400}, None),
    ("max_completion_tokens huge", "/v1/chat/completions", JSON,
     _raw('{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9007199254740993}'), {400},
     "max_completion_tokens"),
    ("seed 2**64", "/v1/completions", JSON, _body({"seed": 2**64}), {400}, "seed"),
    ("seed -2**63", "/v1/completions", JSON, _body({"seed": -(2**63)}), {200}, None),
    # negative, NaN and infinite sampling values (Python's json accepts NaN and Infinity literals)
    ("temperature -1", "/v1/completions", JSON, _body({"temperature": -1.0}), {400}, "temperature"),
    ("temperature NaN", "/v1/completions", JSON, _raw('{"prompt": "Hi", "max_tokens": 2, "temperature": NaN}'), {400},
     "temperature"),
    ("top_p Infinity", "/v1/completions", JSON, _raw('{"prompt": "Hi", "max_tokens": 2, "top_p": Infinity}'), {400},
     "top_p"),
    ("temperature 1e400", "/v1/completions", JSON, _raw('{"prompt": "Hi", "max_tokens": 2, "temperature": 1e400}'),
     {400}, "temperature"),
    ("top_k -5", "/v1/completions", JSON, _body({"top_k": -5}), {400}, "top_k"),
    ("frequency_penalty NaN", "/v1/completions", JSON,
     _raw('{"prompt": "Hi", "max_tokens": 2, "frequency_penalty": NaN}'), {400}, "frequency_penalty"),
    ("min_tokens -1", "/v1/completions", JSON, _body({"min_tokens": -1}), {400}, "min_tokens"),
    ("logprobs -1", "/v1/completions", JSON, _body({"logprobs": -1}), {400}, "logprobs"),
    ("top_logprobs NaN", "/v1/chat/completions", JSON,
     _raw('{"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": NaN}'), {400},
     "top_logprobs"),
    ("stop_token_ids negative", "/v1/completions", JSON, _body({"stop_token_ids": [-1]}), {400}, "stop_token_ids"),
    ("prompt token id past vocab", "/v1/completions", JSON, _body({"prompt": [1, 10**9]}), {400}, "prompt"),
    # bytes and characters
    ("invalid UTF-8", "/v1/completions", JSON, b'{"prompt": "caf\xc3\x28 \xff\xfe", "max_tokens": 2}', {400}, None),
    ("invalid UTF-8 in chat", "/v1/chat/completions", JSON,
     b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', {400}, None),
    ("lone surrogate escape", "/v1/completions", JSON, _raw('{"prompt": "a\\ud800b", "max_tokens": 2}'), {400},
     "prompt"),
    ("raw control characters", "/v1/completions", JSON, b'{"prompt": "a\x00b\x1bc", "max_tokens": 2}', {400}, None),
    ("escaped control characters", "/v1/completions", JSON,
     _raw('{"prompt": "a\\u0000b\\u001b[31mc\\u0007\\r\\n", "max_tokens": 2}'), {200}, None),
    ("escaped control characters in chat", "/v1/chat/completions", JSON,
     _raw('{"messages": [{"role": "user", "content": "\\u0000\\u0001\\u007f"}], "max_tokens": 2}'), {200}, None),
    ("BOM before JSON", "/v1/completions", JSON, b"\xef\xbb\xbf" + _body({}), {200, 400}, None),
    # framing and content types
    ("empty body", "/v1/completions", JSON, b"", {400}, None),
    ("empty body, no content type", "/v1/chat/completions", {}, b"", {400}, None),
    ("JSON null", "/v1/completions", JSON, b"null", {400}, None),
    ("JSON array", "/v1/chat/completions", JSON, b"[]", {400}, None),
    ("truncated JSON", "/v1/completions", JSON, b'{"prompt": "Hi", "max_tok', {400}, None),
    ("text/plain", "/v1/completions", {"content-type": "text/plain"}, _body({}), {415}, "Content-Type"),
    ("form-urlencoded", "/v1/completions", {"content-type": "application/x-www-form-urlencoded"},
     b"prompt=Hi&max_tokens=2", {415}, "Content-Type"),
    ("multipart", "/v1/chat/completions", {"content-type": "multipart/form-data; boundary=x"},
     b"--x\r\nContent-Disposition: form-data; name=prompt\r\n\r\nHi\r\n--x--\r\n", {415}, "Content-Type"),
    ("json with odd charset", "/v1/completions", {"content-type": "application/json; charset=latin-1"}, _body({}),
     {200, 400}, None),
    ("giant body, Content-Length", "/v1/completions", JSON, _body({"prompt": "a" * (5 * 1024 * 1024)}), {413},
     "limit"),
    ("giant body, chunked", "/v1/completions", JSON, "chunked", {413}, "limit"),
    ("3 MB prompt under the body limit", "/v1/completions", JSON, _body({"prompt": "word " * 600_000}), {400},
     "context length"),
    # nesting depth
    ("100k nested arrays", "/v1/completions", JSON, b"[" * DEPTH + b"]" * DEPTH, {400}, None),
    ("100k nested objects", "/v1/chat/completions", JSON, b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, {400}, None),
    ("100k nested in prompt", "/v1/completions", JSON,
     b'{"max_tokens": 2, "prompt": ' + b"[" * DEPTH + b"1" + b"]" * DEPTH + b"}", {400}, None),
    ("500 nested in an unknown field", "/v1/completions", JSON,
     b'{"prompt": "Hi", "max_tokens": 2, "extra": ' + b"[" * 500 + b"]" * 500 + b"}", {200}, None),
    ("500 nested in content", "/v1/chat/completions", JSON,
     b'{"messages": [{"role": "user", "content": ' + b"[" * 500 + b"]" * 500 + b"}]}", {400}, "content"),
    # unknown fields are ignored, as OpenAI does
    ("unknown fields", "/v1/completions", JSON,
     _body({"frobnicate": True, "nested": {"a": [1, {"b": None}]}, "best_of_luck": 7}), {200}, None),
    ("unknown fields in a message", "/v1/chat/completions", JSON,
     _raw('{"messages": [{"role": "user", "content": "Hi", "mood": "grumpy"}], "max_tokens": 2, "x": 1}'), {200},
     None),
]


SLOW_IN_PROCESS = {"3 MB prompt under the body limit"}  # seconds of real tokenization; the real server runs it


def request_content(body: Any) -> Any:
    return _chunked(5 * 1024 * 1024) if body == "chunked" else body


def check_answer(response: httpx.Response, allowed: set[int], fragment: str | None) -> None:
    assert response.status_code in allowed, response.text[:500]
    if response.status_code != 200:
        err = response.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
        if fragment is not None:
            assert fragment in err["message"] + str(err.get("param")), err
    else:
        assert response.json()["choices"], response.text[:500]


async def _achunked(body: Iterator[bytes]) -> AsyncIterator[bytes]:
    for piece in body:
        yield piece


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("path", "headers", "body", "allowed", "fragment"),
                         [pytest.param(*case[1:], id=case[0]) for case in CASES if case[0] not in SLOW_IN_PROCESS])
async def test_bad_input_in_process(app: Any, anyio_backend: str, path: str, headers: dict[str, str], body: Any,
                                    allowed: set[int], fragment: str | None) -> None:
    content = request_content(body)
    if not isinstance(content, bytes):
        content = _achunked(content)  # the ASGI transport wants an async body to send it chunked
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ingress", timeout=60) as c:
        response = await c.post(path, content=content, headers=headers)
    check_answer(response, allowed, fragment)
