"""The CPU decode attention with its KV from memory: the shipped prefetch against the previous one.

actors/models/csrc/paged_decode.c requests the KV head's slice of a block `PF_AHEAD` blocks
ahead into L2 (`PF_LOCALITY` 2); until stop 42 it requested the next block only, into L1
(`-DPF_AHEAD=1 -DPF_LOCALITY=3`, which this script builds beside the shipped library: the cache
key holds the flags). Both run the same calls: a "step" is one call per layer over 30 layer-sized
caches of SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, blocks of 16 tokens) with
shuffled block tables, so, as in the engine, each layer's K and V come from memory, not from a
cache a previous call filled; a 64 MB buffer is read between steps to push out what is left. The
builds alternate step by step; the minimum over `--rounds` steps is kept (a shared box only ever
adds time). Prints ms a step and the KV read per second, per (threads, batch, context), the
ratio shipped / previous (below 1: faster), and whether the outputs are the same bits (they must
be: a prefetch changes no result; exit 1 otherwise).

    python benchmarks/decode_attention_memory.py [--contexts 128,272,512,1024] [--batches 1,8,16] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
PREVIOUS = ("-DPF_AHEAD=1", "-DPF_LOCALITY=3")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,272,512,1024", help="KV tokens per decode")
    ap.add_argument("--batches", default="1,8,16", help="decodes per call")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from actors.models import cpu_attention, cpu_pool
    from actors.models.ckernel import CKernel

    shipped = cpu_attention.KERNEL.load()
    previous = CKernel("paged_decode.c", cpu_attention._declare, "no comparison", extra_flags=PREVIOUS).load()
    if shipped is None or previous is None:
        print("the decode attention kernel cannot be built here (no gcc?): nothing to compare", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    sweep = torch.ones(16 << 20)  # 64 MB
    rows, same = [], True
    torch.set_num_threads(1)  # the sweep on this thread alone: no idle OpenMP team spinning beside the pool
    for threads in (int(t) for t in args.threads.split(",")):
        run = cpu_pool.runner() if threads > 1 else None
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                width = (ctx + 2 * batch + BLOCK - 1) // BLOCK
                blocks = batch * width + 4
                caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
                           torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)) for _ in range(LAYERS)]
                tables = torch.randperm(blocks, generator=gen)[:batch * width].reshape(batch, width).contiguous()
                lens = torch.tensor([max(1, ctx - 8 + 2 * i) if ctx > 8 else ctx for i in range(batch)])
                q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
                outs = {name: torch.empty_like(q) for name in ("shipped", "previous")}
                best = {"shipped": float("inf"), "previous": float("inf")}
                for r in range(args.rounds):
                    for name, lib in (("shipped", shipped), ("previous", previous))[::1 if r % 2 else -1]:
                        float(sweep.sum())
                        t0 = time.perf_counter()
                        for k, v in caches:
                            rc = lib.tidal_paged_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
                                                        lens.data_ptr(), outs[name].data_ptr(), batch, HEADS,
                                                        KV_HEADS, HEAD_DIM, BLOCK, width, blocks, 0.125, threads, run)
                            if rc:
                                raise RuntimeError(f"tidal_paged_decode returned {rc}")
                        best[name] = min(best[name], time.perf_counter() - t0)
                equal = torch.equal(outs["shipped"], outs["previous"])
                same = same and equal
                mb = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4 * int(lens.sum()) / 1e6
                row = {"threads": threads, "batch": batch, "context": ctx, "kv_mb": round(mb, 1),
                       "previous_ms": round(best["previous"] * 1e3, 3), "shipped_ms": round(best["shipped"] * 1e3, 3),
                       "ratio": round(best["shipped"] / best["previous"], 3), "same_bits": equal}
                rows.append(row)
                if not args.json:
                    print(f"threads {threads}, batch {batch:2d}, context {ctx:4d} ({mb:6.1f} MB of KV): "
                          f"{row['previous_ms']:7.2f} -> {row['shipped_ms']:7.2f} ms a step "
                          f"({mb / 1e3 / best['previous']:4.1f} -> {mb / 1e3 / best['shipped']:4.1f} GB/s), "
                          f"x{row['ratio']:.3f}; same bits: {equal}", flush=True)
                del caches
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
