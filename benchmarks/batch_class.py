"""The batch class on the sharp day's trough: one A100 Llama-70B TP8 unit, simulated (cost model).

Side by side on the same interactive trace (the study's sharp day, peak 1.3x the unit's measured
capacity, the first `--hours` hours: 00:00 onwards) and the same backlog (`--backlog` batch
requests with Azure code lengths, all submitted at 00:00):

- `day`: the interactive day alone (adaptive policy) - the baseline for SLO attainment;
- `batch-class`: the day plus the backlog sent as the batch class (`service_tier="flex"`),
  batch queue bound raised so the whole backlog queues;
- `no-batch-class`: the day plus the backlog sent as ordinary requests (`batch.enabled=false`);
- two saturated runs, which define the trough's spare capacity: `batch-saturated` (the first
  3,000 backlog requests alone, batch class) gives R_batch, the batch tokens/s a unit sustains
  within its TPOT target; `interactive-saturated` (3,000 day-mix requests at once, adaptive,
  admission off so all are served, the step sizer holding the TPOT target) gives R_int.

Spare capacity of the window W = R_batch x (W - T_int), with T_int = (interactive prompt +
output tokens completed in the window in `day`) / R_int: the seconds of a saturated unit the
interactive load occupies. Used = batch prompt + output tokens of batch requests completed
within the window in `batch-class`. Interactive figures count interactive requests only.

    python benchmarks/batch_class.py [--hours 8] [--backlog 50000] [--seed 0] [--out runs/batch-class]
        [--set batch.reserve_full_load=0 ...]   # a batch.* setting for the batch-class run (repeatable)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen import plots
from loadgen.records import Trace
from loadgen.report import OK, Slo
from loadgen.sim.backlog import batch_tokens_by_time, with_backlog
from loadgen.sim.config import SimConfig
from loadgen.sim.runner import RunSpec, executor_factory, run_policy, unit_config
from loadgen.sim.simulation import simulate
from loadgen.sim.study import day_trace, length_trace
from tidal_core import SchedulerConfig, preset
from tidal_core.batch_config import BatchClassConfig
from tidal_core.overrides import parse_pairs

BIG_QUEUE = {"batch.max_queue_tokens": str(10**10)}


def saturated_tokens_per_s(trace: Trace, cfg: SchedulerConfig, cost: CostModel, batch_ids: frozenset[int]) -> float:
    """Prompt + output tokens/s over the middle 80% of completions of a burst at t=0."""
    run = simulate(trace, SimConfig(cfg, executor_factory(cost), batch_ids=batch_ids))
    out = run.outcomes
    ok = out.status == OK
    order = np.argsort(out.e2e_s[ok])
    finish, tokens = out.e2e_s[ok][order], (out.input_tokens + out.output_tokens)[ok][order]
    lo, hi = int(0.1 * finish.size), int(0.9 * finish.size) - 1
    return float(tokens[lo + 1:hi + 1].sum() / (finish[hi] - finish[lo]))


def slo_config(base: SchedulerConfig, slo: Slo, **admission: Any) -> SchedulerConfig:
    cfg = preset("adaptive", base)
    return dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, target_ttft_s=slo.ttft_s,
                                                                  target_tpot_s=slo.tpot_s, **admission))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=8.0, help="simulated window from 00:00 (the trough: 8)")
    ap.add_argument("--backlog", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/batch-class")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a scheduler field in the batch-class run (e.g. batch.reserve_full_load=0)")
    ap.add_argument("--plot", default=None, help="also write the plot here (e.g. docs/img/batch_class_trough.png)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost = CostModel.load("a100-llama70b-tp8")
    base = unit_config(cost, max_batch_size=128, max_num_batched_tokens=2048, max_model_len=8192)
    slo, window = Slo(1.0, 0.1), args.hours * 3600.0
    day = day_trace("day-in-life-sharp", cost, base, hours=args.hours, seed=args.seed, peak_load=1.3, cv=None)
    mixed, batch_ids = with_backlog(day, args.backlog, seed=args.seed, max_len=base.max_model_len)

    t0 = time.perf_counter()
    n_sat = min(3000, args.backlog)
    sat_batch, sat_ids = with_backlog(Trace("none", np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                            duration_s=0.0, source="none"), n_sat, seed=args.seed,
                                      max_len=base.max_model_len)
    # Within the TPOT target itself: batch steps may fill the whole target (no policy margins).
    sat_cfg = dataclasses.replace(slo_config(base, slo), batch=BatchClassConfig(step_fraction=1.0))
    sat_cfg = dataclasses.replace(sat_cfg, step_sizing=dataclasses.replace(sat_cfg.step_sizing, headroom=1.0))
    r_batch = saturated_tokens_per_s(sat_batch, sat_cfg, cost, sat_ids)
    r_int = saturated_tokens_per_s(length_trace(3000, 12345, base.max_model_len), slo_config(base, slo, enabled=False),
                                   cost, frozenset())
    runs = {
        "day": run_policy(RunSpec(day, base, cost, slo, seed=args.seed), "adaptive", progress=False),
        "batch-class": run_policy(RunSpec(mixed, base, cost, slo, seed=args.seed, batch_ids=batch_ids,
                                          overrides={**BIG_QUEUE, **parse_pairs(args.set)}), "adaptive",
                                  progress=False),
        "no-batch-class": run_policy(RunSpec(mixed, base, cost, slo, seed=args.seed, batch_ids=batch_ids,
                                             overrides={**BIG_QUEUE, "batch.enabled": "false"}), "adaptive",
                                     progress=False),
    }
    wall = time.perf_counter() - t0
    day_out = runs["day"].run.outcomes
    ok = (day_out.status == OK) & (day_out.arrival_s + day_out.e2e_s <= window)
    int_tokens = float((day_out.input_tokens + day_out.output_tokens)[ok].sum())
    t_int = int_tokens / r_int
    spare = r_batch * max(0.0, window - t_int)
    bmix = runs["batch-class"].run.outcomes
    used = float(batch_tokens_by_time(bmix, batch_ids, window, window)[0])
    rows: dict[str, Any] = {}
    for name, r in runs.items():
        s = r.summary
        rows[name] = {k: s.get(k) for k in ("arrived", "completed", "rejected", "slo_attainment", "ttft_p99_ms",
                                            "tpot_p99_ms", "batch_arrived", "batch_completed", "batch_refused",
                                            "batch_lost", "batch_last_done_s", "batch_tokens")}
        rows[name]["preempted"] = dict(r.run.counters.get("preempted", {}))
        rows[name]["wall_s"] = round(r.wall_s, 1)
    result = {
        "window_h": args.hours, "backlog": args.backlog, "seed": args.seed, "set": args.set,
        "r_batch_tok_s": round(r_batch, 1),
        "r_int_tok_s": round(r_int, 1), "interactive_tokens_in_window": int(int_tokens),
        "t_int_s": round(t_int, 1), "spare_tokens": int(spare), "batch_tokens_used_in_window": int(used),
        "spare_used": round(used / spare, 4) if spare else None,
        "attainment_delta_points": round(100 * (rows["batch-class"]["slo_attainment"]
                                               - rows["day"]["slo_attainment"]), 3),
        "runs": rows, "wall_s": round(wall, 1),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if args.plot:
        write_plot(Path(args.plot), runs, batch_ids, window, r_batch, t_int)
    return 0


def write_plot(path: Path, runs: dict[str, Any], batch_ids: frozenset[int], window: float, r_batch: float,
               t_int: float, bin_s: float = 600.0) -> None:
    day_out, bmix = runs["day"].run.outcomes, runs["batch-class"].run.outcomes
    ok = day_out.status == OK
    edges = np.arange(0.0, window + bin_s, bin_s)
    inter, _ = np.histogram((day_out.arrival_s + day_out.e2e_s)[ok], bins=edges,
                            weights=(day_out.input_tokens + day_out.output_tokens)[ok])
    batch = batch_tokens_by_time(bmix, batch_ids, bin_s, window)[: inter.size]
    hours = edges[:-1] / 3600.0 + bin_s / 7200.0
    plots.plot_stacked(path, hours, {"interactive tokens/s (day alone)": inter / bin_s,
                                     "batch tokens/s (batch class)": batch / bin_s},
                       "Sharp day 00:00-08:00, one A100 70B unit: the trough filled by a batch backlog",
                       "tokens / s (prompt + output)", (r_batch, "saturated batch rate within the TPOT target"))


if __name__ == "__main__":
    raise SystemExit(main())
