"""The gates' aim (tidal_core/door_aim.py) in Serve without Ray: each front gate learns from the
responses to the requests it let through, the Ingress's gate from its unit's verdicts, the proxy's
from the Ingress's and the unit's (`x-tidal-refused-by`, `x-tidal-refusal-reason`)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from typing import Any

import httpx
import pytest

from serve_app.front_gate import REFUSAL_REASON, REFUSED_BY, FrontGate
from tests.serve_app.test_front_gate import BUSY, CHAT, IDLE, client, gated_app
from tidal_core import AdmissionConfig

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("reason", ["prefill_backlog", "prompt_over_target"])
async def test_the_units_backlog_refusals_teach_the_gate_to_refuse_them_itself(tok: Any, reason: str) -> None:
    from serve_app.unit_api import EngineError

    app, engine, gate, _ = gated_app(tok)
    engine.first_error = EngineError(429, "rate_limit_error", reason, "busy", 1.0)
    # Predicted at about 0.85 s of the unit's 1 s limit: let through while the gate's aim is 1.
    gate.observe(dataclasses.replace(BUSY, queue_delay_s=0.85))
    async with client(app) as c:
        answers = [await c.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
    assert all(r.status_code == 429 and r.headers[REFUSAL_REASON] == reason for r in answers)
    where = [r.headers[REFUSED_BY] for r in answers]
    if reason == "prefill_backlog":  # each lowers the aim by 0.097: 0.806 after two, under 0.85
        assert where == ["unit", "unit", "ingress", "ingress"] and gate.aim.num_refused == 2
        assert gate.aim.value == pytest.approx(1 - 2 * 0.1 * 0.97)
    else:  # a prompt too long on its own says nothing of the backlog the gate predicts
        assert where == ["unit"] * 4 and gate.aim.value == 1.0 and gate.aim.num_refused == 0
    assert len(engine.requests) == where.count("unit")


async def test_an_admitted_request_raises_the_gates_aim_back(tok: Any) -> None:
    app, _, gate, _ = gated_app(tok)
    gate.aim.value = 0.5
    gate.observe(IDLE)
    async with client(app) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert gate.aim.num_admitted == 1 and gate.aim.value == pytest.approx(0.5 + 0.1 * 0.03)


async def test_the_proxy_gate_learns_its_aim_from_the_refusals_made_behind_it() -> None:
    """A `prefill_backlog` refusal by the Ingress's gate or the unit lowers the proxy gate's aim; a
    response from an admitted request raises it; another rule's refusal tells it nothing. The
    proxy's own 429 says its rule too."""
    from serve_app.proxy_gate import ProxyGateMiddleware

    answers = [(429, "ingress", "prefill_backlog"), (429, "unit", "prefill_backlog"), (429, "unit", "costly_prompt"),
               (200, None, None)]

    async def downstream(scope: Any, receive: Any, send: Any) -> None:  # the Ingress and the unit behind
        status, where, reason = answers.pop(0)
        headers = [(REFUSED_BY.encode(), where.encode()), (REFUSAL_REASON.encode(), reason.encode())] if where else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.get_running_loop().create_future()
    reported: list[float] = []  # what `tidal_front_aim` is set to: each new value
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), rng=random.Random(0), on_aim=reported.append)
    proxy.gates["/sim"] = ("sim", gate)
    gate.observe(IDLE)
    seen: list[float] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://proxy") as c:
        for _ in range(4):
            await c.post("/sim/v1/chat/completions", json=CHAT)
            seen.append(gate.aim.value)
        gate.observe(BUSY)
        own = await c.post("/sim/v1/chat/completions", json=CHAT)
    down = 0.1 * (1 - 0.03)
    assert seen == pytest.approx([1 - down, 1 - 2 * down, 1 - 2 * down, 1 - 2 * down + 0.1 * 0.03])
    assert (gate.aim.num_refused, gate.aim.num_admitted) == (2, 1)
    assert reported == [seen[0], seen[1], seen[3]]  # the costly_prompt refusal changed nothing
    assert own.status_code == 429 and own.headers[REFUSAL_REASON] == "prefill_backlog" == own.json()["error"]["code"]


async def test_an_aim_that_holds_still_is_set_again_while_the_gate_runs() -> None:
    """Ray drops a gauge series that is not set again within two export intervals, so the poll loop
    sets the aim every `AIM_REPORT_S` even when no response changed it (a quiet door keeps its gauge)."""
    from serve_app.front_gate import AIM_REPORT_S

    now = [0.0]
    reported: list[tuple[float, float]] = []  # (clock, aim) at each set

    async def poll(refused_at_door: Any) -> Any:
        return IDLE

    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), poll, period_s=0.001, idle_period_s=0.001,
                     clock=lambda: now[0], on_aim=lambda v: reported.append((now[0], v)))
    gate.start()
    for step in range(1, 41):  # 40 s of the gate's clock in 1 s steps, nothing changing the aim
        now[0] = float(step)
        await asyncio.sleep(0.005)
    await gate.stop()
    times = [t for t, _ in reported]
    assert all(v == 1.0 for _, v in reported)
    assert times[0] <= 1.0 and times[-1] >= 40.0 - AIM_REPORT_S
    assert max(b - a for a, b in itertools.pairwise(times)) <= AIM_REPORT_S + 1.0  # never unset for 20 s
    assert len(times) <= 40 / AIM_REPORT_S + 2  # not once per poll
