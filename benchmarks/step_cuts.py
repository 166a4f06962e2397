"""Why the step sizer cut the steps it cut: one matrix cell's adaptive run, with the sizer's state
at every step whose prompt tokens it held back.

For each such step: the decodes beside it, the allowance against what the token budget left, the
regime, the aim, the measured repayment per decode step, the smallest bank among the decodes and
whether the prefill was deferred; then a summary and the head of the borrow table the sizer read
(`m(k) - 1`: the further tokens a decode that has produced k is credited with, at the borrow
quantile of recent output lengths). The window is sweet_spot.py's (same trace, rate, offset).

    python benchmarks/step_cuts.py --trace mooncake-conv --rate 1 --offset-min 30 [--set KEY=VALUE] [--show 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sweet_spot import COST_MODELS, TRACES, policy_run
from loadgen.report import Slo
from tidal_core.step_limits import StepLimits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", choices=TRACES, default="mooncake-conv")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--cost-model", choices=COST_MODELS, default=COST_MODELS[0])
    ap.add_argument("--hours", type=float, default=0.25)
    ap.add_argument("--offset-min", type=float, default=0.0)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE overrides for the adaptive run")
    ap.add_argument("--show", type=int, default=20, help="cut steps to print one by one")
    args = ap.parse_args()

    cuts: list[dict[str, Any]] = []
    tables: list[tuple[int, ...]] = []
    inner = StepLimits.prefill_allowance

    def watched(self: StepLimits, now: float, num_decodes: int, wanted: float = float("inf")) -> float:
        allowance = inner(self, now, num_decodes, wanted)
        sizer = self.sizer
        if allowance < wanted and sizer is not None:
            cuts.append({"decodes": num_decodes, "allowance": int(allowance), "wanted": int(wanted),
                         "regime": self.regime.regime.name, "deferred": self.deferred,
                         "aim_ms": round(sizer.aim_s * 1e3, 1), "repay_ms": round(sizer.repay_s * 1e3, 1),
                         "min_bank_ms": round(sizer.min_bank_s() * 1e3, 1)})
            tables.append(sizer.borrow)
        return allowance

    StepLimits.prefill_allowance = watched  # type: ignore[method-assign]
    try:
        run = policy_run(args.cost_model, args.trace, args.rate, args.hours, Slo(1.0, 0.1), "adaptive",
                         dict(p.split("=", 1) for p in args.set), args.offset_min)
    finally:
        StepLimits.prefill_allowance = inner  # type: ignore[method-assign]
    print(f"goodput {run['goodput_rps']} req/s, completed {run['completed']}, refused {run['rejected']}, "
          f"TTFT missed {run['ttft_missed']}, TPOT missed {run['tpot_missed']}, steps {run['steps']}")
    for c in cuts[:args.show]:
        print("  " + ", ".join(f"{k} {v}" for k, v in c.items()))
    cut = [c for c in cuts if not c["deferred"]]
    if cut:
        def span(key: str) -> str:
            values = [c[key] for c in cut]
            return f"{min(values)} .. {statistics.median(values)} .. {max(values)}"
        print(f"{len(cut)} steps allowed fewer prompt tokens than the budget left, not deferred "
              f"(min .. median .. max): decodes {span('decodes')}; allowance "
              f"{span('allowance')} of {span('wanted')}; repayment {span('repay_ms')} ms; smallest bank "
              f"{span('min_bank_ms')} ms; regimes {sorted({c['regime'] for c in cut})}")
        print(f"borrow table at the last cut, k = 0, 4, 8, ... 56: {tables[-1][:60:4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
