"""The CPU model step with one torch thread and with more, side by side (what `engine.torch_threads` buys).

One offline SmolLM2 engine (`continuous`, the converted cache, float32), the same greedy requests
run in alternating rounds with `torch.set_num_threads` at each count of `--threads`; reported per
count: the prefill's wall ms per prompt token and the decode step's wall ms (median of the rounds),
and whether the greedy tokens match the first count's. Wall time, not CPU time: a second thread
is worth what it shortens the step, and its spinning is CPU that buys nothing. Run it on a quiet
box; the serving figures are `benchmarks/vs_vllm_cpu.py --orders tidal-only --tidal-config ...`.

    python benchmarks/cpu_threads.py [--threads 1,2] [--shapes 4x128,8x256] [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_gemm import offline_engine, run_steps  # the same offline harness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="4x128,8x256", help="BATCHxPROMPT, comma-separated")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    ex, cfg = offline_engine()
    rows = []
    for shape in args.shapes.split(","):
        batch, prompt = (int(v) for v in shape.split("x"))
        runs: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
        for _ in range(args.rounds):
            for c in counts:
                torch.set_num_threads(c)
                runs[c].append(run_steps(ex, cfg, batch, prompt, args.steps, seed=0, clock=time.perf_counter))
        first = runs[counts[0]][0]["outputs"]
        for c in counts:
            med = {k: statistics.median(r[k] for r in runs[c]) for k in ("prefill_ms_per_token", "decode_ms_per_step")}
            rows.append({"batch": batch, "prompt": prompt, "threads": c,
                         "prefill_ms_per_token": round(med["prefill_ms_per_token"], 3),
                         "decode_ms_per_step": round(med["decode_ms_per_step"], 2),
                         "same_tokens": all(r["outputs"] == first for r in runs[c])})
    torch.set_num_threads(counts[0])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    base = {(r["batch"], r["prompt"]): r for r in rows if r["threads"] == counts[0]}
    print("| batch, prompt | threads | prefill wall ms per token | ratio | decode step wall ms | ratio "
          "| same greedy tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = base[(r["batch"], r["prompt"])]
        print(f"| {r['batch']}, {r['prompt']} | {r['threads']} | {r['prefill_ms_per_token']} | "
              f"{r['prefill_ms_per_token'] / b['prefill_ms_per_token']:.2f} | {r['decode_ms_per_step']} | "
              f"{r['decode_ms_per_step'] / b['decode_ms_per_step']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
