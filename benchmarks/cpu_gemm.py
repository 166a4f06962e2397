"""The CPU model step with and without `cpu_gemm` (pre-arranged linear weights), side by side.

Two offline engines over SmolLM2-135M-Instruct (float32, one torch thread, the `continuous`
core preset), one with `EngineSpec.cpu_gemm` on and one off, in the same process (`--flag
cpu_block_gemm`: that switch instead, the GGUF's quantized blocks for linears of up to 16 rows;
with `cpu_gemm` off neither runs; `--flag cpu_fused_ops`: the fused C norms, SiLU and RoPE;
`--flag cpu_decode_layers`: a decode step's layers in one C call). For each batch size, both run
the same requests (`--prompt` tokens each, greedy, `ignore_eos`) in alternating rounds: the
prefill step's and the decode steps' CPU time (this thread's, so a neighbour's load moves it
less than wall time) and the generated tokens, which must be the same with both layouts. Prints
per batch: ms per decode step, per prefill token, and the ratio on / off (below 1: faster).
`--threads N` (N > 1): the engines use N torch threads (the CPU kernels' pool), and the times are
wall time, since the pool's helpers spend CPU on other threads.

    python benchmarks/cpu_gemm.py [--flag cpu_gemm|cpu_block_gemm|cpu_fused_ops|cpu_decode_layers]
                                  [--batches 1,4,8,16] [--prompt 128] [--steps 16] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def offline_engine(kv_cache_gb: float = 1.0, torch_threads: int = 1, **spec: Any) -> Any:
    """An offline SmolLM2 engine (one torch thread unless told, `continuous`), warmed up; `spec`: EngineSpec fields.
    Also the harness of benchmarks/cpu_attention.py."""
    from actors.executor import LocalExecutor
    from actors.llm_engine import LLMEngine, scheduler_config
    from actors.worker_setup import EngineSpec
    from tidal_core import SamplingParams

    ex = LocalExecutor(EngineSpec(max_model_len=1024, kv_cache_gb=kv_cache_gb, torch_threads=torch_threads, **spec))
    cfg = scheduler_config(ex.info, "continuous", max_batch_size=64, max_num_batched_tokens=4096)
    LLMEngine(ex, ex.info, None, cfg).generate([[1] * 16], SamplingParams(max_tokens=4))  # warm-up
    return ex, cfg


def run_steps(ex: Any, cfg: Any, batch: int, prompt: int, steps: int, seed: int,
              clock: Callable[[], float] = time.thread_time) -> dict[str, Any]:
    """`batch` greedy requests of `prompt` tokens: ms of `clock` (this thread's CPU time unless told)
    per prefill token and per decode step."""
    from actors.llm_engine import LLMEngine
    from tidal_core import SamplingParams

    engine = LLMEngine(ex, ex.info, None, cfg)
    ids = [engine.add_request([100 + (seed * 31 + i * 7 + j) % 4000 for j in range(prompt)],
                              SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
           for i in range(batch)]
    c0 = clock()
    while engine.scheduler.num_waiting or engine.scheduler.prefilling:
        engine.step()
    c1 = clock()
    n = 0
    while engine.has_unfinished:
        engine.step()
        n += 1
    c2 = clock()
    return {"prefill_ms_per_token": (c1 - c0) * 1e3 / (batch * prompt),
            "decode_ms_per_step": (c2 - c1) * 1e3 / max(1, n),
            "outputs": [engine.completions.pop(i).token_ids for i in ids]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", default="cpu_gemm",
                    choices=("cpu_gemm", "cpu_block_gemm", "cpu_fused_ops", "cpu_decode_layers"),
                    help="the EngineSpec switch the two engines differ in")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads; above 1 the times are wall time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    engines = {on: offline_engine(torch_threads=args.threads, **{args.flag: on}) for on in (True, False)}
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                runs[on].append(run_steps(*engines[on], batch, args.prompt, args.steps, seed=r, clock=clock))
        keys = ("prefill_ms_per_token", "decode_ms_per_step")
        med = {on: {k: statistics.median(x[k] for x in runs[on]) for k in keys} for on in runs}
        same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[True], runs[False], strict=True))
        row = {"batch": batch, "on": med[True], "off": med[False], "same_tokens": same,
               "decode_ratio": med[True]["decode_ms_per_step"] / med[False]["decode_ms_per_step"],
               "prefill_ratio": med[True]["prefill_ms_per_token"] / med[False]["prefill_ms_per_token"]}
        rows.append(row)
        off, on_ = med[False], med[True]
        what = "CPU" if args.threads == 1 else "wall"
        print(f"batch {batch:3d}: decode step {off['decode_ms_per_step']:7.1f} -> {on_['decode_ms_per_step']:7.1f}"
              f" ms {what} (x{row['decode_ratio']:.2f}); prefill {off['prefill_ms_per_token']:.3f} -> "
              f"{on_['prefill_ms_per_token']:.3f} ms/token (x{row['prefill_ratio']:.2f}); same greedy tokens: {same}",
              flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
