"""The scheduler cycle with prefix caching on and no hits, against caching off, side by side.

    python benchmarks/prefix_cache_cycle.py [--baseline DIR] [--rounds 8] [--cycles 2000] [--off-hashed]

`tidal bench scheduler`'s setup (256 running, 4096 waiting) in three modes: the cache off; on,
with prompts that carry no block hashes; on, with every prompt hashed and unique (the cache
consulted and filled, never hit). Each round is one fresh interpreter per tree, running the
modes side by side (`loadgen.sim.bench.bench_interleaved`: one scheduler per mode, stepped in
turn, cycle by cycle, so a shared machine's slow spells fall on each alike); rounds alternate
which tree goes first, and round r uses seed r. With `--baseline` (a checkout of another
commit) the same bench harness, this tree's `loadgen/sim/bench.py`, drives that tree's core.

Reported per tree and mode: the medians over rounds of each run's p50 thread CPU time per cycle
(the steadier figure on a shared machine) and p50 wall time; the ratio of each mode to `off` in
the same tree, as a ratio of those medians and as the median (and range) of the per-round
ratios; with a baseline, each mode's ratio this / baseline. `--off-hashed` adds a fourth mode,
the cache off with every prompt carrying its hashes all the same: what holding them costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tree_run import json_from_tree

MODES = {"off": (False, False), "on_unhashed": (True, False), "on_hashed_no_hits": (True, True)}
# `--off-hashed`: the cache off, every prompt carrying its unique hashes all the same (unused):
# what holding the hashes costs, apart from the cache's work with them.
OFF_HASHED = {"off_hashed": (False, True)}
KEYS = ("cpu_p50_us", "p50_us")
HARNESS = Path(__file__).resolve().parents[1] / "loadgen" / "sim" / "bench.py"
# The harness is loaded from its file, so its `tidal_core` imports resolve to the tree under test.
_CODE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("tidal_bench_harness", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
modes = json.loads(sys.argv[2])
print(json.dumps(bench.bench_interleaved(modes, 256, 4096, int(sys.argv[3]), seed=int(sys.argv[4]))))
"""


def _once(tree: Path, modes: dict[str, tuple[bool, bool]], cycles: int, seed: int) -> dict[str, dict[str, float]]:
    result: dict[str, dict[str, float]] = json_from_tree(tree, _CODE, str(HARNESS), json.dumps(modes), str(cycles),
                                                          str(seed))
    return result


def measure(trees: dict[str, Path], rounds: int, cycles: int, modes: dict[str, tuple[bool, bool]]) -> dict[str, Any]:
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(n, m): [] for n in trees for m in modes}
    names = list(trees)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for mode, result in _once(trees[name], modes, cycles, seed=r).items():
                runs[(name, mode)].append(result)
    out: dict[str, Any] = {"rounds": rounds, "cycles": cycles, "trees": {n: str(t) for n, t in trees.items()}}
    for name in trees:
        med = {m: {k: statistics.median(x[k] for x in runs[(name, m)]) for k in KEYS} for m in modes}
        off = runs[(name, "off")]
        paired = {m: sorted(x["cpu_p50_us"] / o["cpu_p50_us"] for x, o in zip(runs[(name, m)], off, strict=True))
                  for m in modes}
        out[name] = {
            "median": med,
            "ratio_vs_off": {m: {k: round(med[m][k] / med["off"][k], 3) for k in KEYS} for m in modes},
            "per_round_cpu_ratio_vs_off": {m: {"median": round(statistics.median(v), 3), "min": round(v[0], 3),
                                               "max": round(v[-1], 3)} for m, v in paired.items()},
        }
    if "baseline" in trees:
        out["this_vs_baseline"] = {m: {k: round(out["this"]["median"][m][k] / out["baseline"]["median"][m][k], 3)
                                       for k in KEYS} for m in modes}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, measured alongside")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--off-hashed", action="store_true", help="add the mode: cache off, prompts hashed all the same")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    result = measure(trees, args.rounds, args.cycles, {**MODES, **(OFF_HASHED if args.off_hashed else {})})
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
