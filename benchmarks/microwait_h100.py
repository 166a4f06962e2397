"""Does the adaptive micro-wait pay where the seed expected it to? High QPS, short prompts, a fast GPU.

    .venv/bin/python benchmarks/microwait_h100.py [--cost-model h100-llama70b-tp8] [--minutes 10]

Constant-rate Poisson traffic of short requests (prompts 64-256 tokens, outputs 8-32) on the
H100 Llama-70B TP8 cost model, at 2-20 req/s: `eager`, `continuous`, `fixed-wait` and `adaptive`
side by side (same requests, same unit). Prints TTFT p50/p99, goodput and how many steps the
micro-wait delayed (`microwait_expired`).
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

POLICIES = ("eager", "continuous", "fixed-wait", "adaptive")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost-model", default="h100-llama70b-tp8")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 10.0, 20.0])
    args = ap.parse_args()
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    rng = np.random.default_rng(0)
    print("| req/s | " + " | ".join(f"{p} TTFT p50 / p99 (ms), goodput, waits" for p in POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for rate in args.rates:
        span = args.minutes * 60.0
        arrival = gamma_arrival_times(RateCurve.constant(rate, span), cv=1.0, seed=1, end_s=span)
        n = arrival.size
        trace = Trace("short", arrival, rng.integers(64, 256, n), rng.integers(8, 32, n), duration_s=span)
        cells = []
        for policy in POLICIES:
            run = run_policy(RunSpec(trace, base, cost, Slo()), policy, progress=False)
            s, waits = run.summary, run.run.counters["dispatch"].get("microwait_expired", 0)
            cells.append(f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}, {s['goodput_rps']:.2f}, {waits}")
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
