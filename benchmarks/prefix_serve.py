"""Cache-aware routing in Serve on the Mooncake trace (issue 15): a fleet of simulated units behind
tidalserve's request router, least-loaded routing against cache-aware routing, each run on its own
fresh deployment, and the simulator's fleet on the same trace beside them.

The Mooncake conversation trace records, per request, one id per 512 prompt tokens (`hash_ids`):
equal ids, equal prefix. The replay turns them into prompt text that shares what the trace's
prompts share (`loadgen.prompts.build_prefixed_prompt`), so the units' prefix caches and the
router's prefix index meet the reuse the trace recorded, through the whole Serve path: the proxy,
the front gates, the ingress's tokenizer and block hashes, `TidalRequestRouter` and the units'
caches. Each response's `usage.prompt_tokens_details.cached_tokens` says what the unit reused.
Beside each run, request by request against the simulator (`request_by_request`): what Serve did
with the requests the simulator served within the SLO, and the TTFT difference by prompt length.
`--rescore DIR` computes it all again from a recorded run, without Serve.

The fleet: configs/sim.yaml's application (simulated A100 70B TP8 units, prefix caching on) with
`--units` ServingUnit replicas behind configs/prod.yaml's request router; `prefix_routing` true
(the shipped default) or false (`choose_unit`: least predicted delay). The units run in real
time, so a run takes the trace window's length (`--hours` of the trace from `--offset-min`,
thinned or replicated to `--rate` x its recorded rate). Prompts clipped to `--max-input` tokens
and outputs to `--max-output`, so that both fit the units' 8,192-token context.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/prefix_serve.py --out DIR
    python benchmarks/prefix_serve.py --rescore DIR [the run's own arguments] --out OTHER_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

import numpy as np

from loadgen.records import Trace
from loadgen.report import OK, RunOutcomes, Slo
from loadgen.traces import load_trace
from tests.integration.reliability.cluster import app_from_config, machine, routed_fleet, serve_cluster
from tests.integration.reliability.load import meets_slo, read_records, run_load, sim_unit

APP = "fleet"
ROUTINGS = {"load": {"prefix_routing": False}, "prefix": {"prefix_routing": True}}


def mooncake(hours: float, offset_min: float, rate: float, max_input: int, max_output: int, seed: int) -> Trace:
    trace = load_trace("mooncake-conv", hours=(offset_min / 60.0) + hours, rate_scale=rate, seed=seed)
    if offset_min:
        trace = trace.window(offset_min * 60.0, offset_min * 60.0 + hours * 3600.0)
    return trace.clipped(max_input, max_output)


def serve_figures(records: list[dict[str, Any]], summary: dict[str, Any], duration_s: float,
                  slo: Slo) -> dict[str, Any]:
    """What one Serve run gave: goodput within the SLO, the cache's hits as the responses reported
    them, TTFT of the completed, refusals by where they were decided."""
    ok = [r for r in records if r["status"] == "ok"]
    refused: dict[str, int] = {}
    for r in records:
        if r["status"] == "rejected":
            key = r.get("refused_by") or "unknown"
            refused[key] = refused.get(key, 0) + 1
    within = sum(1 for r in ok if meets_slo(r, slo))
    return {"arrived": len(records), "completed": len(ok), "within_slo": within,
            "goodput_rps": round(within / duration_s, 4), "refused": refused,
            "errors": sum(1 for r in records if r["status"] in ("error", "incomplete")),
            "ttft_p50_ms": summary.get("ttft_p50_ms"), "ttft_p99_ms": summary.get("ttft_p99_ms"),
            "tpot_p99_ms": summary.get("tpot_p99_ms"), "prefix_cache": summary.get("prefix_cache")}


def simulate(trace: Trace, units: int, routing: str, slo: Slo) -> tuple[dict[str, Any], RunOutcomes]:
    """The simulator's fleet of the same units on the same trace, routed `routing` ("load" /
    "prefix"): its figures and its per-request outcomes."""
    from loadgen.sim.runner import RunSpec, run_policy

    cost, base = sim_unit()
    spec = RunSpec(trace, base, cost, slo, units=units, overrides={"enable_prefix_caching": "true"}, routing=routing)
    run = run_policy(spec, "adaptive", progress=False)
    s = run.summary
    row = {k: s.get(k) for k in ("arrived", "completed", "goodput_rps", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")}
    row.update({k: round(v, 4) for k, v in run.run.prefix_cache.items()})
    return row, run.run.outcomes


def _spread(values: list[float]) -> list[float] | None:
    return [round(float(v), 3) for v in np.percentile(values, [10, 50, 90])] if values else None


def request_by_request(records: list[dict[str, Any]], sim: RunOutcomes, trace: Trace, slo: Slo) -> dict[str, Any]:
    """Serve against the simulator, request by request on the same trace: what Serve did with the
    requests the simulator served within the SLO (and, for those refused for a backlog,
    the door's predicted TTFT from the 429's message against the simulator's TTFT), and Serve's
    TTFT minus the simulator's for the requests both completed, by prompt length (seconds)."""
    meets = sim.meets_slo(slo)
    fates: dict[str, int] = {}
    predicted, sim_ttft = [], []
    for i, r in enumerate(records):
        if not meets[i]:
            continue
        key = r["status"] if r["status"] != "rejected" else f"refused by {r.get('refused_by') or 'unknown'}"
        fates[key] = fates.get(key, 0) + 1
        found = re.search(r"first token ([0-9.]+)s", r.get("error") or "")
        if r["status"] == "rejected" and found:
            predicted.append(float(found.group(1)))
            sim_ttft.append(float(sim.ttft_s[i]))
    bands: dict[str, Any] = {}
    for lo, hi in ((0, 2000), (2000, 5000), (5000, 1 << 30)):
        delta = [r["ttft_s"] - float(sim.ttft_s[i]) for i, r in enumerate(records) if r["status"] == "ok"
                 and sim.status[i] == OK and lo <= trace.input_tokens[i] < hi]
        bands[f"{lo}-{hi if hi < 1 << 30 else ''}"] = {"n": len(delta), "serve_minus_sim_s": _spread(delta)}
    return {"simulator_within_slo_in_serve": fates,
            "refused_for_backlog": {"n": len(predicted), "predicted_ttft_s": _spread(predicted),
                                  "simulator_ttft_s": _spread(sim_ttft)},
            "ttft_serve_minus_simulator_by_prompt_tokens": bands}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| routing | run | completed / arrived | within the SLO | goodput (req/s) | TTFT p50 (ms) | "
             "prompt tokens cached | refused at the door / by a unit |", "|---|---|---|---|---|---|---|---|"]
    for kind, row in rows.items():
        s, m = row["serve"], row["simulator"]
        door = s["refused"].get("proxy", 0) + s["refused"].get("ingress", 0)
        hit = (s["prefix_cache"] or {}).get("hit_rate")
        lines.append(f"| {kind} | Serve | {s['completed']} / {s['arrived']} | {s['within_slo']} | {s['goodput_rps']} | "
                     f"{s['ttft_p50_ms']} | {hit} | {door} / {s['refused'].get('unit', 0)} |")
        lines.append(f"| {kind} | simulator | {m['completed']} / {m['arrived']} | | {m['goodput_rps']} | "
                     f"{m['ttft_p50_ms']} | {m.get('hit_rate')} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--hours", type=float, default=0.05, help="hours of the trace (played in real time)")
    p.add_argument("--offset-min", type=float, default=0.0, help="start this many minutes into the trace")
    p.add_argument("--rate", type=float, default=1.0, help="the trace's rate multiple (thinned below 1)")
    p.add_argument("--max-input", type=int, default=7000)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", action="append", choices=tuple(ROUTINGS), help="default: both")
    p.add_argument("--stats-period", type=float, default=None,
                   help="the units' routing-stats period, seconds (default: configs/prod.yaml's)")
    p.add_argument("--out", type=Path, default=Path("runs/prefix-serve"))
    p.add_argument("--rescore", type=Path, metavar="DIR",
                   help="no Serve run: the figures again from DIR's recorded runs (with the arguments they had)")
    args = p.parse_args(argv)
    slo = Slo()
    trace = mooncake(args.hours, args.offset_min, args.rate, args.max_input, args.max_output, args.seed)
    report: dict[str, Any] = {"machine_at_start": machine(), "trace": trace.name, "requests": len(trace),
                              "duration_s": trace.duration_s, "units": args.units, "rate": args.rate,
                              "offset_min": args.offset_min, "stats_period_s": args.stats_period, "runs": {}}
    print(f"{trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, {args.units} units", flush=True)
    for kind in args.routing or list(ROUTINGS):
        app = routed_fleet(app_from_config("sim", APP, f"/{APP}"), args.units, ROUTINGS[kind], args.stats_period)
        if args.rescore is None:
            with serve_cluster([app]) as base:
                run = asyncio.run(run_load(f"{base}/{APP}", APP, trace, args.out / kind, drain_timeout_s=180.0))
            records, summary = run.records, run.summary
        else:  # a recorded run again, with the arguments it was made with
            records = read_records(args.rescore / kind)
            summary = json.loads((args.rescore / kind / "summary.json").read_text())[APP]
        sim_row, sim_outcomes = simulate(trace, args.units, kind, slo)
        row = {"serve": serve_figures(records, summary, trace.duration_s, slo), "simulator": sim_row,
               "request_by_request": request_by_request(records, sim_outcomes, trace, slo)}
        report["runs"][kind] = row
        print(kind, json.dumps(row), flush=True)
    runs = report["runs"]
    if len(runs) == 2:
        report["prefix_vs_load"] = {
            side: round(runs["prefix"][side]["goodput_rps"] / runs["load"][side]["goodput_rps"], 3)
            if runs["load"][side]["goodput_rps"] else None for side in ("serve", "simulator")}
        print("goodput, cache-aware / least-loaded:", json.dumps(report["prefix_vs_load"]))
    report["machine_at_end"] = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_serve.json").write_text(json.dumps(report, indent=1))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
