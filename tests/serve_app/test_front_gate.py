"""The front gate (serve_app/front_gate.py) in the FastAPI app without Ray: refusals at the door,
before the body is read or the engine called; the spread retry-after; the snapshots' two feeds
(the unit's verdicts and the poll); and the unit's side of the feed (serve_app/engine_loop.py)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import random
import time
from typing import Any

import httpx
import pytest

from serve_app.engine_loop import EngineLoop
from serve_app.front_gate import FrontGate
from serve_app.handle_client import HandleEngineClient
from serve_app.ingress import build_app
from serve_app.openai.errors import OpenAIError
from serve_app.openai.server import OpenAIServer
from serve_app.unit_api import GenerateChunk, GenerateRequest
from tests.serve_app.openai_fakes import FakeEngine
from tests.serve_app.test_engine_loop import CFG, AsyncFake, collect
from tests.serve_app.test_ingress_errors import INFO, FakeHandle, FakeResponse
from tidal_core import AdmissionConfig, Regime, SamplingParams, Scheduler, UnitLoad, preset

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BUSY = UnitLoad("u1", num_running=40, num_waiting=30, queue_delay_s=6.0, kv_usage=0.2, capacity_rps=4.0,
                regime=Regime.OVERLOAD, prefill_s_per_token=1e-4)
IDLE = UnitLoad("u1", 0, 0, 0.0, 0.0, capacity_rps=4.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gated_app(tok: Any, **gate_kw: Any) -> tuple[Any, FakeEngine, FrontGate, Clock]:
    engine = FakeEngine(tok)
    clock = Clock()
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), clock=clock, rng=random.Random(0), **gate_kw)
    app = build_app(OpenAIServer(engine, tok))
    app.state.front_gate = gate
    return app, engine, gate, clock


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ingress")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_busy_units_snapshot_refuses_at_the_door_without_calling_the_engine(tok: Any, path: str) -> None:
    app, engine, gate, _ = gated_app(tok)
    gate.observe(BUSY)
    body = CHAT if path.endswith("chat/completions") else {"prompt": "Hi", "max_tokens": 4}
    async with client(app) as c:
        resp = await c.post(path, json=body)
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "prefill_backlog")
    ms = int(resp.headers["retry-after-ms"])
    assert int(resp.headers["retry-after"]) == -(-ms // 1000) and ms >= 5000  # 6 s ahead - 1 s target
    assert engine.requests == [] and gate.refused == {"prefill_backlog": 1}


async def test_every_refusal_is_reported_with_its_reason_and_nothing_else_is(tok: Any) -> None:
    reasons: list[str] = []
    app, _, gate, _ = gated_app(tok, on_refusal=reasons.append)  # the Ingress's: `tidal_front_refusals`
    async with client(app) as c:
        gate.observe(IDLE)
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        gate.observe(BUSY)
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 429
        assert (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})).status_code == 429
    assert reasons == ["prefill_backlog", "prefill_backlog"] == ["prefill_backlog"] * gate.refused["prefill_backlog"]


async def test_idle_stale_or_absent_snapshots_let_requests_through(tok: Any) -> None:
    app, engine, gate, clock = gated_app(tok)
    async with client(app) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200  # nothing heard yet
        gate.observe(IDLE)
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        gate.observe(dataclasses.replace(BUSY, queue_delay_s=30.0))
        clock.now += 5.5  # the busy snapshot is stale: the unit decides
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # never gated
    assert len(engine.requests) == 3


async def test_a_big_prompt_is_refused_where_a_small_one_passes(tok: Any) -> None:
    app, engine, gate, _ = gated_app(tok)
    gate.observe(dataclasses.replace(BUSY, queue_delay_s=0.9, prefill_s_per_token=0.001))
    async with client(app) as c:
        small = await c.post("/v1/chat/completions", json=CHAT)
        big = await c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "w " * 900}]})
    assert small.status_code == 200 and big.status_code == 429  # 1800 bytes ~ 300 tokens ~ 0.3 s more
    assert len(engine.requests) == 1


async def test_a_units_own_429_leaves_with_a_spread_retry_after(tok: Any) -> None:
    from serve_app.unit_api import EngineError

    app, engine, gate, _ = gated_app(tok)
    engine.first_error = EngineError(429, "rate_limit_error", "prefill_backlog", "busy", 1.0)
    gate.observe(IDLE)  # the gate lets them through; the unit refuses (final authority)
    async with client(app) as c:
        delays = [int((await c.post("/v1/chat/completions", json=CHAT)).headers["retry-after-ms"]) for _ in range(8)]
    # 4 req/s of capacity: refusal k gets the k-th 250 ms slot from the unit's 1 s on (the clock
    # stands still here), jittered inside it.
    assert all(1000 + 250 * k <= d <= 1250 + 250 * k for k, d in enumerate(delays)), delays


async def test_a_closed_gate_answers_503_with_retry_after(tok: Any) -> None:
    app, engine, _, _ = gated_app(tok, closed=lambda: OpenAIError(503, "rebuilding", "server_error", None,
                                                                   "engine_recovering", 5.0))
    async with client(app) as c:
        resp = await c.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "5" and engine.requests == []


async def test_the_poll_keeps_the_view_fresh_and_a_failing_poll_keeps_the_last() -> None:
    answers: list[UnitLoad | Exception] = [BUSY, RuntimeError("no replica"), IDLE]

    async def poll(refused_at_door: int = 0) -> UnitLoad:
        answer = answers.pop(0) if answers else IDLE
        if isinstance(answer, Exception):
            raise answer
        return answer

    gate = FrontGate(AdmissionConfig(), poll, period_s=0.001, idle_period_s=0.001)  # no dozing here
    gate.start()
    gate.start()  # idempotent
    for _ in range(500):
        if not answers:
            break
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.01)
    await gate.stop()
    assert not answers and gate.sightings["u1"].load == IDLE and gate.refusal(100) is None


async def test_handle_client_feeds_the_gate_and_hides_the_admission_chunk() -> None:
    seen: list[tuple[UnitLoad, float | None, int]] = []
    response = FakeResponse([GenerateChunk(load=IDLE, waited_s=0.25, num_prompt_tokens=7), GenerateChunk([5]),
                             GenerateChunk([6], "stop", load=None)])
    handle = FakeHandle(response)
    sent: list[GenerateRequest] = []
    original = handle.remote

    def remote(*args: Any) -> Any:
        sent.extend(args)
        return original(*args)

    handle.remote = remote  # type: ignore[method-assign]
    engine = HandleEngineClient(handle, INFO, on_load=lambda *verdict: seen.append(verdict))  # type: ignore[arg-type]
    chunks = [c async for c in engine.generate(GenerateRequest("r", [1], SamplingParams(max_tokens=2), 0.0))]
    assert [c.token_ids for c in chunks] == [[5], [6]] and seen == [(IDLE, 0.25, 7)]
    assert sent[0].report_load


def test_the_unit_reports_its_load_with_its_verdicts() -> None:
    async def main() -> None:
        cfg = preset("adaptive", CFG, admission=AdmissionConfig(max_queue_len=1))
        loop = EngineLoop(Scheduler(cfg), AsyncFake(step_s=0.01), unit_id="u9")
        reqs = [GenerateRequest(r, [1] * 8, SamplingParams(max_tokens=3), time.time(), report_load=True)
                for r in "abc"]
        results = await asyncio.gather(*(collect(loop, r) for r in reqs))
        for chunks in results:
            assert chunks[0].load is not None and chunks[0].load.unit_id == "u9"
            assert chunks[0].waited_s is not None and 0.0 <= chunks[0].waited_s < 5.0  # the wait it arrived with
            assert chunks[0].num_prompt_tokens == 8  # the prompt as the unit counted it
            if chunks[0].error is None:  # admitted: the verdict alone first, then the tokens
                assert chunks[0].token_ids == [] and chunks[0].finish_reason is None
                assert [t for c in chunks for t in c.token_ids] == [42] * 3
            else:
                assert chunks[0].error.status == 429 and chunks[0].load.num_waiting >= 1
        assert any(chunks[0].error is not None for chunks in results)
        plain = [c async for c in loop.generate(GenerateRequest("d", [1] * 8, SamplingParams(max_tokens=2),
                                                               time.time()))]
        assert all(c.load is None for c in plain)  # not asked: the stream is as before
        await loop.stop()

    asyncio.run(main())


def test_requests_let_through_count_until_their_verdict_so_a_burst_is_refused_before_any_returns() -> None:
    from tidal_core.front_admission import PROMPT_BYTES_PER_TOKEN, PathModel

    def burst_through(gate: FrontGate) -> int:
        passed = 0
        while gate.refusal(body) is None:
            passed += 1
            assert passed < 100
        return passed

    clock = Clock()
    body = int(100 * PROMPT_BYTES_PER_TOKEN)  # bytes: ~100 tokens at the prior, ~0.1 s of prefill each
    timed = FrontGate(AdmissionConfig(target_ttft_s=1.0, burst_factor=2.0), clock=clock)
    timed.observe(dataclasses.replace(IDLE, prefill_s_per_token=0.001))  # 1 ms per prompt token
    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0, burst_factor=2.0), clock=clock)
    gate.path = PathModel(prior_s=0.0)  # an instant way to the unit
    gate.observe(dataclasses.replace(IDLE, prefill_s_per_token=0.001))
    passed = burst_through(gate)
    assert 19 <= passed <= 21  # ~2 s (burst_factor x the target) of prefill let through, then refused
    # The way takes time (the prior: 20 ms per request on it), and the unit cannot start on the
    # first request before it arrives: fewer pass.
    assert burst_through(timed) < passed
    clock.now += 0.5  # work still on its way to the unit does not drain: nothing more passes
    assert gate.refusal(body) is not None

    gate._pending.clear()  # as if their verdicts had come back: the unit's snapshot holds them now
    gate.observe(dataclasses.replace(IDLE, prefill_s_per_token=0.001))
    assert gate.refusal(body) is None and len(gate._pending) == 1

    async def one_request() -> None:  # a request's own task: its unit's verdict releases it, not others
        assert gate.refusal(body) is None and len(gate._pending) == 2
        gate.observe(dataclasses.replace(IDLE, prefill_s_per_token=0.001))
        assert len(gate._pending) == 1

    asyncio.run(one_request())


async def test_stop_ends_the_poll_even_when_a_cancellation_is_lost() -> None:
    # Python 3.11's `asyncio.wait_for` can swallow a cancellation that lands as its inner call
    # finishes; a poll that swallows it itself stands in for that race, deterministically.
    entered = asyncio.Event()

    async def poll(refused_at_door: int = 0) -> UnitLoad:
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        return IDLE

    gate = FrontGate(AdmissionConfig(), poll, period_s=0.001)
    gate.start()
    await entered.wait()
    await asyncio.wait_for(gate.stop(), 2.0)  # the old loop polled on forever: TimeoutError here
    assert gate.sightings["u1"].load == IDLE


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def _gate_answering(load: UnitLoad, **kw: Any) -> FrontGate:
    """A gate whose poll always answers `load`, polling every millisecond while it polls fast."""
    async def poll(refused_at_door: int = 0) -> UnitLoad:
        return load

    return FrontGate(AdmissionConfig(), poll, period_s=0.001, **kw)


async def test_an_idle_unit_is_polled_once_a_doze_and_a_request_wakes_the_poll() -> None:
    gate = _gate_answering(IDLE, idle_period_s=4.0)  # a doze of 4 s against a millisecond's pace
    gate.start()
    await _until(lambda: gate.num_polls == 1)
    await asyncio.sleep(0.2)
    assert gate.num_polls == 1  # dozing, not polling every millisecond
    contextvars.copy_context().run(gate.refusal, 100)  # a request arrives: the poll wakes now
    await _until(lambda: gate.num_polls >= 2, timeout_s=3.0)
    await gate.stop()


async def test_a_dev_servers_gate_keeps_its_idle_pace_under_traffic_until_the_queue_nears_its_limit() -> None:
    """Protect mode (make serve) refuses only a full queue: with the queue far from its limit the
    poll stays at its idle pace however many requests come (each poll costs CPU the model's steps
    need on a small box); once the queue reaches half the limit, requests keep it fast again."""
    protect = AdmissionConfig(mode="protect", max_queue_len=64)
    load = dataclasses.replace(BUSY, num_waiting=10)

    async def poll(refused_at_door: int = 0) -> UnitLoad:
        return load

    gate = FrontGate(protect, poll, period_s=0.001, idle_period_s=4.0)
    gate.start()
    await _until(lambda: gate.num_polls == 1)

    async def traffic() -> None:
        while True:
            contextvars.copy_context().run(gate.refusal, 100)
            await asyncio.sleep(0.001)

    sender = asyncio.get_running_loop().create_task(traffic())
    await asyncio.sleep(0.3)
    assert gate.num_polls == 1  # 300 requests, no poll: a 10-deep queue cannot reach 64 unseen
    load = dataclasses.replace(BUSY, num_waiting=40)
    gate.observe(load)  # a verdict shows the queue past half its limit
    await _until(lambda: gate.num_polls >= 6, timeout_s=3.0)  # fast again (a doze each would take 20 s)
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sender
    await gate.stop()


async def test_requests_keep_the_poll_fast_and_a_busy_unit_without_requests_dozes() -> None:
    gate = _gate_answering(BUSY, idle_period_s=4.0)
    gate.start()
    await _until(lambda: gate.num_polls == 1)
    await asyncio.sleep(0.2)
    assert gate.num_polls == 1  # nobody asks: no poll, busy or not

    async def traffic() -> None:
        while True:
            contextvars.copy_context().run(gate.refusal, 100)
            await asyncio.sleep(0.001)

    sender = asyncio.get_running_loop().create_task(traffic())
    await _until(lambda: gate.num_polls >= 6)  # five polls of a doze each would take 20 s
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sender
    await gate.stop()


async def test_snapshots_kept_fresh_by_verdicts_are_not_polled_for() -> None:
    clock = Clock()
    gate = _gate_answering(BUSY, idle_period_s=0.001, clock=clock)
    gate.observe(BUSY)  # a unit's verdict, as a request let through receives it
    gate.start()
    await asyncio.sleep(0.1)  # ~100 turns of the poll loop, all with a snapshot 0 s old
    assert gate.num_polls == 0
    clock.now += 1.0  # no verdict for a second: the poll asks the unit again
    await _until(lambda: gate.num_polls >= 1)
    await gate.stop()


def test_the_poll_periods_must_fit_the_snapshots_age_limit() -> None:
    for period_s, idle_s in ((0.0, 1.0), (0.5, 0.1), (0.1, 5.0)):
        with pytest.raises(ValueError, match="period_s"):
            FrontGate(AdmissionConfig(), period_s=period_s, idle_period_s=idle_s)


async def test_the_doors_refusals_reach_a_unit_with_the_next_poll_once() -> None:
    """A request refused at the door never reaches a unit: the gate passes its refusals on with its
    next poll, even while verdicts keep its snapshots fresh, and each only once; the unit counts
    them in its load, refusal meters and `costly_prompt` sample, not in the requests it received."""
    clock, passed = Clock(), []

    async def poll(refused_at_door: list[tuple[int, str]]) -> UnitLoad:
        passed.append(list(refused_at_door))
        return BUSY

    gate = FrontGate(AdmissionConfig(target_ttft_s=1.0), poll, period_s=0.001, idle_period_s=0.001, clock=clock)
    gate.observe(BUSY)  # fresh: without refusals to pass on, no poll (as in the test above)
    for _ in range(7):
        assert contextvars.copy_context().run(gate.refusal, 100) is not None
    # each one's prompt estimate and the rule's reason
    assert len(gate.undelivered) == 7 and all(n > 0 and why == "prefill_backlog" for n, why in gate.undelivered)
    estimates = list(gate.undelivered)
    gate.start()
    await _until(lambda: sum(map(len, passed)) == 7)
    await asyncio.sleep(0.05)
    assert gate.undelivered == [] and passed == [estimates]
    await gate.stop()

    cfg = preset("adaptive", CFG)
    sched = Scheduler(dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission,
                                                                             shed_costly_prompts_in_overload=True)))
    loop = EngineLoop(sched, AsyncFake(step_s=0.01), unit_id="u9")
    before = loop.load(10.0)
    seen = sched.admission.costly.num_seen
    after = loop.load(10.0, refused_at_door=[(300, "prefill_backlog")] * 50)
    assert after.load > before.load and after.refused_fraction == 1.0 and after.num_arrived == before.num_arrived
    assert sched.regime.refusals.fraction(10.0) == 1.0  # refused for the work ahead: the regime's signal too
    assert sched.admission.costly.num_seen == seen + 50  # the `costly_prompt` sample, where the rule is on
