"""The fewest GPU-hours any autoscaler of whole units could spend on a simulated day at >= 99%.

    .venv/bin/python benchmarks/fleet_bound.py [--day day-in-life-sharp] [--peak-units 3]
        [--cost-model a100-llama70b-tp8] [--max-units 6] [--minutes 20] [--attainment 0.99]

The fleet study (docs/day-in-the-life.md §4) compares the autoscaled fleet's GPU-hours with the
peak-provisioned fleet's. How low that ratio can go depends on the day's shape and on the size
of a unit, not only on the autoscaler: a fleet of whole 8-GPU units pays for whole units even
when it tracks demand perfectly. This script estimates that floor on the simulator:

1. **Attainment of a fleet of n units at a constant rate** (n = 1..`--max-units`, per-unit rates
   on a grid): n fixed units, adaptive policy, the fleet's routing, `--minutes` of constant-rate
   traffic with the day's burstiness (CV) and length distribution (`loadgen.sim.study.constant_trace`),
   the share of requests that met the SLO. Made non-increasing in the rate (noise aside, more
   traffic per unit never helps). Fleets larger than `--max-units` are taken at the largest's curve.
2. **The clairvoyant whole-unit fleet**: at every `--step-s` of the day's rate curve it runs some
   whole number of units, ready the instant they are wanted and gone the instant they are not (no
   start-up, no hysteresis, no forecast error), chosen to spend the fewest GPU-hours while the
   *day's* attainment (requests weighted, as the study counts it) reaches `--attainment`: the
   Lagrangian choice per moment (fewest units less a price times the requests met), the price
   bisected until the day's attainment is met. It may run a moment hot and make it up elsewhere,
   as a real fleet may. Its GPU-hours estimate a floor for any autoscaler of these units; the
   same with every moment held at `--attainment` is printed beside it.

The floor is an estimate from steady-state runs, not a proof: transients between fleet sizes
are ignored (they only cost a real fleet more) and the curves are measured on one seed. Each grid
point is one simulation (seconds on one core); the script takes about ten minutes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.arrivals import rate_for_peak_load
from loadgen.daycurve import servegen_day_curve, sharp_day_curve
from loadgen.ratecurve import RateCurve
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.study import constant_trace, unit_capacity


def day_curve(name: str, peak_rps: float) -> RateCurve:
    """The day's rate curve scaled as `loadgen.sim.study.day_trace` scales it."""
    curve = servegen_day_curve("m-large", mean_rps=1.0) if name == "day-in-life" else sharp_day_curve(peak_rps=1.0)
    return curve.scaled(rate_for_peak_load(curve, peak_rps, 1.0))


def attainment(cost: CostModel, units: int, rate_per_unit: float, minutes: float, seed: int) -> float:
    base = unit_config(cost)
    trace = constant_trace(rate_per_unit * units, minutes, seed, base.max_model_len)
    spec = RunSpec(trace, base, cost, Slo(), units=units, seed=seed)
    return float(run_policy(spec, "adaptive", progress=False).summary["slo_attainment"])


def attainment_curves(cost: CostModel, max_units: int, rates: np.ndarray, minutes: float,
                      seed: int) -> np.ndarray:
    """[n - 1, k]: the attainment of n fixed units at `rates[k]` per unit, non-increasing in k."""
    curves = np.empty((max_units, rates.size))
    for n in range(1, max_units + 1):
        for k, r in enumerate(rates):
            curves[n - 1, k] = attainment(cost, n, float(r), minutes, seed)
        curves[n - 1] = np.minimum.accumulate(curves[n - 1])
        print(f"| {n} | " + " | ".join(f"{a:.4f}" for a in curves[n - 1]) + " |", flush=True)
    return curves


def met_share(curves: np.ndarray, rates: np.ndarray, units: int, rate_per_unit: np.ndarray) -> np.ndarray:
    """The share of requests met by `units` units at these per-unit rates (interpolated; below the
    grid, its first point; above it, its last)."""
    row = curves[min(units, curves.shape[0]) - 1]
    return np.interp(rate_per_unit, rates, row)


def clairvoyant(curves: np.ndarray, rates: np.ndarray, day: np.ndarray, target: float, most: int,
                every_moment: bool = False) -> tuple[np.ndarray, float]:
    """Units at each moment of `day` (rates) and the day's attainment. `every_moment`: the fewest
    units holding `target` at each moment; else the fewest GPU-hours for `target` over the day."""
    sizes = np.arange(1, most + 1)
    met = np.stack([day * met_share(curves, rates, int(n), day / n) for n in sizes])  # [n, t] requests met
    if every_moment:
        ok = met >= target * day - 1e-12
        fleet = np.where(ok.any(axis=0), sizes[np.argmax(ok, axis=0)], most)
        return fleet, float(met[fleet - 1, np.arange(day.size)].sum() / day.sum())

    def choose(price: float) -> tuple[np.ndarray, float]:
        fleet = sizes[np.argmin(sizes[:, None] - price * met, axis=0)]
        return fleet, float(met[fleet - 1, np.arange(day.size)].sum() / day.sum())

    lo, hi = 0.0, 1.0
    while choose(hi)[1] < target and hi < 1e9:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if choose(mid)[1] < target else (lo, mid)
    return choose(hi)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--day", default="day-in-life-sharp", choices=("day-in-life-sharp", "day-in-life"))
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    ap.add_argument("--peak-units", type=float, default=3.0,
                    help="the day peaks at this many units' saturated capacity")
    ap.add_argument("--fixed-units", type=int, default=None,
                    help="the fixed fleet the ratio is against (default: the smallest the curves say meets the target)")
    ap.add_argument("--max-units", type=int, default=6, help="fleet sizes measured (larger ones use the largest's)")
    ap.add_argument("--most-units", type=int, default=12, help="the clairvoyant fleet's ceiling")
    ap.add_argument("--minutes", type=float, default=20.0, help="constant-rate traffic per grid point")
    ap.add_argument("--grid", default="0.8:2.6:0.1", help="per-unit rates, req/s: FIRST:LAST:STEP")
    ap.add_argument("--attainment", type=float, default=0.99)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=10.0, help="how often the clairvoyant fleet re-decides")
    args = ap.parse_args()

    cost = CostModel.load(args.cost_model)
    saturated = unit_capacity(cost, unit_config(cost))
    peak = args.peak_units * saturated
    first, last, step = (float(x) for x in args.grid.split(":"))
    rates = np.round(np.arange(first, last + step / 2, step), 6)
    print(f"{args.day}, {cost.name}: peak {peak:.2f} req/s ({args.peak_units:g} x a unit's saturated "
          f"{saturated:.2f} req/s); target {args.attainment:.0%} of requests within the SLO\n")
    print("Attainment of n fixed units at a constant rate per unit (req/s):\n")
    print("| units | " + " | ".join(f"{r:g}" for r in rates) + " |")
    print("|---|" + "---|" * rates.size, flush=True)
    curves = attainment_curves(cost, args.max_units, rates, args.minutes, args.seed)

    day = day_curve(args.day, peak).rate_at(np.arange(0.0, 86400.0, args.step_s))

    def fixed_attainment(n: int) -> float:
        return float(met_share(curves, rates, n, day / n).dot(day) / day.sum())

    print("\nFixed fleets on the day, estimated from the curves:\n")
    print("| fixed units | day's attainment |")
    print("|---|---|")
    sized = None
    for n in range(1, args.most_units + 1):
        met = fixed_attainment(n)
        print(f"| {n} | {met:.2%} |")
        if met >= args.attainment:
            sized = n
            break
    units = args.fixed_units or sized or args.most_units
    fixed = units * 24.0 * cost.tp
    print(f"\nGPU-hours over the day, against {units} fixed units ({fixed:.0f}; their estimated "
          f"attainment {fixed_attainment(units):.2%}):\n")
    print("| clairvoyant whole-unit fleet | day's attainment | GPU-hours | vs fixed | units: mean / most |")
    print("|---|---|---|---|---|")
    for label, every in (("fewest GPU-hours for the day's target (the floor)", False),
                         ("every moment at the target", True)):
        fleet, met = clairvoyant(curves, rates, day, args.attainment, args.most_units, every)
        hours = float(fleet.mean()) * 24.0 * cost.tp
        print(f"| {label} | {met:.2%} | {hours:.0f} | {hours / fixed:.3f} | {fleet.mean():.2f} / {fleet.max()} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
