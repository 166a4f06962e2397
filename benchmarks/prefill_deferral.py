"""Deferred prefill (issue 12): what a small chunk costs, and what deferring does, on the simulator.

Three parts, cost-model figures, no GPU:
- `costs`: the cost models' step time per prompt token beside eight decodes, by chunk size (the
  fixed cost of a step that holds prefill, spread over its tokens);
- `cells`: adaptive with `step_sizing.defer` on and off on one 15-minute window each: goodput,
  TPOT p99, the requests over the TPOT target (their output lengths), the share of steps deferred,
  and the linear step model the unit learned (what `StepSizer.defer` decides with);
- `fleet`: the one-unit autoscaling check of tests/loadgen/test_simulator.py (rate signal only,
  and with the step-time signal; the aim held fixed) with deferring on and off.

    python benchmarks/prefill_deferral.py [--part costs|cells|fleet ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.report import Slo, summarize
from loadgen.sim.runner import RunSpec, run_policy, sim_config, unit_config
from loadgen.sim.simulation import Simulation
from loadgen.traces import load_trace
from tidal_core import AutoscaleConfig

GPUS = ("a100-llama70b-tp8", "h100-llama70b-tp8")
CELLS = (("a100-llama70b-tp8", "azure-conv", 1.0, 0.0), ("h100-llama70b-tp8", "azure-conv", 1.0, 0.0),
         ("h100-llama70b-tp8", "mooncake-conv", 3.0, 15.0))


def part_costs() -> None:
    print("| GPU | chunk (tokens) | step beside 8 decodes (ms) | ms per prompt token over the decode-only step |\n"
          "|---|---|---|---|")
    for gpu in GPUS:
        cm = CostModel.load(gpu)
        decode = cm.step_time_s([], 8, 8 * 4000, None)
        print(f"| {gpu.split('-')[0]} | 0 | {decode * 1e3:.1f} | - |")
        for n in (128, 256, 512, 1024, 2048):
            t = cm.step_time_s([(n, 0)], 8, 8 * 4000, None)
            print(f"| {gpu.split('-')[0]} | {n} | {t * 1e3:.1f} | {(t - decode) / n * 1e3:.4f} |")


def part_cells() -> None:
    print("| GPU | trace | rate | offset (min) | defer | goodput | TPOT p99 (ms) | over the TPOT target "
          "(their output tokens) | steps deferred / all "
          "| learned: overhead, prefill step, per token, per decode (ms) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for gpu, trace_name, rate, off in CELLS:
        cost = CostModel.load(gpu)
        base = unit_config(cost, max_batch_size=128, max_num_batched_tokens=2048, max_model_len=8192)
        trace = load_trace(trace_name, hours=0.25 + off / 60, seed=0, rate_scale=rate).clipped(8191, 8191)
        if off:
            trace = trace.window(off * 60, off * 60 + 900)
        for defer in ("true", "false"):
            spec = RunSpec(trace, base, cost, Slo(), overrides={"step_sizing.defer": defer})
            sim = Simulation(trace, sim_config(spec, "adaptive"))
            run = sim.run()
            o, summary = run.outcomes, summarize(run.outcomes, spec.slo)
            served = np.isfinite(o.ttft_s) & (o.output_tokens > 1)
            over = served & (np.nan_to_num(o.tpot_s, nan=0.0) > spec.slo.tpot_s)
            steps = run.counters["steps"]
            svc = sim.fleet.all_units()[0].sched.load.service
            print(f"| {gpu.split('-')[0]} | {trace_name} | {rate}x | {off:g} | {defer} | {summary['goodput_rps']} | "
                  f"{summary['tpot_p99_ms']} | {int(over.sum())} of {int(served.sum())} "
                  f"({sorted(o.output_tokens[over].tolist())}) | {steps['prefill_deferred']} / {steps['total']} | "
                  f"{svc.overhead_s * 1e3:.1f}, {svc.prefill_step_s * 1e3:.1f}, {svc.prefill_s_per_token * 1e3:.4f}, "
                  f"{svc.decode_s_per_seq * 1e3:.3f} |", flush=True)


def part_fleet() -> None:
    from loadgen.sim.study import constant_trace

    cost = CostModel.load("a100-llama70b-tp8")
    steady = constant_trace(2.0, 12.0, seed=5, max_len=8192)
    cfg = AutoscaleConfig(min_units=1, max_units=3, target_load=1.0, smoothing_s=30.0, lead_s=0.0,
                          upscale_delay_s=60.0, downscale_delay_s=1e6, hot_tpot_fraction=0.75, cool_tpot_fraction=0.5)
    print("| defer | signals | GPU-hours | SLO attainment |\n|---|---|---|---|")
    for defer in ("true", "false"):
        for label, auto in (("arrival rate", dataclasses.replace(cfg, hot_tpot_fraction=None)),
                            ("arrival rate + step time", cfg)):
            spec = RunSpec(steady, unit_config(cost), cost, Slo(), autoscale=auto, provisioning_s=60.0,
                           overrides={"step_sizing.aim_gain": "0", "step_sizing.defer": defer})
            s = run_policy(spec, "adaptive", progress=False).summary
            print(f"| {defer} | {label} | {s['gpu_hours']} | {s['slo_attainment']} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=("costs", "cells", "fleet"))
    args = ap.parse_args(argv)
    for part in args.part or ("costs", "cells", "fleet"):
        {"costs": part_costs, "cells": part_cells, "fleet": part_fleet}[part]()
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
