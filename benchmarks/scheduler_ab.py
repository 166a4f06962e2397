"""`tidal bench scheduler` of two checkouts side by side: this tree against a baseline tree.

    python benchmarks/scheduler_ab.py BASELINE_DIR [--rounds 5] [--running 256] [--waiting 4096]

Runs the bench (`loadgen.sim.bench.bench_scheduler`, the code behind `tidal bench scheduler
--running 256 --waiting 4096`) alternately in a fresh interpreter of each tree, `--rounds`
times, so both see the same machine noise, and prints the medians of p50 / p99 wall time and
p50 thread CPU time per tree, plus their ratio. Two variants: the bench as shipped (no TPOT
target, so the step sizer is off) and with `admission.target_tpot_s = 0.1` (step sizer on;
in a baseline tree, whatever held the TPOT target there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tree_run import json_from_tree

_CODE = """
import functools, json, sys
import loadgen.sim.bench as b
if sys.argv[1] == "tpot":
    b.AdmissionConfig = functools.partial(b.AdmissionConfig, target_tpot_s=0.1)
r = b.bench_scheduler(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
print(json.dumps(r))
"""


def _once(tree: Path, variant: str, running: int, waiting: int, cycles: int) -> dict[str, float]:
    result: dict[str, float] = json_from_tree(tree, _CODE, variant, str(running), str(waiting), str(cycles))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=4096)
    ap.add_argument("--cycles", type=int, default=3000)
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this": Path(__file__).resolve().parents[1]}
    print("| variant | tree | p50 us | p99 us | CPU p50 us |\n|---|---|---|---|---|")
    for variant in ("shipped", "tpot"):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(_once(tree, variant, args.running, args.waiting, args.cycles))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("p50_us", "p99_us", "cpu_p50_us")}
               for name, rs in runs.items()}
        for name in trees:
            m = med[name]
            print(f"| {variant} | {name} | {m['p50_us']:.1f} | {m['p99_us']:.1f} | {m['cpu_p50_us']:.1f} |")
        ratio = med["this"]["p50_us"] / med["baseline"]["p50_us"]
        print(f"| {variant} | this / baseline (p50) | {ratio:.2f} | "
              f"{med['this']['p99_us'] / med['baseline']['p99_us']:.2f} | "
              f"{med['this']['cpu_p50_us'] / med['baseline']['cpu_p50_us']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
