"""Outcomes of a load run, and the summary every run writes (simulated or real, same schema).

Owns: `Slo` (the latency targets a request must meet to count as goodput), `RunOutcomes`
(per-request arrays: arrival, tokens, status, TTFT, E2E), `summarize` (the `summary.json`
entry of one policy/run) and `per_hour` (the hour x metric table). `tidal simulate` and
`tidal replay` both build `RunOutcomes`, so their summaries compare directly.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

OK, REJECTED, ERROR, INCOMPLETE = 0, 1, 2, 3
STATUS_NAMES = {OK: "ok", REJECTED: "rejected", ERROR: "error", INCOMPLETE: "incomplete"}

SUMMARY_KEYS = (
    "arrived", "completed", "rejected", "errors", "incomplete", "preempted",
    "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    "throughput_tok_s", "goodput_rps", "slo_attainment", "gpu_hours", "duration_s",
)


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when it completes with TTFT <= ttft_s and TPOT <= tpot_s.

    Defaults for Llama-70B on 8xA100 (justified in docs/day-in-the-life.md): an interactive
    first token within 1 s, and 100 ms per output token (10 tok/s, above reading speed, and
    within reach of a batch-64 decode step, measured at 72 ms).
    """

    ttft_s: float = 1.0
    tpot_s: float = 0.100


@dataclass
class RunOutcomes:
    """Per-request results; times in seconds from the run start, NaN where not reached."""

    arrival_s: NDArray[np.float64]
    input_tokens: NDArray[np.int64]
    output_tokens: NDArray[np.int64]  # generated (what the client received)
    status: NDArray[np.int8]
    ttft_s: NDArray[np.float64]
    e2e_s: NDArray[np.float64]
    duration_s: float
    gpu_hours: float = 0.0
    preempted: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int, duration_s: float) -> RunOutcomes:
        nan = np.full(n, np.nan)
        return cls(np.zeros(n), np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, INCOMPLETE, np.int8),
                   nan, nan.copy(), duration_s)

    @property
    def tpot_s(self) -> NDArray[np.float64]:
        """Mean time per output token after the first; NaN for fewer than two tokens."""
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
        return np.where(self.output_tokens >= 2, tpot, np.nan)

    def meets_slo(self, slo: Slo) -> NDArray[np.bool_]:
        tpot = self.tpot_s
        ok = self.status == OK
        ttft_ok = np.nan_to_num(self.ttft_s, nan=np.inf) <= slo.ttft_s
        tpot_ok = np.isnan(tpot) | (np.nan_to_num(tpot, nan=0.0) <= slo.tpot_s)
        return ok & ttft_ok & tpot_ok

    def select(self, mask: NDArray[np.bool_], duration_s: float, gpu_hours: float) -> RunOutcomes:
        return RunOutcomes(self.arrival_s[mask], self.input_tokens[mask], self.output_tokens[mask],
                           self.status[mask], self.ttft_s[mask], self.e2e_s[mask], duration_s, gpu_hours)


def _pct_ms(values: NDArray[np.float64], q: float) -> float | None:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    return round(float(np.percentile(finite, q)) * 1000.0, 3)


def summarize(out: RunOutcomes, slo: Slo) -> dict[str, Any]:
    """One run's `summary.json` entry (keys in SUMMARY_KEYS, plus `slo`)."""
    n = int(out.status.size)
    ok = out.status == OK
    completed = int(ok.sum())
    good = int(out.meets_slo(slo).sum())
    duration = max(out.duration_s, 1e-9)
    tokens = int(out.output_tokens[ok].sum())
    return {
        "arrived": n,
        "completed": completed,
        "rejected": int((out.status == REJECTED).sum()),
        "errors": int((out.status == ERROR).sum()),
        "incomplete": int((out.status == INCOMPLETE).sum()),
        "preempted": out.preempted,
        "ttft_p50_ms": _pct_ms(out.ttft_s[ok], 50),
        "ttft_p99_ms": _pct_ms(out.ttft_s[ok], 99),
        "tpot_p50_ms": _pct_ms(out.tpot_s[ok], 50),
        "tpot_p99_ms": _pct_ms(out.tpot_s[ok], 99),
        "e2e_p50_ms": _pct_ms(out.e2e_s[ok], 50),
        "e2e_p99_ms": _pct_ms(out.e2e_s[ok], 99),
        "throughput_tok_s": round(tokens / duration, 3),
        "goodput_rps": round(good / duration, 4),
        "slo_attainment": round(good / n, 5) if n else None,
        "gpu_hours": round(out.gpu_hours, 4),
        "duration_s": round(out.duration_s, 3),
        "slo": asdict(slo),
    }


def per_hour(out: RunOutcomes, slo: Slo, hour_s: float = 3600.0,
             gpu_hours_by_hour: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """The summary for each hour of arrivals (requests belong to the hour they arrived in)."""
    num_hours = max(1, math.ceil(out.duration_s / hour_s - 1e-9))
    hour_of = np.minimum((out.arrival_s // hour_s).astype(np.int64), num_hours - 1)
    rows = []
    for h in range(num_hours):
        gpu_h = gpu_hours_by_hour[h] if gpu_hours_by_hour is not None and h < len(gpu_hours_by_hour) else 0.0
        span = min(hour_s, out.duration_s - h * hour_s)
        row = summarize(out.select(hour_of == h, span, gpu_h), slo)
        row["hour"] = h
        rows.append(row)
    return rows


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)
