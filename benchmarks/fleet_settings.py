"""Autoscaler settings on the simulated sharp day: what each costs in GPU-hours and SLO attainment.

    .venv/bin/python benchmarks/fleet_settings.py [--start-units 2] [--setting JSON ...]

The fleet part of `tidal study` (docs/day-in-the-life.md §4) runs one setting, the defaults of
`tidal_core.AutoscaleConfig`. This runs several side by side on the same trace (the sharp
day peaking at three units' measured capacity, seed 0, adaptive policy in every unit, A100
Llama-70B TP8 cost model) so the choice of defaults can be checked or redone. Each setting is a
JSON object of `AutoscaleConfig` fields; a run takes about five minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.study import day_trace
from tidal_core import AutoscaleConfig

DEFAULT_SETTINGS = (  # the defaults, then the smoothing and target load around them
    "{}",
    '{"target_load": 0.7}',
    '{"target_load": 0.75}',
    '{"target_load": 0.7, "smoothing_s": 150}',
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", action="append", help="AutoscaleConfig fields as JSON (repeatable)")
    ap.add_argument("--start-units", type=int, default=2, help="units serving at midnight")
    ap.add_argument("--peak-units", type=int, default=3)
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hours", type=float, default=24.0, help="a shorter day for a quick look")
    args = ap.parse_args()
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    trace = day_trace("day-in-life-sharp", cost, base, hours=args.hours, seed=args.seed, peak_load=1.0, cv=None,
                      units=args.peak_units)
    print("| setting | SLO attainment | rejected | TTFT p99 (ms) | TPOT p99 (ms) | GPU-hours |")
    print("|---|---|---|---|---|---|", flush=True)
    for setting in args.setting or DEFAULT_SETTINGS:
        fields = json.loads(setting)
        config = AutoscaleConfig(**{"min_units": 1, "max_units": 4 * args.peak_units, **fields})
        spec = RunSpec(trace, base, cost, Slo(), units=args.start_units, seed=args.seed, autoscale=config)
        s = run_policy(spec, "adaptive", progress=False).summary
        print(f"| `{setting}` | {s['slo_attainment']:.2%} | {s['rejected']} | {s['ttft_p99_ms']:.0f} | "
              f"{s['tpot_p99_ms']:.0f} | {s['gpu_hours']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
