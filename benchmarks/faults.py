"""Faults, the recorded version (issue 8, item 2): kill a TP worker, then a ServingUnit replica, mid-stream.

A Ray cluster of this script's own runs configs/local.yaml (SmolLM2 on CPU, one TP worker) at `/`
and configs/sim.yaml at `/sim`, as the integration tests do. `--repeat` times each: four long
streams running (each past its first token), then (a) the local unit's TP worker is killed (by
name `tidal-tp-<unit>-r0` once workers are named, else SIGKILL to its process) and (b) the sim
app's ServingUnit replica is killed with `ray.kill`. A streamed request goes out every 0.5 s from the
kill until a new unit serves (each leaves after its first token).

Reported per run: how each in-flight stream ended and how long after the kill; when the new unit
answered (`unit_ready_s`) and served a first token (`served_again_s`); how the requests sent during
recovery were answered (503 + Retry-After, or held until the new unit was up, and for how long).

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/faults.py [--repeat 3] [--out runs/faults]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

from tests.integration.reliability.cluster import (
    LOCAL_MODEL,
    SIM_MODEL,
    app_from_config,
    machine,
    serve_cluster,
    wait_until,
)
from tests.integration.reliability.faults import run_fault, serves

SCENARIOS = (("tp_worker", "local", "", LOCAL_MODEL), ("router", "sim", "/sim", SIM_MODEL))


def row(figures: dict[str, Any]) -> str:
    kinds = sorted({s["kind"] for s in figures["streams"]})
    return "| " + " | ".join(str(x) for x in (
        figures["fault"], ",".join(kinds), figures["stream_error_max_s"], figures["unit_ready_s"],
        figures["served_again_s"], len(figures["probes"]), figures["probes_503"], figures["probes_held"],
        figures["held_wait_max_s"])) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/faults"))
    args = p.parse_args(argv)
    apps = [app_from_config("local", "local", "/"), app_from_config("sim", "sim", "/sim")]
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {"machine_at_start": machine()}
    with serve_cluster(apps) as base:
        for i in range(args.repeat):
            for fault, app, prefix, model in SCENARIOS:
                url = base + prefix
                run = asyncio.run(run_fault(url, app, model, fault))
                figures = run.figures()
                figures["state_after_healthy"] = bool(run.state_after and run.state_after["healthy"])
                runs.append({"repeat": i, **figures})
                print(json.dumps({k: v for k, v in figures.items() if k != "probes"}), flush=True)
                if not wait_until(lambda u=url, m=model: serves(u, m), 300.0, 1.0):
                    raise RuntimeError(f"{app} did not serve again after the {fault} fault")
    report["runs"], report["machine_at_end"] = runs, machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(report, indent=1))
    print("| fault | in-flight streams ended as | last error after kill s | new unit answers s | first token "
          "again s | requests during recovery | 503 | held | longest hold s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
