"""Prompts too slow for the TTFT target, in overload: admission's `prompt_over_target` rule on and off.

For each cost model x trace x rate (one hour of the trace, prompts clipped to 8k as
`benchmarks/sweet_spot.py` reads it), runs `adaptive` and `sarathi` at one token budget (the same
SLO admission, so the same rule) with `admission.refuse_slow_prompts_in_overload` off and on,
side by side, and reports goodput, the share of the completed requests that missed the TTFT
target, and the rule's refusals. Whether the rule refuses the right requests is read from the run
with it off, where every request it would have refused is served: at each arrival in OVERLOAD
with nothing ahead, the verdict it would have given (the unit's bound times its learned ratio,
as the rule judges), then how many of those it would have refused missed the target when served,
against how many of those it would have admitted did. A rule that refuses what would have made
it shows as a low first share.

    python benchmarks/slow_prompts.py --out runs/slow_prompts.json
    python benchmarks/slow_prompts.py --cost-model a100-llama70b-tp4 --trace mooncake-conv --rate 1
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tidal_core.admission as admission
from benchmarks.admission_watch import watching_admission
from benchmarks.sweet_spot import SHIPPED_COST_MODELS, TRACES, _window
from loadgen.report import OK, Slo, write_json
from loadgen.sim.runner import RunSpec, run_policy
from tidal_core.regime import Regime

RULE = "admission.refuse_slow_prompts_in_overload"


def one_run(cost_name: str, trace_name: str, rate: float, hours: float, policy: str, budget: int, rule: bool,
            slo: Slo) -> dict[str, Any]:
    cost, base, trace = _window(cost_name, trace_name, rate, hours, 0.0)
    refused: list[str] = []
    verdicts: dict[int, bool] = {}  # in OVERLOAD with nothing ahead: would the rule refuse it

    def judged(controller: admission.AdmissionController, req: Any, state: admission.UnitState, verdict: Any) -> None:
        if verdict is not None:
            refused.append(verdict.reason)
        elif state.regime is Regime.OVERLOAD and state.alone_ttft_s > 0.0:
            verdicts[int(req.request_id)] = controller.too_slow_alone(state)

    overrides = {RULE: str(rule).lower(), "max_num_batched_tokens": str(budget)}
    with watching_admission(judged):
        run = run_policy(RunSpec(trace, base, cost, slo, overrides=overrides), policy, progress=False)
    o = run.run.outcomes
    ok = o.status == OK
    missed = ok & (np.nan_to_num(o.ttft_s, nan=np.inf) > slo.ttft_s)
    row = {"cost_model": cost_name, "trace": trace_name, "rate": rate, "policy": policy, "budget": budget,
           "rule": rule, "goodput_rps": run.summary.get("goodput_rps"), "completed": int(ok.sum()),
           "ttft_missed": int(missed.sum()), "ttft_missed_share": round(float(missed.sum() / max(1, ok.sum())), 4),
           "tpot_p99_ms": run.summary.get("tpot_p99_ms"), "refused": dict(Counter(refused))}
    if not rule:  # every request is served here, those the rule would refuse included
        ids = np.array(sorted(verdicts), dtype=np.int64)
        would = np.array([verdicts[i] for i in ids], dtype=bool)
        served = ok[ids] if ids.size else np.zeros(0, bool)
        late = missed[ids] if ids.size else np.zeros(0, bool)
        row["would_refuse"] = int((would & served).sum())
        row["would_refuse_missed"] = int((would & late).sum())
        row["would_admit"] = int((~would & served).sum())
        row["would_admit_missed"] = int((~would & late).sum())
    return row


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", action="append", choices=SHIPPED_COST_MODELS)
    ap.add_argument("--trace", action="append", choices=TRACES)
    ap.add_argument("--rate", action="append", type=float)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=2048, help="sarathi's token budget (adaptive's ceiling too)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    slo = Slo(1.0, 0.1)
    rows = []
    print("| GPU | trace | rate | policy | goodput off / on | ratio | completed that missed TTFT off / on | "
          "refused prompt_over_target | rule off: would refuse (missed when served) | would admit (missed) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for cm in args.cost_model or ["a100-llama70b-tp8", "h100-llama70b-tp8", "a100-llama70b-tp4",
                                  "h100-llama70b-tp4"]:
        for tr in args.trace or ["mooncake-conv", "azure-conv"]:
            for rate in args.rate or [0.3, 1.0, 3.0]:
                for policy in ("adaptive", "sarathi"):
                    off, on = (one_run(cm, tr, rate, args.hours, policy, args.budget, rule, slo)
                               for rule in (False, True))
                    rows += [off, on]
                    ratio = round(on["goodput_rps"] / off["goodput_rps"], 3) if off["goodput_rps"] else None
                    name = policy if policy == "adaptive" else f"sarathi-{args.budget}"
                    print(f"| {cm} | {tr} | {rate}x | {name} | {off['goodput_rps']} / {on['goodput_rps']} | {ratio} | "
                          f"{off['ttft_missed_share']:.1%} / {on['ttft_missed_share']:.1%} | "
                          f"{on['refused'].get('prompt_over_target', 0)} | {off['would_refuse']} "
                          f"({_share(off['would_refuse_missed'], off['would_refuse'])}) | {off['would_admit']} "
                          f"({_share(off['would_admit_missed'], off['would_admit'])}) |", flush=True)
    if args.out:
        write_json(Path(args.out), rows)
    print(f"{len(rows) // 2} pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
