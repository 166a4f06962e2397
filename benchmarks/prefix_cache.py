"""Prefix caching, side by side in one run: the scheduler's cost, one unit's gain, a fleet's routing.

Parts (`--part`, repeatable; default all):

- `scheduler`: `tidal bench scheduler`'s cycle (256 running, 4096 waiting) with the cache off,
  on with prompts that carry no block hashes, and on with every prompt hashed and unique (the
  cache consulted and filled, never hit). Rounds alternate the order; medians of the per-run
  p50 (thread CPU time, the steadier figure on a shared machine, and wall time).
- `unit`: the Mooncake conversation trace on one A100 / Llama-70B TP8 unit (the project's cost
  model, `adaptive`, SLO TTFT <= 1 s and TPOT <= 100 ms, prompts clipped to 8k as `tidal
  simulate` does), cache off and on: goodput, TTFT p50, the hit rate and an unbounded cache's
  (over the whole trace and over the requests the run admitted).
- `fleet`: 4 such units, cache on, at 3x the one-unit rate: cache-aware routing against the
  least-loaded-of-two routing the fleet uses today.

`--rate` (repeatable) is the one-unit rate as a multiple of the trace's (3.4 req/s): 0.3 is
about what one unit sustains (its measured capacity on these lengths is 0.92 req/s), 1.0 the
trace as recorded (about 3.7x overload). Rates below 1 thin the trace at random, and the
ideal is computed on the same thinned trace.

    nice -n 10 python benchmarks/prefix_cache.py --hours 1 --rate 0.3 --rate 1 --out runs/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.bench import bench_scheduler
from loadgen.sim.runner import PolicyRun, RunSpec, run_policy, unit_config
from loadgen.traces import load_trace

KEYS = ("arrived", "completed", "rejected", "goodput_rps", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
        "tpot_p99_ms")


def part_scheduler(rounds: int, cycles: int) -> dict[str, Any]:
    modes = {"off": (False, False), "on_unhashed": (True, False), "on_hashed_no_hits": (True, True)}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            on, hashed = modes[mode]
            runs[mode].append(bench_scheduler(256, 4096, cycles, seed=r, prefix_caching=on, hashed=hashed))
    med = {m: {k: statistics.median(x[k] for x in rs) for k in ("cpu_p50_us", "p50_us", "mean_us")}
           for m, rs in runs.items()}
    base = med["off"]
    return {"median": med, "ratio_vs_off": {m: {k: round(v / base[k], 3) for k, v in d.items()}
                                            for m, d in med.items()}, "rounds": rounds, "cycles": cycles}


def _row(run: PolicyRun) -> dict[str, Any]:
    row = {k: run.summary.get(k) for k in KEYS}
    row.update({k: round(v, 4) for k, v in run.run.prefix_cache.items()})
    return row


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def part_unit(cost: CostModel, hours: float, rate: float, slo: Slo, overrides: dict[str, str] | None = None
              ) -> dict[str, Any]:
    base, extra = unit_config(cost), overrides or {}
    trace = load_trace("mooncake-conv", hours=hours, rate_scale=rate, seed=0).clipped(8191, 8191)
    off = run_policy(RunSpec(trace, base, cost, slo, overrides=extra), "adaptive", progress=False)
    on = run_policy(RunSpec(trace, base, cost, slo, overrides={**extra, "enable_prefix_caching": "true"}), "adaptive",
                    progress=False)
    a, b = _row(on), _row(off)
    return {"trace": trace.name, "requests": len(trace), "rate_scale": rate, "off": b, "on": a,
            "goodput_on_vs_off": _ratio(a["goodput_rps"], b["goodput_rps"]),
            "ttft_p50_on_vs_off": _ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]),
            "hit_rate_vs_ideal": _ratio(a["hit_rate"], a["ideal_hit_rate"]),
            "hit_rate_vs_ideal_served": _ratio(a["hit_rate"], a["ideal_hit_rate_served"])}


def part_fleet(cost: CostModel, hours: float, rate: float, units: int, slo: Slo,
               overrides: dict[str, str] | None = None, routing: dict[str, float] | None = None) -> dict[str, Any]:
    base = unit_config(cost)
    trace = load_trace("mooncake-conv", hours=hours, rate_scale=rate, seed=0).clipped(8191, 8191)
    cache = {**(overrides or {}), "enable_prefix_caching": "true"}
    out: dict[str, Any] = {"trace": trace.name, "requests": len(trace), "rate_scale": rate, "units": units}
    for kind in ("load", "prefix"):
        spec = RunSpec(trace, base, cost, slo, units=units, overrides=cache, routing=kind,
                       prefix_routing=(routing or {}) if kind == "prefix" else {})
        out[kind] = _row(run_policy(spec, "adaptive", progress=False))
    out["goodput_prefix_vs_load"] = _ratio(out["prefix"]["goodput_rps"], out["load"]["goodput_rps"])
    out["ttft_p50_prefix_vs_load"] = _ratio(out["prefix"]["ttft_p50_ms"], out["load"]["ttft_p50_ms"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=("scheduler", "unit", "fleet"))
    ap.add_argument("--hours", type=float, default=1.0, help="window of the Mooncake trace")
    ap.add_argument("--rate", type=float, action="append", help="one unit's rate, x the trace's (default 0.3, 1)")
    ap.add_argument("--fleet-units", type=int, default=4)
    ap.add_argument("--fleet-rate-factor", type=float, default=3.0, help="the fleet's rate / one unit's")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="scheduler overrides for every simulated run (as `tidal simulate --set`)")
    ap.add_argument("--routing-set", action="append", default=[], metavar="KEY=VALUE",
                    help="the fleet's cache-aware routing: PrefixRoutingConfig fields (e.g. max_extra_delay_s=1e9)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    routing = {k: int(v) if v.isdigit() else float(v) for k, v in (kv.split("=", 1) for kv in args.routing_set)}
    parts = args.part or ["scheduler", "unit", "fleet"]
    slo = Slo(1.0, 0.1)
    cost = CostModel.load(args.cost_model)
    result: dict[str, Any] = {"cost_model": cost.name, "hours": args.hours}
    if "scheduler" in parts:
        result["scheduler"] = part_scheduler(args.rounds, args.cycles)
        print(json.dumps(result["scheduler"]["ratio_vs_off"]), flush=True)
    for rate in args.rate or [0.3, 1.0]:
        if "unit" in parts:
            unit = result.setdefault("unit", {})[str(rate)] = part_unit(cost, args.hours, rate, slo, overrides)
            print(json.dumps({k: v for k, v in unit.items() if k not in ("on", "off")}), flush=True)
        if "fleet" in parts:
            fleet = result.setdefault("fleet", {})[str(rate)] = part_fleet(
                cost, args.hours, rate * args.fleet_rate_factor, args.fleet_units, slo, overrides, routing)
            print(json.dumps({k: v for k, v in fleet.items() if k not in ("load", "prefix")}), flush=True)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
