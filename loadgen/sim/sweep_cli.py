"""`tidal sweep`: adaptive against every baseline at its hindsight-best knob, over the study's matrix.

Owns: the command's arguments and its driver: cells run one after another (or over `--jobs`
processes), each written to `<out>/cells/<cell>.json` as soon as it finishes, so an interrupted
sweep resumes where it stopped (`--fresh` reruns everything); then `sweep.md`, `sweep.json`
and the plots from whatever cells exist, with the cells still missing listed. `--rerun FAMILY`
runs only that family's variants on the cells already written and puts them in place of the
stored ones, the other variants kept: after a change to the adaptive policy the baselines,
which do not run its step sizer, need not be simulated again (a day on the H200 8B unit: 29
variants, 9 minutes). `--seqs` (default 16 32 64) adds the `sarathi-seqs` family, `sarathi`'s
budgets at each of those batch caps, the second knob a vLLM user tunes (`--no-seqs`: without it).

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadgen.report import write_json
from loadgen.retry_policy import RetryPolicy
from loadgen.sim import sweep_matrix as m


def _families(args: argparse.Namespace) -> tuple[list[m.Family], list[str]]:
    families, missing = m.available()
    if args.budgets:
        families = [m.Family(f.name, f.preset, f.knob, tuple(args.budgets)) if f.knob == "max_num_batched_tokens"
                    else f for f in families]
    if args.caps:
        families = [m.Family(f.name, f.preset, f.knob, tuple(args.caps)) if f.knob and "requests" in f.knob
                    else f for f in families]
    if args.seqs and not args.no_seqs:
        families.append(m.capped_family(tuple(args.budgets or m.BUDGETS), tuple(args.seqs)))
    return families, missing


Job = tuple[m.Cell, list[m.Family], dict[str, Any], m.Window, RetryPolicy | None, str, bool]


def _cell_job(job: Job, tick: Callable[[str], None] | None = None) -> tuple[str, int]:
    from loadgen.sim.sweep_run import run_cell

    cell, families, slos, window, retries, path, merge = job
    t0 = time.perf_counter()
    res = run_cell(cell, families, slos, window, retries, tick)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    count = len(res["variants"])
    if merge:  # --rerun: these families' variants in place of the stored ones, the rest kept
        stored = json.loads(Path(path).read_text())
        if {k: stored[k] for k in ("trace", "requests")} != {k: res[k] for k in ("trace", "requests")}:
            raise SystemExit(f"{path}: the stored cell ran another trace ({stored['trace']}, {stored['requests']} "
                             f"requests); --rerun needs the same --minutes/--day-minutes/--seed, or --fresh")
        stored["variants"].update(res["variants"])
        stored["rerun"] = {**stored.get("rerun", {}), **{f.name: res["wall_s"] for f in families}}
        res = stored
    write_json(Path(path), res)
    return cell.key, count


def _variants(job: Job) -> int:
    return sum(len(f.variants()) for f in job[1])


def _grid(families: list[m.Family], knob: str) -> tuple[int, ...]:
    return next((f.values for f in families if f.knob == knob), ())


def _seqs_note(families: list[m.Family]) -> str:
    capped = next((f for f in families if f.seqs), None)
    return f"; batch caps {capped.seqs} for {capped.name}" if capped else ""


def run_sweep(args: argparse.Namespace) -> int:
    from loadgen.sim.sweep_plots import plot_day_hours, plot_ratios
    from loadgen.sim.sweep_report import report_markdown

    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    slos = {k: m.SLOS[k] for k in (args.slo or list(m.SLOS))}
    families, missing = _families(args)
    ablations = m.ablations() if not args.no_ablations else []
    retries = RetryPolicy(max_retries=args.retries) if args.retries > 0 else None
    window = m.Window(minutes=args.minutes, day_minutes=args.day_minutes, seed=args.seed)
    cells = m.cells(args.trace or m.TRACES, args.rate or m.RATES, args.gpu or m.GPUS)
    rerun = [f for f in families + ablations if f.name in (args.rerun or ())]
    unknown = set(args.rerun or ()) - {f.name for f in rerun}
    if unknown:
        raise SystemExit(f"--rerun: no family {', '.join(sorted(unknown))} in this sweep; choose from "
                         f"{', '.join(f.name for f in families + ablations)}")
    jobs: list[Job] = []
    for cell in cells:
        path = out / "cells" / f"{cell.key}.json"
        fams = families + (ablations if cell.rate in args.ablation_rates else [])
        if path.exists() and rerun and not args.report_only and not args.fresh:
            jobs.append((cell, [f for f in rerun if f in fams], slos, window, retries, str(path), True))
            continue
        if args.report_only or (path.exists() and not args.fresh):
            continue
        jobs.append((cell, fams, slos, window, retries, str(path), False))
    bar = tqdm(total=sum(_variants(j) for j in jobs), desc=f"sweep: {len(jobs)} cells", unit="variant",
               disable=args.quiet)

    def tick(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)

    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for key, count in pool.imap_unordered(_cell_job, jobs):
                bar.set_postfix_str(key)
                bar.update(count)
    else:
        for job in jobs:
            _cell_job(job, tick)
    bar.close()
    results = []
    absent = []
    for cell in cells:
        path = out / "cells" / f"{cell.key}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
        else:
            absent.append(cell.key)
    header = (f"# Sweep: adaptive against each baseline at its hindsight-best knob\n\n"
              f"Cells: {len(results)} of {len(cells)}"
              f"{' (missing: ' + ', '.join(absent) + ')' if absent else ''}. Real traces and the constant rate: "
              f"the first {window.minutes:g} min; days: 24 hours of {window.day_minutes:g} min each. "
              f"Retrying clients: {'openai rules, max_retries ' + str(args.retries) if retries else 'off'}. "
              f"Grids: token budget {_grid(families, 'max_num_batched_tokens')}, "
              f"caps {_grid(families, 'admission.max_concurrent_requests')}"
              f"{_seqs_note(families)}"
              f"{'; presets missing in this core: ' + ', '.join(missing) if missing else ''}.\n")
    md = report_markdown(results, slos, header)
    (out / "sweep.md").write_text(md)
    write_json(out / "sweep.json", {"cells": [r["cell"] for r in results], "missing": absent,
                                    "slos": {k: vars(v) for k, v in slos.items()}})
    for name in slos:
        plot_ratios(out / f"ratio_{name}.png", results, name)
        for res in results:
            if res["cell"]["trace"] in m.DAYS:
                plot_day_hours(out / "days" / f"{res['cell']['trace']}__x{res['cell']['rate']:g}__"
                               f"{res['cell']['gpu']}__{name}.png", res, name)
    print(md)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sweep", help="adaptive vs each baseline at its hindsight-best knob, per trace x rate x GPU x SLO")
    p.add_argument("--out", required=True, help="folder for cells/*.json, sweep.md, sweep.json and the plots")
    p.add_argument("--trace", action="append", choices=m.TRACES, help=f"repeat; default all: {', '.join(m.TRACES)}")
    p.add_argument("--rate", action="append", type=float, help="rate multiple, repeat; default 0.3, 1, 3")
    p.add_argument("--gpu", action="append", help="cost model, repeat; default: " + ", ".join(m.GPUS))
    p.add_argument("--slo", action="append", choices=tuple(m.SLOS), help="repeat; default both")
    p.add_argument("--minutes", type=float, default=10.0, help="window of each real trace and the constant rate")
    p.add_argument("--day-minutes", type=float, default=2.5, help="minutes each hour of a synthetic day lasts")
    p.add_argument("--budgets", type=int, nargs="+", help=f"token-budget grid (default {m.BUDGETS})")
    p.add_argument("--caps", type=int, nargs="+", help=f"queue-cap grid (default {m.CAPS})")
    p.add_argument("--seqs", type=int, nargs="+", metavar="CAP", default=list(m.SEQS),
                   help=f"the {m.CAPPED} family: sarathi's token budgets at each of these batch caps "
                        f"(max_batch_size, vLLM's max_num_seqs; default {' '.join(map(str, m.SEQS))})")
    p.add_argument("--no-seqs", action="store_true", help=f"no {m.CAPPED} family: one knob per baseline")
    p.add_argument("--retries", type=int, default=2, help="client max_retries (openai default 2; 0: none)")
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--ablation-rates", type=float, nargs="+", default=[1.0], help="rates whose cells run ablations")
    p.add_argument("--jobs", type=int, default=1, help="processes (default 1: one cell at a time)")
    p.add_argument("--fresh", action="store_true", help="rerun cells already written")
    p.add_argument("--report-only", action="store_true", help="run nothing: the report from the cells written")
    p.add_argument("--rerun", action="append", metavar="FAMILY",
                   help="repeat: on cells already written, rerun only this policy family (e.g. adaptive) and keep "
                        "the other variants stored; cells not written yet run in full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_sweep)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tidal")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
