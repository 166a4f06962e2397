"""What the Serve path adds to one request on an idle simulated unit.

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/serve_idle_path.py [--requests 20]

Deploys configs/sim.yaml (real Serve: proxy, ingress, router, the simulated A100 TP8 unit),
sends sequential streamed completions of a fixed ~200-token prompt with 8 output tokens, one
at a time with a pause between them, and prints TTFT and the decode cadence beside the cost
model's prefill step and batch-1 decode step for the same prompt: the difference is what HTTP,
the proxy, the ingress, the router and the streaming hops add when nothing queues.

Then the front gates' two priors (tidal_core/front_admission.py), which price what the gates let
through before any verdict came back (a burst into a fresh server): `PATH_PRIOR_S`, one request's
way from the proxy's arrival stamp to its unit, read from each response's `x-tidal-unit-waited-ms`
(both loops), and `PROMPT_BYTES_PER_TOKEN`, from `--requests` chat requests with the prompts of
the burst benchmark (`benchmarks/overload.py --burst`: 50-450 random words), one at a time: the
body's bytes against the unit's count of the prompt's tokens (`x-tidal-prompt-tokens`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.model_loader import load_tokenizer, prepare  # noqa: E402
from calibration.cost_model import CostModel  # noqa: E402
from tests.integration.reliability.burst import BurstSpec  # noqa: E402
from tests.integration.reliability.cluster import SIM_MODEL, app_from_config, serve_cluster  # noqa: E402
from tidal_core.front_admission import PATH_PRIOR_S, PROMPT_BYTES_PER_TOKEN  # noqa: E402

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
    ttfts, cadences, ways, sizes = [], [], [], []
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
            ways.append(float(r.headers["x-tidal-unit-waited-ms"]))
            time.sleep(0.3)
        for prompt in BurstSpec(args.requests, 1.0).prompts():
            chat = json.dumps({"model": SIM_MODEL, "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": 2}).encode()
            r = httpx.post(f"{base}/v1/chat/completions", content=chat, timeout=60,
                           headers={"content-type": "application/json"})
            ways.append(float(r.headers["x-tidal-unit-waited-ms"]))
            sizes.append((len(chat), int(r.headers["x-tidal-prompt-tokens"])))
            time.sleep(0.3)
    ttft, cadence = statistics.median(ttfts), statistics.median(cadences)
    print(f"prompt {num_prompt} tokens, {args.requests} requests one at a time")
    print(f"TTFT p50 {ttft:.1f} ms vs cost-model prefill step {prefill_ms:.1f} ms: +{ttft - prefill_ms:.1f} ms")
    print(f"decode cadence p50 {cadence:.1f} ms vs cost-model batch-1 step {decode_ms:.1f} ms: "
          f"+{cadence - decode_ms:.1f} ms")
    ways.sort()
    print(f"the way from the proxy's stamp to the unit, {len(ways)} requests: p50 {statistics.median(ways):.1f} ms "
          f"(min {ways[0]:.1f}, max {ways[-1]:.1f}); the gates' prior: {1000 * PATH_PRIOR_S:.0f} ms")
    per_request = [b / t for b, t in sizes]
    print(f"chat bodies, {len(sizes)} requests: {sum(b for b, _ in sizes) / sum(t for _, t in sizes):.2f} bytes per "
          f"prompt token over all ({min(per_request):.2f}-{max(per_request):.2f} per request); the gates' prior: "
          f"{PROMPT_BYTES_PER_TOKEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
