"""Running one cell of the sweep: every policy variant on one trace, judged under every SLO.

Owns: `variant_config` (a preset, its knob override and the SLO's admission targets),
`run_cell` (each distinct configuration simulated once: a policy whose configuration does not
depend on the SLO, like an unbounded queue, is run once and judged under each SLO) and
`best_of` (the hindsight-best grid value of a family). A cell's result is plain JSON.

Each run records, per SLO: the summary (goodput per original request, TPOT p99 of admitted
requests...), goodput timed from the first send (what a user behind a retrying client sees),
per-hour goodput on the days; per run: the retrying clients' counters and the TTFT
prediction error (the scheduler's predicted TTFT at admission over the measured TTFT).

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from calibration.cost_model import CostModel
from loadgen.report import OK, Slo, per_hour, summarize
from loadgen.retry_policy import RetryPolicy
from loadgen.sim.runner import RunSpec, run_policy, unit_config
from loadgen.sim.sweep_matrix import Cell, Family, Window, cell_trace
from tidal_core import SchedulerConfig, preset
from tidal_core.overrides import apply_overrides

SUMMARY_KEYS = ("arrived", "completed", "rejected", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                "goodput_rps", "slo_attainment", "throughput_tok_s")


def variant_config(family: Family, overrides: dict[str, str], base: SchedulerConfig, slo: Slo) -> SchedulerConfig:
    """As `tidal simulate --policy P --set k=v` builds it: preset, overrides, then the SLO's
    targets for a policy with admission control (the same rule as loadgen.sim.runner.run_policy).

    A token budget below the batch cap (the preset's, or the one `overrides` sets) lowers the cap
    to it, as vLLM requires (`max_num_seqs <= max_num_batched_tokens`) of a user who sets a small
    budget.
    """
    cfg = preset(family.preset, base)
    budget = overrides.get("max_num_batched_tokens")
    cap = int(overrides.get("max_batch_size", cfg.max_batch_size))  # the preset's, or the second knob's
    if budget is not None and int(budget) < cap:
        overrides = {**overrides, "max_batch_size": budget}
    cfg = apply_overrides(cfg, overrides)
    if cfg.admission.enabled:
        cfg = dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, target_ttft_s=slo.ttft_s,
                                                                     target_tpot_s=slo.tpot_s))
    return cfg


def prediction_error(outcomes: Any) -> dict[str, Any]:
    """Predicted / measured TTFT of completed requests: p10, p50, p90 (None without predictions)."""
    predicted = outcomes.extra.get("predicted_ttft_s")
    if predicted is None:
        return {"n": 0, "p10": None, "p50": None, "p90": None}
    ok = (outcomes.status == OK) & np.isfinite(predicted) & (outcomes.ttft_s > 0)
    ratio = predicted[ok] / outcomes.ttft_s[ok]
    if ratio.size == 0:
        return {"n": 0, "p10": None, "p50": None, "p90": None}
    p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
    return {"n": int(ratio.size), "p10": round(float(p10), 3), "p50": round(float(p50), 3),
            "p90": round(float(p90), 3)}


def _judge(run: Any, slo: Slo, hour_s: float | None) -> dict[str, Any]:
    out = run.outcomes
    s = summarize(out, slo)
    row: dict[str, Any] = {k: s[k] for k in SUMMARY_KEYS}
    if run.retries is not None:
        row["client_goodput_rps"] = summarize(run.retries.client_outcomes(out), slo)["goodput_rps"]
    if hour_s is not None:
        row["hours"] = [h["goodput_rps"] for h in per_hour(out, slo, hour_s=hour_s)]
        row["hours_tpot_p99_ms"] = [h["tpot_p99_ms"] for h in per_hour(out, slo, hour_s=hour_s)]
    return row


def run_cell(cell: Cell, families: list[Family], slos: dict[str, Slo], window: Window,
             retries: RetryPolicy | None, tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every variant of `families` on the cell's trace; one entry per variant label."""
    cost = CostModel.load(cell.gpu)
    base = unit_config(cost)
    trace = cell_trace(cell, cost, base, window)
    hour_s = window.hour_s(cell) if cell.is_day else None
    variants: dict[str, Any] = {}
    for family in families:
        for label, overrides in family.variants():
            configs = {name: variant_config(family, overrides, base, slo) for name, slo in slos.items()}
            entry: dict[str, Any] = {"family": family.name, "knob": family.knob,
                                     "value": int(overrides[family.knob]) if family.knob else None,
                                     "slo": {}, "runs": {}}
            if "max_batch_size" in overrides:  # the second knob (`Family.seqs`)
                entry["max_batch_size"] = int(overrides["max_batch_size"])
            runs: dict[str, Any] = {}
            for name, cfg in configs.items():
                key = next(k for k, c in configs.items() if c == cfg)  # the first SLO with this configuration
                if key not in runs:
                    spec = RunSpec(trace, base, cost, slos[key], seed=window.seed, scheduler=cfg, retries=retries)
                    result = run_policy(spec, family.preset, progress=False)
                    runs[key] = result.run
                    entry["runs"][key] = {"wall_s": round(result.wall_s, 2),
                                          "prediction": prediction_error(result.run.outcomes),
                                          "retries": result.run.retries.summary() if result.run.retries else None,
                                          "rejected": dict(result.run.counters["rejected"])}
                entry["slo"][name] = {**_judge(runs[key], slos[name], hour_s), "run": key}
            variants[label] = entry
            if tick is not None:
                tick(f"{cell.key} {label}")
    return {"cell": dataclasses.asdict(cell), "trace": trace.name, "requests": len(trace),
            "duration_s": trace.duration_s, "hour_s": hour_s, "variants": variants}


def best_of(variants: dict[str, Any], family: str, slo: str) -> tuple[str, dict[str, Any]] | None:
    """The family's variant with the most goodput under `slo` (ties: the first in grid order)."""
    rows = [(label, v) for label, v in variants.items() if v["family"] == family]
    if not rows:
        return None
    return max(rows, key=lambda lv: lv[1]["slo"][slo]["goodput_rps"])
