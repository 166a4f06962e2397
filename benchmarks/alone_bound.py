"""The lone-prompt bound that `prompt_over_target` judges by, against what the prompts then took.

Admission's `prompt_over_target` rule (core/admission.py) refuses, in OVERLOAD, a request with
nothing ahead whose own TTFT would more likely miss the target than not: its bound
(`UnitState.alone_ttft_s`: the time it waited plus `UnitView.alone_prefill_s`) times a learned
ratio (`AloneFit`, the median of measured / bound over the long prompts admitted with nothing
ahead). This runs one simulated unit on a trace and records every arrival admission saw with
nothing ahead; per 1,000-token bin of prompt length it prints how many there were, how many
were admitted and how many `prompt_over_target` refused, the bound's median, the learned ratio
at their arrival (median), the admitted prompts' measured TTFT / bound (p10 / p50 / p90) and how
many of them got their first token within the target. A ratio that moves with the prompt's
length is a bound whose shape is wrong: one scalar cannot correct it for every length.
Pure core and the simulator, no Ray; seconds per trace hour.

    python benchmarks/alone_bound.py --trace mooncake-conv --rate 0.3
    python benchmarks/alone_bound.py --trace mooncake-conv --rate 1 --cost-model h100-llama70b-tp8
    python benchmarks/alone_bound.py --trace mooncake-conv --rate 0.3 --set step_sizing.borrow_quantile=0.05
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.admission_watch import OnCheck, watching_admission
from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, sim_config, unit_config
from loadgen.sim.simulation import simulate
from loadgen.traces import load_trace
from tidal_core.admission import AdmissionController, UnitState

Seen = tuple[int, float, float, str | None]  # prompt tokens, bound (s), learned ratio, refusal reason


def _recorder(seen: dict[str, Seen]) -> OnCheck:
    """Records each check of a request with nothing ahead, by request id (`watching_admission`)."""

    def record(controller: AdmissionController, req: Any, state: UnitState, verdict: Any) -> None:
        if not state.work_ahead and state.alone_ttft_s > 0.0:
            seen[req.request_id] = (req.num_prompt_tokens, state.alone_ttft_s, controller.alone.value,
                                    verdict.reason if verdict is not None else None)

    return record


def table(seen: dict[str, Seen], ttft_s: np.ndarray, target_s: float, bin_tokens: int) -> list[str]:
    """The per-bin rows (markdown) of what `_recording` saw, with each request's measured TTFT."""
    bins: dict[int, list[tuple[float, float, str | None, float]]] = {}
    for rid, (tokens, bound, ratio, reason) in seen.items():
        bins.setdefault(tokens // bin_tokens, []).append((bound, ratio, reason, float(ttft_s[int(rid)])))
    rows = ["| prompt tokens | nothing ahead | admitted | refused `prompt_over_target` | bound p50 (s) "
            "| learned ratio p50 | measured / bound p10 / p50 / p90 | admitted within the target |",
            "|---|---|---|---|---|---|---|---|"]
    for b in sorted(bins):
        items = bins[b]
        admitted = [(bound, ttft) for bound, _, reason, ttft in items if reason is None and np.isfinite(ttft)]
        spread = (" / ".join(f"{v:.2f}" for v in np.percentile([t / bd for bd, t in admitted], [10, 50, 90]))
                  if admitted else "-")
        rows.append(f"| {b * bin_tokens}-{(b + 1) * bin_tokens - 1} | {len(items)} | {len(admitted)} "
                    f"| {sum(1 for i in items if i[2] == 'prompt_over_target')} "
                    f"| {np.median([i[0] for i in items]):.3f} | {np.median([i[1] for i in items]):.3f} "
                    f"| {spread} | {sum(1 for _, t in admitted if t <= target_s)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="mooncake-conv")
    p.add_argument("--rate", type=float, default=0.3, help="rate scale of the trace")
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--cost-model", default="a100-llama70b-tp8")
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--ttft", type=float, default=1.0)
    p.add_argument("--tpot", type=float, default=0.1)
    p.add_argument("--bin", type=int, default=1000, help="prompt tokens per row")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a scheduler setting (repeatable)")
    args = p.parse_args(argv)
    cost = CostModel.load(args.cost_model)
    base = unit_config(cost)
    longest = base.max_model_len - 1  # as `tidal simulate` and the study cut prompts to the context
    trace = load_trace(args.trace, hours=args.hours, seed=0, rate_scale=args.rate).clipped(longest, longest)
    overrides = dict(item.split("=", 1) for item in args.set)
    spec = RunSpec(trace, base, cost, Slo(args.ttft, args.tpot), overrides=overrides)
    seen: dict[str, Seen] = {}
    with watching_admission(_recorder(seen)):
        run = simulate(trace, sim_config(spec, args.policy))
    o = run.outcomes
    print(f"{args.trace} x{args.rate:g}, {args.hours:g} h, {args.cost_model}, {args.policy}: "
          f"{len(trace)} arrived, {int(np.isfinite(o.ttft_s).sum())} got a first token, "
          f"rejected {dict(run.counters.get('rejected', {}))}")
    print("\n".join(table(seen, o.ttft_s, args.ttft, args.bin)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
