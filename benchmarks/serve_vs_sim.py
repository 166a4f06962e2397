"""The same trace through configs/sim.yaml over HTTP and through the simulator, side by side.

    .venv/bin/python benchmarks/serve_vs_sim.py --minutes 5 --load 0.6 --out runs/serve-vs-sim

1. Starts a Ray cluster and deploys configs/sim.yaml through Serve's config path (as
   `serve deploy` would), on a free port.
2. Replays a window of the Azure conversation trace, re-rated to `--load` x the simulated unit's
   measured capacity, open loop, with `tidal replay`'s client (real HTTP, streaming).
3. Simulates the *same requests* (the replay's actual send times and the server-counted prompt
   tokens, so tokenization differences cannot bias it) with the simulator driving the same
   scheduler config against the same cost model.
4. Prints throughput and TTFT side by side (and writes both run directories, readable by
   `tidal compare`). Serve's extra time per step (HTTP, handles, the engine loop, asyncio
   sleep granularity) shows as the gap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from calibration.cost_model import CostModel  # noqa: E402
from calibration.unit_sizing import pool_blocks  # noqa: E402
from loadgen.client import ClientConfig  # noqa: E402
from loadgen.records import Trace  # noqa: E402
from loadgen.replay import ReplayConfig, replay  # noqa: E402
from loadgen.report import Slo  # noqa: E402
from loadgen.sim.runner import RunSpec, run_policy, write_run  # noqa: E402
from loadgen.sim.study import unit_capacity  # noqa: E402
from loadgen.traces import load_trace  # noqa: E402
from serve_app.config_loader import load_app_args, scheduler_config  # noqa: E402

COLUMNS = ("arrived", "completed", "rejected", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "goodput_rps")


def start_server(port: int) -> str:
    import ray
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    sys.path.insert(0, str(ROOT / "tests"))
    from tests.integration.conftest import shipped_controller_options, wait_healthy

    config = yaml.safe_load((ROOT / "configs" / "sim.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}})
    serve_start(http_options={"host": "127.0.0.1", "port": port}, controller_options=shipped_controller_options()
                ).deploy_apps(ServeDeploySchema.model_validate(config))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300)
    return url


def replayed_trace(out_dir: Path, sent: Trace) -> Trace:
    """The requests exactly as they reached the server: send times and server-side prompt tokens
    (the trace's own count where the server reported none, e.g. a 429)."""
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["sent_s"])
    start = rows[0]["sent_s"]
    return Trace("replayed", [r["sent_s"] - start for r in rows],
                 [r.get("input_tokens") or int(sent.input_tokens[r["index"]]) for r in rows],
                 [r["requested_output_tokens"] for r in rows], source="replayed requests")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--load", type=float, default=0.6, help="offered load as a multiple of measured capacity")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/serve-vs-sim")
    args = ap.parse_args()
    out = Path(args.out)

    sim_args = load_app_args(yaml.safe_load((ROOT / "configs" / "sim.yaml").read_text())["applications"][0]["args"],
                             environ={})
    cost = CostModel.load(sim_args.engine.cost_model or "a100-llama70b-tp8")
    cfg = scheduler_config(sim_args.scheduler, num_kv_blocks=pool_blocks(cost, block_size=16),
                           block_size=sim_args.engine.block_size, max_model_len=sim_args.engine.max_model_len,
                           service_prior=cost.service_prior())
    capacity = unit_capacity(cost, cfg)
    source = load_trace("azure-conv", hours=args.minutes / 60)
    rate_scale = args.load * capacity / (len(source) / source.duration_s)
    trace = load_trace("azure-conv", hours=args.minutes / 60, rate_scale=rate_scale, seed=args.seed,
                       max_input=sim_args.engine.max_model_len - 513, max_output=512)
    print(f"capacity {capacity:.3f} req/s; replaying {len(trace)} requests over {trace.duration_s:.0f} s "
          f"({len(trace) / trace.duration_s:.3f} req/s)", flush=True)

    url = start_server(args.port)
    t0 = time.perf_counter()
    real = replay(trace, ClientConfig(url, model=sim_args.engine.model_id), ReplayConfig(run_name="serve"),
                  out / "serve")
    print(f"replay done in {time.perf_counter() - t0:.0f} s", flush=True)

    same = replayed_trace(out / "serve", trace)
    sim = run_policy(RunSpec(same, cfg, cost, Slo(), scheduler=cfg), cfg.policy, progress=False)
    write_run(out / "sim", "simulator, same requests", [sim], Slo())
    s_real, s_sim = real.summary, sim.summary
    print("| metric | Serve (configs/sim.yaml) | simulator | Serve / simulator |\n|---|---|---|---|")
    for key in COLUMNS:
        a, b = s_real.get(key), s_sim.get(key)
        ratio = f"{a / b:.3f}" if isinstance(a, int | float) and isinstance(b, int | float) and b else "–"
        print(f"| {key} | {a} | {b} | {ratio} |")
    drift = s_real.get("drift", {})
    print(f"\nclient drift p50 {drift.get('p50_ms')} ms, p99 {drift.get('p99_ms')} ms")
    ok = np.isfinite([s_real["ttft_p50_ms"] or np.nan])
    return 0 if ok.all() else 1


if __name__ == "__main__":
    sys.exit(main())
