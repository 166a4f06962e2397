"""The sweet spot: adaptive (one shipped configuration) against `sarathi` at its best token budget.

For each cost model x trace x rate, runs `adaptive` once and `sarathi` (continuous + the same
SLO admission + a fixed token budget) at every budget of `--budgets`, then picks the best
budget with hindsight (highest goodput) and reports adaptive's goodput as a ratio of it, side
by side with TPOT p99 and TTFT p50 of both (and `eager`'s TTFT p50, the light-load reference).
A second ratio is against the best budget whose TPOT p99 meets the SLO's target: the budget a
user who tunes it for the TPOT target (as Sarathi-Serve derives it) would pick; the best budget
overall breaks that target in many cells. Windows are the first `--hours` of each trace, or the
`--hours` that start `--offset-min` minutes in (a check on traffic the matrix does not hold);
`--no-eager` skips the reference run (the slowest, at 3x). `--trace` also takes a trace file
(any format `tidal simulate --trace PATH` reads), `--slo-ttft` / `--slo-tpot` another SLO pair.

    python benchmarks/sweet_spot.py --hours 0.25 --out runs/sweet_spot.json
    python benchmarks/sweet_spot.py --hours 0.25 --offset-min 15 --no-eager
    python benchmarks/sweet_spot.py --against runs/matrix_a100_0.json --set step_sizing.defer=false

`--against FILE` (repeatable; files this script wrote with `--out`, each remembering its window)
runs only the policy, on every cell of those files, and compares it with the best budget stored
there: the fixed budgets do not depend on the policy's knobs, so a change to adaptive is checked
on the whole matrix (54 cells) in seconds instead of minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from calibration.cost_model import CostModel, shipped_names
from loadgen.report import OK, Slo
from loadgen.sim.runner import PolicyRun, RunSpec, run_policy, unit_config
from loadgen.traces import load_trace

TRACES = ("azure-code", "azure-conv", "mooncake-conv")
RATES = (0.3, 1.0, 3.0)
COST_MODELS = ("a100-llama70b-tp8", "h100-llama70b-tp8")  # the matrix's; any shipped cost model may be named
SHIPPED_COST_MODELS = tuple(shipped_names())
BUDGETS = (128, 256, 512, 1024, 2048, 4096)


def _row(run: PolicyRun, slo: Slo) -> dict[str, Any]:
    """A run's figures, with what its completed requests missed (TTFT over the target, TPOT over
    it) and its steps (all, held back by the TPOT target, prefill deferred): where a loss comes from."""
    row = {k: run.summary.get(k) for k in ("goodput_rps", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "rejected",
                                           "completed", "slo_attainment")}
    o = run.run.outcomes
    ok = o.status == OK
    row["ttft_missed"] = int((ok & (np.nan_to_num(o.ttft_s, nan=np.inf) > slo.ttft_s)).sum())
    tpot_missed = ok & (np.nan_to_num(o.tpot_s, nan=0.0) > slo.tpot_s)
    row["tpot_missed"] = int(tpot_missed.sum())
    lengths = o.output_tokens[tpot_missed]  # which answers miss TPOT: short ones, or any
    row["tpot_missed_output_tokens"] = ([int(lengths.min()), int(np.median(lengths)), int(lengths.max())]
                                        if lengths.size else None)
    row["steps"] = dict(run.run.counters.get("steps", {}))
    return row


def _window(cost_name: str, trace_name: str, rate: float, hours: float, offset_min: float) -> tuple[Any, Any, Any]:
    """The cost model, the unit every run of a cell shares, and the trace window."""
    cost = CostModel.load(cost_name)
    base = unit_config(cost, max_batch_size=128, max_num_batched_tokens=2048, max_model_len=8192)
    trace = load_trace(trace_name, hours=hours + offset_min / 60.0, seed=0, rate_scale=rate).clipped(8191, 8191)
    if offset_min:
        trace = trace.window(offset_min * 60.0, offset_min * 60.0 + hours * 3600.0)
    return cost, base, trace


def cell(cost_name: str, trace_name: str, rate: float, hours: float, budgets: tuple[int, ...], slo: Slo,
         policy: str = "adaptive", overrides: dict[str, str] | None = None, offset_min: float = 0.0,
         eager: bool = True, shared: dict[str, str] | None = None) -> dict[str, Any]:
    """One cell: the policy (with `shared`, then `overrides`), `eager`, and `sarathi` at each budget
    (with `shared`: a setting of what the policies have in common, such as admission)."""
    cost, base, trace = _window(cost_name, trace_name, rate, hours, offset_min)
    shared = shared or {}
    runs: dict[str, Any] = {}
    runs[policy] = _row(run_policy(RunSpec(trace, base, cost, slo, overrides={**shared, **(overrides or {})}),
                                   policy, progress=False), slo)
    if eager:
        runs["eager"] = _row(run_policy(RunSpec(trace, base, cost, slo), "eager", progress=False), slo)
    else:
        runs["eager"] = dict.fromkeys(("goodput_rps", "tpot_p99_ms", "ttft_p50_ms"))
    for b in budgets:
        spec = RunSpec(trace, base, cost, slo, overrides={**shared, "max_num_batched_tokens": str(b)})
        runs[f"sarathi-{b}"] = _row(run_policy(spec, "sarathi", progress=False), slo)
    fixed = [k for k in runs if k.startswith("sarathi-")]
    best = max(fixed, key=lambda k: runs[k]["goodput_rps"] or 0.0)
    within = [k for k in fixed if (runs[k]["tpot_p99_ms"] or 0.0) <= slo.tpot_s * 1e3]
    best_within = max(within, key=lambda k: runs[k]["goodput_rps"] or 0.0) if within else None
    return {"cost_model": cost_name, "trace": trace_name, "rate": rate, "hours": hours, "offset_min": offset_min,
            "best": best,
            "ratio": _ratio(runs[policy], runs[best]), "best_within_tpot": best_within,
            "ratio_within_tpot": _ratio(runs[policy], runs[best_within]) if best_within else None, "runs": runs}


def policy_run(cost_name: str, trace_name: str, rate: float, hours: float, slo: Slo, policy: str,
               overrides: dict[str, str], offset_min: float) -> dict[str, Any]:
    """One policy's figures on one cell's window (`cell`'s unit and trace), with `overrides`."""
    cost, base, trace = _window(cost_name, trace_name, rate, hours, offset_min)
    return _row(run_policy(RunSpec(trace, base, cost, slo, overrides=overrides), policy, progress=False), slo)


def _against_one(job: tuple[dict[str, Any], Slo, str, dict[str, str]]) -> dict[str, Any]:
    stored, slo, policy, overrides = job
    run = policy_run(stored["cost_model"], stored["trace"], stored["rate"], stored["hours"], slo, policy, overrides,
                     stored["offset_min"])
    return {"cost_model": stored["cost_model"], "trace": stored["trace"], "rate": stored["rate"],
            "offset_min": stored["offset_min"], "best": stored["best"],
            "ratio": _ratio(run, stored["runs"][stored["best"]]), "stored_ratio": stored["ratio"], "run": run}


def against(files: list[Path], slo: Slo, policy: str, overrides: dict[str, str], jobs: int) -> list[dict[str, Any]]:
    """The policy on every cell of `files` (this script's `--out`), each against its stored best budget."""
    stored = {f: json.loads(f.read_text()) for f in files}
    cells = [c for f in files for c in stored[f]]
    undated = [str(f) for f in files if any(not {"hours", "offset_min"} <= set(c) for c in stored[f])]
    if undated:  # a file from before cells recorded their window: its offset would be guessed, and wrong
        raise SystemExit(f"{', '.join(undated)}: cells without their window (hours, offset_min); write them again "
                         "with this script's --out")
    work = [(c, slo, policy, overrides) for c in cells]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs) as pool:
            return list(pool.map(_against_one, work))
    return [_against_one(w) for w in work]


def _print_against(rows: list[dict[str, Any]], slo: Slo) -> None:
    print("| GPU | trace | rate | offset (min) | best budget | ratio | stored ratio | TPOT p99 | steps held back | "
          "TPOT missed / completed | their output tokens min / median / max |\n" + "|---" * 11 + "|")
    for r in rows:
        run = r["run"]
        missed = run.get("tpot_missed_output_tokens")
        print(f"| {_gpu_label(r['cost_model'])} | {r['trace']} | {r['rate']}x | {r['offset_min']:g} | "
              f"{r['best'].split('-')[1]} | {r['ratio']} | {r['stored_ratio']} | {run['tpot_p99_ms']} | "
              f"{run['steps'].get('tpot_limited', 0)} | {run['tpot_missed']} / {run['completed']} | "
              f"{' / '.join(map(str, missed)) if missed else '-'} |")
    met = sum(r["ratio"] >= 0.98 for r in rows)
    over = sum((r["run"]["tpot_p99_ms"] or 0.0) > slo.tpot_s * 1e3 for r in rows)
    print(f"{met} of {len(rows)} cells >= 0.98 (stored: {sum(r['stored_ratio'] >= 0.98 for r in rows)}); worst "
          f"{min(r['ratio'] for r in rows)}; TPOT p99 over the target in {over}", file=sys.stderr)


def _gpu_label(cost_name: str) -> str:
    """The matrix's two cost models by their GPU (as the tables always named them), any other by name."""
    return cost_name.split("-")[0] if cost_name in COST_MODELS else cost_name


def _trace_arg(value: str) -> str:
    """A trace of the matrix by name, or a trace file `load_trace` reads (checked here, not mid-run)."""
    if value in TRACES or Path(value).is_file():
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {', '.join(TRACES)} nor a trace file")


def _ratio(run: dict[str, Any], best: dict[str, Any]) -> float:
    best_g = best["goodput_rps"] or 0.0
    return round((run["goodput_rps"] or 0.0) / best_g, 3) if best_g > 0 else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=0.25)
    ap.add_argument("--trace", action="append", type=_trace_arg,
                    help=f"repeatable: {', '.join(TRACES)} (the default: all three) or a trace file "
                         "(e.g. Mooncake's synthetic_trace.jsonl)")
    ap.add_argument("--rate", action="append", type=float)
    ap.add_argument("--cost-model", action="append", choices=SHIPPED_COST_MODELS,
                    help=f"repeatable; default: {', '.join(COST_MODELS)}")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE overrides for the adaptive run")
    ap.add_argument("--set-all", action="append", default=[],
                    help="KEY=VALUE overrides for every run of a cell, the fixed budgets' too (what they share, "
                         "e.g. admission)")
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--offset-min", type=float, default=0.0, help="start the windows this many minutes in")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager reference run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--against", action="append", type=Path, default=[],
                    help="run only the policy on the cells of this --out file, against its stored best budgets")
    ap.add_argument("--jobs", type=int, default=2, help="processes for --against")
    args = ap.parse_args()
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    overrides = dict(p.split("=", 1) for p in args.set)
    shared = dict(p.split("=", 1) for p in args.set_all)
    if shared and args.against:
        raise SystemExit("--set-all changes the fixed budgets' runs too, which --against reads from its file; "
                         "run the whole matrix instead")
    slo = Slo(args.slo_ttft, args.slo_tpot)
    if args.against:
        rows = against(args.against, slo, args.policy, overrides, args.jobs)
        _print_against(rows, slo)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return 0
    cells = []
    print("| GPU | trace | rate | best budget | its goodput | its TPOT p99 | adaptive goodput | TPOT p99 | "
          "TTFT p50 (best / adaptive / eager) | adaptive / best | best within the TPOT target | adaptive / it |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cm in args.cost_model or COST_MODELS:
        for tr in args.trace or TRACES:
            for rate in args.rate or RATES:
                c = cell(cm, tr, rate, args.hours, budgets, slo, args.policy, overrides, args.offset_min,
                         not args.no_eager, shared)
                cells.append(c)
                b, a, e = c["runs"][c["best"]], c["runs"][args.policy], c["runs"]["eager"]
                print(f"| {_gpu_label(cm)} | {tr} | {rate}x | {c['best'].split('-')[1]} | {b['goodput_rps']} | "
                      f"{b['tpot_p99_ms']} | {a['goodput_rps']} | {a['tpot_p99_ms']} | "
                      f"{b['ttft_p50_ms']} / {a['ttft_p50_ms']} / {e['ttft_p50_ms']} | {c['ratio']} | "
                      f"{(c['best_within_tpot'] or '-').split('-')[-1]} | {c['ratio_within_tpot']} |", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(cells, indent=1))
    worst = min(c["ratio"] for c in cells)
    within = [c["ratio_within_tpot"] for c in cells if c["ratio_within_tpot"] is not None]
    print(f"worst ratio {worst}; against the best within the TPOT target {min(within, default=None)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
