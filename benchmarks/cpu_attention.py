"""The CPU decode step with the in-place decode attention kernel and with gather + SDPA, side by side.

Two offline engines over SmolLM2-135M-Instruct (float32, one torch thread, the `continuous`
core preset, block size 16), one with `EngineSpec.cpu_attention` on (actors/models/cpu_attention.py:
decodes read the KV blocks in place) and one off (every decode's blocks gathered with
`index_select`, SDPA with a length mask), in the same process. For each prompt length and batch
size both run the same requests (`--prompt` tokens each, greedy, `ignore_eos`) in alternating
rounds: the decode steps' CPU time (this thread's, so a neighbour's load moves it less than wall
time) and the generated tokens, which must be the same both ways. Prints per (prompt, batch): ms
of CPU per decode step off -> on and the ratio on / off (below 1: faster), medians over rounds.

    python benchmarks/cpu_attention.py [--prompts 128,300] [--batches 1,8,16] [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_gemm import offline_engine, run_steps  # the same offline harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _engine(kernel: bool) -> Any:
    ex, cfg = offline_engine(kv_cache_gb=0.6, cpu_attention=kernel)
    if ex.runner.cpu_decode != kernel:
        raise SystemExit(f"cpu_attention={kernel}: the runner's decode path is not the one asked for")
    return ex, cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="128,300")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    engines = {True: _engine(True), False: _engine(False)}
    rows = []
    for prompt in (int(p) for p in args.prompts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for r in range(args.rounds):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    runs[on].append(run_steps(*engines[on], batch, prompt, args.steps, seed=r))
            med = {on: statistics.median(x["decode_ms_per_step"] for x in runs[on]) for on in runs}
            same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[True], runs[False], strict=True))
            row = {"prompt": prompt, "batch": batch, "on_ms": med[True], "off_ms": med[False],
                   "ratio": med[True] / med[False], "same_tokens": same,
                   "on_all": [x["decode_ms_per_step"] for x in runs[True]],
                   "off_all": [x["decode_ms_per_step"] for x in runs[False]]}
            rows.append(row)
            print(f"prompt {prompt:4d} batch {batch:3d}: decode step {med[False]:7.1f} -> {med[True]:7.1f} ms CPU "
                  f"(x{row['ratio']:.2f}); same greedy tokens: {same}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
