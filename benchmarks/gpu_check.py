"""The engine's GPU figures, measured in one run: step times of a Llama-3-8B-shaped model with
random weights at TP1, CUDA-graph replay vs eager, the bandwidth bound, and the profiler's fit.

Stages (benchmarks/gpu_check.sh runs them in order, each under its own time limit):

    python -m benchmarks.gpu_check engine  --out DIR [--smoke]   # engine.json
    python -m benchmarks.gpu_check profile --out DIR [--smoke]   # costmodel.yaml, profile.json
    python -m benchmarks.gpu_check report  --out DIR             # gpu_check.md from the above

`engine`: one runner (bf16, Triton attention, CUDA graphs per batch x context bucket). Decode
steps at each batch and context, eager and replayed from the same state (the sampled tokens
must be identical), timed by `StepResult.device_time_s` (ends on a device synchronize), median
of repeats; prefill steps of one prompt. The bound of a decode step is its bytes read once
(weights + the batch's KV) at the copy bandwidth measured in the same run (bytes read and
written by a device-to-device copy, per second). `profile`: `actors.profiler.profile` on the
same shape (the full sweep), which fits the cost model and reports its held-out errors.
`--smoke` runs the tiny config on CPU with few points, to test the script without a GPU: its
figures mean nothing. No Ray, no network; needs torch (+ Triton on CUDA), numpy, pyyaml.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from tidal_core.buckets import CudaGraphBuckets

# torch and the engine are imported by the stages that run them: `report` needs neither.

FULL = dict(model="llama-3-8b", batches=(1, 2, 4, 8, 16, 32, 64), contexts=(1024, 4096),
            prefill=(512, 2048, 8192), repeats=10, max_model_len=8192 + 256, step_tokens=8192)
SMOKE = dict(model="tiny", batches=(1, 2, 4), contexts=(24, 60), prefill=(16, 64), repeats=2, max_model_len=128,
             step_tokens=128)
GOALS = {"decode_vs_bound_b64_4k": 1.5, "graph_speedup_b1_8": 1.5, "heldout_max_abs_rel_error": 0.10}


def check_plan(cfg: dict[str, Any]) -> None:
    """Fail before the model is built if a step of the plan could not run (positions past the
    rotary table, a step larger than the memory profile covers)."""
    longest = max(cfg["contexts"]) + len(cfg["batches"]) * (2 * cfg["repeats"] + 4)
    for what, need in (("the longest decode context", longest), ("the largest prefill", max(cfg["prefill"]))):
        if need > cfg["max_model_len"]:
            raise ValueError(f"{what} reaches {need} tokens > max_model_len={cfg['max_model_len']}")
    if cfg["step_tokens"] < max(max(cfg["prefill"]), max(cfg["batches"])):
        raise ValueError(f"step_tokens={cfg['step_tokens']} is below the largest step the plan sends")


def copy_bandwidth(device: Any, mib: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `mib` MiB (median of 5)."""
    import torch

    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times)


def _build(cfg: dict[str, Any], smoke: bool) -> tuple[Any, Any]:
    from actors.profiler import PRESETS
    from actors.worker_setup import EngineSpec, WorkerBuilder

    device = "cpu" if smoke else "cuda"
    spec = EngineSpec(random_config=dict(PRESETS[cfg["model"]]), device=device, max_model_len=cfg["max_model_len"],
                      max_num_batched_tokens=cfg["step_tokens"], max_batch_size=max(cfg["batches"]),
                      cuda_graph_buckets=tuple(cfg["batches"]), gpu_memory_utilization=0.9, kv_cache_gb=0.05,
                      torch_threads=1 if smoke else None, seed=0)
    builder = WorkerBuilder(spec)
    blocks, _ = builder.load()
    return builder.finish(blocks), builder


def _median_ms(runner: Any, make_plan: Any, repeats: int) -> tuple[float, list[Any]]:
    results = [runner.execute(make_plan()) for _ in range(repeats + 1)]  # the first is a warm-up
    return statistics.median(r.device_time_s for r in results[1:]) * 1e3, results


def _snapshot(runner: Any, rids: list[str]) -> dict[str, tuple[int, list[int]]]:
    return {r: (runner.states[r].num_computed, list(runner.states[r].token_ids)) for r in rids}


def _restore(runner: Any, snap: dict[str, tuple[int, list[int]]]) -> None:
    """Back to a snapshot: KV past a request's context is never read, so only the counts matter."""
    for rid, (computed, tokens) in snap.items():
        st = runner.states[rid]
        st.num_computed = computed
        st.token_ids[:] = tokens


def _decode_rows(runner: Any, maker: Any, cfg: dict[str, Any], weight_bytes: int, kv_token_bytes: int,
                 bandwidth: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    buckets = CudaGraphBuckets(runner.graphs.buckets) if runner.graphs is not None else None
    reps = cfg["repeats"]
    for ctx in cfg["contexts"]:
        extra = len(cfg["batches"]) * (2 * reps + 4)  # tokens every batch's eager + graph runs append
        rids = maker.prefill_many([ctx - 1] * max(cfg["batches"]), extra, cfg["step_tokens"])
        for batch in cfg["batches"]:
            sub = rids[:batch]
            snap = _snapshot(runner, sub)
            eager_ms, eager = _median_ms(runner, lambda sub=sub: maker.decode(sub), reps)
            row: dict[str, Any] = {"batch": batch, "context": ctx, "eager_ms": round(eager_ms, 4)}
            kv_bytes = sum(runner.context_len(r) for r in sub) * kv_token_bytes
            row["bound_ms"] = round((weight_bytes + kv_bytes) / bandwidth * 1e3, 4)
            row["eager_vs_bound"] = round(eager_ms / row["bound_ms"], 3)
            if buckets is not None and buckets.bucket_for(batch) is not None:
                padded = buckets.bucket_for(batch)
                after = _snapshot(runner, sub)
                _restore(runner, snap)  # the same state again: eager and graph must sample the same tokens
                replay = runner.execute(dataclasses.replace(maker.decode(sub), padded_batch_size=padded))
                row["token_identical"] = replay.sampled_token_ids == eager[0].sampled_token_ids
                _restore(runner, after)
                graph_ms, _ = _median_ms(
                    runner, lambda sub=sub, p=padded: dataclasses.replace(maker.decode(sub), padded_batch_size=p), reps)
                row.update(graph_ms=round(graph_ms, 4), graph_speedup=round(eager_ms / graph_ms, 3),
                           graph_vs_bound=round(graph_ms / row["bound_ms"], 3))
            rows.append(row)
        runner.execute(maker.decode([], finished=rids))
    return rows


def _attention_rows(runner: Any, cfg: dict[str, Any], bandwidth: float) -> list[dict[str, Any]]:
    """One layer's decode attention alone (the Triton kernel, no other op) at the largest batch and
    context and at batch 1: one pass over the KV (splits=1) against the split-KV launch the engine
    picks, as KV bytes read per second against the copy bandwidth; on a GPU, other launch choices
    too. Device time of graph replays, median of repeats."""
    import torch

    from actors.paged_attention import BLOCK_N, DECODE_LAUNCH, decode_splits, triton_decode
    from actors.profiler_sweeps import device_timed

    if runner.attention_backend != "triton":
        return []
    attn = runner.model.layers[0].self_attn
    k_cache, v_cache = runner.kv_caches[0]
    bs, kvh, hd = runner.block_size, attn.shard.kv_count, attn.head_dim
    dev, dt = runner.device, runner.model.dtype
    rows = []
    for batch, ctx in ((max(cfg["batches"]), max(cfg["contexts"])), (1, max(cfg["contexts"])),
                       (max(cfg["batches"]), min(cfg["contexts"]))):
        per_seq = -(-ctx // bs)
        tables = torch.arange(batch * per_seq, device=dev).remainder(runner.num_blocks).view(batch, per_seq)
        lens = torch.full((batch,), ctx, device=dev)
        q = torch.randn(batch, attn.shard.q_count, hd, device=dev, dtype=dt)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * ctx * kvh * hd * k_cache.element_size()
        width = per_seq * bs
        auto, auto_share = decode_splits(width)
        args = (q, k_cache, v_cache, tables, lens, attn.scale, out)

        def row(share: int, chosen: bool, variant: bool, args: tuple = args, batch: int = batch, ctx: int = ctx,
                width: int = width, kv_bytes: int = kv_bytes) -> dict[str, Any]:
            ms = device_timed(lambda: triton_decode(*args, share=share), cfg["repeats"] * 3, dev)
            return {"batch": batch, "context": ctx, "splits": -(-width // share), "chosen": chosen,
                    "variant": variant, "ms": round(ms, 4), "kv_bytes_per_s": round(kv_bytes / ms * 1e3),
                    "vs_copy_bandwidth": round(kv_bytes / ms * 1e3 / bandwidth, 3),
                    "launch": {**DECODE_LAUNCH, "share": share}}

        for splits, share in sorted({(1, -(-width // BLOCK_N) * BLOCK_N), (auto, auto_share)}):
            rows.append(row(share, splits == auto, False))
            if splits == auto and dev.type == "cuda":  # the engine's launch against other block/warp/stage choices
                default = dict(DECODE_LAUNCH)
                try:
                    for variant in LAUNCH_VARIANTS:
                        DECODE_LAUNCH.update({**default, **{k: v for k, v in variant.items() if k != "share"}})
                        rows.append(row(variant.get("share", share), False, True))
                finally:
                    DECODE_LAUNCH.clear()
                    DECODE_LAUNCH.update(default)
    return rows


LAUNCH_VARIANTS = ({"num_stages": 3}, {"num_stages": 1}, {"BLOCK_KV": 32, "num_stages": 3}, {"share": 512},
                   {"share": 1024}, {"num_warps": 8})


def _host_profile(runner: Any, maker: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Where an eager step's host time goes: cProfile over a few eager steps of one prompt of the
    smallest prefill size (what every prefill step pays before its device work), the functions
    with the most time of their own, per step."""
    import cProfile
    import pstats

    n, steps = min(cfg["prefill"]), 3
    runner.execute(maker.prefill([n], 0))  # warm-up
    prof = cProfile.Profile()
    wall = []
    for _ in range(steps):
        plan = maker.prefill([n], 0)
        t0 = time.perf_counter()
        prof.enable()
        runner.execute(plan)
        prof.disable()
        wall.append(time.perf_counter() - t0)
        runner.execute(maker.decode([], finished=list(plan.num_scheduled_tokens)))
    stats = pstats.Stats(prof)
    rows = sorted(((v[2], v[1], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.stats.items()),  # type: ignore[attr-defined]
                  reverse=True)[:15]
    return {"prompt_tokens": n, "wall_ms_per_step": round(statistics.median(wall) * 1e3, 3),
            "top_own_time": [{"function": name, "calls_per_step": calls // steps,
                              "own_ms_per_step": round(own / steps * 1e3, 3)} for own, calls, name in rows]}


def engine(out: Path, smoke: bool) -> dict[str, Any]:
    import torch

    from actors.profiler import PRESETS
    from actors.profiler_sweeps import _PlanMaker

    cfg = SMOKE if smoke else FULL
    check_plan(cfg)
    # Before the engine takes the device's memory: 2 x 2 GiB, many times the L2.
    bandwidth = copy_bandwidth(torch.device("cpu" if smoke else "cuda"), 64 if smoke else 2048)
    if not smoke:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    runner, builder = _build(cfg, smoke)
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token_bytes = builder.kv_spec().bytes_per_block // builder.spec.block_size
    maker = _PlanMaker(runner, PRESETS[cfg["model"]]["vocab_size"])
    decode = _decode_rows(runner, maker, cfg, weight_bytes, kv_token_bytes, bandwidth)
    attention = _attention_rows(runner, cfg, bandwidth)
    prefill = []
    for n in cfg["prefill"]:
        times = []
        for _ in range(cfg["repeats"] + 1):  # the first is a warm-up
            plan = maker.prefill([n], 0)
            done = runner.execute(plan)
            runner.execute(maker.decode([], finished=list(plan.num_scheduled_tokens)))
            times.append(done.device_time_s)
        ms = statistics.median(times[1:]) * 1e3
        prefill.append({"tokens": n, "ms": round(ms, 4), "tokens_per_s": round(n / ms * 1e3, 1)})
    host = _host_profile(runner, maker, cfg)
    mem = builder.memory
    result = {"model": cfg["model"], "device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)",
              "dtype": str(runner.model.dtype), "attention": runner.attention_backend,
              "graph_buckets": list(runner.graphs.captured_batches) if runner.graphs else [],
              "graph_context_widths": list(runner.graphs.widths) if runner.graphs else [],
              "build_s": round(build_s, 1), "kv_blocks": runner.num_blocks, "weight_bytes": weight_bytes,
              "copy_bandwidth_bytes_per_s": round(bandwidth),
              "memory_profile": dataclasses.asdict(mem) if mem else None,
              "graph_pool_bytes_measured": runner.graphs.pool_bytes if runner.graphs else None,
              "graph_padding": runner.graphs.padding() if runner.graphs else None, "decode": decode, "prefill": prefill,
              "attention_kernel": attention, "eager_host_profile": host}
    if torch.cuda.is_available() and not smoke:
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["total_memory"] = torch.cuda.get_device_properties(0).total_memory
    (out / "engine.json").write_text(json.dumps(result, indent=1))
    del runner, builder
    gc.collect()
    return result


def profile(out: Path, smoke: bool) -> dict[str, Any]:
    from actors.profiler import profile as run_profile
    from actors.profiler import write

    cfg = SMOKE if smoke else FULL
    t0 = time.perf_counter()
    model = run_profile(cfg["model"], "cpu" if smoke else "h200", 1, None, "cpu" if smoke else "cuda",
                        quick=smoke, threads=1 if smoke else None)
    write(model, out / "costmodel.yaml")
    fit = model.fit or {}
    result = {"model": cfg["model"], "seconds": round(time.perf_counter() - t0, 1), "name": model.name,
              "coefficients": model.coefficients.to_dict(),
              **{k: fit.get(k) for k in ("train_max_abs_rel_error", "heldout_max_abs_rel_error",
                                         "train_rms_rel_error", "heldout_rms_rel_error")},
              "points": fit.get("points", [])}
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    return result


def _goal(value: float | None, limit: float, higher_is_better: bool) -> str:
    if value is None:
        return "not measured"
    ok = value >= limit if higher_is_better else value <= limit
    return f"{value:.3g} ({'met' if ok else 'MISSED'}: goal {'>=' if higher_is_better else '<='} {limit})"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def report(out: Path) -> str:
    """gpu_check.md: every figure of engine.json and profile.json, and the goals, met or missed."""
    eng, prof = _load(out / "engine.json"), _load(out / "profile.json")
    log = (out / "gpu_tests.log").read_text().splitlines() if (out / "gpu_tests.log").exists() else []
    tests = [ln.strip("= ") for ln in log if re.search(r"\d+ (passed|failed|skipped|error)", ln)][-1:]
    lines = ["# GPU check", "", f"GPU tests: {tests[0] if tests else 'not run'}", ""]
    if eng:
        lines += [f"Engine: {eng['model']} random weights on {eng['device']}, {eng['dtype']}, attention "
                  f"{eng['attention']}, graphs {eng['graph_buckets']} x widths {eng['graph_context_widths']}, "
                  f"{eng['kv_blocks']} KV blocks, copy bandwidth {eng['copy_bandwidth_bytes_per_s'] / 1e12:.3g} TB/s "
                  f"(read + written), built in {eng['build_s']} s.", "",
                  f"Memory profile (bytes): {eng['memory_profile']}; graph pool measured after capture "
                  f"{eng['graph_pool_bytes_measured']}; peak allocated {eng.get('max_memory_allocated')} of "
                  f"{eng.get('total_memory')}. Graph padding: {eng['graph_padding']}.", "",
                  "| batch | context | eager ms | graph ms | graph speedup | bound ms | eager / bound | graph / bound "
                  "| tokens identical |", "|---|---|---|---|---|---|---|---|---|"]
        for r in eng["decode"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['eager_ms']} | {r.get('graph_ms', '-')} | "
                         f"{r.get('graph_speedup', '-')} | {r['bound_ms']} | {r['eager_vs_bound']} | "
                         f"{r.get('graph_vs_bound', '-')} | {r.get('token_identical', '-')} |")
        lines += ["", "| prefill tokens | ms | tokens/s |", "|---|---|---|"]
        lines += [f"| {r['tokens']} | {r['ms']} | {r['tokens_per_s']} |" for r in eng["prefill"]]
        if eng.get("attention_kernel"):
            lines += ["", "Decode attention of one layer alone (KV bytes read per second; * the engine's choice):", "",
                      "| batch | context | splits | launch | ms | KV TB/s | / copy bandwidth |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {r['batch']} | {r['context']} | {r['splits']}{' *' if r['chosen'] else ''} | "
                      f"{r.get('launch', '')} | {r['ms']} | {r['kv_bytes_per_s'] / 1e12:.3g} | "
                      f"{r['vs_copy_bandwidth']} |" for r in eng["attention_kernel"]]
        if eng.get("eager_host_profile"):
            h = eng["eager_host_profile"]
            lines += ["", f"An eager prefill step of {h['prompt_tokens']} tokens: {h['wall_ms_per_step']} ms of wall "
                      "time (cProfile on); the functions with the most time of their own, per step:", "",
                      "| function | calls | own ms |", "|---|---|---|"]
            lines += [f"| {r['function']} | {r['calls_per_step']} | {r['own_ms_per_step']} |"
                      for r in h["top_own_time"]]
        big = [r for r in eng["decode"] if r["batch"] == 64 and r["context"] == 4096]
        best = min((r.get("graph_vs_bound", r["eager_vs_bound"]) for r in big), default=None)
        small = [r["graph_speedup"] for r in eng["decode"] if r["batch"] <= 8 and "graph_speedup" in r]
        checked = [r["token_identical"] for r in eng["decode"] if "token_identical" in r]
        same = (all(checked) and f"yes, {len(checked)} of {len(checked)}") if checked else "not measured"
        if checked and not all(checked):
            same = f"NO: {checked.count(False)} of {len(checked)} steps differ"
        lines += ["", "Goals:", f"- decode, batch 64 at 4k context, vs the bandwidth bound: "
                  f"{_goal(best, GOALS['decode_vs_bound_b64_4k'], False)}",
                  f"- CUDA-graph replay vs eager at batch 1-8 (lowest): "
                  f"{_goal(min(small) if small else None, GOALS['graph_speedup_b1_8'], True)}; "
                  f"graph and eager tokens identical: {same}"]
    if prof:
        lines += [f"- fitted cost model ({prof['name']}, {prof['seconds']} s), held-out max |rel error|: "
                  f"{_goal(prof['heldout_max_abs_rel_error'], GOALS['heldout_max_abs_rel_error'], False)} "
                  f"(train max {prof['train_max_abs_rel_error']})", "",
                  "| set | kind | batch x prompt | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['set']} | {p['kind']} | {p['batch']} x {p['prompt']} | {p['measured_ms']} | "
                  f"{p['predicted_ms']} | {p['rel_error']:+.1%} |" for p in prof["points"]]
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("engine", "profile", "report"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU: tests the script, not the GPU")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.smoke and args.stage != "report":
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --smoke to test the script on CPU")
    if args.stage == "engine":
        print(json.dumps(engine(args.out, args.smoke)["decode"][-1]))
    elif args.stage == "profile":
        res = profile(args.out, args.smoke)
        print(f"profile: held-out max |rel error| {res['heldout_max_abs_rel_error']}")
    else:
        print(report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
