"""What a step's trip to the model worker costs, through the step socket and through Ray actor calls.

Two replica groups of SmolLM2-135M-Instruct on CPU (TP 1, float32), one with `step_socket` on
(actors/step_socket.py) and one with it off (plain actor calls), in one Ray cluster, driven in
alternating rounds by the serving unit's own calls: the core scheduler's schedule / on_step_done
around `await group.execute(plan)` on an asyncio loop. Every round runs the same requests
(`--batch` prompts of `--prompt` tokens, `--tokens` greedy tokens each, `ignore_eos`) through each
group. Per step, the transport's cost is the wall time of `execute` seen by the unit less the
step's own time measured inside the worker (`StepResult.device_time_s`): the plan's pickling and
trip there, the result's trip back and the unit's loop waking up. The scheduler's own work
between steps is outside it (the same for both).

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/step_transport.py \
        [--batch 4] [--prompt 64] [--tokens 48] [--rounds 3]

Prints per transport the median and mean per-step cost over all rounds, each round's median, and
whether both gave the same tokens (they must).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


async def run_round(group: Any, batch: int, prompt: int, tokens: int, seed: int) -> tuple[list[float], list[list[int]]]:
    """One round through `group`: the per-step transport cost (s) and the generated tokens."""
    from actors.llm_engine import LLMEngine, scheduler_config
    from tidal_core import SamplingParams
    from tidal_core.plan import Run

    engine = LLMEngine(group.blocking(), group.info, None, scheduler_config(group.info, "continuous"))
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request([100 + (seed * 7 + i * 13 + j) % 5000 for j in range(prompt)], sampling)
            for i in range(batch)]
    sched, costs, done = engine.scheduler, [], {}
    while sched.has_unfinished:
        decision = sched.schedule(time.perf_counter())
        assert isinstance(decision, Run), decision
        t0 = time.perf_counter()
        result = await group.execute(decision.plan)
        costs.append(time.perf_counter() - t0 - result.device_time_s)
        outputs = sched.on_step_done(decision.plan, result, time.perf_counter())
        done.update({r.request_id: list(r.output_token_ids) for r in outputs.finished})
    return costs, [done[r] for r in rids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import ray

    from actors.engine_spec import EngineSpec
    from actors.replica import ReplicaGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = EngineSpec(model="smollm2-135m-instruct", device="cpu", max_model_len=1024, kv_cache_gb=0.25)
    groups = {name: ReplicaGroup(spec, step_timeout_s=120.0, step_socket=(name == "socket"))
              for name in ("socket", "actor_calls")}
    try:
        for name, group in groups.items():
            if group.transport != name:
                raise SystemExit(f"asked for {name}, the group uses {group.transport}")
        costs: dict[str, list[float]] = {name: [] for name in groups}
        per_round: dict[str, list[float]] = {name: [] for name in groups}
        same = True

        async def rounds() -> None:
            nonlocal same
            await run_round(groups["socket"], 1, 8, 2, seed=99)  # warm-up, both
            await run_round(groups["actor_calls"], 1, 8, 2, seed=99)
            for r in range(args.rounds):
                order = ("socket", "actor_calls") if r % 2 == 0 else ("actor_calls", "socket")
                outs = {}
                for name in order:
                    c, outs[name] = await run_round(groups[name], args.batch, args.prompt, args.tokens, seed=r)
                    costs[name] += c
                    per_round[name].append(statistics.median(c))
                same = same and outs["socket"] == outs["actor_calls"]

        asyncio.run(rounds())
    finally:
        for group in groups.values():
            group.shutdown()
        ray.shutdown()
    summary = {name: {"steps": len(c), "p50_ms": statistics.median(c) * 1e3, "mean_ms": statistics.mean(c) * 1e3,
                      "round_p50_ms": [round(x * 1e3, 3) for x in per_round[name]]} for name, c in costs.items()}
    for name, s in summary.items():
        print(f"{name:12s} {s['steps']:4d} steps: transport cost per step p50 {s['p50_ms']:.3f} ms, "
              f"mean {s['mean_ms']:.3f} ms; per round p50 {s['round_p50_ms']}")
    print(f"socket / actor calls, p50: x{summary['socket']['p50_ms'] / summary['actor_calls']['p50_ms']:.2f}; "
          f"same tokens: {same}")
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
