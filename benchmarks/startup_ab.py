"""Start-up to first answer of `serve run configs/local.yaml`, this tree against another, side by
side; optionally also the CPU the server burns at rest and under a load.

    .venv/bin/python benchmarks/startup_ab.py [--baseline CHECKOUT] [--rounds N] [--config PATH]
        [--rest-s 30] [--load 256x128@8] [--requests-per-user 2]

Each round launches `serve run` (as `make serve` does, with the proxy's gate) from each tree in
turn, the order alternating between rounds, and times from the launch to the first 200 answer
to a chat request (a newcomer's first answer: Ray's start, Serve's, the model's load, the first
step). With `--rest-s`, after a settling pause it then counts the CPU every process of the
server uses over that many seconds with no request (benchmarks/cpu_split.py's roles, as % of
one core): what a laptop pays for a server left running, and what a 2-core box's model worker
loses to the rest. With `--load`, it then runs that workload (benchmarks/chat_load.py, streaming
chat, `ignore_eos`) and records tokens/s and CPU ms per output token by role. Then it stops the
server. The model cache is warm (`make model`). The same interpreter and virtualenv run both
trees (each tree first on `PYTHONPATH`); only the project's code differs. Prints each run and the
median per tree; the box's load moves both, so read the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chat_load import Workload, fixed_length_prompts, run_load  # noqa: E402
from benchmarks.cpu_split import CpuSplit  # noqa: E402
from benchmarks.vs_vllm_cpu import MAKE_SERVE_ENV, MODEL, first_answer, free_port, parse_shapes, stop_server  # noqa: E402

SETTLE_S = 10.0  # after the first answer: the warm-up's metrics pushes and the replicas' start-up work end


def run_server(tree: Path, config: Path, rest_s: float = 0.0, load: Workload | None = None,
               prompts: list[Any] | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """One launch: start-up to the first answer (s), then the CPU at rest and the load if asked."""
    port = free_port()
    cfg = yaml.safe_load(config.read_text())
    cfg["http_options"].update(host="127.0.0.1", port=port)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(tree), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               "HF_HUB_OFFLINE": "1", **MAKE_SERVE_ENV}
        serve = Path(sys.executable).parent / "serve"
        start = time.monotonic()
        proc = subprocess.Popen([str(serve), "run", str(path)], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            first_answer(url, timeout_s, proc, poll_s=0.2)
            out: dict[str, Any] = {"startup_s": time.monotonic() - start}
            if rest_s > 0:
                time.sleep(SETTLE_S)
                split = CpuSplit(proc.pid)
                split.start()
                time.sleep(rest_s)
                # CPU ms over rest_s seconds, as % of one core: ms / (10 * s).
                out["rest_pct"] = {k: round(v / (10.0 * rest_s), 1) for k, v in split.stop(1).items()}
            if load is not None:
                assert prompts is not None
                split = CpuSplit(proc.pid)
                split.start()
                result = asyncio.run(run_load(url, MODEL, prompts, load))
                out["load"] = {**result.summary(), "cpu_ms_per_token": split.stop(result.output_tokens)}
            return out
        finally:
            stop_server(proc)  # SIGTERM: serve run shuts Serve and its Ray instance down
            time.sleep(2.0)  # the Ray instance's processes are gone before the next launch


def _median_table(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs), 2) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another checkout of the project (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    ap.add_argument("--rest-s", type=float, default=0.0, help="also count the CPU at rest over this many seconds")
    ap.add_argument("--load", type=parse_shapes, help="also run one workload, IN x OUT @ CONCURRENCY (e.g. 256x128@8)")
    ap.add_argument("--requests-per-user", type=int, default=2, help="requests of the load = this x concurrency")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    load = prompts = None
    if args.load:
        from actors.model_loader import load_tokenizer, prepare

        isl, osl, conc = args.load[0]
        load = Workload(isl, osl, conc, max(4, args.requests_per_user * conc))
        prompts = fixed_length_prompts(load_tokenizer(Path(prepare(MODEL))), isl, 64, seed=isl)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        order = list(trees.items()) if rnd % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            run = run_server(tree, args.config, args.rest_s, load, prompts)
            runs[name].append(run)
            line = f"round {rnd + 1}: {name:10s} start-up {run['startup_s']:6.1f} s"
            if "rest_pct" in run:
                line += f"  at rest (% of a core) {run['rest_pct']}"
            if "load" in run:
                line += (f"  load {run['load']['output_tokens_per_s']} tok/s, failures {run['load']['failures']}, "
                         f"CPU ms/token {run['load']['cpu_ms_per_token']}")
            print(line, flush=True)
    med: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        med[name] = {"startup_s": statistics.median(r["startup_s"] for r in rs)}
        each = ", ".join(f"{r['startup_s']:.1f}" for r in rs)
        print(f"{name:10s} start-up median {med[name]['startup_s']:6.1f} s  ({each})")
        if args.rest_s > 0:
            med[name]["rest"] = _median_table([r["rest_pct"] for r in rs])
            print(f"{name:10s} at rest, % of one core (median per role): {med[name]['rest']}")
        if load is not None:
            med[name]["tok_s"] = statistics.median(r["load"]["output_tokens_per_s"] for r in rs)
            med[name]["cpu"] = _median_table([r["load"]["cpu_ms_per_token"] for r in rs])
            print(f"{name:10s} {load.label}: {med[name]['tok_s']:.2f} tok/s (median), "
                  f"CPU ms/token (median per role) {med[name]['cpu']}")
    if "baseline" in med:
        this, base = med["this tree"], med["baseline"]
        print(f"this tree / baseline: start-up {this['startup_s'] / base['startup_s']:.3f}", end="")
        if args.rest_s > 0:
            print(f", CPU at rest {this['rest']['total'] / base['rest']['total']:.3f}", end="")
        if load is not None:
            print(f", load tokens/s {this['tok_s'] / base['tok_s']:.3f}", end="")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
