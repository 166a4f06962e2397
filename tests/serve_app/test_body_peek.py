"""The service class a request asks for, read ahead of the app at the front door
(serve_app/openai/body_peek.py): the body is replayed intact, only a body that names a class key
is parsed, and the gate lets a batch-class request through to its unit."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.openai import body_peek
from serve_app.openai.body_peek import asks_for_batch, peek_service_class
from tests.serve_app.openai_fakes import raw_post
from tests.serve_app.test_front_gate import BUSY, CHAT, client, gated_app
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
    assert not asks_for_batch(b'{"service_tier": ' + b"[" * 100_000)  # nested past the parser: no 500 here


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


async def test_a_refusal_reads_the_body_once_and_parses_none(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate reads the body ahead only to find a batch-class request; one that names neither
    `service_tier` nor `priority` is not parsed, and the app never reads it."""
    app, _, gate, _ = gated_app(tok)
    gate.observe(BUSY)

    def no_parse(_: bytes) -> None:
        raise AssertionError("the gate parsed a body that names no service class")

    monkeypatch.setattr(body_peek, "json", SimpleNamespace(loads=no_parse))
    sent, reads = await raw_post(app, "/v1/chat/completions", json.dumps(CHAT).encode(), len(json.dumps(CHAT)))
    assert sent[0]["status"] == 429 and reads == 1


@pytest.mark.parametrize("asks", [{"service_tier": "flex"}, {"priority": 3}])
async def test_a_batch_class_request_is_not_held_to_the_ttft_target_at_the_door(tok: Any, asks: dict) -> None:
    """A flex request goes on to its unit, whose batch queue decides, where an interactive one is
    refused at the door; the body reaches the app intact."""
    app, engine, gate, _ = gated_app(tok)
    gate.observe(BUSY)
    async with client(app) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 429
        flex = await c.post("/v1/chat/completions", json={**CHAT, **asks})
        bad = await c.post("/v1/chat/completions", json={**CHAT, "service_tier": "scale"})
    assert flex.status_code == 200, flex.text
    assert bad.status_code == 429  # not the batch class: judged at the door (the app would answer 400)
    assert [r.service_class for r in engine.requests] == [ServiceClass.BATCH]
    assert gate.refused == {"prefill_backlog": 2} and len(gate.undelivered) == 2  # the flex one is no door refusal
