"""Instructions per scheduler cycle of two checkouts: this tree against a baseline tree.

    python benchmarks/scheduler_instructions_ab.py BASELINE_DIR [--cycles 1100] [--base-cycles 100] [--calls-only]

Wall-clock ratios from benchmarks/scheduler_ab.py swing by tens of percent on a shared machine;
instruction counts do not. This runs the same bench (`loadgen.sim.bench.bench_scheduler`, 256
running, 4096 waiting) under valgrind's cachegrind (no cache simulation) in a fresh interpreter
of each tree, twice per tree and variant: with `--cycles` and with `--base-cycles`. The
difference, divided by the difference in cycles, is the instructions one cycle costs, set-up
and interpreter start excluded. A cycle here includes what the bench does around the two timed
calls (topping the queue up with `add_request`, the counting executor), identical in both
trees except for `add_request` itself. String hashing is fixed (`PYTHONHASHSEED=0`) so both
trees do the same dict and set work. Variants as in scheduler_ab.py: as shipped (no TPOT
target, step sizer off) and with `admission.target_tpot_s = 0.1` (step sizer on). Needs
`valgrind` on PATH; each run takes about 20-60 s.

`--calls-only` counts what `tidal bench scheduler` times and nothing else: the instructions
inside `schedule()` and `on_step_done()` of the `--cycles` timed cycles (the fill-up before
them, `add_request` and the executor left out). The bench runs under callgrind with
collection off except inside `functools.reduce`, through which a subclass of `Scheduler`
routes exactly those two calls once the bench's timed loop has started (the core never calls
`reduce`), and callgrind writes one count per call, so each cycle's count is known: the table
gives their mean, median and 99th percentile, the tail without the machine's noise. The
routing itself adds about 2.5 k instructions per cycle, the same in both trees. One run per
tree and variant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CODE = """
import functools, sys
import loadgen.sim.bench as b
if sys.argv[1] == "tpot":
    b.AdmissionConfig = functools.partial(b.AdmissionConfig, target_tpot_s=0.1)
b.bench_scheduler(256, 4096, int(sys.argv[2]))
"""

_CALLS_ONLY_CODE = """
import functools, sys
import loadgen.sim.bench as b
if sys.argv[1] == "tpot":
    b.AdmissionConfig = functools.partial(b.AdmissionConfig, target_tpot_s=0.1)
reduce, timing = functools.reduce, []
class _Clock:  # the bench reads it first at its first timed cycle
    @staticmethod
    def perf_counter():
        timing.append(True)
        return 0.0
    thread_time = perf_counter
b.time = _Clock
class Counted(b.Scheduler):
    def schedule(self, now):
        if timing:
            return reduce(lambda f, a: f(a), (now,), super().schedule)
        return super().schedule(now)
    def on_step_done(self, plan, result, now):
        if timing:
            return reduce(lambda f, a: f(*a), ((plan, result, now),), super().on_step_done)
        return super().on_step_done(plan, result, now)
b.Scheduler = Counted
b.bench_scheduler(256, 4096, int(sys.argv[2]))
"""


def _instructions(tree: Path, variant: str, cycles: int) -> int:
    """Instructions the whole interpreter run executed (cachegrind's `summary:` line)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}  # same hashes, same dict work
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cachegrind.out"
        subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
                        sys.executable, "-c", _CODE, variant, str(cycles)],
                       cwd=tree, env=env, check=True, capture_output=True)
        summary = next(line for line in out.read_text().splitlines() if line.startswith("summary:"))
    return int(summary.split()[1])


def _calls_instructions(tree: Path, variant: str, cycles: int) -> list[int]:
    """Instructions inside each timed cycle's `schedule()` and `on_step_done()`, sorted (callgrind,
    collection toggled, one dump per call: `out.N` is the N-th call)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                        "--dump-after=functools_reduce", f"--callgrind-out-file={out}",
                        sys.executable, "-c", _CALLS_ONLY_CODE, variant, str(cycles)],
                       cwd=tree, env=env, check=True, capture_output=True)
        per_call = []
        for n in range(1, 2 * cycles + 1):
            text = Path(f"{out}.{n}").read_text()
            per_call.append(int(next(line for line in text.splitlines() if line.startswith("totals:")).split()[1]))
    return sorted(a + b for a, b in zip(per_call[0::2], per_call[1::2], strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--cycles", type=int, default=1100)
    ap.add_argument("--base-cycles", type=int, default=100)
    ap.add_argument("--calls-only", action="store_true",
                    help="count only schedule() and on_step_done() of the timed cycles (callgrind)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    if args.cycles <= args.base_cycles and not args.calls_only:
        print(f"--cycles={args.cycles} must be above --base-cycles={args.base_cycles}", file=sys.stderr)
        return 2
    trees = {"baseline": args.baseline.resolve(), "this": Path(__file__).resolve().parents[1]}
    if args.calls_only:
        return _calls_only(trees, args.cycles)
    print("| variant | tree | instructions per cycle |\n|---|---|---|")
    for variant in ("shipped", "tpot"):
        per_cycle: dict[str, float] = {}
        for name, tree in trees.items():
            hi, lo = _instructions(tree, variant, args.cycles), _instructions(tree, variant, args.base_cycles)
            per_cycle[name] = (hi - lo) / (args.cycles - args.base_cycles)
            print(f"| {variant} | {name} | {per_cycle[name]:,.0f} |", flush=True)
        print(f"| {variant} | this / baseline | {per_cycle['this'] / per_cycle['baseline']:.4f} |", flush=True)
    return 0


def _calls_only(trees: dict[str, Path], cycles: int) -> int:
    print("| variant | tree | instructions in schedule() + on_step_done(): mean | p50 | p99 |\n|---|---|---|---|---|")
    for variant in ("shipped", "tpot"):
        stats: dict[str, tuple[float, float, float]] = {}
        for name, tree in trees.items():
            counts = _calls_instructions(tree, variant, cycles)
            stats[name] = (statistics.fmean(counts), statistics.median(counts), counts[int(0.99 * (len(counts) - 1))])
            print(f"| {variant} | {name} | " + " | ".join(f"{v:,.0f}" for v in stats[name]) + " |", flush=True)
        ratios = (t / b for t, b in zip(stats["this"], stats["baseline"], strict=True))
        print(f"| {variant} | this / baseline | " + " | ".join(f"{r:.4f}" for r in ratios) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
