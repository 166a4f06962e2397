"""Autoscaler settings on a simulated day: what each costs in GPU-hours and SLO attainment.

    .venv/bin/python benchmarks/fleet_settings.py [--start-units N] [--setting JSON ...]
        [--day day-in-life-sharp|day-in-life] [--from-hour H --hours N] [--routing R ...]

The fleet part of `tidal study` (docs/day-in-the-life.md §4) runs one setting, the defaults of
`tidal_core.AutoscaleConfig`. This runs several side by side on the same trace (by default the
sharp day peaking at three units' measured capacity, seed 0, adaptive policy in every unit, A100
Llama-70B TP8 cost model) so the choice of defaults can be checked or redone. Each setting is a
JSON object of `AutoscaleConfig` fields (`{"hot_tpot_fraction": null}` is the arrival-rate-only
autoscaler, `{"min_units": 5, "max_units": 5}` a fixed fleet of five); a full day takes five to
ten minutes on one core. `--from-hour` and `--hours`
cut a window out of the day (e.g. 5..11, the morning ramp) for a quicker look; the fleet then
starts with the units the window's first ten minutes ask for, as the study's does at midnight.
GPU-hours are also given against a fixed fleet of `--fixed-units` units over the same span
(the sharp day's peak-provisioned fleet is five units). `--routing` (repeatable) runs each
setting with each fleet routing of `loadgen.sim.config.ROUTINGS` (default "load"; "load-blind"
is the previous prompt-blind rule).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.config import ROUTINGS
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.study import day_trace, unit_capacity
from tidal_core import AutoscaleConfig

DEFAULT_SETTINGS = (  # the arrival-rate-only autoscaler (the previous defaults), then the defaults
    '{"hot_tpot_fraction": null}',
    "{}",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", action="append", help="AutoscaleConfig fields as JSON (repeatable)")
    ap.add_argument("--start-units", type=int, default=None,
                    help="units serving at the start (default: what the first ten minutes ask for)")
    ap.add_argument("--peak-units", type=int, default=3)
    ap.add_argument("--fixed-units", type=int, default=5, help="the fixed fleet GPU-hours are compared with")
    ap.add_argument("--day", default="day-in-life-sharp", choices=("day-in-life-sharp", "day-in-life"))
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-hour", type=float, default=0.0)
    ap.add_argument("--hours", type=float, default=24.0, help="the window's length")
    ap.add_argument("--routing", action="append", choices=ROUTINGS, help="fleet routing (repeatable; default load)")
    args = ap.parse_args()
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    trace = day_trace(args.day, cost, base, hours=24.0, seed=args.seed, peak_load=1.0, cv=None,
                      units=args.peak_units)
    if args.from_hour or args.hours != 24.0:
        trace = trace.window(args.from_hour * 3600.0, (args.from_hour + args.hours) * 3600.0)
    fixed_gpu_hours = args.fixed_units * cost.tp * trace.duration_s / 3600.0
    first_rate = float(np.count_nonzero(trace.arrival_s < 600.0)) / 600.0
    print(f"{trace.name}, hours {args.from_hour:g}-{args.from_hour + args.hours:g}: {len(trace)} requests; "
          f"GPU-hours vs {args.fixed_units} fixed units "
          f"({fixed_gpu_hours:.0f} GPU-hours)\n")
    print("| setting | routing | start | SLO attainment | rejected | TTFT p99 (ms) | TPOT p99 (ms) | GPU-hours "
          "| vs fixed |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for setting in args.setting or DEFAULT_SETTINGS:
        fields = json.loads(setting)
        config = AutoscaleConfig(**{"min_units": 1, "max_units": 4 * args.peak_units, **fields})
        start = args.start_units or max(config.min_units, min(config.max_units, math.ceil(
            first_rate / (config.target_load * unit_capacity(cost, base)))))
        for routing in args.routing or ["load"]:
            spec = RunSpec(trace, base, cost, Slo(), units=start, seed=args.seed, autoscale=config, routing=routing)
            s = run_policy(spec, "adaptive", progress=False).summary
            print(f"| `{setting}` | {routing} | {start} | {s['slo_attainment']:.2%} | {s['rejected']} | "
                  f"{s['ttft_p99_ms']:.0f} | {s['tpot_p99_ms']:.0f} | {s['gpu_hours']:.0f} | "
                  f"{s['gpu_hours'] / fixed_gpu_hours:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
