"""How well a front end that cannot look a prompt up estimates its uncached tokens (issue 15's
cache-aware admission at the door; tidal_core/cached_fit.py): on the Mooncake conversation trace,
each arriving prompt's tokens found cached at its unit, as the simulator's units peek them on
arrival, against three estimates made before the prompt arrived:

- `whole`: nothing cached (the door's backlog rule before stop 48);
- `share`: the share of the prompt tokens cached so far (the door's other rules before stop 48);
- `line`: the unit's `CachedFit`, fitted to the arrivals before this one (shipped).

Reported per estimate: the mean absolute error in tokens, the bias of the total (estimated over
true uncached tokens, less 1), and the median and 10th / 90th percentile relative errors for short
prompts (under 2,000 tokens) and long ones (5,000 and over). Also what one fit of the line costs
over a full window of these arrivals (`fit_us`: the median of 50, microseconds of this CPU), the
reason it is refitted every `REFIT_EVERY` arrivals and not at each verdict. The simulator's fleet runs the trace
(configs/sim.yaml's unit, adaptive, prefix caching on, least-loaded routing) the way
`benchmarks/prefix_serve.py` runs it beside Serve, so the default window is that benchmark's.

    python benchmarks/cached_estimate.py [--units 1] [--hours 0.05] [--rate 1] [--offset-min 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.prefix_serve import mooncake, simulate
from loadgen.report import Slo
from tidal_core.cached_fit import DEFAULT_WINDOW, CachedFit
from tidal_core.queues import UnitQueues


def record_arrivals(units: int, hours: float, offset_min: float, rate: float) -> list[tuple[int, int, int]]:
    """(unit, prompt tokens, cached tokens) of every interactive arrival, in order."""
    seen: list[tuple[int, int, int]] = []
    original = UnitQueues.arriving_uncached

    def arriving_uncached(self: UnitQueues, req: Any) -> int:
        uncached = original(self, req)
        seen.append((id(self), req.num_prompt_tokens, req.num_prompt_tokens - uncached))
        return uncached

    UnitQueues.arriving_uncached = arriving_uncached  # type: ignore[method-assign]
    try:
        simulate(mooncake(hours, offset_min, rate, 7000, 1024, 0), units, "load", Slo())
    finally:
        UnitQueues.arriving_uncached = original  # type: ignore[method-assign]
    return seen


def estimates(arrivals: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """Each arrival's uncached tokens as each estimate had it just before (per unit), and the truth."""
    fits: dict[int, CachedFit] = {}
    sums: dict[int, list[int]] = {}
    out: dict[str, list[float]] = {"true": [], "prompt": [], "whole": [], "share": [], "line": []}
    for unit, p, c in arrivals:
        fit = fits.setdefault(unit, CachedFit())
        cached, prompts = sums.setdefault(unit, [0, 0])
        out["true"].append(p - c)
        out["prompt"].append(p)
        out["whole"].append(p)
        out["share"].append(p * (1.0 - (cached / prompts if prompts else 0.0)))
        out["line"].append(fit.uncached(p))
        fit.observe(p, c)
        sums[unit] = [cached + c, prompts + p]
    return {k: np.asarray(v, dtype=float) for k, v in out.items()}


def fit_cost_us(arrivals: list[tuple[int, int, int]], repeats: int = 50) -> float:
    """Median microseconds of one fit over the last full window of `arrivals`."""
    fit = CachedFit()
    for _, p, c in arrivals[-DEFAULT_WINDOW:]:
        fit.observe(p, c)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fit._fit()
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e6, 1)


def errors(est: dict[str, np.ndarray], name: str) -> dict[str, Any]:
    true, prompt, e = est["true"], est["prompt"], est[name]
    rel = (e - true) / np.maximum(true, 1.0)
    row: dict[str, Any] = {"mean_abs_error_tokens": round(float(np.abs(e - true).mean()), 1),
                           "total_bias": round(float(e.sum() / true.sum() - 1.0), 4)}
    for label, mask in (("short", prompt < 2000), ("long", prompt >= 5000)):
        if mask.any():
            row[f"{label}_relative_error_p10_p50_p90"] = [round(float(x), 3) for x in
                                                         np.percentile(rel[mask], [10, 50, 90])]
            row[f"{label}_n"] = int(mask.sum())
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", type=int, default=1)
    p.add_argument("--hours", type=float, default=0.05)
    p.add_argument("--offset-min", type=float, default=0.0)
    p.add_argument("--rate", type=float, default=1.0)
    args = p.parse_args(argv)
    arrivals = record_arrivals(args.units, args.hours, args.offset_min, args.rate)
    est = estimates(arrivals)
    report = {"arrivals": len(arrivals), "units": args.units, "hours": args.hours, "rate": args.rate,
              "offset_min": args.offset_min,
              "true_cached_share": round(1.0 - float(est["true"].sum() / est["prompt"].sum()), 4),
              **{name: errors(est, name) for name in ("whole", "share", "line")},
              "fit_us": fit_cost_us(arrivals)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
