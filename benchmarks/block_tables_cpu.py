"""Host cost of a decode step's block tables: padded Python lists vs one gather from the store.

The CUDA-graph path used to pad every row of a decode batch in Python to the graph's fixed
width (max_model_len / block_size, 512 at 8192 tokens) and build a tensor from the lists on
every step; now the rows come from one `index_select` on the `BlockTableStore` (the copy to the
device is the same single copy either way and is not timed here). Both are timed side by side
in one run, on the same tables, and checked equal.

    python -m benchmarks.block_tables_cpu [--batch 64] [--context 4096] [--width 512] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from actors.block_tables import BlockTableStore
from actors.input_batch import _decode_tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence (block size 16)")
    parser.add_argument("--width", type=int, default=512, help="the padded width of the old graph path")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    blocks = -(-args.context // 16)
    tables = {f"r{i}": rng.sample(range(100_000), blocks) for i in range(args.batch)}
    store = BlockTableStore(pad=100_000, device=torch.device("cpu"))
    for rid, t in tables.items():
        store.add(rid, t)
    rids = list(tables)
    assert torch.equal(store.gather(rids, args.width), _decode_tables(list(tables.values()), 100_000, args.width))
    timings: dict[str, list[float]] = {"padded_lists": [], "store_gather": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        _decode_tables([tables[r][:blocks] for r in rids], 100_000, args.width)
        t1 = time.perf_counter()
        store.gather(rids, args.width)
        t2 = time.perf_counter()
        timings["padded_lists"].append(t1 - t0)
        timings["store_gather"].append(t2 - t1)
    med = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
    print(json.dumps({"batch": args.batch, "context": args.context, "width": args.width, "steps": args.steps,
                      "median_us": {k: round(v, 1) for k, v in med.items()},
                      "speedup": round(med["padded_lists"] / med["store_gather"], 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
