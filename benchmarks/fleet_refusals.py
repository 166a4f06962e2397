"""Where an autoscaled fleet loses SLO attainment: refusals and late requests by hour.

    .venv/bin/python benchmarks/fleet_refusals.py [--setting JSON] [--day D] [--from-hour H --hours N]
        [--routing load|load-blind|prefix]

One `benchmarks/fleet_settings.py` run (same trace, start and bounds, so the same figures),
instrumented: for each hour the arrivals, the refusals, the admitted requests late on TTFT or
TPOT, the mean serving units and arrival demand; for each refusal the prompt's length and
whether another serving unit had a predicted queueing delay under 0.3 s at that instant, and
whether one would have admitted it by the router's bound (its published predicted TTFT for
this prompt within its limit: the refusal was the routing's choice, not the fleet's size; a
short queue is not enough when the prompt's own prefill at a loaded unit takes the target).
`--routing load-blind` is the previous prompt-blind router, whose refusals this diagnosed (89%
with an idle unit at hand); the default, the fleet's "load" routing, sends a prompt that both
sampled units would refuse to the best unit over all (core/routing.py), which replaced the
scratch "second chance" retry this script once carried.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.report import OK, REJECTED, Slo
from loadgen.sim import simulation as simmod
from loadgen.sim.config import ROUTINGS
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.study import day_trace, unit_capacity
from tidal_core import AutoscaleConfig
from tidal_core.front_admission import published_load
from tidal_core.routing import would_refuse

LOG: list[tuple[float, int, int, int]] = []
"""Per refusal: time, prompt tokens, serving units with queue delay < 0.3 s, serving units the
router's bound (`would_refuse` on their published loads) says would admit it."""


def instrument() -> None:
    plain = simmod.Simulation.on_arrival

    def on_arrival(self: Any, i: int, now: float) -> None:
        plain(self, i, now)
        if self.rec.status[i] != REJECTED:
            return
        serving = self.fleet._refresh_serving(now)
        idle = sum(1 for u in serving if u.sched.snapshot(now).queue_delay_s < 0.3)
        n = int(self.inputs[i])
        admits = sum(1 for u in serving if not would_refuse(published_load(u.sched, now), n))
        LOG.append((now, n, idle, admits))

    simmod.Simulation.on_arrival = on_arrival  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="{}", help="AutoscaleConfig fields as JSON")
    ap.add_argument("--day", default="day-in-life-sharp", choices=("day-in-life-sharp", "day-in-life"))
    ap.add_argument("--from-hour", type=float, default=0.0)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--routing", default="load", choices=ROUTINGS)
    a = ap.parse_args()
    instrument()
    cost = CostModel.load("a100-llama70b-tp8")
    base = unit_config(cost)
    trace = day_trace(a.day, cost, base, hours=24.0, seed=0, peak_load=1.0, cv=None, units=3)
    if a.from_hour or a.hours != 24.0:
        trace = trace.window(a.from_hour * 3600.0, (a.from_hour + a.hours) * 3600.0)
    first_rate = float(np.count_nonzero(trace.arrival_s < 600.0)) / 600.0
    config = AutoscaleConfig(**{"min_units": 1, "max_units": 12, **json.loads(a.setting)})
    start = max(config.min_units, min(config.max_units, math.ceil(
        first_rate / (config.target_load * unit_capacity(cost, base)))))
    r = run_policy(RunSpec(trace, base, cost, Slo(), units=start, seed=0, autoscale=config,
                         routing=a.routing), "adaptive", progress=False)
    s, out, slo = r.summary, r.run.outcomes, Slo()
    print(f"`{a.setting}` {a.routing} routing, {trace.name}, start {start}: attainment "
          f"{s['slo_attainment']:.2%}, refused {s['rejected']}, GPU-hours {s['gpu_hours']:.0f}, "
          f"TPOT p99 {s['tpot_p99_ms']:.0f} ms")
    ok = out.status == OK
    hours = max(1, math.ceil(trace.duration_s / 3600.0 - 1e-9))
    hour = np.minimum((out.arrival_s // 3600).astype(int), hours - 1)
    log = np.array(LOG, dtype=float).reshape(-1, 4)
    print("\n| hour | arrived | refused | late TTFT | late TPOT | attainment | units | demand | refused, a unit idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for h in range(hours):
        m = hour == h
        ts = [x for x in r.run.samples.timeline if h * 3600 <= x["t"] < (h + 1) * 3600]
        lm = log[:, 0] // 3600 == h
        late_ttft, late_tpot = ok & m & (out.ttft_s > slo.ttft_s), ok & m & (out.tpot_s > slo.tpot_s)
        print(f"| {h} | {int(m.sum())} | {int((out.status[m] == REJECTED).sum())} | "
              f"{int(late_ttft.sum())} | {int(late_tpot.sum())} | "
              f"{r.hours[h]['slo_attainment']:.2%} | {np.mean([x['serving'] for x in ts]) if ts else 0:.2f} | "
              f"{np.mean([x['demand_units'] for x in ts]) if ts else 0:.2f} | {int((log[lm, 2] > 0).sum())} |")
    if len(log):
        print(f"\nrefused prompts' tokens p10/p50/p90 {np.percentile(log[:, 1], [10, 50, 90]).round()}, all prompts' "
              f"p50/p90/p99 {np.percentile(trace.input_tokens, [50, 90, 99]).round()}; refused while another unit "
              f"had < 0.3 s of queue: {int((log[:, 2] > 0).sum())} of {len(log)}; while another unit would "
              f"admit it by the router's bound: {int((log[:, 3] > 0).sum())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
