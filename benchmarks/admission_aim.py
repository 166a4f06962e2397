"""The learned admission aim against admission at the TTFT target itself, side by side on the simulator.

    .venv/bin/python benchmarks/admission_aim.py [--cost-model a100-llama70b-tp8] [--seeds 0 1 2]

Two workloads on one unit (SLO TTFT <= 1 s, TPOT <= 100 ms), each run twice on the same
requests: `adaptive` as shipped (the aim learned, `admission.aim_gain` 0.02) and the same policy
with `admission.aim_gain=0` (the limit is the target itself, as before the aim):

- *steady overload*: Poisson arrivals at `--rate` req/s (about twice the A100 70B unit's capacity
  on these lengths) for `--minutes`, prompts 80-600 tokens, outputs 16-256;
- *a burst into a quiet unit*: a request every 2 s for 10 s, then `--burst-n` requests spread
  uniformly over `--burst-s` seconds (prompts 80-600 tokens, 128 output tokens): the shape of
  `benchmarks/overload.py --burst 400:2` against configs/sim.yaml, without Serve.

`--shipped-only` runs the default configuration alone, so the same script can be run from a
checkout of an earlier commit (copy it into that tree's benchmarks/) for a before / after.

Prints, per seed: requests admitted, the share of them with a first token within the TTFT target,
TTFT p50 / p99 of the admitted, and goodput (requests/s within both SLOs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config

VARIANTS = {"target itself (aim_gain 0)": {"admission.aim_gain": "0"}, "learned aim (shipped)": {}}


def steady_trace(seed: int, rate: float, minutes: float) -> tuple[Trace, float]:
    rng = np.random.default_rng(seed)
    span = minutes * 60.0
    arrival = np.cumsum(rng.exponential(1.0 / rate, int(rate * span * 1.5) + 10))
    arrival = arrival[arrival < span]
    n = arrival.size
    return Trace("steady", arrival, rng.integers(80, 600, n), rng.integers(16, 256, n), duration_s=span + 60.0), 0.0


def burst_trace(seed: int, n: int, span: float) -> tuple[Trace, float]:
    rng = np.random.default_rng(seed)
    lead = 10.0
    arrival = np.concatenate([np.arange(0.0, lead, 2.0), lead + np.sort(rng.uniform(0.0, span, n))])
    k = arrival.size
    return Trace("burst", arrival, rng.integers(80, 600, k), np.full(k, 128), duration_s=lead + span + 60.0), lead


def row(trace: Trace, since_s: float, cost: CostModel, overrides: dict[str, str]) -> dict[str, float]:
    slo = Slo()
    run = run_policy(RunSpec(trace, unit_config(cost), cost, slo, overrides=overrides), "adaptive", progress=False)
    ttft = run.run.outcomes.ttft_s
    sel = trace.arrival_s >= since_s
    admitted = sel & np.isfinite(ttft)
    t = ttft[admitted]
    return {"arrived": int(sel.sum()), "admitted": int(admitted.sum()),
            "within": float(np.mean(t <= slo.ttft_s)) if t.size else float("nan"),
            "p50": float(np.median(t)) if t.size else float("nan"),
            "p99": float(np.quantile(t, 0.99)) if t.size else float("nan"),
            "goodput": float(run.summary["goodput_rps"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rate", type=float, default=8.0, help="steady overload: req/s")
    ap.add_argument("--minutes", type=float, default=3.0, help="steady overload: how long")
    ap.add_argument("--burst-n", type=int, default=400)
    ap.add_argument("--burst-s", type=float, default=2.0)
    ap.add_argument("--shipped-only", action="store_true", help="the default configuration alone (runs on older trees)")
    args = ap.parse_args()
    variants = {"shipped": {}} if args.shipped_only else VARIANTS
    cost = CostModel.load(args.cost_model)
    workloads = {f"steady overload, {args.rate:g} req/s for {args.minutes:g} min":
                 lambda seed: steady_trace(seed, args.rate, args.minutes),
                 f"burst, {args.burst_n} in {args.burst_s:g} s after a quiet 10 s":
                 lambda seed: burst_trace(seed, args.burst_n, args.burst_s)}
    print(f"{args.cost_model}, adaptive, SLO TTFT <= 1 s / TPOT <= 100 ms\n")
    print("| workload | seed | admission | admitted / arrived | admitted within 1 s | TTFT p50 / p99 (s) "
          "| goodput (req/s) |")
    print("|---|---|---|---|---|---|---|")
    for name, make in workloads.items():
        for seed in args.seeds:
            trace, since = make(seed)
            for label, overrides in variants.items():
                r = row(trace, since, cost, overrides)
                print(f"| {name} | {seed} | {label} | {r['admitted']} / {r['arrived']} | {r['within']:.3f} | "
                      f"{r['p50']:.3f} / {r['p99']:.3f} | {r['goodput']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
