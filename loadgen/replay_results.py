"""What a replay leaves behind: per-request records, the shared summary, per-hour rows and plots.

Owns: `Recorder` (turns each finished request into one `requests.jsonl` line as it finishes, and
into the arrays of a `loadgen.report.RunOutcomes`), `drift_stats`, and `write_outputs`
(`summary.json` keyed by the run name in the simulator's schema plus `drift`, `client` and
`replay` entries; `per_hour.json`; the shared plots from `loadgen.plots`).

Times: every `*_s` in the JSON is wall-clock seconds of the replay, from its start. A trace
compressed with `time_scale` (0.1 = ten times faster) is played as loaded, so those seconds are
the trace's own seconds times `time_scale`. Per-hour rows and the timeline plot use *trace*
hours (3600 * time_scale wall seconds each), so a compressed day still has 24 rows that line up
with the simulator's; each request's `trace_s` is its arrival on the uncompressed trace's
clock (`scheduled_s / time_scale`). TTFT, TPOT and E2E are measured from the moment the request
went on the wire; add the drift for the latency a user arriving on schedule would have seen.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from loadgen import plots
from loadgen.client import RequestResult
from loadgen.records import Trace
from loadgen.report import ERROR, INCOMPLETE, OK, REJECTED, RunOutcomes, Slo, per_hour, summarize, write_json

ITL_LIST_MAX = 256  # longer streams store summary stats of their inter-token latencies instead
STATUS_CODES = {"ok": OK, "rejected": REJECTED, "error": ERROR, "incomplete": INCOMPLETE}


def _r(value: float, digits: int = 6) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), digits)


def itl_field(itl_ms: list[float]) -> list[float] | dict[str, float]:
    if len(itl_ms) <= ITL_LIST_MAX:
        return [round(v, 3) for v in itl_ms]
    arr = np.asarray(itl_ms)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"n": int(arr.size), "mean": round(float(arr.mean()), 3), "p50": round(float(p50), 3),
            "p90": round(float(p90), 3), "p99": round(float(p99), 3), "max": round(float(arr.max()), 3)}


class Recorder:
    """Collects results of one replay of `trace` (schedule in wall seconds) started at `start_t`."""

    def __init__(self, trace: Trace, requests_path: Path, start_t: float, time_scale: float = 1.0) -> None:
        n = len(trace)
        self.trace = trace
        self.start_t = start_t
        self.time_scale = time_scale
        self.launched = np.zeros(n, dtype=bool)
        self.status = np.full(n, INCOMPLETE, dtype=np.int8)
        self.input_tokens = trace.input_tokens.astype(np.int64).copy()
        self.output_tokens = np.zeros(n, dtype=np.int64)
        self.ttft = np.full(n, np.nan)
        self.e2e = np.full(n, np.nan)
        self.drift = np.full(n, np.nan)  # on the wire minus scheduled
        self.dispatch_drift = np.full(n, np.nan)  # task started minus scheduled (event-loop lateness)
        self.cached_tokens = np.full(n, -1, dtype=np.int64)  # -1: not reported
        self.num_recorded = 0
        self.retry_lag = np.zeros(n)  # last attempt's send minus the first send (0 without retries)
        self.retry_rows: list[dict[str, Any]] = []
        requests_path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = requests_path.open("w", encoding="utf-8")

    def on_launch(self, index: int, now: float) -> float:
        """Mark `index` launched; returns its dispatch drift in seconds."""
        self.launched[index] = True
        drift = now - self.start_t - float(self.trace.arrival_s[index])
        self.dispatch_drift[index] = drift
        return drift

    def record(self, res: RequestResult) -> dict[str, Any]:
        i, t0 = res.index, self.start_t
        scheduled = float(self.trace.arrival_s[i])
        sent = res.sent_t - t0 if math.isfinite(res.sent_t) else math.nan
        first = res.first_sent_t - t0 if math.isfinite(res.first_sent_t) else sent
        ttft = res.first_token_t - res.sent_t if math.isfinite(res.first_token_t) else math.nan
        e2e = res.end_t - res.sent_t if math.isfinite(res.end_t) else math.nan
        tpot = (e2e - ttft) / (res.output_tokens - 1) if res.status == "ok" and res.output_tokens >= 2 else math.nan
        self.status[i] = STATUS_CODES[res.status]
        self.input_tokens[i] = res.input_tokens
        self.output_tokens[i] = res.output_tokens
        self.cached_tokens[i] = res.cached_tokens if res.cached_tokens is not None else -1
        self.ttft[i], self.e2e[i], self.drift[i] = ttft, e2e, first - scheduled
        self.retry_lag[i] = sent - first if math.isfinite(sent - first) else 0.0
        self.num_recorded += 1
        record = {"index": i, "scheduled_s": _r(scheduled), "trace_s": _r(scheduled / self.time_scale),
                  "sent_s": _r(sent), "drift_s": _r(first - scheduled),
                  "status": res.status, "http_status": res.http_status, "ttft_s": _r(ttft), "e2e_s": _r(e2e),
                  "tpot_s": _r(tpot), "itl_ms": itl_field(res.inter_token_ms()), "output_tokens": res.output_tokens,
                  "input_tokens": res.input_tokens, "requested_output_tokens": int(self.trace.output_tokens[i]),
                  "usage_reported": res.usage_reported, "cached_tokens": res.cached_tokens,
                  "retry_after_s": res.retry_after_s, "error": res.error,
                  "error_code": res.error_code, "refused_by": res.refused_by}
        if res.attempts > 1 or not math.isnan(res.first_sent_t):
            record.update(attempts=res.attempts, first_sent_s=_r(first), retries=res.retries,
                          client_ttft_s=_r(ttft + sent - first))
            self.retry_rows.append({"attempts": res.attempts, "retries": res.retries, "http_status": res.http_status})
        self._file.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        self._file.close()

    def outcomes(self, duration_s: float, gpu_hours: float) -> RunOutcomes:
        """Outcomes of the launched requests (all of them unless the run was interrupted)."""
        m = self.launched
        return RunOutcomes(self.trace.arrival_s[m].astype(np.float64), self.input_tokens[m], self.output_tokens[m],
                           self.status[m], self.ttft[m], self.e2e[m], duration_s, gpu_hours)


def drift_stats(drift_s: NDArray[np.float64], dispatch_s: NDArray[np.float64]) -> dict[str, Any]:
    """p50/p99/max (ms) of send drift (on the wire minus scheduled) and of event-loop lateness."""
    d = drift_s[np.isfinite(drift_s)]
    disp = dispatch_s[np.isfinite(dispatch_s)]
    if d.size == 0:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None, "over_50ms": 0,
                "dispatch_p99_ms": None}
    p50, p99 = np.percentile(d, [50, 99])
    return {"n": int(d.size), "p50_ms": round(float(p50) * 1e3, 3), "p99_ms": round(float(p99) * 1e3, 3),
            "max_ms": round(float(d.max()) * 1e3, 3), "mean_ms": round(float(d.mean()) * 1e3, 3),
            "over_50ms": int((d > 0.050).sum()),
            "dispatch_p99_ms": round(float(np.percentile(disp, 99)) * 1e3, 3) if disp.size else None}


def prefix_cache_stats(rec: Recorder) -> dict[str, Any] | None:
    """What the server said its prefix cache saved, over the completed requests that reported it:
    cached / prompt tokens (the token hit rate) and the requests with any hit. None when no
    response reported cached tokens (a server without the field)."""
    m = rec.launched & (rec.status == STATUS_CODES["ok"]) & (rec.cached_tokens >= 0)
    if not m.any():
        return None
    cached, prompt = int(rec.cached_tokens[m].sum()), int(rec.input_tokens[m].sum())
    return {"requests": int(m.sum()), "requests_with_hits": int((rec.cached_tokens[m] > 0).sum()),
            "cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": round(cached / prompt, 4) if prompt else 0.0}


def write_outputs(out_dir: Path, run_name: str, rec: Recorder, *, slo: Slo, duration_s: float, time_scale: float,
                  gpus: float, extra: dict[str, Any], plot: bool = True) -> dict[str, Any]:
    """summary.json, per_hour.json and the plots; returns this run's summary entry."""
    gpu_hours = gpus * duration_s / 3600.0
    outcomes = rec.outcomes(duration_s, gpu_hours)
    summary = summarize(outcomes, slo)
    summary["drift"] = drift_stats(rec.drift[rec.launched], rec.dispatch_drift[rec.launched])
    cache = prefix_cache_stats(rec)
    if cache is not None:
        summary["prefix_cache"] = cache
    if rec.retry_rows:  # the replay retried refusals: per original request, and as the user waited
        from loadgen.replay_retries import retry_summary

        lag = rec.retry_lag[rec.launched]
        client = dataclasses.replace(outcomes, ttft_s=outcomes.ttft_s + lag, e2e_s=outcomes.e2e_s + lag)
        summary["client_goodput_rps"] = summarize(client, slo)["goodput_rps"]
        summary["retries"] = retry_summary(rec.retry_rows, extra.get("replay", {}).get("retries"))
    summary.update(extra)
    hour_s = 3600.0 * time_scale
    num_hours = max(1, math.ceil(duration_s / hour_s - 1e-9))
    by_hour = [gpus * min(hour_s, duration_s - h * hour_s) / 3600.0 for h in range(num_hours)]
    rows = per_hour(outcomes, slo, hour_s=hour_s, gpu_hours_by_hour=by_hour)
    write_json(out_dir / "summary.json", {run_name: summary})
    write_json(out_dir / "per_hour.json", {run_name: rows})
    if plot:
        _plots(out_dir, run_name, outcomes, rows, slo, time_scale, duration_s)
    return summary


def _plots(out_dir: Path, run_name: str, out: RunOutcomes, rows: list[dict[str, Any]], slo: Slo,
           time_scale: float, duration_s: float) -> None:
    trace_s = duration_s / time_scale
    # About 100 bins whatever the length, 5-minute bins at most (the simulator's choice for a day).
    bin_s = float(min(300.0, max(1.0, trace_s / 100.0)))
    plots.plot_timeline(out_dir / "timeline.png", out.arrival_s / time_scale, trace_s, [],
                        f"{run_name}: offered arrival rate (trace time; played at time_scale {time_scale:g})",
                        bin_s=bin_s)
    plots.plot_hourly(out_dir / "ttft_p99_per_hour.png", {run_name: rows}, "ttft_p99_ms", "TTFT p99 (ms)",
                      f"{run_name}: TTFT p99 per trace hour", log=True, hline=slo.ttft_s * 1000.0)
    ok = out.status == OK
    plots.plot_cdf(out_dir / "latency_cdf.png",
                   {"TTFT": out.ttft_s[ok], "TPOT": out.tpot_s[ok], "E2E": out.e2e_s[ok]},
                   "seconds (from the request on the wire)", f"{run_name}: latency CDF of completed requests")
