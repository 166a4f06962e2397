"""Load with probes beside it, and the figures issue 8 asks of a run.

Owns: `sim_unit` (configs/sim.yaml's unit for the simulator), `sim_capacity_rps` (its capacity on a
length mix, by simulation),
`poisson_trace` / `soak_trace` (Poisson at a fixed rate; the compressed sharp tidal day), `run_load`
(an open-loop `loadgen` replay with `watch_unit` polling `/health` and `unit_state(check=True)`
beside it, and optionally a `Probe` once the arrivals stop), `run_soak` (the same with RSS
sampled), `load_figures` and `soak_figures`. Figures are returned, never asserted here.

Must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
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
from tests.integration.reliability.cluster import ROOT, SIM_MODEL, replicas_rss, router_handle


def sim_unit(config: Path = ROOT / "configs" / "sim.yaml") -> tuple[Any, Any]:
    """The cost model and the simulator's unit config of `config`'s simulated unit: the same
    scheduler and cost model as the Serve app."""
    import yaml

    from calibration.cost_model import CostModel
    from loadgen.sim.runner import unit_config

    (app,) = yaml.safe_load(config.read_text())["applications"]
    engine, sched = app["args"]["engine"], app["args"]["scheduler"]
    cost = CostModel.load(engine["cost_model"])
    return cost, unit_config(cost, max_batch_size=sched["max_batch_size"],
                             max_num_batched_tokens=sched["max_num_batched_tokens"],
                             max_model_len=engine["max_model_len"])


def sim_capacity_rps(max_input: int = 6000, max_output: int = 1024, num_requests: int = 1500, seed: int = 12345,
                     config: Path = ROOT / "configs" / "sim.yaml", source: str = "azure-conv") -> float:
    """Requests/s one simulated unit of `config` sustains on `source`'s lengths (a shipped trace,
    `loadgen.lengths`) clipped like the load, measured by the simulator (`sim_unit`,
    `loadgen.sim.runner.measure_capacity`). About 2.86 req/s on Azure-conversation lengths
    unclipped (1157 / 213 tokens mean)."""
    from loadgen.sim.runner import measure_capacity

    cost, base = sim_unit(config)
    inp, out = sample_length_arrays(num_requests, source=source, seed=seed, max_input=max_input,
                                    max_output=max_output)
    lengths = Trace("capacity-lengths", np.zeros(num_requests), np.maximum(inp, 8), np.maximum(out, 1),
                    duration_s=0.0)
    return measure_capacity(cost, base, lengths, num_requests)


def poisson_trace(rate_rps: float, duration_s: float, seed: int, *, max_input: int = 6000,
                  max_output: int = 1024, source: str = "azure-conv") -> Trace:
    """Poisson arrivals at `rate_rps` for `duration_s`, (prompt, output) lengths resampled jointly
    from `source` (a shipped trace: the Azure conversation trace by default), clipped to the given
    maxima."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_rps, size=int(rate_rps * duration_s * 1.5) + 16)
    arrival = np.cumsum(gaps)
    arrival = arrival[arrival < duration_s]
    inp, out = sample_length_arrays(arrival.size, source=source, seed=seed, max_input=max_input,
                                    max_output=max_output)
    inp = np.maximum(inp, 8)  # a few trace rows have (nearly) empty prompts; the API refuses empty ones
    return Trace(f"poisson-{rate_rps:g}rps", arrival, inp, np.maximum(out, 1), duration_s=duration_s,
                 source=f"Poisson {rate_rps:g} req/s, {source} lengths, seed {seed}")


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
    return LoadRun(read_records(out_dir), report.summary, samples, trace, time.perf_counter() - t0, probed)


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    """A replay's `requests.jsonl` in `out_dir`, sorted by index."""
    lines = (out_dir / "requests.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda r: r["index"])


def pct(values: list[float], q: float) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return round(float(np.percentile(finite, q)), 3) if finite else None


def spread_ms(values_s: list[float]) -> dict[str, float | int | None]:
    ms = [v * 1e3 for v in values_s if v is not None]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": round(max(ms), 3) if ms else None}


def meets_slo(record: dict[str, Any], slo: Slo) -> bool:
    """A `requests.jsonl` record completed within both targets (as `RunOutcomes.meets_slo` judges:
    a request of one output token has no TPOT to miss)."""
    return (record["status"] == "ok" and record["ttft_s"] is not None and record["ttft_s"] <= slo.ttft_s
            and (record["tpot_s"] is None or record["tpot_s"] <= slo.tpot_s))


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
    by_code: dict[str, list[dict[str, Any]]] = {}
    for r in rejected:  # the 429's admission rule, from its OpenAI-style error body
        by_code.setdefault(r.get("error_code") or "none", []).append(r)
    meets = [r for r in ok if meets_slo(r, slo)]
    samples = run.samples
    states = [s for s in samples if s.error is None and s.num_free_blocks is not None]
    return {
        "sent": len(records), "by_status": by_status, "completed": len(ok), "rejected": len(rejected),
        "rejection_latency": spread_ms([r["e2e_s"] for r in rejected]),
        "rejected_by_code": {code: len(rs) for code, rs in sorted(by_code.items())},
        "rejection_latency_by_code": {code: spread_ms([r["e2e_s"] for r in rs])
                                      for code, rs in sorted(by_code.items())},
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
                   rss_period_s: float = 5.0, drain_timeout_s: float = 300.0) -> tuple[LoadRun, list[dict[str, Any]]]:
    """`run_load` with the replicas' RSS sampled beside it."""
    stop = asyncio.Event()
    rss = asyncio.create_task(watch_rss(app, stop, rss_period_s))
    try:
        run = await run_load(base_url, app, trace, out_dir, model=model, watch_period_s=1.0,
                             drain_timeout_s=drain_timeout_s)
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


