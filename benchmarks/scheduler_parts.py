"""Two parts of the scheduler's cycle on their own, in this tree and optionally a baseline tree.

    python benchmarks/scheduler_parts.py [--baseline DIR] [--rounds 5]

- `forecast`: the first slot's wait forecast (core/departures.py, `steps_until(1, ...)`) for
  256 running requests, their produced tokens uniform in 0-300, over 512 recorded output lengths
  uniform in 16-512: what the regime's read of the predicted delay paid every 50 ms before it
  was formed only where it counts (benchmarks/RESULTS.md, "The slot forecast formed only where it
  counts").
- `tables up to N`: one rebuild of the step sizer's borrow and pressure tables (core/step_sizer.py,
  at its default quantiles 0.01 and 0.05) from 512 output lengths uniform in 16-N, N = 512 (the
  bench's) and 4,096.

Each round runs every part in a fresh interpreter of each tree in turn (the median of 200 calls
each), alternating which tree goes first; the table prints the median over rounds in µs, and with
a baseline the ratio this / baseline. A baseline whose `_past_this_step` builds one table per
call (before 93ab2f8) is called once per quantile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tree_run import json_from_tree

_CODE = """
import inspect, json, random, statistics, time
from tidal_core.departures import steps_until
from tidal_core.step_sizer import _past_this_step
rng = random.Random(0)
lengths = sorted(rng.randint(16, 512) for _ in range(512))
produced = [rng.randint(0, 300) for _ in range(256)]
one_per_call = len(inspect.signature(_past_this_step).parameters) == 2
def tables(lengths):
    return (_past_this_step(lengths, 0.01), _past_this_step(lengths, 0.05)) if one_per_call else \\
        _past_this_step(lengths, 0.01, 0.05)
def median_us(fn, *args):
    times = []
    for _ in range(200):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6
out = {"forecast": median_us(steps_until, 1, produced, lengths)}
for top in (512, 4096):
    out[f"tables up to {top}"] = median_us(tables, [rng.randint(16, top) for _ in range(512)])
print(json.dumps(out))
"""


def _once(tree: Path) -> dict[str, float]:
    result: dict[str, float] = json_from_tree(tree, _CODE)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[name].append(_once(trees[name]))
    parts = list(runs["this"][0])
    med = {name: {p: statistics.median(run[p] for run in rs) for p in parts} for name, rs in runs.items()}
    names = list(trees)
    print("| part | " + " | ".join(f"{n} µs" for n in names) + (" | this / baseline |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for p in parts:
        cells = [f"{med[n][p]:.1f}" for n in names]
        if len(names) > 1:
            cells.append(f"{med['this'][p] / med['baseline'][p]:.2f}")
        print(f"| {p} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
