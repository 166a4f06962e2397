"""PNG plots shared by `tidal simulate`, `tidal study`, `tidal replay` and `tidal compare`.

Owns: the figure functions. Inputs are plain data (timelines as lists of dicts, per-hour rows,
arrays), so simulated and real runs plot the same way. matplotlib runs headless (Agg).
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt
import numpy as np

REGIME_COLORS = {"light": "#d8f0d8", "steady": "#fff3c4", "overload": "#f8d0d0"}


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def arrival_rate(arrival_s: np.ndarray, bin_s: float, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests/s per bin (bin centres in hours, rates)."""
    bins = max(1, int(np.ceil(duration_s / bin_s)))
    counts, edges = np.histogram(arrival_s, bins=bins, range=(0.0, bins * bin_s))
    return (edges[:-1] + bin_s / 2) / 3600.0, counts / bin_s


def plot_timeline(path: Path, arrival_s: np.ndarray, duration_s: float, regime_changes: Sequence[tuple[float, str]],
                  title: str, timeline: Sequence[Mapping[str, Any]] | None = None, bin_s: float = 300.0) -> Path:
    """Arrival rate over the run, shaded by the detected regime (and serving units if several)."""
    fig, ax = plt.subplots(figsize=(11, 4))
    hours, rate = arrival_rate(arrival_s, bin_s, duration_s)
    changes = [*list(regime_changes), (duration_s, "")]
    for (t0, regime), (t1, _) in itertools.pairwise(changes):
        if regime in REGIME_COLORS:
            ax.axvspan(t0 / 3600, t1 / 3600, color=REGIME_COLORS[regime], lw=0)
    ax.plot(hours, rate, color="black", lw=1.2, label=f"arrival rate ({bin_s / 60:.0f}-min bins)")
    ax.set_xlabel("hour")
    ax.set_ylabel("requests / s")
    for regime, color in REGIME_COLORS.items():
        ax.plot([], [], color=color, lw=8, label=regime)
    if timeline and max((row.get("units", 1) for row in timeline), default=1) > 1:
        ax2 = ax.twinx()
        ax2.step([row["t"] / 3600 for row in timeline], [row["units"] for row in timeline], where="post",
                 color="tab:blue", lw=1.2, label="units")
        ax2.set_ylabel("serving units", color="tab:blue")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)
    ax.set_xlim(0, duration_s / 3600)
    return _save(fig, path)


def plot_hourly(path: Path, per_hour: Mapping[str, Sequence[Mapping[str, Any]]], metric: str, ylabel: str,
                title: str, log: bool = False, hline: float | None = None) -> Path:
    """One line per policy/run: `metric` of each hour's row."""
    fig, ax = plt.subplots(figsize=(11, 4))
    for name, rows in per_hour.items():
        xs = [r["hour"] for r in rows if r.get(metric) is not None]
        ys = [r[metric] for r in rows if r.get(metric) is not None]
        ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", ls="--", lw=1, label="SLO")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("hour")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_distributions(path: Path, batch_sizes: Mapping[str, np.ndarray], waits_ms: Mapping[str, np.ndarray],
                       title: str) -> Path:
    """Batch size per step and wait chosen before a step, one histogram per policy/run."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for name, sizes in batch_sizes.items():
        if len(sizes):
            ax1.hist(sizes, bins=np.arange(0, max(int(np.max(sizes)), 1) + 2) - 0.5, histtype="step", lw=1.2,
                     density=True, label=name)
    ax1.set_xlabel("sequences per step")
    ax1.set_ylabel("fraction of steps")
    ax1.set_title("batch size")
    ax1.legend(fontsize=8)
    for name, waits in waits_ms.items():
        nonzero = np.asarray(waits)[np.asarray(waits) > 0]
        if nonzero.size:
            ax2.hist(nonzero, bins=40, histtype="step", lw=1.2,
                     label=f"{name} ({nonzero.size / max(len(waits), 1):.1%} of steps waited)")
    ax2.set_xlabel("wait chosen before the step (ms)")
    ax2.set_title("micro-wait / batching delay (steps with a wait)")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no step waited", ha="center", va="center", transform=ax2.transAxes)
    fig.suptitle(title)
    return _save(fig, path)


def plot_latency_throughput(path: Path, curves: Mapping[str, Sequence[Mapping[str, Any]]], title: str,
                            latency_key: str = "ttft_p99_ms", slo_ms: float | None = None) -> Path:
    """Per policy: offered rate -> throughput, latency and goodput (a QPS sweep)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for name, points in curves.items():
        rate = [p["offered_rps"] for p in points]
        ax1.plot([p["throughput_tok_s"] for p in points], [p.get(latency_key) or np.nan for p in points],
                 marker="o", ms=3, label=name)
        ax2.plot(rate, [p["goodput_rps"] for p in points], marker="o", ms=3, label=name)
    if slo_ms is not None:
        ax1.axhline(slo_ms, color="grey", ls="--", lw=1, label="SLO")
    ax1.set_yscale("log")
    ax1.set_xlabel("throughput (output tokens / s)")
    ax1.set_ylabel(latency_key.replace("_", " "))
    ax1.set_title("latency vs throughput")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("offered load (requests / s)")
    ax2.set_ylabel("goodput (requests / s within SLO)")
    ax2.set_title("goodput vs offered load")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_cdf(path: Path, series: Mapping[str, np.ndarray], xlabel: str, title: str) -> Path:
    """Empirical CDFs, e.g. TTFT of a real run against the simulator's prediction."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        v = np.sort(np.asarray(values)[np.isfinite(values)])
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, lw=1.4, label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_stacked(path: Path, hours: np.ndarray, stacks: Mapping[str, np.ndarray], title: str, ylabel: str,
                 hline: tuple[float, str] | None = None) -> Path:
    """Series stacked over time (e.g. interactive and batch tokens/s), with an optional level line."""
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.stackplot(hours, *stacks.values(), labels=list(stacks), alpha=0.8)
    if hline is not None:
        ax.axhline(hline[0], color="black", ls="--", lw=1, label=hline[1])
    ax.set_xlabel("hour")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xlim(float(hours[0]), float(hours[-1]))
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)
