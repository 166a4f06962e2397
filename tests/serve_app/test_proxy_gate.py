"""The proxy's gate (serve_app/proxy_gate.py) without Ray: refusals by route before the Ingress,
API keys before any admission verdict, requests on their way counted from the units' arrivals,
and the way to the unit learned from the verdicts (the Ingress's gate and the proxy's)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Any

import httpx
import pytest

from serve_app.front_gate import FrontGate
from tests.serve_app.test_front_gate import BUSY, CHAT, IDLE, Clock
from tidal_core import AdmissionConfig

pytestmark = pytest.mark.anyio


async def test_the_proxy_gate_refuses_by_route_and_releases_at_the_response_start() -> None:
    from serve_app.proxy_gate import ProxyGateMiddleware, middlewares

    forwarded: list[str] = []

    async def downstream(scope: Any, receive: Any, send: Any) -> None:  # stands for Serve's routing
        forwarded.append(scope["path"])
        gated = scope["path"].startswith("/sim/v1/")
        assert len(gate._pending) == gated  # let through: pending until its response starts
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert not gate._pending
        await send({"type": "http.response.body", "body": b"{}"})

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.get_running_loop().create_future()  # no controller to read apps from here
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0))
    proxy.gates["/sim"] = ("sim", gate)
    c = httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy")
    async with c:
        assert (await c.post("/sim/v1/chat/completions", json=CHAT)).status_code == 200
        gate.observe(BUSY)
        refused = await c.post("/sim/v1/chat/completions", json=CHAT)
        other = await c.post("/other/v1/chat/completions", json=CHAT)  # not a tidalserve route: untouched
        health = await c.get("/sim/health")
    assert refused.status_code == 429 and refused.headers["retry-after-ms"] and other.status_code == 200
    assert health.status_code == 200 and forwarded == ["/sim/v1/chat/completions", "/other/v1/chat/completions",
                                                       "/sim/health"]
    assert [m.cls for m in middlewares()] == [ProxyGateMiddleware]


async def test_the_proxy_gate_lets_a_batch_class_request_through_to_its_unit() -> None:
    from serve_app.proxy_gate import ProxyGateMiddleware

    bodies: list[dict[str, Any]] = []

    async def downstream(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        bodies.append(json.loads(message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.get_running_loop().create_future()
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0))
    proxy.gates["/sim"] = ("sim", gate)
    gate.observe(BUSY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy") as c:
        assert (await c.post("/sim/v1/chat/completions", json=CHAT)).status_code == 429
        flex = await c.post("/sim/v1/chat/completions", json={**CHAT, "service_tier": "flex"})
    assert flex.status_code == 200 and bodies == [{**CHAT, "service_tier": "flex"}]
    assert gate.refused == {"prefill_backlog": 1} and not gate._pending  # no ticket: nothing pending


async def test_the_proxy_gate_checks_api_keys_before_any_admission_verdict() -> None:
    from serve_app.api_keys import KeySet
    from serve_app.auth import INVALID_KEY, UNAUTHORIZED_HEADERS
    from serve_app.openai.http_limits import error_response
    from serve_app.proxy_gate import ProxyGateMiddleware

    forwarded: list[str] = []

    async def downstream(scope: Any, receive: Any, send: Any) -> None:
        forwarded.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    class Count:
        n = 0

        def inc(self, value: float) -> None:
            self.n += int(value)

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.get_running_loop().create_future()
    proxy._auth_failures = failures = Count()
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0))
    proxy.gates["/sim"] = ("sim", gate)
    proxy.keys["sim"] = KeySet.of(["tk-proxy-good-1"])
    canonical = error_response(INVALID_KEY, UNAUTHORIZED_HEADERS)
    c = httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy")
    good = {"Authorization": "Bearer tk-proxy-good-1"}
    async with c:
        gate.observe(BUSY)  # overloaded: still, a caller without a valid key learns only that
        refused = [await c.post("/sim/v1/chat/completions", json=CHAT, headers=h)
                   for h in ({}, {"Authorization": "Bearer tk-proxy-bad"}, {"Authorization": "tk-proxy-good-1"})]
        busy = await c.post("/sim/v1/chat/completions", json=CHAT, headers=good)
        gate.observe(IDLE)
        served = await c.post("/sim/v1/chat/completions", json=CHAT, headers=good)
        health = await c.get("/sim/health")  # not gated at the proxy: the Ingress decides
    assert {(r.status_code, r.content, r.headers["www-authenticate"]) for r in refused} == {
        (401, canonical.body, UNAUTHORIZED_HEADERS["WWW-Authenticate"])}
    assert failures.n == 3
    assert busy.status_code == 429 and served.status_code == 200 and health.status_code == 200
    assert forwarded == ["/sim/v1/chat/completions", "/sim/health"]


def test_requests_answered_without_reaching_a_unit_do_not_stay_on_the_way() -> None:
    import contextvars

    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), clock=Clock(), count_arrivals=True)
    gate.observe(dataclasses.replace(IDLE, prefill_s_per_token=0.001, num_arrived=7))

    def refused_by_the_ingress() -> None:  # one request's context, as in the proxy's middleware
        assert gate.refusal(600) is None
        gate.answered(reached_a_unit=False)

    for _ in range(200):  # far more than 2 s of prefill, had they all stayed counted
        contextvars.copy_context().run(refused_by_the_ingress)
    assert gate.in_flight() == 0 and gate.refusal(600) is None


async def test_the_gates_learn_the_way_to_the_unit_and_the_prompts_size_from_its_verdicts() -> None:
    """The unit's verdict says how long its request had waited since the proxy's stamp when it
    arrived, and how many tokens its prompt held: the Ingress's gate learns its own stretch of the
    way from it (less the wait it judged the request with) and the body's bytes per token, adds both
    to the response for the proxy (`UNIT_WAITED`, `PROMPT_TOKENS`), and the proxy's gate learns the
    whole way and the same bytes per token from those headers."""
    from serve_app.front_gate import PROMPT_TOKENS, UNIT_WAITED
    from serve_app.ingress_gate import FrontGateMiddleware
    from serve_app.proxy_gate import ProxyGateMiddleware
    from tidal_core.front_admission import PATH_PRIOR_S, PROMPT_BYTES_PER_TOKEN

    body = json.dumps(CHAT).encode()
    tokens = len(body) // 2  # 2 bytes a token: far denser than the prior, so the step is plain to see
    prior_tokens = 512  # the prompt size model's prior weighs as one verdict on a prompt this long
    learned_bytes_per_token = ((0.9 * prior_tokens * PROMPT_BYTES_PER_TOKEN + 0.1 * len(body))
                               / (0.9 * prior_tokens + 0.1 * tokens))

    ingress_gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), clock=Clock(), rng=random.Random(0))
    ingress_gate.observe(IDLE)

    async def unit_side(scope: Any, receive: Any, send: Any) -> None:  # the handler, after the unit's verdict
        ingress_gate.observe(IDLE, unit_waited_s=0.03, prompt_tokens=tokens)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    class State:
        front_gate = ingress_gate

    class Holder:
        state = State()

    gated = FrontGateMiddleware(unit_side)

    async def ingress_app(scope: Any, receive: Any, send: Any) -> None:
        await gated({**scope, "app": Holder()}, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(ingress_app), base_url="http://ingress") as c:
        answered = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert answered.headers[UNIT_WAITED] == "30.0" and answered.headers[PROMPT_TOKENS] == str(tokens)
    # No stamp here: the Ingress judged it at ~0 s waited, so its stretch is the whole 30 ms (one
    # step of the mean from the prior).
    assert ingress_gate.path.num_observed == 1
    assert ingress_gate.path.per_request_s == pytest.approx(PATH_PRIOR_S + 0.1 * (0.03 - PATH_PRIOR_S), abs=1e-3)
    assert ingress_gate.sizes.num_observed == 1
    assert ingress_gate.sizes.bytes_per_token == pytest.approx(learned_bytes_per_token)

    async def behind_the_proxy(scope: Any, receive: Any, send: Any) -> None:  # Serve's routing, then the Ingress
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(UNIT_WAITED.encode(), b"25.0"), (PROMPT_TOKENS.encode(), str(tokens).encode())]})
        await send({"type": "http.response.body", "body": b"{}"})

    proxy = ProxyGateMiddleware(behind_the_proxy)
    proxy._task = asyncio.get_running_loop().create_future()
    proxy_gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0), count_arrivals=True)
    proxy_gate.observe(IDLE)
    proxy.gates["/sim"] = ("sim", proxy_gate)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy") as c:
        sent = await c.post("/sim/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert sent.status_code == 200
    assert proxy_gate.path.per_request_s == pytest.approx(PATH_PRIOR_S + 0.1 * (0.025 - PATH_PRIOR_S))  # alone: 25 ms
    assert proxy_gate.sizes.bytes_per_token == pytest.approx(learned_bytes_per_token)

