"""Start-up to first answer of `serve run configs/local.yaml`, this tree against another, side by side.

    .venv/bin/python benchmarks/startup_ab.py [--baseline CHECKOUT] [--rounds N] [--config PATH]

Each round launches `serve run` (as `make serve` does, with the proxy's gate) from each tree in
turn, the order alternating between rounds, and times from the launch to the first 200 answer
to a chat request (a newcomer's first answer: Ray's start, Serve's, the model's load, the first
step), then stops it. The model cache is warm (`make model`). The same interpreter and
virtualenv run both trees (each tree first on `PYTHONPATH`); only the project's code differs.
Prints each run and the median per tree; the box's load moves both, so read the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_vllm_cpu import free_port, stop_server  # noqa: E402

BODY = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def first_answer_s(tree: Path, config: Path, timeout_s: float = 300.0) -> float:
    port = free_port()
    cfg = yaml.safe_load(config.read_text())
    cfg["http_options"].update(host="127.0.0.1", port=port)
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(tree), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               "HF_HUB_OFFLINE": "1", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.proxy_gate:middlewares"}
        serve = Path(sys.executable).parent / "serve"
        start = time.monotonic()
        proc = subprocess.Popen([str(serve), "run", str(path)], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while time.monotonic() - start < timeout_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve run exited ({proc.returncode}) before answering ({tree})")
                try:
                    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=30)
                    if r.status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            raise TimeoutError(f"no answer within {timeout_s:.0f} s ({tree})")
        finally:
            stop_server(proc)  # SIGTERM: serve run shuts Serve and its Ray instance down
            time.sleep(2.0)  # the Ray instance's processes are gone before the next launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another checkout of the project (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    times: dict[str, list[float]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        order = list(trees.items()) if rnd % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            t = first_answer_s(tree, args.config)
            times[name].append(t)
            print(f"round {rnd + 1}: {name:10s} {t:6.1f} s", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in med.items():
        print(f"{name:10s} median {m:6.1f} s  ({', '.join(f'{t:.1f}' for t in times[name])})")
    if "baseline" in med:
        print(f"this tree / baseline: {med['this tree'] / med['baseline']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
