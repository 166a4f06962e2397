"""SmolLM2's linears on the GGUF's quantized blocks against the float32 layouts, per row count.

The model's 121 linears (30 layers' fused QKV, output, fused gate/up and down projections, and
the tied 49,152-row LM head), each called once per "step" in model order, as a decode step
calls them: `BlockWeights.matmul` (actors/models/block_gemm.py, the blocks of the Q4_1 / Q8_0
file the model was converted from) against `CpuWeights.linear` without blocks (one row: the
transposed copy; more: oneDNN's packed layout), the float32 path `cpu_block_gemm: false`
serves. One torch thread by default, timed in this thread's CPU time; `--threads N` runs both on
N threads (the blocks on their kernel's pool, float32 on oneDNN's) and times wall clock. The two
alternate in rounds and the minimum over rounds is kept (a shared box only ever adds time).
Also prints the largest difference of the outputs, relative to their scale: float32 rounding,
the weights being the same values.

    python benchmarks/block_gemm.py [--rows 1,2,4,6,8,12,16] [--rounds 5] [--threads 1]
    python benchmarks/block_gemm.py --memory   # RSS of the loaded model, float32 layouts vs blocks

`--memory` loads SmolLM2 in two fresh interpreters, as a worker does (`cpu_gemm` layouts, then
the blocks when on), and prints each one's resident memory (VmRSS) once loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


_LOAD = """
import sys
from actors import model_loader
from actors.models.block_gemm import attach_blocks
from actors.models.cpu_gemm import prepare_cpu_gemm
blocks = sys.argv[1] == "blocks"
path = model_loader.prepare(model_loader.DEFAULT_MODEL)
model = model_loader.load_model(model_loader.DEFAULT_MODEL)
prepare_cpu_gemm(model, transposed=not blocks)
n = attach_blocks(model, model_loader.gguf_source(path)) if blocks else 0
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(n, rss // 1024)
"""


def memory() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    for mode in ("float32", "blocks"):
        out = subprocess.run([sys.executable, "-c", _LOAD, mode], capture_output=True, text=True, env=env, check=True)
        linears, rss = out.stdout.split()
        print(f"{mode:8s}: {rss} MB resident once loaded ({linears} linears on blocks)", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (more than 1: wall-clock time)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--memory", action="store_true", help="resident memory of the loaded model, both ways")
    args = ap.parse_args()
    if args.memory:
        return memory()

    import torch

    from actors import model_loader
    from actors.models.block_gemm import attach_blocks
    from actors.models.cpu_gemm import CpuWeights, prepare_cpu_gemm

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    path = model_loader.prepare(model_loader.DEFAULT_MODEL)
    source = model_loader.gguf_source(path)
    if source is None:
        print(f"{path} keeps no GGUF beside it: nothing to compare")
        return 1
    model = model_loader.load_model(model_loader.DEFAULT_MODEL)
    prepare_cpu_gemm(model)
    attached = attach_blocks(model, source)
    pairs = [(m.cpu_layouts.blocks, CpuWeights(m.cpu_layouts.weight, None)) for m in model.modules()
             if getattr(m, "cpu_layouts", None) is not None and m.cpu_layouts.blocks is not None]
    print(f"{attached} linears on blocks, {len(pairs)} compared")
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        xs = {k: torch.randn(rows, k, generator=gen) for k in {b.shape[1] for b, _ in pairs}}
        best = {"blocks": float("inf"), "float32": float("inf")}
        for r in range(args.rounds):
            for name in (("blocks", "float32") if r % 2 == 0 else ("float32", "blocks")):
                t0 = clock()
                for blocks, plain in pairs:
                    x = xs[blocks.shape[1]]
                    blocks.matmul(x) if name == "blocks" else plain.linear(x)
                best[name] = min(best[name], clock() - t0)
        err = max(((b.matmul(xs[b.shape[1]]) - p.linear(xs[b.shape[1]])).abs().max()
                   / p.linear(xs[b.shape[1]]).abs().max()).item() for b, p in pairs)
        row = {"rows": rows, "blocks_ms": best["blocks"] * 1e3, "float32_ms": best["float32"] * 1e3,
               "ratio": best["blocks"] / best["float32"], "max_rel_diff": err}
        rows_out.append(row)
        kind = "CPU" if args.threads == 1 else "wall"
        print(f"{rows:3d} rows: blocks {row['blocks_ms']:7.1f} ms, float32 {row['float32_ms']:7.1f} ms {kind} a step "
              f"(x{row['ratio']:.2f}); largest difference {err:.1e} of the output's scale", flush=True)
    if args.json:
        print(json.dumps(rows_out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
