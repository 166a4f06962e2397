"""The sweep's figures: adaptive / hindsight-best per cell, and a day's goodput hour by hour.

Owns: `plot_ratios` (one bar per cell, the 0.98 goal and parity marked) and `plot_day_hours`
(adaptive, the best fixed configuration over the whole day, and vLLM's shipped default where
swept). Inputs are the cells' JSON. matplotlib runs headless (via loadgen.plots).
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen import plots
from loadgen.sim.sweep_report import GOAL, best_fixed, headline_rows

plt = plots.plt


def plot_ratios(path: Path, results: Sequence[dict[str, Any]], slo: str) -> Path | None:
    rows = [r for r in headline_rows(results, slo) if r.get("ratio") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(rows) + 2), 4.2))
    labels = [f"{r['trace']} {r['rate']} {r['gpu']}" for r in rows]
    colors = ["#3a7d44" if r["ratio"] >= GOAL else "#c0392b" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(GOAL, color="grey", lw=0.8, ls="--", label=f"goal {GOAL}")
    ax.set_xticks(range(len(rows)), labels, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("adaptive / hindsight-best fixed goodput")
    ax.set_title(f"adaptive vs the best fixed configuration per cell (SLO {slo})")
    ax.legend(fontsize=8)
    return plots._save(fig, path)


def plot_day_hours(path: Path, res: dict[str, Any], slo: str) -> Path | None:
    variants = res["variants"]
    best = best_fixed(res, slo)
    if best is None or "hours" not in variants["adaptive"]["slo"][slo]:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.8))
    series = {"adaptive": variants["adaptive"], f"{best[0]} (best over the day)": best[1]}
    for label, v in series.items():
        hours = [h if h is not None else 0.0 for h in v["slo"][slo]["hours"]]
        ax.plot(range(len(hours)), hours, marker="o", ms=3, label=label)
    ax.set_xlabel("hour of the day")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.set_title(f"{res['trace']} on {res['cell']['gpu']} (SLO {slo})", fontsize=9)
    ax.legend(fontsize=8)
    return plots._save(fig, path)
