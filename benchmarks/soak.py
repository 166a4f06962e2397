"""Soak, the 10-minute version (issue 8, item 5): a compressed tidal day against the simulated unit.

A Ray cluster of this script's own runs configs/sim.yaml. After a 20 s warm-up (first-use
allocations are not a leak) and a drain, the ServingUnit and Ingress replicas' RSS is taken; then the
sharp tidal day (docs/traces.md) compressed into `--duration` seconds, peaking at `--peak-load` x
the unit's capacity, is replayed open loop with `tidal replay`'s machinery while `/health`,
`unit_state(check=True)` and the replicas' RSS are sampled. Then the unit is drained and the RSS
taken again.

Reported: every request's outcome (none may be stuck or failed), the load figures (429 latency,
SLO attainment of the admitted, health, KV), the state after the drain (all KV blocks free, no
request or stream left), RSS before/after and its growth (issue 8 asks < 5%), and the RSS series.
With `--days N` the day is played N times in a row (new prompts each day) and the RSS is taken
after each: growth that stops after the first day is a high-water mark (memory Python keeps after
the peak's concurrency), growth that repeats every day is a leak.

With `--allocator jemalloc` every process of the cluster runs on the jemalloc that Ray ships
(preloaded, with `--malloc-conf`), and the ServingUnit's live bytes as jemalloc counts them are
reported beside its RSS (`--python-malloc` makes Python's objects come from it too, so the count
covers them): live bytes that come back after the drain while RSS does not are memory the
allocator retains after the peak, not memory the program holds.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/soak.py [--duration 600] [--days 1] \
        [--allocator jemalloc [--python-malloc]] [--out runs/soak]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

from serve_app.memory_trim import ray_jemalloc
from tests.integration.reliability.cluster import (
    app_from_config,
    machine,
    replicas_rss,
    router_handle,
    serve_cluster,
    wait_drained,
)
from tests.integration.reliability.load import (
    poisson_trace,
    run_load,
    run_soak,
    sim_capacity_rps,
    soak_figures,
    soak_trace,
)

# Freed pages go back within a second (muzzy pages would stay in RSS until the kernel reclaims them).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"


def preload_jemalloc(malloc_conf: str) -> None:
    """Every process the cluster starts inherits these: Ray's own jemalloc, preloaded."""
    path = ray_jemalloc()
    if path is None:
        raise SystemExit("--allocator jemalloc: this Ray install ships no ray/core/libjemalloc.so")
    os.environ.update(LD_PRELOAD=str(path), MALLOC_CONF=malloc_conf)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="wall seconds the day is compressed into")
    p.add_argument("--peak-load", type=float, default=1.3, help="peak rate as a multiple of the unit's capacity")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--days", type=int, default=1, help="play the day this many times in a row")
    p.add_argument("--drain", type=float, default=600.0, help="seconds in-flight requests may take after a day")
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace the ServingUnit's allocations (tracemalloc, FRAMES deep) and report where memory "
                        "grew from the warm-up to the end of each day (slows the unit)")
    p.add_argument("--allocator", choices=("system", "jemalloc"), default="system",
                   help="jemalloc: run every process of the cluster on Ray's bundled jemalloc (LD_PRELOAD)")
    p.add_argument("--malloc-conf", default=JEMALLOC_CONF, help="jemalloc's MALLOC_CONF with --allocator jemalloc")
    p.add_argument("--python-malloc", action="store_true",
                   help="PYTHONMALLOC=malloc: Python's objects from the C allocator instead of its own arenas")
    args = p.parse_args(argv)
    if args.allocator == "jemalloc":
        preload_jemalloc(args.malloc_conf)
    if args.python_malloc:
        os.environ["PYTHONMALLOC"] = "malloc"
    if args.tracemalloc:
        os.environ["TIDAL_TRACEMALLOC"] = str(args.tracemalloc)  # inherited by the cluster's processes
    capacity = sim_capacity_rps()
    report: dict[str, Any] = {"machine_at_start": machine(), "capacity_rps": round(capacity, 3),
                              "duration_s": args.duration, "peak_load": args.peak_load, "days": [],
                              "allocator": args.allocator, "python_malloc": args.python_malloc}
    if args.allocator == "jemalloc":
        report["malloc_conf"] = args.malloc_conf
    with serve_cluster([app_from_config("sim", "sim", "/sim")]) as base:
        url = base + "/sim"
        asyncio.run(run_load(url, "sim", poisson_trace(2.0, 20.0, seed=1, max_output=64), args.out / "warmup"))
        wait_drained("sim")
        unit = router_handle("sim")
        unit.memory_growth.remote(baseline=True).result(timeout_s=120)
        before = first = replicas_rss("sim")
        heap_before = unit.allocator_stats.remote().result(timeout_s=60)
        for day in range(args.days):
            trace = soak_trace(args.duration, args.peak_load, capacity, seed=args.seed + day)
            run, rss = asyncio.run(run_soak(url, "sim", trace, args.out / f"day{day}", drain_timeout_s=args.drain))
            state, drain_s = wait_drained("sim", timeout_s=300.0)
            after = replicas_rss("sim")
            figures = {"day": day, **soak_figures(run, before, after, state), "drained_after_s": round(drain_s, 2),
                       "rss_growth_since_start": {k: round((after[k] - first[k]) / first[k], 4) for k in first},
                       "machine": machine()}
            heap_after = unit.allocator_stats.remote().result(timeout_s=60)
            if heap_before and heap_after:  # jemalloc's own counts, MB
                figures["unit_allocator_mb"] = {k: [round(heap_before[k] / 2**20, 1), round(heap_after[k] / 2**20, 1)]
                                                for k in heap_after if k in heap_before}
            report["days"].append(figures)
            print(json.dumps(figures, indent=1), flush=True)
            print("RSS (MB) every minute:", [{k: round(v / 2**20, 1) for k, v in s.items() if k != "t"}
                                             for s in rss[::12]], flush=True)
            (args.out / f"day{day}" / "rss.json").write_text(json.dumps(rss))
            growth = unit.memory_growth.remote().result(timeout_s=300)
            if growth:
                (args.out / f"day{day}" / "tracemalloc.txt").write_text("\n\n".join(growth))
                print("ServingUnit memory growth since the warm-up (tracemalloc):", *growth[:6], sep="\n", flush=True)
            before, heap_before = after, heap_after
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
