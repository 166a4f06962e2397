"""A burst into one simulated unit: do the requests it admits keep the TTFT target?

The simulator's version of `benchmarks/overload.py --burst N:T`: N requests evenly spaced over
T seconds into one unit of configs/sim.yaml's scheduler (adaptive, TTFT <= 1 s, TPOT <= 100 ms;
`--cost-model`), either with the Serve burst's shape (prompts of `--prompt-min`..`--prompt-max`
tokens, `--output` tokens each) or with lengths drawn from a trace (`--lengths azure-conv`).
`--warmup N:T` sends a first burst and `--gap` idle seconds before the measured one, so the
unit has finished requests behind it. `--retries 2` makes the clients retry a refusal as the
official `openai` client does (`overload.py --client openai`), at the `Retry-After` Serve's front
door sends (loadgen/sim/retries.py); without it each request is sent once (`--client httpx`).
Prints, per burst, the admitted count (with retries: served in the end, and the HTTP attempts),
the share of them whose first token came within the target (timed from the attempt that got
in, as `overload.py` times it), and their TTFT p50 / p99 / max. Run it in two trees
(PYTHONPATH) to compare them: the simulator is deterministic.

    python benchmarks/sim_burst.py --burst 2000:10
    python benchmarks/sim_burst.py --burst 400:2 --lengths azure-conv --cost-model h100-llama70b-tp8
    python benchmarks/sim_burst.py --burst 400:2 --retries 2
    python benchmarks/sim_burst.py --burst 400:2 --retries 2 --set admission.aim_tail=0.01

`--set KEY=VALUE` (repeatable) overrides a scheduler setting, as `tidal simulate --set` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.lengths import sample_length_arrays
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.retry_policy import RetryPolicy
from loadgen.sim.runner import RunSpec, sim_config, unit_config
from loadgen.sim.simulation import simulate


def _shape(spec: str) -> tuple[int, float]:
    n, seconds = spec.split(":")
    return int(n), float(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--burst", default="2000:10", metavar="N:T")
    p.add_argument("--warmup", metavar="N:T", help="a first burst, then --gap idle seconds")
    p.add_argument("--gap", type=float, default=60.0)
    p.add_argument("--cost-model", default="a100-llama70b-tp8")
    p.add_argument("--lengths", choices=("fixed", "azure-conv", "azure-code"), default="fixed")
    p.add_argument("--prompt-min", type=int, default=70)
    p.add_argument("--prompt-max", type=int, default=620)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--ttft", type=float, default=1.0)
    p.add_argument("--tpot", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--retries", type=int, default=0, help="the clients' max_retries (the openai client's 2; 0: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a scheduler setting (repeatable)")
    args = p.parse_args(argv)

    bursts = ([_shape(args.warmup)] if args.warmup else []) + [_shape(args.burst)]
    total = sum(n for n, _ in bursts)
    rng = np.random.default_rng(args.seed)
    if args.lengths == "fixed":
        inputs, outputs = rng.integers(args.prompt_min, args.prompt_max, total), np.full(total, args.output)
    else:
        inputs, outputs = sample_length_arrays(total, source=args.lengths, seed=args.seed, max_input=6000,
                                               max_output=1024)
    arrivals, start, spans = [], 0.0, []
    for n, seconds in bursts:
        arrivals.append(start + np.arange(n) * seconds / n)
        spans.append((sum(m for m, _ in bursts[:len(spans)]), n))
        start += seconds + args.gap
    trace = Trace("sim-burst", np.concatenate(arrivals), np.maximum(inputs, 8), np.maximum(outputs, 1),
                  duration_s=start)
    cost = CostModel.load(args.cost_model)
    retries = RetryPolicy(max_retries=args.retries) if args.retries > 0 else None
    overrides = dict(item.split("=", 1) for item in args.set)
    spec = RunSpec(trace, unit_config(cost), cost, Slo(args.ttft, args.tpot), overrides=overrides, retries=retries)
    run = simulate(trace, sim_config(spec, "adaptive"))
    out = run.outcomes
    for (first, n), (bn, seconds) in zip(spans, bursts, strict=True):
        ttft = out.ttft_s[first:first + n]
        ok = np.isfinite(ttft)
        row = {"burst": f"{bn} in {seconds:g} s", "cost_model": args.cost_model, "lengths": args.lengths,
               "admitted": int(ok.sum()), "within_target": round(float((ttft[ok] <= args.ttft).mean()), 3)}
        if run.retries is not None:  # admitted on any attempt: served in the end
            row["http_attempts"] = int(run.retries.attempts[first:first + n].sum())
        if ok.any():
            row.update({f"ttft_{k}_s": round(float(v), 3) for k, v in
                        (("p50", np.percentile(ttft[ok], 50)), ("p99", np.percentile(ttft[ok], 99)),
                         ("max", ttft[ok].max()))})
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
