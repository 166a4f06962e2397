"""`tidal simulate` and `tidal study`: the simulator's command line.

`tidal simulate --batch-backlog N` adds N batch-class requests (`service_tier="flex"`) to the
trace at `--batch-at`, with lengths from `--batch-lengths`, due by `--batch-due`, and reports
the interactive requests' figures (the SLO table) and the backlog's (a second table) apart;
`--batch-compare` also runs each policy with the backlog sent as ordinary requests
(`batch.enabled=false`) and on the trace without the backlog (loadgen/sim/backlog.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadgen.sim.config import ROUTINGS
from tidal_core import POLICIES, AutoscaleConfig, preset


def _trace_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if args.rate_scale != 1.0:
        kw["rate_scale"] = args.rate_scale
    if args.max_input:
        kw["max_input"] = args.max_input
    if args.max_output:
        kw["max_output"] = args.max_output
    if args.peak_rps is not None:
        kw["peak_rps"] = args.peak_rps
    if args.cv is not None:
        kw["cv"] = args.cv
    return kw


def _backlog_times(args: argparse.Namespace) -> tuple[float, float | None]:
    """(`--batch-at`, `--batch-due`) in seconds from the trace's start; ValueError names the fix."""
    from loadgen.sim.backlog import clock_s

    at_s = clock_s(args.batch_at)
    due_s = clock_s(args.batch_due) if args.batch_due else None
    if due_s is not None and due_s <= at_s:
        raise ValueError(f"--batch-due {args.batch_due} must be after --batch-at {args.batch_at}")
    if args.batch_backlog < 0:
        raise ValueError(f"--batch-backlog {args.batch_backlog} must be >= 0")
    return at_s, due_s


def _runs(spec: Any, policies: list[str], compare: bool, day: Any, progress: bool) -> list[Any]:
    """Each policy on `spec`; with a backlog and `compare`, also without the batch class
    (`<policy>-no-batch-class`) and on the trace without the backlog (`<policy>-day`)."""
    from dataclasses import replace

    from loadgen.sim.runner import run_policy

    runs = []
    for p in policies:
        runs.append(run_policy(spec, p, progress=progress))
        if compare and spec.batch_ids:
            off = replace(spec, overrides={**spec.overrides, "batch.enabled": "false"})
            alone = replace(spec, trace=day, batch_ids=frozenset())
            for label, variant in ((f"{p}-no-batch-class", off), (f"{p}-day", alone)):
                run = run_policy(variant, p, progress=progress)
                run.policy = label
                runs.append(run)
    return runs


def run_simulate(args: argparse.Namespace) -> int:
    from tidal_core.overrides import apply_overrides, parse_pairs

    try:  # checked before any trace is loaded, so a typo fails at once
        overrides = parse_pairs([*(args.set or []), *(["enable_prefix_caching=true"] if args.prefix_caching else [])])
        for name in args.policy:
            apply_overrides(preset(name), overrides)
        at_s, due_s = _backlog_times(args)
    except ValueError as e:
        print(f"tidal simulate: {e}", file=sys.stderr)
        return 2
    from calibration.cost_model import CostModel
    from loadgen.report import Slo
    from loadgen.sim.backlog import batch_markdown, with_backlog
    from loadgen.sim.runner import RunSpec, summary_markdown, unit_config, write_run
    from loadgen.sim.study import day_trace
    from loadgen.traces import load_trace

    cost = CostModel.load(args.cost_model)
    base = unit_config(cost, max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len)
    if args.trace.startswith("day-in-life") and args.peak_rps is None:
        trace = day_trace(args.trace, cost, base, hours=args.hours or 24.0, seed=args.seed,
                          peak_load=args.peak_load, cv=args.cv, units=args.units)
    else:
        trace = load_trace(args.trace, hours=args.hours, seed=args.seed, **_trace_kwargs(args))
    day = trace = trace.clipped(args.max_model_len - 1, args.max_model_len - 1)
    batch_ids: frozenset[int] = frozenset()
    if args.batch_backlog:
        trace, batch_ids = with_backlog(day, args.batch_backlog, seed=args.seed, max_len=args.max_model_len,
                                        at_s=at_s, source=args.batch_lengths)
    autoscale = AutoscaleConfig(min_units=args.min_units, max_units=args.max_units) if args.autoscale else None
    spec = RunSpec(trace, base, cost, Slo(args.slo_ttft, args.slo_tpot), units=args.units, autoscale=autoscale,
                   provisioning_s=args.provisioning_s, seed=args.seed, overrides=overrides, routing=args.routing,
                   batch_ids=batch_ids, batch_due_s=due_s)
    runs = _runs(spec, args.policy, args.batch_compare, day, not args.quiet)
    out = Path(args.out)
    write_run(out, f"{trace.name} on {cost.name}", runs, spec.slo, requests_jsonl=not args.no_requests)
    print(summary_markdown(runs))
    if batch_ids:
        table = batch_markdown({r.policy: r.summary for r in runs if "batch_arrived" in r.summary})
        (out / "batch.md").write_text(table)
        print(f"\nbatch backlog ({len(batch_ids)} requests at {args.batch_at}, due {args.batch_due or 'trace end'}; "
              "the table above counts interactive requests only)\n\n" + table)
    print(json.dumps({r.policy: round(r.wall_s, 1) for r in runs}), "(wall seconds per policy)", file=sys.stderr)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", default="a100-llama70b-tp8", help="name under calibration/costmodels or a YAML path")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT target, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _batch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch backlog", "deferrable work sent as the batch class (service_tier=flex); the SLO "
                             "table then counts interactive requests only, the backlog gets its own table")
    g.add_argument("--batch-backlog", type=int, default=0, metavar="N", help="batch requests to add (default 0: none)")
    g.add_argument("--batch-lengths", default="azure-code", metavar="SOURCE",
                   help="their (prompt, output) lengths, resampled from a trace: azure-code (default), azure-conv, "
                        "mooncake-conv, or a trace file")
    g.add_argument("--batch-at", default="00:00", metavar="HH:MM", help="when they are all submitted (default 00:00, "
                                                                          "the trace's start)")
    g.add_argument("--batch-due", default=None, metavar="HH:MM",
                   help="due time: the backlog table counts those done by then (default: the trace's end)")
    g.add_argument("--batch-compare", action="store_true",
                   help="also run each policy with the backlog as ordinary requests (batch.enabled=false) and on "
                        "the trace without it")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("simulate", help="replay a trace through the real scheduler on a simulated GPU")
    p.add_argument("--trace", required=True,
                   help="day-in-life | day-in-life-sharp | azure-code | azure-conv | mooncake-conv | PATH")
    p.add_argument("--policy", action="append", choices=POLICIES, required=True, help="repeat to compare")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any scheduler field after the preset, dotted for nested ones "
                        "(e.g. --set max_num_batched_tokens=512 --set admission.target_ttft_s=2); repeatable")
    _common(p)
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--units", type=int, default=1, help="fixed number of serving units")
    scale.add_argument("--autoscale", action="store_true", help="let the core autoscaler size the fleet")
    p.add_argument("--min-units", type=int, default=1)
    p.add_argument("--max-units", type=int, default=8)
    p.add_argument("--provisioning-s", type=float, default=300.0, help="time before a new unit serves")
    p.add_argument("--prefix-caching", action="store_true",
                   help="turn the prefix cache on (traces with prefix ids, e.g. mooncake-conv, get hits); the summary "
                        "then shows its hit rate beside an unbounded cache's")
    p.add_argument("--routing", choices=ROUTINGS, default="load",
                   help="fleet routing: least predicted TTFT of two, admission-aware (load), cache-aware "
                        "(prefix), or the previous prompt-blind rule (load-blind)")
    p.add_argument("--hours", type=float, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--peak-load", type=float, default=1.3,
                   help="synthetic days: peak rate as a multiple of the fleet's measured capacity")
    p.add_argument("--peak-rps", type=float, default=None, help="synthetic days: absolute peak rate instead")
    p.add_argument("--cv", type=float, default=None, help="synthetic days: inter-arrival CV (burstiness)")
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--no-requests", action="store_true", help="skip the per-request JSONL files")
    _batch_options(p)
    p.add_argument("--out", required=True)
    p.set_defaults(func=run_simulate)

    s = sub.add_parser("study", help="the day-in-the-life study: policies, QPS sweep, autoscaled fleet")
    _common(s)
    s.add_argument("--hours", type=float, default=24.0)
    s.add_argument("--part", action="append", choices=("day", "sweep", "fleet"), help="default: all")
    s.add_argument("--out", required=True)

    def _run_study(args: argparse.Namespace) -> int:
        from loadgen.sim.study import run_study

        return run_study(args)

    s.set_defaults(func=_run_study)
