"""`tidal study`: the seed's day-in-the-life comparison, reproduced on the calibrated simulator.

Three parts, each written under `--out`:
- `day/`: the five policies on a 24 h tidal day for one 8xA100 Llama-70B unit, with the peak
  at 1.3x the unit's measured capacity so LIGHT, STEADY and OVERLOAD all occur;
- `sweep/`: constant-rate traffic from 10% to 200% of capacity, per policy: latency-throughput
  and goodput curves;
- `fleet/`: an autoscaled fleet (adaptive policy + core autoscaler, units take
  `provisioning_s` to come up) against a fixed fleet provisioned for the peak: GPU-hours and
  SLO attainment.
`study.md` collects the tables; docs/day-in-the-life.md interprets them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from calibration.cost_model import CostModel
from loadgen import plots
from loadgen.arrivals import gamma_arrival_times, rate_for_peak_load, servegen_day_curve, sharp_day_curve
from loadgen.lengths import sample_length_arrays
from loadgen.records import Trace
from loadgen.report import Slo, markdown_table, write_json
from loadgen.sim.runner import (
    RunSpec,
    measure_capacity,
    run_policy,
    summary_markdown,
    unit_config,
    write_run,
)
from loadgen.traces import DEFAULT_DAY_CV
from tidal_core import POLICIES, AutoscaleConfig, SchedulerConfig

SWEEP_LOADS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)


def length_trace(n: int, seed: int, max_len: int) -> Trace:
    inp, out = sample_length_arrays(n, source="azure-conv", seed=seed, max_input=max_len - 1, max_output=max_len - 1)
    return Trace("azure-conv-lengths", np.zeros(n), inp, out, duration_s=0.0, source="azure-conv lengths")


_CAPACITY_CACHE: dict[tuple[str, SchedulerConfig], float] = {}


def unit_capacity(cost: CostModel, base: SchedulerConfig) -> float:
    key = (cost.name, base)
    if key not in _CAPACITY_CACHE:
        _CAPACITY_CACHE[key] = measure_capacity(cost, base, length_trace(3000, 12345, base.max_model_len))
    return _CAPACITY_CACHE[key]


def day_trace(name: str, cost: CostModel, base: SchedulerConfig, *, hours: float, seed: int, peak_load: float,
              cv: float | None, units: int = 1) -> Trace:
    """A synthetic day whose peak is `peak_load` x the measured capacity of `units` units."""
    capacity = unit_capacity(cost, base) * units
    if name == "day-in-life":
        curve = servegen_day_curve("m-large", mean_rps=1.0)
    else:
        curve = sharp_day_curve(peak_rps=1.0)
    curve = curve.scaled(rate_for_peak_load(curve, capacity, peak_load))
    span = hours * 3600.0
    arrival = gamma_arrival_times(curve, cv=DEFAULT_DAY_CV if cv is None else cv, seed=seed, end_s=span)
    inp, out = sample_length_arrays(arrival.size, source="azure-conv", seed=seed, max_input=base.max_model_len - 1,
                                    max_output=base.max_model_len - 1)
    return Trace(f"{name} (peak {peak_load:g}x capacity of {units} unit{'s' * (units > 1)})", arrival, inp, out,
                 duration_s=span, source=f"{curve!r}; azure-conv lengths; seed {seed}")


def constant_trace(rate: float, minutes: float, seed: int, max_len: int) -> Trace:
    from loadgen.ratecurve import RateCurve

    span = minutes * 60.0
    arrival = gamma_arrival_times(RateCurve.constant(rate, span), cv=DEFAULT_DAY_CV, seed=seed, end_s=span)
    inp, out = sample_length_arrays(arrival.size, source="azure-conv", seed=seed, max_input=max_len - 1,
                                    max_output=max_len - 1)
    return Trace(f"constant {rate:.3g} rps", arrival, inp, out, duration_s=span, source="sweep")


def run_day(out: Path, cost: CostModel, base: SchedulerConfig, slo: Slo, hours: float, seed: int,
            progress: bool = True) -> str:
    sections = []
    for name in ("day-in-life-sharp", "day-in-life"):
        trace = day_trace(name, cost, base, hours=hours, seed=seed, peak_load=1.3, cv=None)
        spec = RunSpec(trace, base, cost, slo, seed=seed)
        runs = [run_policy(spec, p, progress=progress) for p in POLICIES]
        write_run(out / "day" / name, f"{name} on {cost.name}", runs, slo, requests_jsonl=False)
        wall = ", ".join(f"{r.policy} {r.wall_s:.0f}s" for r in runs)
        sections.append(f"### {trace.name}: {len(trace)} requests\n\n{summary_markdown(runs)}\n"
                        f"Simulation wall time: {wall}\n\n"
                        f"{(out / 'day' / name / 'per_hour.md').read_text()}")
    return "\n".join(sections)


def run_sweep(out: Path, cost: CostModel, base: SchedulerConfig, slo: Slo, seed: int, minutes: float = 20.0,
              progress: bool = True) -> str:
    capacity = unit_capacity(cost, base)
    curves: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    # One bar over the runs (a fast unit's sweep replays tens of thousands of requests a run).
    with tqdm(total=len(SWEEP_LOADS) * len(POLICIES), desc="constant-rate sweep", unit="run",
              disable=not progress) as bar:
        for load in SWEEP_LOADS:
            trace = constant_trace(load * capacity, minutes, seed, base.max_model_len)
            spec = RunSpec(trace, base, cost, slo, seed=seed)
            for policy in POLICIES:
                bar.set_postfix_str(f"{load:g}x {policy}")
                r = run_policy(spec, policy, progress=progress)
                curves[policy].append({"load": load, "offered_rps": round(load * capacity, 4), **r.summary})
                bar.update()
    write_json(out / "sweep" / "curves.json", curves)
    plots.plot_latency_throughput(out / "sweep" / "latency_throughput.png", curves,
                                  f"constant-rate sweep on {cost.name}", slo_ms=slo.ttft_s * 1000)
    rows = [{"load": pt["load"], **{p: curves[p][i]["goodput_rps"] for p in POLICIES}}
            for i, pt in enumerate(curves["adaptive"])]
    ttft = [{"load": pt["load"], **{p: curves[p][i]["ttft_p99_ms"] for p in POLICIES}}
            for i, pt in enumerate(curves["adaptive"])]
    return (f"Unit capacity (measured): {capacity:.3f} req/s\n\nGoodput (req/s within SLO) by offered load "
            f"(x capacity):\n\n{markdown_table(rows, ['load', *POLICIES])}\nTTFT p99 (ms):\n\n"
            f"{markdown_table(ttft, ['load', *POLICIES])}")


def run_fleet(out: Path, cost: CostModel, base: SchedulerConfig, slo: Slo, hours: float, seed: int,
              peak_units: int = 3, autoscale: AutoscaleConfig | None = None, attainment_goal: float = 0.99,
              progress: bool = True) -> str:
    """Autoscaled fleet vs the smallest fixed fleet that meets the SLO goal, on the same day.

    The day peaks at `peak_units` x one unit's measured capacity. Fixed fleets are tried from
    `peak_units` up until one reaches `attainment_goal`: that is "provisioning for the peak"
    (the units capacity alone suggests are not enough: within the SLO a unit serves less than
    its saturated completion rate). Every fixed fleet tried is a row.
    """
    config = autoscale or AutoscaleConfig(min_units=1, max_units=4 * peak_units)
    trace = day_trace("day-in-life-sharp", cost, base, hours=hours, seed=seed, peak_load=1.0, cv=None,
                      units=peak_units)
    rows = []
    for units in range(peak_units, config.max_units + 1):
        label = f"fixed {units} units"
        r = run_policy(RunSpec(trace, base, cost, slo, units=units, seed=seed), "adaptive", progress=progress)
        write_run(out / "fleet" / f"fixed-{units}", f"{label}: {trace.name}", [r], slo, requests_jsonl=False)
        rows.append({"fleet": label, **r.summary})
        if r.summary["slo_attainment"] >= attainment_goal:
            break
    # The day wraps around: at midnight a fleet that has been running carries what the evening
    # needed, not its minimum. Start with the units the first ten minutes' rate asks for.
    first_rate = float(np.count_nonzero(trace.arrival_s < 600.0)) / 600.0
    start_units = max(config.min_units,
                      min(config.max_units, math.ceil(first_rate / (config.target_load * unit_capacity(cost, base)))))
    label = (f"autoscaled ({config.min_units}..{config.max_units} units, {start_units} at midnight, "
             f"target load {config.target_load})")
    r = run_policy(RunSpec(trace, base, cost, slo, units=start_units, seed=seed, autoscale=config), "adaptive",
                   progress=progress)
    write_run(out / "fleet" / "autoscaled", f"{label}: {trace.name}", [r], slo, requests_jsonl=False)
    rows.append({"fleet": label, **r.summary})
    fixed_gpu_hours = rows[-2]["gpu_hours"]
    for row in rows:
        row["gpu_hours_vs_fixed"] = round(row["gpu_hours"] / fixed_gpu_hours, 3)
    return markdown_table(rows, ["fleet", "arrived", "completed", "rejected", "ttft_p99_ms", "tpot_p99_ms",
                                 "goodput_rps", "slo_attainment", "gpu_hours", "gpu_hours_vs_fixed"])


def run_study(args: argparse.Namespace) -> int:
    out = Path(args.out)
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost, max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    parts = args.part or ["day", "sweep", "fleet"]
    progress = not getattr(args, "quiet", False)
    md = [f"# Study on {cost.name}\n\nSLO: TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s * 1000:.0f} ms. "
          f"Unit: max_batch_size {base.max_batch_size}, budget {base.max_num_batched_tokens} tokens, "
          f"{base.num_kv_blocks} KV blocks of {base.block_size}.\n"]
    if "day" in parts:
        md.append("## Day in the life (one unit)\n\n" + run_day(out, cost, base, slo, args.hours, args.seed, progress))
    if "sweep" in parts:
        md.append("## Constant-rate sweep (one unit)\n\n"
                  + run_sweep(out, cost, base, slo, args.seed, progress=progress))
    if "fleet" in parts:
        md.append("## Autoscaled fleet\n\n" + run_fleet(out, cost, base, slo, args.hours, args.seed,
                                                                 progress=progress))
    (out / "study.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text("\n\n".join(md) + "\n")
    print((out / "study.md").read_text())
    return 0
