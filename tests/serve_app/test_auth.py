"""API keys and per-key limits at the front end, in-process (no Ray): the 401 for every malformed
or wrong Authorization header, the open paths, 429 `rate_limit_exceeded` per key, tokens counted,
keys held as digests, and a rotated keys file picked up without dropping anything."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from serve_app.api_keys import KeySet, KeyStore, key_id, parse_keys
from serve_app.auth import ApiKeyGate, bearer_token, gate_from_args
from serve_app.config_loader import AppArgs, env_api_keys
from tests.serve_app.openai_fakes import CHAT, FakeEngine, assert_openai_error, client

pytestmark = pytest.mark.anyio
KEY = "tk-live-0123456789abcdef"
OTHER = "tk-live-fedcba9876543210"


def make(tok: Any, auth: dict[str, Any], env_keys: list[str] = (KEY,)) -> tuple[Any, FakeEngine, ApiKeyGate]:  # type: ignore[assignment]
    from serve_app.ingress import build_app
    from serve_app.key_usage import MeteredEngine
    from serve_app.openai.server import OpenAIServer

    gate = gate_from_args({"auth": auth}, list(env_keys), metrics=False)
    assert gate is not None
    engine = FakeEngine(tok)
    return build_app(OpenAIServer(MeteredEngine(engine, gate.usage), tok), auth_gate=gate), engine, gate


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Every one of these must be refused, with the same answer.
BAD_HEADERS: dict[str, list[tuple[bytes, bytes]]] = {
    "none": [],
    "empty": [(b"authorization", b"")],
    "scheme only": [(b"authorization", b"Bearer")],
    "scheme and space": [(b"authorization", b"Bearer ")],
    "wrong key": [(b"authorization", f"Bearer {OTHER}".encode())],
    "key in wrong case": [(b"authorization", f"Bearer {KEY.upper()}".encode())],
    "key prefix": [(b"authorization", f"Bearer {KEY[:-1]}".encode())],
    "key plus suffix": [(b"authorization", f"Bearer {KEY}x".encode())],
    "key without scheme": [(b"authorization", KEY.encode())],
    "basic": [(b"authorization", b"Basic dXNlcjpwYXNz")],
    "basic with the key": [(b"authorization", f"Basic {KEY}".encode())],
    "token scheme": [(b"authorization", f"Token {KEY}".encode())],
    "two tokens": [(b"authorization", f"Bearer {KEY} {KEY}".encode())],
    "tab inside": [(b"authorization", f"Bearer {KEY}\t{KEY}".encode())],
    "two headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"authorization", f"Bearer {KEY}".encode())],
    "unicode": [(b"authorization", "Bearer clé-ünïcødé-🔑".encode())],
    "latin-1 bytes": [(b"authorization", b"Bearer \xff\xfe\xfd")],
    "very long": [(b"authorization", b"Bearer " + b"k" * 100_000)],
    "x-api-key only": [(b"x-api-key", KEY.encode())],
    "nul byte": [(b"authorization", f"Bearer {KEY}\x00".encode())],
}
GOOD_HEADERS = {
    "plain": f"Bearer {KEY}",
    "lower-case scheme": f"bearer {KEY}",
    "upper-case scheme": f"BEARER {KEY}",
    "several spaces": f"Bearer    {KEY}",
}


def test_bearer_token_parsing() -> None:
    for name, headers in BAD_HEADERS.items():
        token = bearer_token(headers)
        assert token is None or token.decode(errors="replace") != KEY, name
    for name, value in GOOD_HEADERS.items():
        assert bearer_token([(b"authorization", value.encode())]) == KEY.encode(), name


async def _raw(app: Any, headers: list[tuple[bytes, bytes]], path: str = "/v1/chat/completions") -> Any:
    import httpx

    async with client(app) as c:
        req = c.build_request("POST", path, json=CHAT)
        req.headers = httpx.Headers([(k, v) for k, v in req.headers.raw if k.lower() != b"authorization"] + headers)
        return await c.send(req)


async def test_every_bad_header_gets_the_same_401_and_nothing_reaches_the_engine(tok: Any) -> None:
    app, engine, _ = make(tok, {"required": True})
    answers = set()
    for name, headers in BAD_HEADERS.items():
        resp = await _raw(app, headers)
        err = assert_openai_error(resp, 401)
        assert err["code"] == "invalid_api_key", name
        answers.add((resp.status_code, resp.content, resp.headers["www-authenticate"]))
    assert len(answers) == 1  # missing, malformed and wrong keys cannot be told apart
    assert KEY.encode() not in next(iter(answers))[1]
    assert engine.requests == []
    for name, value in GOOD_HEADERS.items():
        resp = await _raw(app, [(b"authorization", value.encode())])
        assert resp.status_code == 200, (name, resp.text)
    assert len(engine.requests) == len(GOOD_HEADERS)


async def test_the_401_comes_before_body_checks(tok: Any) -> None:
    app, engine, _ = make(tok, {"required": True})
    async with client(app) as c:
        too_big = await c.post("/v1/completions", content=b"x" * (5 * 2**20), headers={"content-type": "text/plain"})
        unknown = await c.get("/v1/nothing-here")
        models = await c.get("/v1/models")
    for resp in (too_big, unknown, models):
        assert assert_openai_error(resp, 401)["code"] == "invalid_api_key"
    assert engine.requests == []


async def test_open_paths_need_no_key(tok: Any) -> None:
    app, _, _ = make(tok, {"required": True})
    async with client(app) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/models", headers=bearer(KEY))).status_code == 200
    app, _, _ = make(tok, {"required": True, "open_paths": []})
    async with client(app) as c:
        assert (await c.get("/health")).status_code == 401


async def test_rate_limit_per_key_is_its_own_429(tok: Any) -> None:
    app, engine, gate = make(tok, {"required": True, "rpm": 3}, [KEY, OTHER])
    gate.usage.clock = lambda: 1000.0  # a still clock: retry-after is exact whatever the box's speed
    async with client(app) as c:
        codes = [(await c.post("/v1/chat/completions", json=CHAT, headers=bearer(KEY))).status_code
                 for _ in range(3)]
        limited = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(KEY))
        other = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(OTHER))
    assert codes == [200, 200, 200] and other.status_code == 200
    err = assert_openai_error(limited, 429)
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert key_id(KEY) in err["message"] and KEY not in limited.text
    assert int(limited.headers["retry-after"]) == 20  # one request per 20 s at 3 rpm
    assert int(limited.headers["retry-after-ms"]) == 20_000
    assert limited.headers["x-ratelimit-limit-requests"] == "3"
    assert len(engine.requests) == 4


async def test_tokens_count_against_tpm(tok: Any) -> None:
    app, engine, gate = make(tok, {"required": True, "tpm": 10})
    gate.usage.clock = lambda: 1000.0
    async with client(app) as c:
        first = await c.post("/v1/completions", json={"prompt": "hello " * 10, "max_tokens": 16},
                             headers=bearer(KEY))
        second = await c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer(KEY))
    used = first.json()["usage"]["total_tokens"]
    assert used > 10
    err = assert_openai_error(second, 429)
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
    # 10 tokens/min = one per 6 s; the debt is used - 10, and one token must be left to admit again
    assert int(second.headers["retry-after"]) == (used - 10 + 1) * 6
    assert len(engine.requests) == 1


async def test_streamed_tokens_are_counted(tok: Any) -> None:
    from tidal_core.rate_limit import RateLimiter

    app, _, gate = make(tok, {"required": True, "tpm": 10_000})
    gate.usage.clock = lambda: 1000.0  # a still clock: no refill, the bucket shows exactly what was charged
    async with client(app) as c:
        body = {"prompt": "hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        resp = await c.post("/v1/completions", json=body, headers=bearer(KEY))
    usage = [line for line in resp.text.splitlines() if '"usage": {' in line or '"usage":{' in line]
    assert resp.status_code == 200 and usage
    limiter: RateLimiter = gate.usage.limiter
    bucket = limiter._state[key_id(KEY)].tokens
    assert bucket is not None
    import json

    total = json.loads(usage[-1].removeprefix("data: "))["usage"]["total_tokens"]
    assert 10_000 - bucket.level == total


def test_keys_are_held_as_digests_and_ids() -> None:
    keys = KeySet.of([KEY, OTHER, "has space", KEY])
    assert len(keys) == 2 and keys.ids == sorted([key_id(KEY), key_id(OTHER)])
    assert all(KEY.encode() not in d for d, _ in keys.digests)
    assert keys.lookup(KEY.encode()) == key_id(KEY) and keys.lookup(b"nope") is None
    assert parse_keys(f"# comment\n{KEY}, {OTHER}\n\n") == [KEY, OTHER]
    assert env_api_keys({"TIDAL_API_KEYS": f"{KEY},{OTHER}"}) == [KEY, OTHER] and env_api_keys({}) == []


def test_config(tmp_path: Path) -> None:
    assert gate_from_args({}, [], metrics=False) is None  # a dev server: no key
    assert gate_from_args({"auth": {"required": False}}, [KEY], metrics=False) is not None  # env keys turn it on
    with pytest.raises(ValueError, match="TIDAL_API_KEYS"):
        gate_from_args({"auth": {"required": True}}, [], metrics=False)
    with pytest.raises(ValueError, match="key id"):
        AppArgs.model_validate({"auth": {"per_key": {KEY: {"rpm": 1}}}})
    with pytest.raises(ValueError, match="reload_period_s"):
        AppArgs.model_validate({"auth": {"reload_period_s": 30}})
    gate = gate_from_args({"auth": {"required": True, "rpm": 5, "per_key": {key_id(KEY): {"rpm": 50}}}}, [KEY],
                          metrics=False)
    assert gate is not None and gate.usage.limiter.limits(key_id(KEY)).rpm == 50


def _write(path: Path, text: str, mtime: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.utime(tmp, (mtime, mtime))
    tmp.replace(path)  # as a Secret volume updates: atomically


def test_rotation_of_the_keys_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ray.serve.serve_app.api_keys")
    path = tmp_path / "keys"
    _write(path, f"{KEY}\n", 1000)
    store = KeyStore(["env-key-000000000"], str(path), reload_period_s=2.0)
    changes: list[list[str]] = []
    store.on_change = lambda keys: changes.append(keys.ids)
    assert store.lookup(KEY.encode(), 10.0) and store.lookup(b"env-key-000000000", 10.0)
    _write(path, f"{OTHER}\n", 1001)
    assert store.lookup(KEY.encode(), 11.0) == key_id(KEY)  # within the period: not re-read yet
    assert store.lookup(OTHER.encode(), 12.0) == key_id(OTHER)  # the next check sees the new file
    assert store.lookup(KEY.encode(), 12.0) is None
    assert store.lookup(b"env-key-000000000", 12.0)  # environment keys stay
    assert changes == [sorted([key_id(OTHER), key_id("env-key-000000000")])]
    path.unlink()  # a Secret being swapped: unreadable for a moment keeps the keys
    assert store.lookup(OTHER.encode(), 20.0) == key_id(OTHER)
    _write(path, "", 1002)
    assert store.lookup(OTHER.encode(), 30.0) is None  # an empty file revokes its keys
    log = caplog.text
    assert KEY not in log and OTHER not in log and key_id(OTHER) in log

