"""The autoscaler's step-time signal against load: one unit's measured TPOT at constant rates.

    .venv/bin/python benchmarks/tpot_signal.py [--rate R ...] [--minutes 20]

One simulated unit (adaptive policy, A100 Llama-70B TP8 cost model, TPOT target 100 ms) at each
constant arrival rate: SLO attainment, TPOT p99, and the unit's measured TPOT
(`UnitLoad.tpot_s`, core/tpot_meter.py) sampled every minute after the first three — what the
autoscaler's `hot_tpot_fraction` / `cool_tpot_fraction` are compared with
(docs/day-in-the-life.md §4). About a minute on one core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.study import constant_trace, unit_capacity


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, action="append", help="req/s (repeatable)")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    args = ap.parse_args()
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    capacity = unit_capacity(cost, base)
    print(f"unit capacity (saturated) {capacity:.2f} req/s\n")
    print("| rate (req/s) | load | SLO attainment | rejected | TPOT p99 (ms) | measured TPOT mean (min-max) ms |")
    print("|---|---|---|---|---|---|", flush=True)
    for rate in args.rate or (0.5, 1.0, 1.4, 1.7, 1.9, 2.1, 2.3):
        trace = constant_trace(rate, args.minutes, 0, base.max_model_len)
        run = run_policy(RunSpec(trace, base, cost, Slo(), seed=0), "adaptive", progress=False)
        tpot = np.array([row["tpot_ms_max"] for row in run.run.samples.timeline[3:]])
        s = run.summary
        print(f"| {rate:g} | {rate / capacity:.2f} | {s['slo_attainment']:.2%} | {s['rejected']} | "
              f"{s['tpot_p99_ms']:.0f} | {tpot.mean():.0f} ({tpot.min():.0f}-{tpot.max():.0f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
