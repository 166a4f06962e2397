"""One cell of `tidal sweep`, one policy variant, over several seeds: is a change a change, or the seed?

A sweep cell reads one seed (the rate scaling's sample of a real trace, the synthetic days'
arrivals, the retrying clients' jitter), and near 0.98 a few requests decide a cell. This runs
one variant of a cell exactly as the sweep does (`loadgen.sim.sweep_run.variant_config`, the
cell's trace and window, the `openai` client's retries at the door's `Retry-After`) for each
`--seed`, with `--set` overrides on top (as `tidal simulate --set`), and prints per seed the
goodput, the refusals by rule and the retries. Run it with and without an override (or in two
trees, PYTHONPATH) to see whether a cell's move is the change's.

    python benchmarks/sweep_cell.py --trace mooncake-conv --rate 0.3 --gpu a100-llama70b-tp8 --seed 0 --seed 1 --seed 2
    python benchmarks/sweep_cell.py --trace mooncake-conv --rate 0.3 --gpu a100-llama70b-tp8 --seed 0 --seed 1 \\
        --seed 2 --set regime.refused_overload=1.01 --set regime.refused_exit=1.01
    python benchmarks/sweep_cell.py ... --family sarathi-seqs --set max_num_batched_tokens=2048 --set max_batch_size=32
"""

from __future__ import annotations

import argparse
import json

from calibration.cost_model import CostModel
from loadgen.report import summarize
from loadgen.retry_policy import RetryPolicy
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.sweep_matrix import SLOS, TRACES, Cell, Family, Window, capped_family, cell_trace
from loadgen.sim.sweep_run import variant_config
from tidal_core.overrides import parse_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, choices=TRACES)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--gpu", default="a100-llama70b-tp8")
    ap.add_argument("--slo", default="ttft1-tpot100", choices=sorted(SLOS))
    ap.add_argument("--family", default="adaptive",
                    help="the policy preset (adaptive, sarathi, ...; sarathi-seqs: sarathi with its batch cap)")
    ap.add_argument("--seed", type=int, action="append", help="repeatable (default 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scheduler overrides")
    ap.add_argument("--retries", type=int, default=2, help="client max_retries (0: none)")
    ap.add_argument("--minutes", type=float, default=Window.minutes)
    ap.add_argument("--day-minutes", type=float, default=Window.day_minutes)
    args = ap.parse_args()
    overrides = parse_pairs(args.set)
    family = capped_family() if args.family == capped_family().name else Family(args.family, args.family)
    cell, slo, cost = Cell(args.trace, args.rate, args.gpu), SLOS[args.slo], CostModel.load(args.gpu)
    base = unit_config(cost)
    retries = RetryPolicy(max_retries=args.retries) if args.retries > 0 else None
    for seed in args.seed or [0]:
        window = Window(args.minutes, args.day_minutes, seed)
        trace = cell_trace(cell, cost, base, window)
        cfg = variant_config(family, overrides, base, slo)
        run = run_policy(RunSpec(trace, base, cost, slo, seed=seed, scheduler=cfg, retries=retries),
                         family.preset, progress=False).run
        print(json.dumps({"cell": cell.key, "slo": args.slo, "family": family.name, "set": args.set, "seed": seed,
                          "goodput_rps": summarize(run.outcomes, slo)["goodput_rps"],
                          "rejected": dict(run.counters["rejected"]),
                          "attempts": run.retries.summary()["attempts"] if run.retries else len(trace)}))


if __name__ == "__main__":
    main()
