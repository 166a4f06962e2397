"""Does the adaptive micro-wait pay where the seed expected it to? High QPS, short prompts, a fast GPU.

    .venv/bin/python benchmarks/microwait_h100.py [--cost-model h100-llama70b-tp8] [--minutes 10]
        [--cv 1 4] [--policy adaptive --policy adaptive-no-microwait]

Constant-rate traffic of short requests (prompts 64-256 tokens, outputs 8-32) on the H100
Llama-70B TP8 cost model, at 2-20 req/s, with gamma inter-arrival times of coefficient of
variation `--cv` (1 = Poisson, larger = burstier): the policies side by side (same requests,
same unit; by default `eager`, `continuous`, `fixed-wait`, `adaptive` and
`adaptive-no-microwait`, the same policy without the wait). Prints TTFT p50/p99, goodput and
how many steps the micro-wait delayed (`microwait_expired`).

The repository's profiling data (Vidur) holds Llama-2-70B operator profiles only, so no
8B-class cost model can be derived from it; the fastest unit it supports is H100 70B TP8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.arrivals import gamma_arrival_times
from loadgen.ratecurve import RateCurve
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config

POLICIES = ("eager", "continuous", "fixed-wait", "adaptive", "adaptive-no-microwait")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost-model", default="h100-llama70b-tp8")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 10.0, 20.0])
    ap.add_argument("--cv", type=float, nargs="+", default=[1.0], help="inter-arrival CV (burstiness)")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    args = ap.parse_args()
    policies = tuple(args.policy or POLICIES)
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    rng = np.random.default_rng(0)
    print("| req/s | CV | " + " | ".join(f"{p} TTFT p50 / p99 (ms), goodput, waits" for p in policies) + " |")
    print("|---" * (len(policies) + 2) + "|")
    for cv in args.cv:
        for rate in args.rates:
            span = args.minutes * 60.0
            arrival = gamma_arrival_times(RateCurve.constant(rate, span), cv=cv, seed=1, end_s=span)
            n = arrival.size
            trace = Trace("short", arrival, rng.integers(64, 256, n), rng.integers(8, 32, n), duration_s=span)
            cells = []
            for policy in policies:
                run = run_policy(RunSpec(trace, base, cost, Slo()), policy, progress=False)
                s, waits = run.summary, run.run.counters["dispatch"].get("microwait_expired", 0)
                cells.append(f"{s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.0f}, {s['goodput_rps']:.3f}, {waits}")
            print(f"| {rate:g} | {cv:g} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
