"""The proxy's signed arrival stamp (serve_app/openai/arrival_stamp.py): the proxy stamps what it
lets through, the Ingress trusts only a stamp its key verifies, and the Ingress's gate and the unit
then count the time a request already spent in front of them."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import httpx
import pytest

from serve_app.front_gate import FrontGate
from serve_app.openai.arrival_stamp import (
    ARRIVAL_HEADER,
    MAX_CLOCK_SKEW_S,
    MAX_STAMP_AGE_S,
    ArrivalKey,
    mark_arrival,
    restamp,
)
from tests.serve_app.test_front_gate import CHAT, IDLE, client, gated_app
from tidal_core import AdmissionConfig, Regime

pytestmark = pytest.mark.anyio
NOW = 1_000_000.0


def test_a_stamp_verifies_under_its_own_key_only_and_within_bounds() -> None:
    key, other = ArrivalKey(), ArrivalKey()
    assert key.hex != other.hex and len(key.hex) == 64
    stamp = key.stamp(NOW - 2.5)
    assert key.verify(stamp, NOW) == pytest.approx(NOW - 2.5, abs=1e-6)
    assert ArrivalKey(key.hex).verify(stamp, NOW) == pytest.approx(NOW - 2.5, abs=1e-6)  # the same key elsewhere
    assert other.verify(stamp, NOW) is None  # another application's (or a rebuilt one's) key
    tag = stamp.partition(b":")[2]
    forged_time = f"{NOW - 30:.6f}".encode() + b":" + tag  # an older time under the genuine tag
    assert key.verify(forged_time, NOW) is None
    for garbage in (b"", b"123.0", b"123.0:", b":abc", b"abc:" + tag, b"nan:" + key.stamp(NOW).partition(b":")[2]):
        assert key.verify(garbage, NOW) is None, garbage
    assert key.verify(key.stamp(NOW - MAX_STAMP_AGE_S - 1), NOW) is None  # too old to be this request's
    assert key.verify(key.stamp(NOW + MAX_CLOCK_SKEW_S + 1), NOW) is None  # from the future
    assert key.verify(key.stamp(NOW + MAX_CLOCK_SKEW_S / 2), NOW) == NOW  # a little clock skew: now
    with pytest.raises(ValueError):
        ArrivalKey("abcd")


def test_the_proxy_replaces_what_a_client_sent_under_the_header() -> None:
    key = ArrivalKey()
    scope: dict[str, Any] = {"headers": [(b"host", b"x"), (ARRIVAL_HEADER, b"1.0:forged"),
                                         (ARRIVAL_HEADER, key.stamp(NOW - 50))]}
    restamp(scope, key, NOW)
    values = [v for k, v in scope["headers"] if k == ARRIVAL_HEADER]
    assert len(values) == 1 and key.verify(values[0], NOW) == NOW
    assert (b"host", b"x") in scope["headers"]


def test_the_ingress_reads_the_stamp_once_and_falls_back_to_its_own_clock() -> None:
    key = ArrivalKey()
    stamped: dict[str, Any] = {"headers": [(ARRIVAL_HEADER, key.stamp(NOW - 4.0))], "state": {"shared": 1}}
    assert mark_arrival(stamped, key, lambda: NOW) == pytest.approx(NOW - 4.0)
    assert stamped["state"] == {"shared": 1, "arrival_s": pytest.approx(NOW - 4.0)}
    assert mark_arrival(stamped, key, lambda: NOW + 9) == pytest.approx(NOW - 4.0)  # computed once
    forged: dict[str, Any] = {"headers": [(ARRIVAL_HEADER, ArrivalKey().stamp(NOW - 4.0))]}
    assert mark_arrival(forged, key, lambda: NOW) == NOW
    unkeyed: dict[str, Any] = {"headers": [(ARRIVAL_HEADER, key.stamp(NOW - 4.0))]}
    assert mark_arrival(unkeyed, None, lambda: NOW) == NOW  # no key: no stamp is trusted


async def test_the_engine_sees_the_proxys_arrival_and_a_forged_one_is_ignored(tok: Any) -> None:
    app, engine, _, _ = gated_app(tok)
    key = ArrivalKey()
    app.state.arrival_key = key
    earlier = time.time() - 3.0
    async with client(app) as c:
        genuine = await c.post("/v1/chat/completions", json=CHAT,
                               headers={ARRIVAL_HEADER.decode(): key.stamp(earlier).decode()})
        forged = await c.post("/v1/chat/completions", json=CHAT,
                              headers={ARRIVAL_HEADER.decode(): ArrivalKey().stamp(earlier).decode()})
        plain = await c.post("/v1/chat/completions", json=CHAT)
    assert genuine.status_code == forged.status_code == plain.status_code == 200
    got = [r.arrival_s for r in engine.requests]
    assert got[0] == pytest.approx(earlier, abs=1e-5)
    assert got[1] > earlier + 2.5 and got[2] > earlier + 2.5  # the Ingress's own clock
    assert genuine.json()["created"] == int(earlier)  # the response's creation time is the arrival too


async def test_the_ingress_gate_counts_the_time_already_spent_before_it(tok: Any) -> None:
    # Work ahead of 0.5 s against a 1 s target: a fresh request passes; one that already spent
    # 0.8 s in the proxy cannot get its first token in time, and is refused at the Ingress's door.
    app, engine, gate, _ = gated_app(tok)
    key = ArrivalKey()
    app.state.arrival_key = key
    ahead = dataclasses.replace(IDLE, num_running=4, num_waiting=3, queue_delay_s=0.5, regime=Regime.OVERLOAD,
                                prefill_s_per_token=1e-4)
    async with client(app) as c:
        gate.observe(ahead)
        fresh = await c.post("/v1/chat/completions", json=CHAT,
                             headers={ARRIVAL_HEADER.decode(): key.stamp(time.time()).decode()})
        gate.observe(ahead)
        late = await c.post("/v1/chat/completions", json=CHAT,
                            headers={ARRIVAL_HEADER.decode(): key.stamp(time.time() - 0.8).decode()})
    assert fresh.status_code == 200, fresh.text
    assert late.status_code == 429 and late.json()["error"]["code"] == "prefill_backlog"
    assert late.headers["x-tidal-refused-by"] == "ingress" and len(engine.requests) == 1


async def test_the_proxy_stamps_what_it_lets_through_with_the_applications_key() -> None:
    from serve_app.proxy_gate import ProxyGateMiddleware

    seen: list[list[tuple[bytes, bytes]]] = []

    async def downstream(scope: Any, receive: Any, send: Any) -> None:  # stands for Serve's routing
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.get_running_loop().create_future()  # no controller to read apps from here
    proxy.gates["/sim"] = ("sim", FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0)))
    key = ArrivalKey()
    c = httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy")
    async with c:
        before_key = await c.post("/sim/v1/chat/completions", json=CHAT)  # key not read yet: no stamp
        proxy.arrival_keys["sim"] = key
        sent = time.time()
        stamped = await c.post("/sim/v1/chat/completions", json=CHAT,
                               headers={ARRIVAL_HEADER.decode(): key.stamp(sent - 40).decode()})
        got = time.time()
    assert before_key.status_code == stamped.status_code == 200
    assert not [v for k, v in seen[0] if k == ARRIVAL_HEADER]
    values = [v for k, v in seen[1] if k == ARRIVAL_HEADER]
    assert len(values) == 1  # the client's (even one under the right key) is gone
    arrival = key.verify(values[0], got)
    assert arrival is not None and sent <= arrival <= got
