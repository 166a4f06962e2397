"""The service class a request asks for, read ahead of the app at the front door
(serve_app/openai/body_peek.py): the body is replayed intact, and only a body that names a class
key is parsed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.openai.body_peek import asks_for_batch, peek_service_class
from tidal_core.service_class import ServiceClass

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("body", "batch"), [
    ({"messages": []}, False), ({"service_tier": "flex"}, True), ({"service_tier": "auto"}, False),
    ({"service_tier": "default", "priority": 9}, False), ({"priority": 1}, True), ({"priority": 0}, False),
    ({"priority": -2}, False), ({"service_tier": "scale"}, False), ({"priority": "high"}, False),
    ({"priority": True}, False), ({"messages": [{"content": '"service_tier": "flex"'}]}, False)])
def test_the_batch_class_as_the_app_reads_it(body: dict[str, Any], batch: bool) -> None:
    assert asks_for_batch(json.dumps(body).encode()) is batch


def test_a_body_that_is_not_a_json_object_asks_for_nothing() -> None:
    assert not asks_for_batch(b'{"service_tier": "flex"')  # cut short
    assert not asks_for_batch(b'["service_tier", "priority"]')


def _receiver(chunks: list[bytes]) -> tuple[Any, list[int]]:
    calls = [0]

    async def receive() -> dict[str, Any]:
        i = calls[0]
        calls[0] += 1
        if i < len(chunks):
            return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1}
        return {"type": "http.disconnect"}

    return receive, calls


async def _drain(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def test_the_body_is_read_ahead_and_replayed_intact() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * 500}], "service_tier": "flex"}).encode()
    chunks = [raw[:100], raw[100:300], raw[300:]]
    receive, calls = _receiver(chunks)
    replay, asked = await peek_service_class(receive, str(len(raw)), 4096)
    assert asked is ServiceClass.BATCH and calls[0] == 3
    assert await _drain(replay) == raw and calls[0] == 3  # the app got the same bytes, none read twice
    assert (await replay())["type"] == "http.disconnect"  # then the live channel


@pytest.mark.parametrize("length", ["", "abc", "5000"])
async def test_a_body_without_a_length_or_past_the_limit_is_not_read(length: str) -> None:
    receive, calls = _receiver([b'{"service_tier": "flex"}'])
    replay, asked = await peek_service_class(receive, length, 4096)
    assert replay is receive and asked is ServiceClass.INTERACTIVE and calls[0] == 0
