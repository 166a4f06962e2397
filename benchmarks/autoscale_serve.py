"""Serve's autoscaler while the front door refuses (issue 17): an overload that the gates turn away
before any unit sees it must still scale the ServingUnit deployment up.

The front gates (serve_app/front_gate.py, serve_app/proxy_gate.py) refuse most of an overload at
the door, so a unit's own arrivals read about its capacity however deep the overload; each gate's
poll passes its refusals on and the unit counts them in its load and refused fraction
(`absorb_door_refusals`), which its `record_autoscaling_stats` reports to Serve's controller, where
`serve_app.autoscaling:TidalAutoscalingPolicy` makes the core autoscale decision. This runs that
whole path: configs/sim.yaml's application (one simulated A100 70B TP8 unit), its ServingUnit
deployment autoscaled as configs/prod.yaml autoscales it (the tidalserve policy, the request
router, Serve's own delays zeroed), with the policy's time constants shortened so that a run takes
minutes on a small box (`--smoothing`, `--upscale-delay`; scale-down held off for the run).

Poisson arrivals at `--load` x one unit's capacity (Azure conversation lengths) for `--duration`
seconds. Every second the ServingUnit replicas by state (`serve.status()`); every request's outcome
and where it was refused (the `x-tidal-refused-by` header: proxy, ingress or unit). Beside it, the
simulator's fleet on the same trace with the same `AutoscaleConfig` and a unit start-up of
`--provisioning` seconds (measured below for Serve's replicas): its units see every arrival, as
units without a door would, so Serve should scale about as soon and as far.

With `--batch N` it also sends N batch-class requests (`service_tier="flex"`, Azure code
lengths) at the start, as a nightly job submits its backlog: with the shipped `scale_for_batch:
false` the backlog alone must not scale the units up (run it with a night's `--load 0.3`). The
simulator's column then shows the interactive traffic alone.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/autoscale_serve.py --out DIR
    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/autoscale_serve.py --load 0.3 \
        --batch 300 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

import numpy as np

from loadgen.records import Trace
from loadgen.report import OK, Slo
from tests.integration.reliability.cluster import app_from_config, autoscaled, machine, serve_cluster
from tests.integration.reliability.load import (
    SIM_MODEL,
    meets_slo,
    poisson_trace,
    run_load,
    sim_capacity_rps,
    sim_unit,
)
from tidal_core import AutoscaleConfig

APP = "auto"
WINDOW_S = 10.0


def watch_replicas(stop: threading.Event, t0: float, period_s: float = 1.0) -> list[dict[str, Any]]:
    """The ServingUnit's replicas by state every `period_s` (seconds from `t0`), until `stop`."""
    from ray import serve

    seen: list[dict[str, Any]] = []
    while not stop.is_set():
        try:
            dep = serve.status().applications[APP].deployments["ServingUnit"]
            states: dict[str, Any] = {str(getattr(k, "value", k)): int(v) for k, v in dep.replica_states.items()}
        except Exception as exc:  # the controller busy or restarting: recorded, not fatal
            states = {"error": type(exc).__name__}
        seen.append({"t": round(time.perf_counter() - t0, 2), **states})
        stop.wait(period_s)
    return seen


def first_time(samples: list[dict[str, Any]], predicate: Any) -> float | None:
    return next((s["t"] for s in samples if predicate(s)), None)


def replicas(sample: dict[str, Any]) -> int:
    """The replicas of a sample in any state (starting, running, stopping)."""
    return sum(v for k, v in sample.items() if k != "t" and isinstance(v, int))


def start_up_s(samples: list[dict[str, Any]]) -> list[float]:
    """How long each added replica took from first seen (STARTING) to RUNNING, from the samples."""
    out, starting_since = [], None
    running = samples[0].get("RUNNING", 0) if samples else 0
    for s in samples:
        if s.get("STARTING", 0) and starting_since is None:
            starting_since = s["t"]
        if s.get("RUNNING", 0) > running:
            if starting_since is not None:
                out.append(round(s["t"] - starting_since, 1))
            running, starting_since = s.get("RUNNING", 0), None if not s.get("STARTING", 0) else s["t"]
    return out


def serve_windows(records: list[dict[str, Any]], replicas: list[dict[str, Any]], duration_s: float,
                  slo: Slo) -> list[dict[str, Any]]:
    """Per `WINDOW_S` of the trace: arrivals, served within the SLO, refusals by where, replicas running."""
    rows = []
    for w in range(int(duration_s // WINDOW_S)):
        lo, hi = w * WINDOW_S, (w + 1) * WINDOW_S
        mine = [r for r in records if lo <= r["scheduled_s"] < hi]
        within = sum(1 for r in mine if meets_slo(r, slo))
        where: dict[str, int] = {}
        for r in mine:
            if r.get("status") == "rejected":
                key = r.get("refused_by") or "unknown"
                where[key] = where.get(key, 0) + 1
        running = [s.get("RUNNING", 0) for s in replicas if lo <= s["t"] < hi]
        rows.append({"window_s": f"{lo:g}-{hi:g}", "arrived": len(mine), "within_slo": within, "refused": where,
                     "units_running_max": max(running, default=None)})
    return rows


def simulate(trace: Trace, config: AutoscaleConfig, provisioning_s: float, slo: Slo) -> dict[str, Any]:
    """The simulator's autoscaled fleet on `trace`: units over time and goodput per window."""
    from loadgen.sim.runner import RunSpec, sim_config
    from loadgen.sim.simulation import simulate as run_sim

    cost, base = sim_unit()
    spec = RunSpec(trace, base, cost, slo, units=config.min_units, autoscale=config, provisioning_s=provisioning_s)
    # Serve's controller asks the policy several times a second: the simulator's fleet decides every second here.
    run = run_sim(trace, dataclasses.replace(sim_config(spec, "adaptive"), autoscale_interval_s=1.0,
                                             sample_interval_s=1.0))
    o = run.outcomes
    meets = o.meets_slo(slo)
    units = [(float(s["t"]), int(s["serving"])) for s in run.samples.timeline]
    started = [(float(s["t"]), int(s["units"])) for s in run.samples.timeline]
    rows = []
    for w in range(int(trace.duration_s // WINDOW_S)):
        lo, hi = w * WINDOW_S, (w + 1) * WINDOW_S
        sel = (trace.arrival_s >= lo) & (trace.arrival_s < hi)
        rows.append({"window_s": f"{lo:g}-{hi:g}", "arrived": int(sel.sum()), "within_slo": int((meets & sel).sum()),
                     "refused": int(((o.status != OK) & sel).sum()),
                     "units_running_max": max((n for t, n in units if lo <= t < hi), default=None)})
    return {"windows": rows, "first_scale_up_s": next((t for t, n in started if n > config.min_units), None),
            "first_added_unit_serving_s": next((t for t, n in units if n > config.min_units), None),
            "within_slo": int(meets.sum()), "arrived": len(o.status)}


async def send_backlog(url: str, n: int, seed: int) -> dict[str, Any]:
    """`n` batch-class requests (`service_tier="flex"`, Azure code lengths) sent at once, as a
    nightly job submits its backlog: how many were served, refused (with their codes) or failed."""
    import httpx

    from loadgen.lengths import sample_length_arrays
    from loadgen.prompts import build_prompt

    inp, out = sample_length_arrays(n, source="azure-code", seed=seed, max_input=6000, max_output=1024)
    counts: dict[str, int] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=60.0), limits=limits) as client:
        async def one(i: int) -> None:
            body = {"model": SIM_MODEL, "service_tier": "flex", "max_tokens": int(max(out[i], 1)),
                    "messages": [{"role": "user", "content": build_prompt(int(max(inp[i], 8)), seed=seed + i)}]}
            try:
                r = await client.post(f"{url}/v1/chat/completions", json=body)
                key = str(r.status_code) if r.status_code != 429 else f"429 {r.json()['error']['code']}"
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            counts[key] = counts.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return counts


def table(serve_rows: list[dict[str, Any]], sim_rows: list[dict[str, Any]]) -> str:
    lines = ["| seconds | arrived | Serve: units running | Serve: within the SLO | Serve: refused at the door / "
             "by a unit | simulator: units serving | simulator: within the SLO |", "|---|---|---|---|---|---|---|"]
    for s, m in zip(serve_rows, sim_rows, strict=True):
        door = s["refused"].get("proxy", 0) + s["refused"].get("ingress", 0)
        lines.append(f"| {s['window_s']} | {s['arrived']} | {s['units_running_max']} | {s['within_slo']} | "
                     f"{door} / {s['refused'].get('unit', 0)} | {m['units_running_max']} | {m['within_slo']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", type=float, default=3.0, help="offered rate as a multiple of one unit's capacity")
    p.add_argument("--duration", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--max-units", type=int, default=3)
    p.add_argument("--smoothing", type=float, default=10.0, help="policy smoothing_s (prod: 300)")
    p.add_argument("--upscale-delay", type=float, default=5.0, help="policy upscale_delay_s (prod: 30)")
    p.add_argument("--downscale-delay", type=float, default=3600.0, help="policy downscale_delay_s (prod: 300)")
    p.add_argument("--then-load", type=float, default=None, help="a second phase at this load (scale-down)")
    p.add_argument("--then-duration", type=float, default=150.0)
    p.add_argument("--provisioning", type=float, default=10.0, help="the simulator's unit start-up, seconds")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="also send N batch-class (flex) requests at the start: a backlog must not scale the units up")
    p.add_argument("--out", type=Path, default=Path("runs/autoscale-serve"))
    args = p.parse_args(argv)
    kwargs = {"target_load": 0.65, "smoothing_s": args.smoothing, "lead_s": 0.0,
              "upscale_delay_s": args.upscale_delay, "downscale_delay_s": args.downscale_delay, "max_step_up": 4,
              "hot_tpot_fraction": 0.85, "cool_tpot_fraction": 0.76, "scale_for_batch": False}
    capacity = sim_capacity_rps()
    trace = poisson_trace(args.load * capacity, args.duration, seed=args.seed)
    if args.then_load is not None:  # a second phase: the tide going out
        later = poisson_trace(args.then_load * capacity, args.then_duration, seed=args.seed + 1)
        trace = Trace(f"{trace.name}+{later.name}", np.concatenate([trace.arrival_s, later.arrival_s + args.duration]),
                      np.concatenate([trace.input_tokens, later.input_tokens]),
                      np.concatenate([trace.output_tokens, later.output_tokens]),
                      duration_s=args.duration + args.then_duration, source=f"{trace.source}; then {later.source}")
        args.duration += args.then_duration
    slo = Slo()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine_at_start": machine(), "capacity_rps": round(capacity, 3),
                              "rate_rps": round(args.load * capacity, 3), "duration_s": args.duration,
                              "seed": args.seed, "policy_kwargs": kwargs, "max_units": args.max_units}
    with serve_cluster([autoscaled(app_from_config("sim", APP, f"/{APP}"), args.max_units, kwargs)]) as base:
        stop, t0 = threading.Event(), time.perf_counter()
        samples: list[dict[str, Any]] = []
        watcher = threading.Thread(target=lambda: samples.extend(watch_replicas(stop, t0)), daemon=True)
        watcher.start()
        async def both() -> Any:
            load = run_load(f"{base}/{APP}", APP, trace, args.out / "serve", drain_timeout_s=120.0)
            if not args.batch:
                return await load, None
            return await asyncio.gather(load, send_backlog(f"{base}/{APP}", args.batch, args.seed))

        run, backlog = asyncio.run(both())
        stop.set()
        watcher.join(timeout=10.0)
    report["replicas"] = samples
    report["batch_backlog"] = backlog
    serve_rows = serve_windows(run.records, samples, args.duration, slo)
    config = AutoscaleConfig(min_units=1, max_units=args.max_units, **kwargs)  # type: ignore[arg-type]
    sim = simulate(trace, config, args.provisioning, slo)
    report["serve"] = {"windows": serve_rows, "summary": run.summary,
                       "first_scale_up_s": first_time(samples, lambda s: replicas(s) > 1),
                       "first_added_unit_running_s": first_time(samples, lambda s: s.get("RUNNING", 0) > 1),
                       "replica_start_up_s": start_up_s(samples),
                       "max_running": max((s.get("RUNNING", 0) for s in samples), default=0)}
    report["simulator"] = sim
    report["machine_at_end"] = machine()
    (args.out / "autoscale.json").write_text(json.dumps(report, indent=1))
    s = report["serve"]
    print(json.dumps({k: s[k] for k in ("first_scale_up_s", "first_added_unit_running_s", "replica_start_up_s",
                                        "max_running")}))
    print(json.dumps({k: sim[k] for k in ("first_scale_up_s", "first_added_unit_serving_s", "within_slo", "arrived")}))
    if backlog is not None:
        print(json.dumps({"batch_backlog": backlog}))
    print(table(serve_rows, sim["windows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
