"""Building and running simulations: unit configs from a cost model, capacity, result files.

Owns: `unit_config` (a serving unit's capacity knobs for a GPU x model x TP cost model),
`measure_capacity` (requests/s one unit sustains on a length mix, measured by simulation),
`run_policies` (one trace, several policies, side by side) and `write_run` (summary.json,
per_hour.json, per-request JSONL, plots). Used by `tidal simulate` and `tidal study`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from calibration.cost_model import CostModel
from calibration.sim_executor import SimExecutor
from calibration.unit_sizing import pool_blocks
from loadgen import plots
from loadgen.records import Trace
from loadgen.report import STATUS_NAMES, RunOutcomes, Slo, markdown_table, per_hour, summarize, write_json
from loadgen.retry_policy import RetryPolicy
from loadgen.sim.backlog import class_split
from loadgen.sim.config import SimConfig
from loadgen.sim.simulation import SimRun, simulate
from tidal_core import AutoscaleConfig, SchedulerConfig, preset
from tidal_core.overrides import apply_overrides


def unit_config(cost_model: CostModel, *, max_batch_size: int = 128, max_num_batched_tokens: int = 2048,
                max_model_len: int = 8192, block_size: int = 16) -> SchedulerConfig:
    """Capacity knobs of one unit: the KV pool is what the cost model's model (fp16) leaves free on
    its GPUs (`calibration.unit_sizing.pool_blocks`)."""
    num_blocks = pool_blocks(cost_model, block_size=block_size)
    return SchedulerConfig(max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_blocks,
                           service_prior=cost_model.service_prior())


def executor_factory(cost_model: CostModel) -> Any:
    return lambda: SimExecutor(cost_model)


def measure_capacity(cost_model: CostModel, base: SchedulerConfig, lengths: Trace, num_requests: int = 3000) -> float:
    """Requests/s one unit completes when saturated: all requests arrive at once, `continuous`
    policy, throughput over the middle 80% of completions (no warm-up or tail effects)."""
    n = min(num_requests, len(lengths))
    burst = Trace("capacity-burst", np.zeros(n), lengths.input_tokens[:n], lengths.output_tokens[:n],
                  duration_s=0.0, source="burst of the first requests of a length trace")
    run = simulate(burst, SimConfig(preset("continuous", base), executor_factory(cost_model)))
    finish = np.sort(run.outcomes.e2e_s[np.isfinite(run.outcomes.e2e_s)])
    lo, hi = int(0.1 * finish.size), int(0.9 * finish.size) - 1
    return float((hi - lo) / (finish[hi] - finish[lo]))


@dataclass
class PolicyRun:
    policy: str
    run: SimRun
    summary: dict[str, Any]
    hours: list[dict[str, Any]]
    wall_s: float


@dataclass
class RunSpec:
    trace: Trace
    base: SchedulerConfig
    cost_model: CostModel
    slo: Slo = field(default_factory=Slo)
    units: int = 1
    autoscale: AutoscaleConfig | None = None
    provisioning_s: float = 300.0
    seed: int = 0
    scheduler: SchedulerConfig | None = None  # an exact config (e.g. a Serve config's) instead of preset + SLO
    overrides: dict[str, str] = field(default_factory=dict)  # dotted field=value, applied last
    retries: RetryPolicy | None = None  # clients retry refused requests (the openai client's rules)
    routing: str = "load"  # fleet routing: loadgen/sim/config.py ROUTINGS
    prefix_routing: dict[str, float] = field(default_factory=dict)  # with routing "prefix": its config's fields
    batch_ids: frozenset[int] = frozenset()  # trace indices sent as the batch class (a backlog)
    batch_due_s: float | None = None  # the backlog's due time (None: the trace's end)


def sim_config(spec: RunSpec, policy: str) -> SimConfig:
    """The simulator's configuration for `policy` on `spec`: the preset (or the exact scheduler),
    its admission targets following the SLO, then `spec.overrides`."""
    # The admission targets follow the SLO, so the adaptive policy protects what is measured.
    cfg = spec.scheduler or preset(policy, spec.base)
    if spec.scheduler is None and (cfg.admission.enabled or cfg.step_sizing.enabled):
        cfg = dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, target_ttft_s=spec.slo.ttft_s,
                                                                     target_tpot_s=spec.slo.tpot_s))
    cfg = apply_overrides(cfg, spec.overrides)  # `tidal simulate --set`: last, so any field can change
    return SimConfig(cfg, executor_factory(spec.cost_model), spec.slo, num_units=spec.units,
                     gpus_per_unit=spec.cost_model.tp, autoscale=spec.autoscale, provisioning_s=spec.provisioning_s,
                     seed=spec.seed, retries=spec.retries, routing=spec.routing,
                     prefix_routing=spec.prefix_routing, batch_ids=spec.batch_ids)


def run_policy(spec: RunSpec, policy: str, progress: bool = True) -> PolicyRun:
    config = sim_config(spec, policy)
    bar = tqdm(total=len(spec.trace), desc=f"{policy:>10}", unit="req", disable=not progress, leave=False,
               mininterval=1.0)
    t0 = time.perf_counter()
    run = simulate(spec.trace, config, progress=bar.update)
    wall = time.perf_counter() - t0
    bar.close()
    run.wall_s = wall
    gpu_by_hour = gpu_hours_by_hour(run.unit_intervals, spec.trace.duration_s, spec.cost_model.tp)
    if spec.batch_ids:  # the SLO figures are the interactive requests'; the backlog is reported apart
        outcomes, summary = class_split(run.outcomes, spec.batch_ids, spec.slo, spec.batch_due_s)
    else:
        outcomes, summary = run.outcomes, summarize(run.outcomes, spec.slo)
    if run.prefix_cache:  # prefix caching on: its hit rate beside an unbounded cache's
        summary["prefix_hit_rate"] = round(run.prefix_cache["hit_rate"], 4)
        summary["prefix_ideal_hit_rate"] = round(run.prefix_cache["ideal_hit_rate"], 4)
        summary["prefix_ideal_hit_rate_served"] = round(run.prefix_cache["ideal_hit_rate_served"], 4)
    return PolicyRun(policy, run, summary, per_hour(outcomes, spec.slo, gpu_hours_by_hour=gpu_by_hour), wall)


def gpu_hours_by_hour(intervals: Sequence[tuple[float, float]], duration_s: float, gpus: int) -> list[float]:
    hours = max(1, int(np.ceil(duration_s / 3600.0 - 1e-9)))
    out = [0.0] * hours
    for a, b in intervals:
        for h in range(hours):
            lo, hi = max(a, h * 3600.0), min(b, (h + 1) * 3600.0)
            if hi > lo:
                out[h] += (hi - lo) * gpus / 3600.0
    return out


def write_requests_jsonl(path: Path, out: RunOutcomes) -> None:
    tpot = out.tpot_s
    with path.open("w") as f:
        for i in range(out.status.size):
            row = {"index": i, "arrival_s": round(float(out.arrival_s[i]), 6),
                   "status": STATUS_NAMES[int(out.status[i])], "input_tokens": int(out.input_tokens[i]),
                   "output_tokens": int(out.output_tokens[i])}
            for key, arr in (("ttft_s", out.ttft_s), ("e2e_s", out.e2e_s), ("tpot_s", tpot)):
                v = float(arr[i])
                row[key] = round(v, 6) if np.isfinite(v) else None
            f.write(json.dumps(row) + "\n")


def write_run(out_dir: Path, title: str, runs: Sequence[PolicyRun], slo: Slo, requests_jsonl: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", {r.policy: r.summary for r in runs})
    write_json(out_dir / "per_hour.json", {r.policy: r.hours for r in runs})
    write_json(out_dir / "counters.json", {r.policy: {**r.run.counters, "prefix_cache": r.run.prefix_cache,
                                                         "wall_s": round(r.wall_s, 2)} for r in runs})
    if requests_jsonl:
        for r in runs:
            write_requests_jsonl(out_dir / f"{r.policy}.requests.jsonl", r.run.outcomes)
    (out_dir / "per_hour.md").write_text(per_hour_markdown(runs))
    for r in runs:
        changes = [(t, regime) for t, uid, regime in r.run.samples.regime_changes if uid == 0]
        plots.plot_timeline(out_dir / f"timeline_{r.policy}.png", r.run.outcomes.arrival_s,
                            r.run.outcomes.duration_s, changes, f"{title}: arrivals and regime ({r.policy})",
                            r.run.samples.timeline)
    per_h = {r.policy: r.hours for r in runs}
    plots.plot_hourly(out_dir / "ttft_p99_per_hour.png", per_h, "ttft_p99_ms", "TTFT p99 (ms)",
                      f"{title}: TTFT p99 per hour", log=True, hline=slo.ttft_s * 1000)
    plots.plot_hourly(out_dir / "goodput_per_hour.png", per_h, "goodput_rps", "goodput (req/s within SLO)",
                      f"{title}: goodput per hour")
    plots.plot_distributions(out_dir / "distributions.png",
                             {r.policy: np.frombuffer(r.run.samples.batch_size, dtype=np.uint16) for r in runs},
                             {r.policy: np.frombuffer(r.run.samples.wait_ms, dtype=np.float32) for r in runs},
                             f"{title}: batch size and wait per step")


SUMMARY_COLUMNS = ("policy", "arrived", "completed", "rejected", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                   "tpot_p99_ms", "throughput_tok_s", "goodput_rps", "slo_attainment", "gpu_hours")


def summary_markdown(runs: Sequence[PolicyRun]) -> str:
    columns: tuple[str, ...] = SUMMARY_COLUMNS
    if any("prefix_hit_rate" in r.summary for r in runs):
        columns += ("prefix_hit_rate", "prefix_ideal_hit_rate", "prefix_ideal_hit_rate_served")
    return markdown_table([{"policy": r.policy, **r.summary} for r in runs], columns)


def per_hour_markdown(runs: Sequence[PolicyRun], metric: str = "goodput_rps") -> str:
    hours = len(runs[0].hours)
    rows = []
    for h in range(hours):
        row: dict[str, Any] = {"hour": h, "arrived": runs[0].hours[h]["arrived"]}
        for r in runs:
            row[r.policy] = r.hours[h].get(metric)
        rows.append(row)
    return f"{metric} per hour\n\n" + markdown_table(rows, ["hour", "arrived", *(r.policy for r in runs)])
