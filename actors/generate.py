"""`tidal generate`: offline generation through the core Scheduler and the real model runner.

Owns: the command. Raw prompts are tokenized as given (BOS added by the tokenizer, no chat
template) unless `--chat`, which applies the model's chat template with a generation prompt.
TP=1 runs in this process; `--tp N > 1` starts a Ray replica group of N workers.

    tidal generate --model smollm2-135m-instruct --max-tokens 32 --temperature 0 --prompt "Hello"

Must not import: fastapi.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from actors.model_loader import DEFAULT_MODEL


def _run(args: argparse.Namespace) -> int:
    from actors.executor import LocalExecutor
    from actors.llm_engine import LLMEngine, scheduler_config
    from actors.model_loader import load_tokenizer
    from actors.worker_setup import EngineSpec
    from tidal_core import SamplingParams

    spec = EngineSpec(model=args.model, tp=args.tp, max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb,
                      device=args.device, seed=args.seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    group: Any = None
    if args.tp > 1:
        import ray

        from actors.replica import ReplicaGroup

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(include_dashboard=False, log_to_driver=False)
        group = ReplicaGroup(spec)
        executor: Any = group.blocking()
        info = group.info
    else:
        local = LocalExecutor(spec)
        executor, info = local, local.info
    try:
        tokenizer = load_tokenizer(info.model_path) if info.model_path else None
        engine = LLMEngine(executor, info, tokenizer, scheduler_config(info, "continuous"))
        completions = engine.generate(args.prompt, sampling, chat=args.chat)
    finally:
        if group is not None:
            group.shutdown()
    for c in completions:
        if args.json:
            print(json.dumps(c.to_json()), flush=True)
        else:
            print(f"--- {c.prompt!r} ({c.finish_reason}, {len(c.token_ids)} tokens)\n{c.text}", flush=True)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="offline generation with the real model (no Serve)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF checkpoint directory, .gguf file or HF id")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (> 1 starts Ray workers)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per completion and line")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache budget on CPU")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.generate")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
