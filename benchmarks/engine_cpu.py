"""SmolLM2 on CPU: our runner + core scheduler vs transformers on the same seeded workload.

Three engines, one process, one after another, the same requests (all submitted at t=0,
greedy, EOS ignored so each request produces exactly its target length):
- ours: `LLMEngine` (core Scheduler, preset "continuous") over the paged-KV runner, TP=1;
- hf-static: transformers `generate` with static batching (batches of `--batch-size` in
  arrival order, left padding, each batch runs to its longest target; extra tokens of
  shorter requests are waste, as in any static batcher);
- hf-cb: transformers' own continuous batching (`ContinuousBatchingManager`, per-request
  `max_new_tokens`), if the installed version has it.
Reported: useful output tokens/s, TTFT p50/p99 (s from submission), and ours/theirs ratios. On a
shared machine wall time swings with the neighbours' load; tokens per CPU-second of this process
(`time.process_time`, all its threads) is the steadier measure of work, and is reported too.

    python benchmarks/engine_cpu.py [--num-requests 32] [--batch-size 16] [--seed 0] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_range) - 1)]
               for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def _summary(name: str, wall_s: float, cpu_s: float, useful: int, ttfts: list[float]) -> dict[str, Any]:
    ttfts = sorted(ttfts)
    return {"engine": name, "wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2), "output_tokens": useful,
            "tokens_per_s": round(useful / wall_s, 2), "tokens_per_cpu_s": round(useful / cpu_s, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3)}


def run_ours(w: Workload, batch: int, budget: int, threads: int) -> dict[str, Any]:
    from actors.executor import LocalExecutor
    from actors.llm_engine import LLMEngine, scheduler_config
    from actors.worker_setup import EngineSpec
    from tidal_core import SamplingParams

    ex = LocalExecutor(EngineSpec(max_model_len=1024, kv_cache_gb=1.0, torch_threads=threads))
    cfg = scheduler_config(ex.info, "continuous", max_batch_size=batch, max_num_batched_tokens=budget)
    LLMEngine(ex, ex.info, None, cfg).generate([w.prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
    engine = LLMEngine(ex, ex.info, None, cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    rids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(w.prompts, w.outputs, strict=True)]
    engine.run_until_done()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    done = [engine.completions[r] for r in rids]
    assert [len(c.token_ids) for c in done] == w.outputs
    return _summary("ours", wall, cpu, sum(w.outputs), [c.first_token_s - t0 for c in done])  # type: ignore[operator]


class _FirstCall:
    """A logits processor that only records when the batch's first token is chosen."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            self.t = time.perf_counter()
        return scores


def run_hf_static(w: Workload, batch: int, path: Any) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generate(torch.tensor([w.prompts[0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    ttfts: list[float] = []
    for start in range(0, len(w.prompts), batch):
        prompts, outs = w.prompts[start:start + batch], w.outputs[start:start + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        first = _FirstCall()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                                 do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([first]))
        assert out.shape[1] - width == max(outs) and first.t is not None
        ttfts += [first.t - t0] * len(prompts)
    return _summary("hf-static", time.perf_counter() - t0, time.process_time() - c0, sum(w.outputs), ttfts)


def run_hf_cb(w: Workload, batch: int, budget: int, path: Any) -> dict[str, Any] | None:
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(w.outputs), eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch, max_batch_tokens=budget, page_size=16)
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=True) as manager:
        t0, c0 = time.perf_counter(), time.process_time()
        rids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True)
                for p, n in zip(w.prompts, w.outputs, strict=True)]
        results: dict[str, Any] = {}
        while len(results) < len(rids):
            res = manager.get_result(timeout=600)
            if res is None:
                raise RuntimeError("transformers continuous batching stopped before finishing")
            results[res.request_id] = res
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    useful = sum(len(results[r].generated_tokens) for r in rids)
    return _summary("hf-cb", wall, cpu, useful, [results[r].timestamps[0] - t0 for r in rids])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=512, help="max tokens per step (ours and hf-cb)")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--output-range", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--seed", type=int, default=0)
    # One thread by default, for every engine alike: on a shared 2-core box two OpenMP threads
    # spin-wait on a descheduled sibling and decode steps get ~3x slower (measured).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engines", nargs="+", default=["ours", "hf-static", "hf-cb"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from actors.model_loader import prepare

    path = prepare("smollm2-135m-instruct")
    w = make_workload(args.num_requests, args.seed, tuple(args.prompt_range), tuple(args.output_range), 49152)
    print(f"workload: {len(w.prompts)} requests, prompt tokens {sum(map(len, w.prompts))}, output tokens "
          f"{sum(w.outputs)}, batch {args.batch_size}, budget {args.budget}, threads {args.threads}", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for name in args.engines:
        row = {"ours": lambda: run_ours(w, args.batch_size, args.budget, args.threads),
               "hf-static": lambda: run_hf_static(w, args.batch_size, path),
               "hf-cb": lambda: run_hf_cb(w, args.batch_size, args.budget, path)}[name]()
        if row is None:
            print(f"{name}: not available in this transformers version", flush=True)
            continue
        rows[name] = row
        print(json.dumps(row) if args.json else row, flush=True)
    if "ours" in rows:
        for other, row in rows.items():
            if other != "ours":
                print(f"ours/{other}: throughput x{rows['ours']['tokens_per_s'] / row['tokens_per_s']:.2f} "
                      f"(per CPU-second x{rows['ours']['tokens_per_cpu_s'] / row['tokens_per_cpu_s']:.2f}), "
                      f"TTFT p50 x{row['ttft_p50_s'] / rows['ours']['ttft_p50_s']:.2f} lower, "
                      f"p99 x{row['ttft_p99_s'] / rows['ours']['ttft_p99_s']:.2f} lower", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
