"""Side-by-side comparison of run directories (`tidal compare DIR [DIR ...]`).

Owns: `load_run_dir` (every summary of a `tidal replay` or `tidal simulate` directory, with its
per-hour rows and per-request TTFTs), `compare_table` and `compare` (markdown to stdout and
`compare.md`, plus overlaid `ttft_cdf.png`, `ttft_p99_per_hour.png`, `goodput_per_hour.png`).

A run directory holds `summary.json` (`{name: summary}`), optionally `per_hour.json`
(`{name: [rows]}`) and per-request lines with a `ttft_s` field: `requests.jsonl` for a replay
(named by the summary's `replay.requests_file`) or `<name>.requests.jsonl` for a simulated policy.
Each run is labelled `<dir name>/<run name>`, so sim vs real, policy vs policy and before vs
after read alike. Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from loadgen import plots
from loadgen.report import markdown_table

TABLE_COLUMNS = ("run", "arrived", "completed", "rejected", "errors", "incomplete", "ttft_p50_ms", "ttft_p99_ms",
                 "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s", "goodput_rps",
                 "slo_attainment", "gpu_hours", "duration_s", "drift_p99_ms")


@dataclass
class RunData:
    label: str
    summary: dict[str, Any]
    hours: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: NDArray[np.float64] | None = None  # completed requests' TTFTs, when a per-request file exists


def _ok_ttfts(path: Path) -> NDArray[np.float64]:
    values: list[float] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            ttft, status = row.get("ttft_s"), row.get("status", "ok")
            if status in ("ok", 0) and isinstance(ttft, int | float) and math.isfinite(ttft):
                values.append(float(ttft))
    return np.asarray(values, dtype=np.float64)


def _requests_file(run_dir: Path, name: str, summary: dict[str, Any], single: bool) -> Path | None:
    replay = summary.get("replay")
    named = replay.get("requests_file") if isinstance(replay, dict) else None
    candidates = [run_dir / named] if named else []
    candidates.append(run_dir / f"{name}.requests.jsonl")
    if single:
        candidates.append(run_dir / "requests.jsonl")
    return next((p for p in candidates if p.is_file()), None)


def load_run_dir(run_dir: str | Path, label: str | None = None) -> list[RunData]:
    """Every run summarised in `run_dir/summary.json`, labelled `<label or dir name>/<run name>`."""
    path = Path(run_dir)
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise FileNotFoundError(f"{summary_file} not found: is {path} a `tidal replay` or `tidal simulate` output?")
    summaries = json.loads(summary_file.read_text())
    if not isinstance(summaries, dict) or not all(isinstance(v, dict) for v in summaries.values()):
        raise ValueError(f"{summary_file} must map run names to summaries")
    hours_file = path / "per_hour.json"
    hours = json.loads(hours_file.read_text()) if hours_file.is_file() else {}
    prefix = label or path.resolve().name
    runs = []
    for name, summary in summaries.items():
        req = _requests_file(path, name, summary, single=len(summaries) == 1)
        runs.append(RunData(f"{prefix}/{name}", summary, list(hours.get(name, [])),
                            _ok_ttfts(req) if req is not None else None))
    return runs


def _labels(dirs: Sequence[Path]) -> list[str]:
    """Directory names, or the paths as given where two directories share a name."""
    names = [d.resolve().name for d in dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(dirs, names, strict=True)]


def compare_table(runs: Sequence[RunData]) -> str:
    rows = []
    for run in runs:
        row = {"run": run.label, **{k: run.summary.get(k) for k in TABLE_COLUMNS[1:]}}
        drift = run.summary.get("drift")
        row["drift_p99_ms"] = drift.get("p99_ms") if isinstance(drift, dict) else None
        rows.append(row)
    return markdown_table(rows, TABLE_COLUMNS)


def compare(dirs: Sequence[str | Path], out_dir: str | Path, *, plot: bool = True) -> str:
    """Write compare.md (and the overlaid plots) for `dirs`; returns the markdown."""
    paths = [Path(d) for d in dirs]
    runs = [run for d, label in zip(paths, _labels(paths), strict=True) for run in load_run_dir(d, label)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = ("# tidal compare\n\n" + "\n".join(f"- `{p}`" for p in paths) + "\n\n" + compare_table(runs)
            + "\nLatencies in ms from the request's arrival at the server (a replay: from the request on the "
            "wire); drift_p99_ms is a replay's send lateness (none for a simulation).\n")
    (out / "compare.md").write_text(text, encoding="utf-8")
    if plot:
        _plots(out, runs)
    return text


def _plots(out: Path, runs: Sequence[RunData]) -> None:
    ttfts = {r.label: r.ttft_s for r in runs if r.ttft_s is not None and r.ttft_s.size}
    if ttfts:
        plots.plot_cdf(out / "ttft_cdf.png", ttfts, "TTFT (s)", "TTFT of completed requests")
    hourly = {r.label: r.hours for r in runs if r.hours}
    if hourly:
        slo = next((r.summary["slo"] for r in runs if isinstance(r.summary.get("slo"), dict)), None)
        plots.plot_hourly(out / "ttft_p99_per_hour.png", hourly, "ttft_p99_ms", "TTFT p99 (ms)",
                          "TTFT p99 per hour", log=True, hline=slo["ttft_s"] * 1000.0 if slo else None)
        plots.plot_hourly(out / "goodput_per_hour.png", hourly, "goodput_rps", "goodput (requests / s within SLO)",
                          "goodput per hour")
