"""Instructions per scheduler cycle with prefix caching off / on, counted by valgrind: a noise-free check.

    python benchmarks/prefix_cache_instructions.py [--baseline DIR] [--cycles 2400] [--timed 1000] [--off-hashed]

Wall and CPU time on a shared machine move by tens of percent from run to run; instruction
counts do not. Each mode of `prefix_cache_cycle.py` (cache off; on, prompts without hashes; on,
every prompt hashed and unique) runs `tidal bench scheduler`'s unit (this tree's
`loadgen/sim/bench.py` `BenchUnit`, 256 running, 4096 waiting, seed 0) for `--cycles` cycles
under `valgrind --tool=callgrind`, collecting only inside the timed part of the last `--timed`
cycles (`schedule()` + `on_step_done()`, run through `exec` so that callgrind's
`--toggle-collect=builtin_exec*` brackets exactly them). Imports also go through `exec`, so
each mode runs twice, with `--timed` and with a fifth of it timed, and the difference over the
extra cycles (by default cycles 1,400-2,200, all after the cache has begun to evict) is the
figure: instructions per timed cycle, and each mode's ratio to `off` (with `--baseline`, a
checkout of another commit, for that tree's core too). `PYTHONHASHSEED=0` fixes dict layouts.
Instructions are not time (cache misses are not counted), but a per-block cost shows in them
as it does in time. `--off-hashed` adds the mode of `prefix_cache_cycle.py --off-hashed`: the
cache off with every prompt carrying its hashes all the same (what holding them costs: their
lists are made and freed with the requests). Needs valgrind; about a minute per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODES = {"off": (False, False), "on_unhashed": (True, False), "on_hashed_no_hits": (True, True)}
OFF_HASHED = {"off_hashed": (False, True)}
HARNESS = Path(__file__).resolve().parents[1] / "loadgen" / "sim" / "bench.py"
_CODE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tidal_bench_harness", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
on, hashed, cycles, timed = sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
unit = bench.BenchUnit(256, 4096, 0, prefix_caching=on, hashed=hashed)
sched = unit.sched
step = compile("d = sched.schedule(unit.now); r = unit.ex.execute(d.plan); unit.now += 0.03; "
               "sched.on_step_done(d.plan, r, unit.now)", "timed", "exec")
for i in range(cycles):
    while sched.num_waiting < unit.num_waiting:
        unit._arrive()
    if i >= cycles - timed:
        exec(step)
    else:
        d = sched.schedule(unit.now); r = unit.ex.execute(d.plan); unit.now += 0.03
        sched.on_step_done(d.plan, r, unit.now)
"""


def _collected(tree: Path, mode: str, cycles: int, timed: int) -> int:
    on, hashed = {**MODES, **OFF_HASHED}[mode]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=builtin_exec*",
                              f"--callgrind-out-file={tmp}/callgrind.out", sys.executable, "-c", _CODE, str(HARNESS),
                              str(int(on)), str(int(hashed)), str(cycles), str(timed)],
                             cwd=tree, env=env, check=True, capture_output=True, text=True).stderr
    found = re.search(r"Collected\s*:\s*([\d,]+)", out)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out[-2000:]}")
    return int(found.group(1).replace(",", ""))


def measure(trees: dict[str, Path], cycles: int, timed: int, modes: dict[str, tuple[bool, bool]]) -> dict[str, Any]:
    short = max(1, timed // 5)
    out: dict[str, Any] = {"cycles": cycles, "timed": timed, "trees": {n: str(t) for n, t in trees.items()}}
    for name, tree in trees.items():
        per = {m: round((_collected(tree, m, cycles, timed) - _collected(tree, m, cycles, short)) / (timed - short))
               for m in modes}
        out[name] = {"instructions_per_cycle": per,
                     "ratio_vs_off": {m: round(v / per["off"], 3) for m, v in per.items()}}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, counted alongside")
    ap.add_argument("--cycles", type=int, default=2400)
    ap.add_argument("--timed", type=int, default=1000,
                    help="the last cycles counted (the bench's cache starts evicting after about 1,200)")
    ap.add_argument("--off-hashed", action="store_true", help="add the mode: cache off, prompts hashed all the same")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    result = measure(trees, args.cycles, args.timed, {**MODES, **(OFF_HASHED if args.off_hashed else {})})
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
