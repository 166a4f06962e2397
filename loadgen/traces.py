"""Traces by name or path: the one entry point the simulator, the CLI and the locust file use.

Owns `load_trace` and the named traces:
- "azure-code", "azure-conv": Azure LLM inference trace 2023, 1 h each (real);
- "mooncake-conv", "mooncake-synthetic": Mooncake FAST'25, long contexts (real);
- "day-in-life": 24 h synthetic day with ServeGen's real hour-of-day shape (m-large);
- "day-in-life-sharp": 24 h synthetic conversation day with a ~35x peak/trough;
- any .csv (Azure or BurstGPT) or .jsonl (Mooncake or ours) path.

Re-exports the record types and readers so `from loadgen.traces import ...` covers them.
docs/traces.md documents every trace, its source and the exact usage.
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from loadgen.arrivals import servegen_day_curve, sharp_day_curve, synthetic_day
from loadgen.datasets import TRACE_FILES, trace_file
from loadgen.daycurve import read_servegen_rates
from loadgen.ratecurve import RateCurve
from loadgen.records import Trace, TraceRecord
from loadgen.trace_readers import (
    read_azure_csv,
    read_burstgpt_csv,
    read_jsonl,
    read_mooncake_jsonl,
    read_trace_file,
    write_jsonl,
)

__all__ = [
    "DEFAULT_DAY_CV",
    "DEFAULT_DAY_PEAK_RPS",
    "NAMED_TRACES",
    "Trace",
    "TraceRecord",
    "load_trace",
    "read_azure_csv",
    "read_burstgpt_csv",
    "read_jsonl",
    "read_mooncake_jsonl",
    "read_servegen_rates",
    "read_trace_file",
    "write_jsonl",
]

SYNTHETIC_DAYS = ("day-in-life", "day-in-life-sharp")
NAMED_TRACES: tuple[str, ...] = (*TRACE_FILES, *SYNTHETIC_DAYS)

# The inter-arrival CV measured on the Azure 2023 conversation trace (1.09 over its hour; the
# code trace is far burstier, 13). Synthetic days default to it; pass cv= to stress burstiness.
DEFAULT_DAY_CV = 1.1
DEFAULT_DAY_PEAK_RPS = 20.0
DEFAULT_DAY_LENGTHS = "azure-conv"

_COMMON_KW = {"time_scale", "rate_scale", "max_input", "max_output"}
_SYNTHETIC_KW = {"cv", "lengths", "peak_rps", "mean_rps", "model_column", "peak_to_trough"}
_FILE_KW = {"model", "log_type", "drop_failed"}
# A real trace may be asked for a little more than it holds (azure-conv is 0.97 h: hours=1 is fine).
_HOURS_SLACK = 1.1


def load_trace(name_or_path: str | Path, *, hours: float | None = None, seed: int = 0,
               data_dir: str | Path | None = None, **kw: Any) -> Trace:
    """A named trace or a trace file, optionally cut, clipped, compressed and re-rated.

    Common keywords: `time_scale` (0.1 plays 10x faster), `rate_scale` (seeded thinning or
    replication), `max_input`/`max_output` (clip lengths). Synthetic days also take `cv`,
    `lengths`, `peak_rps` or `mean_rps`, `model_column` (day-in-life) and `peak_to_trough`
    (day-in-life-sharp). BurstGPT files take `model`, `log_type`, `drop_failed`.
    `hours` is measured before compression: it cuts a real trace, or sets a synthetic day's length.
    """
    name = str(name_or_path)
    allowed = _COMMON_KW | (_SYNTHETIC_KW if name in SYNTHETIC_DAYS else _FILE_KW)
    unknown = sorted(set(kw) - allowed)
    if unknown:
        raise TypeError(f"load_trace({name!r}) got unknown keyword(s) {unknown}; allowed: {sorted(allowed)}")
    if hours is not None and not (hours > 0.0 and math.isfinite(hours)):
        raise ValueError(f"hours={hours} must be finite and > 0")
    time_scale = float(kw.pop("time_scale", 1.0))
    rate_scale = float(kw.pop("rate_scale", 1.0))
    max_input, max_output = kw.pop("max_input", None), kw.pop("max_output", None)
    if name in SYNTHETIC_DAYS:
        trace = _synthetic(name, hours=24.0 if hours is None else hours, seed=seed, time_scale=time_scale,
                           max_input=max_input, max_output=max_output, data_dir=data_dir, **kw)
        time_scale = 1.0  # already applied, exactly, inside synthetic_day
    else:
        trace = _real(name, data_dir=data_dir, **kw)
        if hours is not None:
            trace = _cut(trace, hours)
        if max_input is not None or max_output is not None:
            trace = trace.clipped(max_input or max(int(trace.input_tokens.max(initial=1)), 1),
                                  max_output or max(int(trace.output_tokens.max(initial=1)), 1))
    if (time_scale, rate_scale) != (1.0, 1.0):
        trace = trace.scaled(time_scale=time_scale, rate_scale=rate_scale, seed=seed)
    return trace


def _real(name: str, *, data_dir: str | Path | None, **kw: Any) -> Trace:
    if name in TRACE_FILES:
        path = trace_file(name, data_dir)
        return read_trace_file(path, name=name, **kw)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"{name!r} is neither a named trace ({', '.join(NAMED_TRACES)}) nor an existing file")
    return read_trace_file(path, **kw)


def _cut(trace: Trace, hours: float) -> Trace:
    span_s = hours * 3600.0
    if span_s > trace.duration_s * _HOURS_SLACK:
        raise ValueError(f"{trace.name} covers only {trace.duration_s / 3600:.2f} h, not {hours:g} h; "
                         "use a synthetic day (day-in-life, day-in-life-sharp) for longer runs")
    return trace.window(0.0, span_s) if span_s < trace.duration_s else trace


def _synthetic(name: str, *, hours: float, seed: int, time_scale: float, max_input: int | None,
               max_output: int | None, data_dir: str | Path | None, cv: float = DEFAULT_DAY_CV,
               lengths: str = DEFAULT_DAY_LENGTHS, peak_rps: float | None = None, mean_rps: float | None = None,
               model_column: str | None = None, peak_to_trough: float | None = None) -> Trace:
    if peak_rps is not None and mean_rps is not None:
        raise ValueError("give peak_rps or mean_rps, not both")
    curve: RateCurve
    if name == "day-in-life":
        if peak_to_trough is not None:
            raise TypeError("peak_to_trough applies to day-in-life-sharp only (day-in-life's shape is ServeGen's)")
        curve = servegen_day_curve(model_column or "m-large", mean_rps=1.0, data_dir=data_dir)
    else:
        if model_column is not None:
            raise TypeError("model_column applies to day-in-life only (day-in-life-sharp is a designed shape)")
        curve = sharp_day_curve(peak_rps=1.0, peak_to_trough=35.0 if peak_to_trough is None else peak_to_trough)
    factor = mean_rps / curve.mean if mean_rps is not None else (peak_rps or DEFAULT_DAY_PEAK_RPS) / curve.peak
    return synthetic_day(curve.scaled(factor), cv=cv, lengths=lengths, seed=seed, hours=hours,
                         time_scale=time_scale, name=name, max_input=max_input, max_output=max_output,
                         data_dir=data_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m loadgen.traces NAME [options]`: print a trace's stats, optionally export it as JSONL."""
    parser = argparse.ArgumentParser(prog="python -m loadgen.traces", description=main.__doc__)
    parser.add_argument("trace", help=f"a named trace ({', '.join(NAMED_TRACES)}) or a .csv/.jsonl path")
    parser.add_argument("--hours", type=float, help="cut a real trace / length of a synthetic day")
    parser.add_argument("--seed", type=int, default=0)
    options = {"--time-scale": float, "--rate-scale": float, "--max-input": int, "--max-output": int,
               "--peak-rps": float, "--mean-rps": float, "--cv": float, "--lengths": str, "--peak-to-trough": float}
    for flag, kind in options.items():
        parser.add_argument(flag, type=kind)
    parser.add_argument("--out", help="write the trace here in tidalserve JSONL")
    args = parser.parse_args(argv)
    names = [flag[2:].replace("-", "_") for flag in options]
    kw = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        trace = load_trace(args.trace, hours=args.hours, seed=args.seed, **kw)
    except (TypeError, ValueError, KeyError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        write_jsonl(trace, args.out)
    print(json.dumps({"name": trace.name, "source": trace.source, **trace.stats()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
