"""What the Serve path adds to one request on an idle simulated unit.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/serve_idle_path.py [--requests 20]

Deploys configs/sim.yaml (real Serve: proxy, ingress, router, the simulated A100 TP8 unit),
sends sequential streamed completions of a fixed ~200-token prompt with 8 output tokens, one
at a time with a pause between them, and prints TTFT and the decode cadence beside the cost
model's prefill step and batch-1 decode step for the same prompt: the difference is what HTTP,
the proxy, the ingress, the router and the streaming hops add when nothing queues.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.model_loader import load_tokenizer, prepare  # noqa: E402
from calibration.cost_model import CostModel  # noqa: E402
from tests.integration.reliability.cluster import app_from_config, serve_cluster  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    num_prompt = len(load_tokenizer(prepare(MODEL))(PROMPT)["input_ids"])
    cost = CostModel.load("a100-llama70b-tp8")
    prefill_ms = cost.step_time_s([(num_prompt, 0)], 0, 0, None) * 1000
    decode_ms = cost.step_time_s([], 1, num_prompt, 1) * 1000
    ttfts, cadences = [], []
    with serve_cluster([app_from_config("sim", "sim", "/")]) as base:
        for _ in range(3):  # warm-up
            httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}
        for _ in range(args.requests):
            t0, first = time.perf_counter(), None
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data:") and '"text"' in line:
                        first = time.perf_counter() - t0
            end = time.perf_counter() - t0
            assert first is not None, "no text chunk"
            ttfts.append(first * 1000)
            cadences.append((end - first) * 1000 / (args.max_tokens - 1))
            time.sleep(0.3)
    ttft, cadence = statistics.median(ttfts), statistics.median(cadences)
    print(f"prompt {num_prompt} tokens, {args.requests} requests one at a time")
    print(f"TTFT p50 {ttft:.1f} ms vs cost-model prefill step {prefill_ms:.1f} ms: +{ttft - prefill_ms:.1f} ms")
    print(f"decode cadence p50 {cadence:.1f} ms vs cost-model batch-1 step {decode_ms:.1f} ms: "
          f"+{cadence - decode_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
