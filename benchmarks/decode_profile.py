"""Where one SmolLM2 decode step spends its CPU: cProfile of the offline engine at a given batch.

`LLMEngine` (core `continuous` preset over the paged-KV runner, TP=1, one torch thread) with
`--batch` requests of `--prompt` tokens each; after their prefills, `--steps` decode steps are
profiled. Prints wall and CPU time per step and the functions with the most own time, and the
share of the profiled time spent in the model's matmuls (`torch._C._nn.linear`, or
actors/models/cpu_gemm.py's layouts when `engine.cpu_gemm` is on, the default).

`--sdpa` turns `engine.cpu_attention` off (decodes gather their blocks and run SDPA instead of
the in-place kernel of actors/models/cpu_attention.py). `--prefill` profiles the batch's prefill
steps instead of the decodes; `--no-fused` turns `engine.cpu_fused_ops` off (the small ops
between the matmuls through PyTorch). Also printed: the share in attention and in those small ops.

    python benchmarks/decode_profile.py [--batch 16] [--prompt 128] [--steps 30] [--sdpa] [--prefill] [--no-fused]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--sdpa", action="store_true", help="decodes through gather + SDPA, not the CPU kernel")
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill steps (the batch's prompts, one step of up to 4,096 tokens) instead")
    ap.add_argument("--no-fused", action="store_true", help="the small ops through PyTorch (cpu_fused_ops off)")
    args = ap.parse_args()
    from actors.executor import LocalExecutor
    from actors.llm_engine import LLMEngine, scheduler_config
    from actors.worker_setup import EngineSpec
    from tidal_core import SamplingParams

    ex = LocalExecutor(EngineSpec(max_model_len=1024, kv_cache_gb=1.0, torch_threads=1,
                                   cpu_attention=not args.sdpa, cpu_fused_ops=not args.no_fused))
    cfg = scheduler_config(ex.info, "continuous", max_batch_size=64, max_num_batched_tokens=4096)
    LLMEngine(ex, ex.info, None, cfg).generate([[1] * 16], SamplingParams(max_tokens=4))  # warm-up
    engine = LLMEngine(ex, ex.info, None, cfg)
    for i in range(args.batch):
        engine.add_request([100 + i] * args.prompt,
                           SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True))
    def prefilling() -> bool:
        return bool(engine.scheduler.num_waiting or engine.scheduler.prefilling)

    while not args.prefill and prefilling():  # run the prefills first: the decodes are profiled
        engine.step()
    prof, steps = cProfile.Profile(), 0
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    while (prefilling() if args.prefill else engine.has_unfinished and steps < args.steps):
        engine.step()
        steps += 1
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    # F.linear, or cpu_gemm's layouts: oneDNN's packed product, or `x @ transposed` for one row, or the
    # block kernel's call
    matmuls = ("torch._C._nn.linear>", "mkldnn._linear_pointwise>", "'__matmul__'")
    linear = sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
                 if any(name in k[2] for name in matmuls)
                 or (k[0].endswith("block_gemm.py") and k[2] == "matmul"))  # the GGUF's blocks (cpu_block_gemm)
    attention = ("scaled_dot_product_attention", "index_select", "paged_decode")
    attn = sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
               if any(name in k[2] for name in attention))
    # the ops between the matmuls: PyTorch's (norm, RoPE, SiLU, the residual adds), or the fused C calls
    small = ("'mul'", "'add'", "'pow'", "'mean'", "rsqrt", "'neg'", "torch.cat", "silu", "'to'",
             "rms_norm", "silu_and_mul", "rope_qk", "apply_rotary")
    small_ops = sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
                    if any(name in k[2] for name in small))
    kind = f"prefill steps ({args.batch} x {args.prompt} tokens)" if args.prefill else "decode steps"
    print(f"batch {args.batch}, {steps} {kind}: wall {wall / steps * 1000:.1f} ms/step, "
          f"CPU {cpu / steps * 1000:.1f} ms/step; linear {linear / total:.0%} of the profiled own time, "
          f"attention (SDPA + index_select, or the CPU kernel) {attn / total:.0%}, "
          f"the small ops between the matmuls {small_ops / total:.0%}")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    if args.prefill:  # PyTorch's own op accounting (cProfile cannot see `x * y`): the same prefill again
        from torch.profiler import ProfilerActivity, profile

        for i in range(args.batch):
            engine.add_request([200 + i] * args.prompt, SamplingParams(max_tokens=1, temperature=0.0))
        with profile(activities=[ProfilerActivity.CPU]) as p:
            while prefilling():
                engine.step()
        ops = p.key_averages()
        total_us = sum(e.self_cpu_time_total for e in ops)
        small_names = ("aten::mul", "aten::add", "aten::silu", "aten::cat", "aten::neg", "aten::pow",
                       "aten::mean", "aten::rsqrt", "aten::sum", "aten::div")
        small_us = sum(e.self_cpu_time_total for e in ops if e.key in small_names)
        lin_us = sum(e.self_cpu_time_total for e in ops if "linear" in e.key or "addmm" in e.key)
        print(f"torch.profiler, self CPU of the ops: linears {lin_us / total_us:.0%}, PyTorch's small ops "
              f"between them {small_us / total_us:.0%} (the fused C calls are outside PyTorch's count)")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
