"""How long one `CostModel.plan_time_s` (and one `SimExecutor.execute`) takes, in microseconds.

The simulator calls both once per simulated step, millions of times for a simulated day.
Plans: 64 decodes (a CUDA-graph bucket), a mixed step (64 decodes + two prefill chunks), and
a 128-decode eager step. `plan_time_s` memoises the token-proportional block per token count,
so the first call for a new count is slower (reported as "cold").

    .venv/bin/python benchmarks/cost_model_speed.py [--model a100-llama70b-tp8] [--repeat 7]
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from calibration.sim_executor import SimExecutor
from tidal_core.plan import StepPlan


def decode_plan(step: int, n: int, padded: int | None) -> StepPlan:
    sched = dict.fromkeys((f"d{i}" for i in range(n)), 1)
    return StepPlan(step, sched, {}, [], {}, [], n, 0, 1500 * n, padded)


def mixed_plan(step: int) -> StepPlan:
    sched = dict.fromkeys((f"d{i}" for i in range(64)), 1)
    sched.update({"p0": 1500, "p1": 484})
    return StepPlan(step, sched, {"p0": 2000, "p1": 0}, [], {}, [], 64, 1984, 64 * 1500, None)


def per_call_us(fn: object, arg: StepPlan, number: int, repeat: int) -> float:
    best = min(timeit.repeat(lambda: fn(arg), number=number, repeat=repeat))  # type: ignore[operator]
    return best / number * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="a100-llama70b-tp8")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=200_000)
    args = ap.parse_args()
    cost = CostModel.load(args.model)
    plans = {"64 decodes (bucket 64)": decode_plan(1, 64, 64), "mixed: 64 decodes + 2 chunks": mixed_plan(2),
             "128 decodes (eager)": decode_plan(3, 128, None)}
    print(f"# {cost.name}; Python {platform.python_version()} on {platform.machine()}, "
          f"best of {args.repeat} x {args.number} calls")
    per_call_us(cost.plan_time_s, plans["mixed: 64 decodes + 2 chunks"], args.number, 1)  # warm up the CPU
    for label, plan in plans.items():
        warm = per_call_us(cost.plan_time_s, plan, args.number, args.repeat)
        print(f"plan_time_s    {label:30s} {warm:6.2f} us/call")
    fresh = CostModel.load(args.model)
    cold = min(timeit.repeat(lambda: (fresh._g_cache.clear(), fresh.plan_time_s(plans["mixed: 64 decodes + 2 chunks"])),
                             number=args.number // 10, repeat=args.repeat)) / (args.number // 10) * 1e6
    print(f"plan_time_s    {'mixed, cold (cache cleared)':30s} {cold:6.2f} us/call")
    ex = SimExecutor(cost)
    for label, plan in plans.items():
        if plan.prefill_context:
            continue  # execute() would need the chunks' requests announced first
        us = per_call_us(ex.execute, plan, args.number // 10, args.repeat)
        print(f"execute        {label:30s} {us:6.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
