"""Reliability harness for issue 8: load with probes beside it, figures, fault injection helpers.

Owns: `azure_trace` (Poisson arrivals with Azure-conversation lengths), `run_load` (an open-loop
`loadgen` replay with `watch_unit` polling the unit's `unit_state(check=True)` and `/health`
beside it), the figures read from a run (`load_figures`), `wait_drained` (KV all free, no request
or stream left, integrity check passing), fault-injection lookups (Serve replica and TP worker
actors and their PIDs) and process RSS.

Used by tests/integration/test_reliability_*.py (inside the session cluster of conftest.py) and by
benchmarks/{overload,soak,faults}.py (which start their own cluster with `start_cluster`).
Figures are returned, never asserted here: tests assert correctness (every request ends, nothing
leaks, nothing hangs past a generous bound); benchmarks print and record the timings.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadgen.client import ClientConfig, RequestSpec, send_request
from loadgen.lengths import sample_length_arrays
from loadgen.records import Trace
from loadgen.replay import ReplayConfig, replay_async
from loadgen.report import Slo

SIM_MODEL = "sim-llama-70b-a100"
LOCAL_MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]


def sim_capacity_rps(max_input: int = 6000, max_output: int = 1024, num_requests: int = 1500, seed: int = 12345,
                     config: Path = ROOT / "configs" / "sim.yaml") -> float:
    """Requests/s one simulated unit of `config` sustains on Azure-conversation lengths clipped
    like the load, measured by the simulator (the same scheduler and cost model as the Serve app:
    `loadgen.sim.runner.measure_capacity`). About 2.86 req/s unclipped (1157 / 213 tokens mean)."""
    import yaml

    from actors.cost_model import CostModel
    from loadgen.sim.runner import measure_capacity, unit_config

    (app,) = yaml.safe_load(config.read_text())["applications"]
    engine, sched = app["args"]["engine"], app["args"]["scheduler"]
    cost = CostModel.load(engine["cost_model"])
    base = unit_config(cost, max_batch_size=sched["max_batch_size"],
                       max_num_batched_tokens=sched["max_num_batched_tokens"], max_model_len=engine["max_model_len"])
    inp, out = sample_length_arrays(num_requests, source="azure-conv", seed=seed, max_input=max_input,
                                    max_output=max_output)
    lengths = Trace("capacity-lengths", np.zeros(num_requests), np.maximum(inp, 8), np.maximum(out, 1),
                    duration_s=0.0)
    return measure_capacity(cost, base, lengths, num_requests)


# ---- load ---------------------------------------------------------------------------------------


def azure_trace(rate_rps: float, duration_s: float, seed: int, *, max_input: int = 6000,
                max_output: int = 1024) -> Trace:
    """Poisson arrivals at `rate_rps` for `duration_s`, (prompt, output) lengths resampled jointly
    from the Azure conversation trace (clipped to the given maxima)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_rps, size=int(rate_rps * duration_s * 1.5) + 16)
    arrival = np.cumsum(gaps)
    arrival = arrival[arrival < duration_s]
    inp, out = sample_length_arrays(arrival.size, source="azure-conv", seed=seed, max_input=max_input,
                                    max_output=max_output)
    inp = np.maximum(inp, 8)  # a few trace rows have (nearly) empty prompts; the API refuses empty ones
    return Trace(f"poisson-{rate_rps:g}rps", arrival, inp, np.maximum(out, 1), duration_s=duration_s,
                 source=f"Poisson {rate_rps:g} req/s, azure-conv lengths, seed {seed}")


@dataclass(frozen=True)
class Probe:
    """A request sent `after_s` after the load's last scheduled arrival, repeated every `period_s`
    while it is turned away (429): how long until the unit serves again once load drops."""

    after_s: float = 0.2
    input_tokens: int = 1000
    output_tokens: int = 32
    period_s: float = 0.2
    timeout_s: float = 60.0


async def run_probe(base_url: str, model: str, at: float, probe: Probe) -> dict[str, Any]:
    """`at`: perf_counter time the load ended. Returns the attempts and when one was served."""
    await asyncio.sleep(max(0.0, at + probe.after_s - time.perf_counter()))
    config = ClientConfig(base_url, model=model, read_timeout_s=60.0)
    attempts: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        while True:
            spec = RequestSpec(1_000_000 + len(attempts), probe.input_tokens, probe.output_tokens)
            res = await send_request(client, config, spec)
            ttft = res.first_token_t - res.sent_t
            attempts.append({"sent_after_load_s": round(res.sent_t - at, 3), "status": res.status,
                             "http_status": res.http_status, "retry_after_s": res.retry_after_s,
                             "ttft_s": None if math.isnan(ttft) else round(ttft, 3), "error": res.error})
            if res.status != "rejected" or time.perf_counter() - at > probe.timeout_s:
                break
            await asyncio.sleep(probe.period_s)
    last = attempts[-1]
    return {"attempts": attempts, "served": last["status"] == "ok", "rejected_before": len(attempts) - 1,
            "served_sent_after_load_s": last["sent_after_load_s"] if last["status"] == "ok" else None,
            "served_ttft_s": last["ttft_s"]}


@dataclass
class Sample:
    """One look at the unit while the load runs (t: seconds since the watch started)."""

    t: float
    health_status: int | None
    health_ms: float
    num_free_blocks: int | None = None
    num_blocks: int | None = None
    num_requests: int | None = None
    num_streams: int | None = None
    num_waiting: int | None = None
    regime: str | None = None
    healthy: bool | None = None
    error: str | None = None  # unit_state failed: the integrity check raised, or the call did


def router_handle(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=app)


async def watch_unit(app: str, base_url: str, stop: asyncio.Event, period_s: float = 0.25) -> list[Sample]:
    """Poll `/health` and `unit_state(check=True)` every `period_s` until `stop` is set."""
    handle = router_handle(app)
    samples: list[Sample] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status: int | None = (await client.get(f"{base_url}/health")).status_code
            except httpx.HTTPError:
                status = None
            sample = Sample(start - t0, status, (time.perf_counter() - start) * 1e3)
            try:
                state = await asyncio.wait_for(handle.unit_state.remote(True), 10.0)
                sample.num_free_blocks, sample.num_blocks = state["num_free_blocks"], state["num_blocks"]
                sample.num_requests, sample.num_streams = state["num_requests"], state["num_streams"]
                sample.num_waiting, sample.regime = int(state["num_waiting"]), state["regime_name"]
                sample.healthy = state["healthy"]
            except Exception as exc:  # the integrity check raised (a finding) or the call failed
                sample.error = f"{type(exc).__name__}: {exc}"[:500]
            samples.append(sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, period_s - (time.perf_counter() - start)))
    return samples


@dataclass
class LoadRun:
    records: list[dict[str, Any]]  # requests.jsonl of the replay, sorted by index
    summary: dict[str, Any]
    samples: list[Sample]
    trace: Trace
    wall_s: float
    probe: dict[str, Any] | None


async def run_load(base_url: str, app: str, trace: Trace, out_dir: Path, *, model: str = SIM_MODEL,
                   drain_timeout_s: float = 120.0, watch_period_s: float = 0.25, slo: Slo | None = None,
                   probe: Probe | None = None) -> LoadRun:
    """Replay `trace` open loop against `base_url` while watching the unit of `app`; with
    `probe`, also measure how soon a request is served once the trace's arrivals stop."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_unit(app, base_url, stop, watch_period_s))
    t0 = time.perf_counter()
    prober = None
    if probe is not None:
        prober = asyncio.create_task(run_probe(base_url, model, t0 + trace.duration_s, probe))
    try:
        report = await replay_async(trace, ClientConfig(base_url, model=model, read_timeout_s=60.0),
                                    ReplayConfig(run_name=app, drain_timeout_s=drain_timeout_s, slo=slo or Slo(),
                                                 progress=False, plots=False), out_dir)
        probed = await prober if prober is not None else None
    finally:
        if prober is not None:
            prober.cancel()
        stop.set()
        samples = await watcher
    lines = (out_dir / "requests.jsonl").read_text().splitlines()
    records = sorted((json.loads(line) for line in lines), key=lambda r: r["index"])
    return LoadRun(records, report.summary, samples, trace, time.perf_counter() - t0, probed)


# ---- disconnect storm ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Storm:
    """`clients` streaming requests started over `spread_s`, each cut at a random point (seeded):
    half after a random time (possibly before the response headers, while queued or prefilling),
    half after a random number of SSE lines (mid-decode). Short ones may finish first."""

    clients: int
    seed: int
    prompt_tokens: tuple[int, int] = (40, 600)
    max_tokens: tuple[int, int] = (16, 400)
    spread_s: float = 2.0
    cut_after_s: tuple[float, float] = (0.0, 4.0)
    cut_after_lines: tuple[int, int] = (0, 60)


async def _storm_client(client: httpx.AsyncClient, base_url: str, model: str, i: int, rng: np.random.Generator,
                        storm: Storm) -> dict[str, Any]:
    from loadgen.prompts import build_prompt

    await asyncio.sleep(float(rng.uniform(0.0, storm.spread_s)))
    prompt = build_prompt(int(rng.integers(*storm.prompt_tokens)), seed=storm.seed * 7919 + i)
    body: dict[str, Any] = {"model": model, "stream": True, "ignore_eos": bool(rng.random() < 0.5),
                            "max_tokens": int(rng.integers(*storm.max_tokens))}
    chat = bool(rng.random() < 0.5)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    by_time = bool(rng.random() < 0.5)
    cut_s = float(rng.uniform(*storm.cut_after_s)) if by_time else None
    cut_lines = None if by_time else int(rng.integers(*storm.cut_after_lines))
    out: dict[str, Any] = {"i": i, "chat": chat, "cut_s": cut_s, "cut_lines": cut_lines, "status": None,
                           "lines": 0, "done": False, "cut": False, "error": None, "retry_after": None}
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def read() -> None:
        async with client.stream("POST", base_url + path, json=body) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                out["error"] = (await response.aread())[:300].decode("utf-8", "replace")
                out["retry_after"] = response.headers.get("retry-after")
                return
            async for line in response.aiter_lines():
                if not line:
                    continue
                out["lines"] += 1
                if line == "data: [DONE]":
                    out["done"] = True
                if cut_lines is not None and out["lines"] >= cut_lines and not out["done"]:
                    out["cut"] = True
                    return  # leaving the block closes the unread response: the connection drops

    try:
        await asyncio.wait_for(read(), cut_s)
    except TimeoutError:
        out["cut"] = True
    return out


async def disconnect_storm(base_url: str, model: str, storm: Storm) -> list[dict[str, Any]]:
    """Run the storm; one outcome per client (HTTP status, SSE lines read, finished or cut)."""
    rng = np.random.default_rng(storm.seed)
    seeds = rng.integers(0, 2**31, size=storm.clients)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0), limits=limits) as client:
        return await asyncio.gather(*(_storm_client(client, base_url, model, i, np.random.default_rng(int(seed)),
                                                    storm) for i, seed in enumerate(seeds)))


# ---- single requests with outcomes (fault tests) --------------------------------------------------


@dataclass
class Outcome:
    """How one request ended, times on `time.perf_counter()`.

    kind: "finished" (a complete response), "cut" (we left a stream that was being served),
    "error_event" (an SSE error event after the 200), "http_error" (an HTTP error status with an
    OpenAI error body), "transport_error" (the connection dropped or timed out: no message reached
    the client)."""

    sent_t: float
    kind: str = "transport_error"
    status: int | None = None
    first_chunk_t: float | None = None
    end_t: float | None = None
    chunks: int = 0
    message: str | None = None
    retry_after: str | None = None


def _error_message(raw: str) -> str | None:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        err = json.loads(raw).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    return None


async def request_outcome(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                          first_chunk: asyncio.Event | None = None, cut_after_chunks: int | None = None) -> Outcome:
    """Send one request (streamed if `body["stream"]`) and classify how it ended; never raises.
    With `cut_after_chunks`, leave once that many chunks arrived (kind "cut": it was being served)."""
    out = Outcome(time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            out.status = response.status_code
            out.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                out.message = _error_message((await response.aread()).decode("utf-8", "replace"))
                out.kind = "http_error" if out.message else "transport_error"
            elif not body.get("stream"):
                await response.aread()
                out.kind = "finished"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    message = _error_message(line[5:])
                    if message is not None:
                        out.kind, out.message = "error_event", message
                        break
                    out.chunks += 1
                    if out.first_chunk_t is None:
                        out.first_chunk_t = time.perf_counter()
                        if first_chunk is not None:
                            first_chunk.set()
                    if '"finish_reason":"' in line:
                        out.kind = "finished"
                    elif cut_after_chunks is not None and out.chunks >= cut_after_chunks:
                        out.kind = "cut"
                        break  # leaving the block drops the connection mid-stream
    except httpx.HTTPError as exc:
        out.kind, out.message = "transport_error", f"{type(exc).__name__}: {exc}"[:300]
    out.end_t = time.perf_counter()
    return out


# ---- faults -----------------------------------------------------------------------------------------


@dataclass
class FaultRun:
    """One fault injected under streaming load, and how the app came back. Times: perf_counter."""

    fault: str
    method: str  # how it was injected
    old_unit: str
    kill_t: float
    streams: list[Outcome]  # in flight (each had its first token) when the fault hit
    probes: list[Outcome]  # one new request every `probe_period_s` from the fault until recovery
    new_unit: str | None = None
    unit_ready_t: float | None = None  # unit_state first answered from a new, healthy unit
    state_after: dict[str, Any] | None = None  # a few seconds after recovery

    @property
    def served_again_t(self) -> float | None:
        """First token of the first request sent after the fault that was served."""
        times = [p.first_chunk_t for p in self.probes if p.kind in ("cut", "finished") and p.first_chunk_t]
        return min(times) if times else None

    def held(self, margin_s: float = 1.0) -> list[Outcome]:
        """Requests sent while no unit could take them, yet served once the new unit was up: they
        waited for the rebuild instead of getting 503 + Retry-After."""
        if self.unit_ready_t is None:
            return []
        return [p for p in self.probes if p.kind in ("cut", "finished") and p.sent_t < self.unit_ready_t - margin_s]

    def figures(self) -> dict[str, Any]:
        k = self.kill_t

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - k, 3)

        def answer_s(p: Outcome) -> float:
            return round((p.first_chunk_t or p.end_t or p.sent_t) - p.sent_t, 3)

        held = self.held()
        probes = [{"sent_s": rel(p.sent_t), "kind": p.kind, "status": p.status, "retry_after": p.retry_after,
                   "answer_s": answer_s(p)} for p in self.probes]
        return {"fault": self.fault, "method": self.method, "old_unit": self.old_unit, "new_unit": self.new_unit,
                "streams": [{"kind": s.kind, "status": s.status, "chunks": s.chunks, "error_after_s": rel(s.end_t),
                             "message": (s.message or "")[:120]} for s in self.streams],
                "stream_error_max_s": max((rel(s.end_t) or 0.0) for s in self.streams),
                "unit_ready_s": rel(self.unit_ready_t), "served_again_s": rel(self.served_again_t),
                "probes_503": sum(1 for p in self.probes if p.status == 503), "probes_held": len(held),
                "held_wait_max_s": max((answer_s(p) for p in held), default=None), "probes": probes}


def kill_tp_worker(unit: str) -> str:
    """Kill rank 0 of `unit`'s TP workers: by name (`tidal-tp-<unit>-r0`, namespace "serve") when
    the workers are named, else SIGKILL the one live TPWorker process of this cluster."""
    import os
    import signal

    import ray

    names = tp_worker_actor_names(unit)
    if names:
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        return f"ray.kill({names[0]})"
    workers = alive_actors("TPWorker")
    if len(workers) != 1:
        raise RuntimeError(f"expected the one TP worker of unit {unit}, found {workers}")
    os.kill(workers[0]["pid"], signal.SIGKILL)
    return f"SIGKILL to TPWorker pid {workers[0]['pid']} (TP workers are not named tidal-tp-<unit>-r<rank> yet)"


def kill_router_replica(app: str, unit: str) -> str:
    import ray

    (name,) = [n for n in replica_actor_names(app, "Router") if n.endswith(f"#{unit}")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return f"ray.kill({name})"


async def _until_new_unit(app: str, old: str, run: FaultRun) -> None:
    while True:
        try:  # while no replica exists this call waits in the handle: time out and ask again
            state = await unit_state_async(app, check=False, timeout_s=2.0)
            if state["unit"] != old and state["healthy"]:
                run.unit_ready_t, run.new_unit = time.perf_counter(), state["unit"]
                return
        except Exception:
            pass
        await asyncio.sleep(0.25)


async def run_fault(base_url: str, app: str, model: str, fault: str, *, num_streams: int = 4,
                    probe_period_s: float = 0.5, timeout_s: float = 180.0, settle_s: float = 4.0) -> FaultRun:
    """Start `num_streams` long streams, wait for their first tokens, inject `fault` ("tp_worker"
    or "router"), send a probe every `probe_period_s` (streamed, left after its first token: the
    new unit's first request is a disconnect) until a new unit serves, then check the unit again
    `settle_s` later (more than one health-check period)."""
    old = (await unit_state_async(app))["unit"]
    url = base_url + "/v1/completions"
    stream_body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                   "stream": True}
    probe_body = {"model": model, "prompt": "Hello there", "max_tokens": 8, "stream": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        started = [asyncio.Event() for _ in range(num_streams)]
        streams = [asyncio.create_task(request_outcome(client, url, stream_body, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 120.0)
        kill_t = time.perf_counter()
        method = kill_tp_worker(old) if fault == "tp_worker" else kill_router_replica(app, old)
        run = FaultRun(fault, method, old, kill_t, [], [])
        probes: list[asyncio.Task[Outcome]] = []

        async def send_probes() -> None:
            while True:
                probes.append(asyncio.create_task(request_outcome(client, url, probe_body, cut_after_chunks=1)))
                await asyncio.sleep(probe_period_s)

        sender = asyncio.create_task(send_probes())
        watcher = asyncio.create_task(_until_new_unit(app, old, run))
        try:
            run.streams = list(await asyncio.wait_for(asyncio.gather(*streams), timeout_s))
            while time.perf_counter() - kill_t < timeout_s:
                if run.unit_ready_t is not None and any(p.done() and p.result().kind in ("cut", "finished")
                                                        for p in probes):
                    break
                await asyncio.sleep(0.25)
        finally:
            sender.cancel()
            watcher.cancel()
        run.probes = list(await asyncio.wait_for(asyncio.gather(*probes), timeout_s))
    await asyncio.sleep(settle_s)
    run.state_after = await unit_state_async(app)
    return run


# ---- figures ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return round(float(np.percentile(finite, q)), 3) if finite else None


def spread_ms(values_s: list[float]) -> dict[str, float | int | None]:
    ms = [v * 1e3 for v in values_s if v is not None]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": round(max(ms), 3) if ms else None}


def load_figures(run: LoadRun, slo: Slo | None = None) -> dict[str, Any]:
    """What issue 8 asks of a load run: outcomes, rejection latency, SLO of the admitted, health, KV."""
    slo = slo or Slo()
    records = run.records
    by_status: dict[str, int] = {}
    for r in records:
        key = f"{r['status']}:{r['http_status']}"
        by_status[key] = by_status.get(key, 0) + 1
    ok = [r for r in records if r["status"] == "ok"]
    rejected = [r for r in records if r["status"] == "rejected"]
    meets = [r for r in ok if r["ttft_s"] is not None and r["ttft_s"] <= slo.ttft_s
             and (r["tpot_s"] is None or r["tpot_s"] <= slo.tpot_s)]
    samples = run.samples
    states = [s for s in samples if s.error is None and s.num_free_blocks is not None]
    return {
        "sent": len(records), "by_status": by_status, "completed": len(ok), "rejected": len(rejected),
        "rejection_latency": spread_ms([r["e2e_s"] for r in rejected]),
        "rejections_without_retry_after": sum(1 for r in rejected if r["retry_after_s"] is None),
        "admitted_slo_attainment": round(len(meets) / len(ok), 4) if ok else None,
        "admitted_ttft": spread_ms([r["ttft_s"] for r in ok]),
        "admitted_tpot": spread_ms([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "offered_rps": round(len(records) / max(run.trace.duration_s, 1e-9), 3),
        "completed_rps": round(len(ok) / max(run.trace.duration_s, 1e-9), 3),
        "send_drift_p99_ms": run.summary.get("drift", {}).get("p99_ms"),
        "health_samples": len(samples),
        "health_not_200": sum(1 for s in samples if s.health_status != 200),
        "health_latency": spread_ms([s.health_ms / 1e3 for s in samples]),
        "unit_state_errors": sorted({s.error for s in samples if s.error is not None}),
        "min_free_blocks": min((s.num_free_blocks for s in states), default=None),  # type: ignore[type-var]
        "num_blocks": states[0].num_blocks if states else None,
        "max_waiting": max((s.num_waiting or 0 for s in states), default=None),
        "regimes_seen": sorted({s.regime for s in states if s.regime}),
        "probe_after_load": run.probe,
    }


def samples_json(samples: list[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]


# ---- waiting --------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout_s: float, period_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return predicate()


def unit_state(app: str, check: bool = True, timeout_s: float = 30.0) -> dict[str, Any]:
    return dict(router_handle(app).unit_state.remote(check).result(timeout_s=timeout_s))


async def unit_state_async(app: str, check: bool = True, timeout_s: float = 30.0) -> dict[str, Any]:
    return dict(await asyncio.wait_for(router_handle(app).unit_state.remote(check), timeout_s))


def is_drained(state: dict[str, Any]) -> bool:
    return (state["num_free_blocks"] == state["num_blocks"] and state["num_requests"] == 0
            and state["num_streams"] == 0)


def wait_drained(app: str, timeout_s: float = 60.0) -> tuple[dict[str, Any], float]:
    """Poll until the unit holds no request, stream or KV block (integrity-checked each time);
    returns the last state and the seconds it took (the state may still be busy on timeout)."""
    t0 = time.monotonic()
    state = unit_state(app)
    while not is_drained(state) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        state = unit_state(app)
    return state, time.monotonic() - t0


# ---- actors and processes -----------------------------------------------------------------------


def replica_actor_names(app: str, deployment: str) -> list[str]:
    """Named Serve replica actors of one deployment (namespace "serve"), e.g.
    'SERVE_REPLICA::sim#Router#dixvijpv'; the suffix is the replica id (the unit id)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def tp_worker_actor_names(unit: str | None = None) -> list[str]:
    """TP worker actors named `tidal-tp-<unit>-r<rank>` in namespace "serve"."""
    import ray

    prefix = f"tidal-tp-{unit}-r" if unit else "tidal-tp-"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def alive_actors(class_name: str) -> list[dict[str, Any]]:
    """Live actors of this Ray cluster whose class is `class_name` (Serve replicas are
    `ServeReplica:<app>:<deployment>`), with name and PID, from the GCS actor table.

    The public state API (`ray.util.state`) needs the dashboard, which the test cluster does not
    run; the GCS table is what it reads. Going through the cluster (not a `ps` scan) matters on a
    shared machine: another developer's cluster has processes with the very same titles."""
    import ray._private.state

    actors = ray._private.state.actors()
    return [{"name": a.get("Name") or "", "pid": int(a["Pid"]), "class": a["ActorClassName"]}
            for a in actors.values() if a.get("State") == "ALIVE" and a.get("ActorClassName") == class_name]


def replica_pids(app: str, deployment: str) -> list[int]:
    return sorted(a["pid"] for a in alive_actors(f"ServeReplica:{app}:{deployment}"))


def rss_bytes(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


class CpuMeter:
    """CPU seconds spent by named processes (and the whole machine) between `start` and `stop`:
    where the time goes when the box is saturated."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        import os

        self.pids = {**pids, "client (this process)": [os.getpid()]}
        self._start: dict[str, float] = {}
        self._t0 = 0.0
        self._sys0: Any = None

    @staticmethod
    def _cpu(pids: list[int]) -> float:
        import psutil

        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        return total

    def start(self) -> None:
        import psutil

        self._start = {name: self._cpu(pids) for name, pids in self.pids.items()}
        self._t0, self._sys0 = time.perf_counter(), psutil.cpu_times()

    def stop(self) -> dict[str, Any]:
        """Cores used on average by each process and by the machine (busy = not idle/iowait)."""
        import psutil

        wall = time.perf_counter() - self._t0
        sys1 = psutil.cpu_times()
        busy = sum(getattr(sys1, f) - getattr(self._sys0, f) for f in ("user", "system", "nice", "irq", "softirq"))
        cores = {name: round((self._cpu(pids) - self._start[name]) / wall, 3) for name, pids in self.pids.items()}
        return {"wall_s": round(wall, 2), "cores_by_process": cores, "machine_busy_cores": round(busy / wall, 3),
                "machine_cores": psutil.cpu_count()}


def replicas_rss(app: str) -> dict[str, int]:
    """RSS in bytes of the app's Router and Ingress replica processes (one replica each here)."""
    out: dict[str, int] = {}
    for deployment in ("Router", "Ingress"):
        for i, pid in enumerate(replica_pids(app, deployment)):
            out[f"{deployment}{'' if i == 0 else i}"] = rss_bytes(pid)
    return out


def soak_trace(wall_s: float, peak_load: float, capacity_rps: float, seed: int, *, max_input: int = 6000,
               max_output: int = 1024) -> Trace:
    """The sharp tidal day (docs/traces.md) compressed into `wall_s`, peaking at `peak_load` x
    `capacity_rps` on the wire: night, ramp, a peak past capacity, evening decline."""
    from loadgen.traces import load_trace

    time_scale = wall_s / 86400.0
    return load_trace("day-in-life-sharp", hours=24.0, seed=seed, time_scale=time_scale,
                      peak_rps=peak_load * capacity_rps * time_scale, max_input=max_input, max_output=max_output)


async def watch_rss(app: str, stop: asyncio.Event, period_s: float = 5.0) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    while not stop.is_set():
        samples.append({"t": round(time.perf_counter() - t0, 1), **replicas_rss(app)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
    return samples


async def run_soak(base_url: str, app: str, trace: Trace, out_dir: Path, *, model: str = SIM_MODEL,
                   rss_period_s: float = 5.0) -> tuple[LoadRun, list[dict[str, Any]]]:
    """`run_load` with the replicas' RSS sampled beside it."""
    stop = asyncio.Event()
    rss = asyncio.create_task(watch_rss(app, stop, rss_period_s))
    try:
        run = await run_load(base_url, app, trace, out_dir, model=model, watch_period_s=1.0)
    finally:
        stop.set()
    return run, await rss


def soak_figures(run: LoadRun, rss_before: dict[str, int], rss_after: dict[str, int],
                 drained: dict[str, Any]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for r in run.records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    growth = {k: round((rss_after[k] - rss_before[k]) / rss_before[k], 4) for k in rss_before if k in rss_after}
    return {"requests": len(run.records), "statuses": statuses, "wall_s": round(run.wall_s, 1),
            "rss_before_mb": {k: round(v / 2**20, 1) for k, v in rss_before.items()},
            "rss_after_mb": {k: round(v / 2**20, 1) for k, v in rss_after.items()}, "rss_growth": growth,
            "after_drain": {k: drained[k] for k in ("num_free_blocks", "num_blocks", "num_requests", "num_streams",
                                                    "healthy")},
            "load": {k: v for k, v in load_figures(run).items() if k in (
                "completed", "rejected", "admitted_slo_attainment", "rejection_latency", "admitted_ttft",
                "admitted_tpot", "health_not_200", "unit_state_errors", "min_free_blocks", "send_drift_p99_ms")}}
