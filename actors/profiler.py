"""`tidal profile`: measure the real runner on a device and fit cost-model coefficients.

Owns: the model shape presets (real architectures, random weights: nothing is downloaded),
the profiling run and the fit, written as a cost-model YAML in the format of
calibration/costmodels/*.yaml. The fit reuses calibration/fit.py: its roofline and
relative-error least squares for the device shape, and its end-to-end stage for the host
terms, on whole engine steps measured here instead of SplitwiseSim's.

A TP-N shard is profiled alone on one device (`--tp N`: one rank's heads and columns, the
collectives skipped); the all-reduce terms are zero unless measured elsewhere. `--layers`
profiles fewer layers than the model has (70B does not fit one device at TP1): per-layer
figures are measured, then `num_layers` and the attention terms are scaled to the real depth.
On a GPU the decode steps replay CUDA graphs, as serving runs them (an eager decode of a deep
model is bound by its kernel launches, which no serving step pays); their host floor is fitted
apart from the eager prefill steps' (`graph_host_floor_ms`).
On CPU it runs a quick sweep (tests use the tiny config); the full sweep is meant for a GPU.

    tidal profile --model llama-3-70b --tp 8 --layers 8 --gpu h100 --out costmodels-h100.yaml

Must not import: ray.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=2048),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}),
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
}


def _build_runner(cfg: dict[str, Any], tp: int, device: str, max_len: int, threads: int | None,
                  max_batch: int = 64, graph_batches: tuple[int, ...] = (), graph_context: int = 2048) -> Any:
    """A runner for the sweeps. On CUDA, decode steps of `graph_batches` replay CUDA graphs captured
    at one context bucket of `graph_context` tokens (plus the full width), as serving does; on CPU
    (or with no batches) every step is eager."""
    from actors.models import TPContext
    from actors.worker_setup import EngineSpec, WorkerBuilder

    # The KV budget is profiled on the largest step this sweep sends (its largest decode batch). Half
    # the device is plenty of KV for the sweeps, and leaves room for their own graphs and activations.
    spec = EngineSpec(random_config=cfg, device=device, max_model_len=max_len, kv_cache_gb=0.5,
                      gpu_memory_utilization=0.5, max_num_batched_tokens=min(max_len, 8192), torch_threads=threads,
                      enforce_eager=not graph_batches, cuda_graph_buckets=tuple(graph_batches) or (1,),
                      cuda_graph_contexts=(graph_context,), max_batch_size=max_batch)
    builder = WorkerBuilder(spec, TPContext(0, tp, None, collectives=False))
    blocks, _ = builder.load()
    return builder.finish(blocks)


def _device_coefficients(linear: list[tuple[int, float]], prefill: list[tuple[int, int, float]],
                         decode: list[tuple[int, int, float]], layers: int) -> dict[str, float]:
    import numpy as np

    from calibration.lsq import fit_linear_rel, fit_roofline

    floor, slope, p, _ = fit_roofline(linear)
    pre, _ = fit_linear_rel(np.array([[1.0, n * (c + n / 2), n] for n, c, _ in prefill]),
                            np.array([t for *_, t in prefill]))
    dec, _ = fit_linear_rel(np.array([[1.0, b * c] for b, c, _ in decode]), np.array([t for *_, t in decode]))
    return {"num_layers": layers, "linear_floor_ms": floor, "linear_ms_per_token": slope, "linear_smoothness": p,
            "allreduce_floor_ms": 0.0, "allreduce_ms_per_token": 0.0, "allreduce_smoothness": 1.0,
            "attn_prefill_ms_per_pair": float(pre[1]) * layers, "attn_prefill_ms_per_token": float(pre[2]) * layers,
            "attn_decode_ms_per_token": float(dec[1]) * layers}


def profile(model: str, gpu: str, tp: int = 1, layers: int | None = None, device: str = "auto", quick: bool = True,
            threads: int | None = None) -> Any:
    """Run the sweeps and fit; returns an `calibration.cost_model.CostModel`."""
    from actors.profiler_sweeps import FULL, QUICK, attention_rows, linear_curve, step_points
    from calibration import fit
    from calibration.cost_model import CostCoefficients, CostModel
    from calibration.measured import MeasuredPoint

    cfg = dict(PRESETS[model])
    real_layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = min(layers or real_layers, real_layers)
    sweep = QUICK if quick else FULL
    max_batch = max(*sweep.decode_batches, *(b for b, _ in sweep.decode_attention))
    runner = _build_runner(cfg, tp, device, 2 * max(sweep.prefill_prompts) + 1024, threads, max_batch,
                           sweep.decode_batches)
    linear = linear_curve(runner, sweep)
    prefill, decode = attention_rows(runner, sweep)
    steps = step_points(runner, sweep, cfg["vocab_size"])
    measured_layers = cfg["num_hidden_layers"]
    device_coeffs = _device_coefficients(linear, prefill, decode, measured_layers)
    graphs = set(runner.graphs.captured_batches) if runner.graphs is not None else set()
    points = [MeasuredPoint(kind, prompt, batch, ms, sweep.repeats, held_out=i % 2 == 1,
                            graph=kind == "decode" and batch in graphs)
              for i, (kind, prompt, batch, ms) in enumerate(steps)]
    fitted = fit.end_to_end_stage(gpu, tp, device_coeffs, [p for p in points if not p.held_out])
    coeffs = fit._build(gpu, tp, device_coeffs, **fitted).coefficients.to_dict()
    scale = real_layers / measured_layers  # per-layer terms scale with depth; host terms do not
    coeffs["num_layers"] = real_layers
    for key in ("attn_prefill_ms_per_pair", "attn_prefill_ms_per_token", "attn_decode_ms_per_token"):
        coeffs[key] *= scale
    name = f"{gpu}-{model}-tp{tp}-profiled"
    description = (f"{model} (random weights of the real shapes) at TP{tp} shard on {gpu}, measured by `tidal profile`"
                   f" ({'quick' if quick else 'full'} sweep, {measured_layers} of {real_layers} layers measured)")
    sources = [{"figures": ["all"], "file": "measured by actors/profiler.py", "origin": f"tidal profile on {gpu}",
                "method": "device shape: roofline + relative least squares (calibration/lsq.py); host terms: "
                          "calibration/fit.end_to_end_stage on whole engine steps; every other step held out"}]
    final = CostModel(name, gpu, model, tp, CostCoefficients.from_dict(
        {k: (v if k == "num_layers" else float(f"{v:.6g}")) for k, v in coeffs.items()}),
        description=description, sources=sources)
    if measured_layers == real_layers:
        final.fit = fit.fit_report(final, points)
        final.fit["split"] = "held out: every other measured step (prefill prompt sizes, then decode batch sizes)"
    return final


def write(model: Any, out: Path) -> Path:
    import yaml

    out.parent.mkdir(parents=True, exist_ok=True)
    header = "# Generated by `tidal profile`; measured on a device, not by hand. Form: docs/cost-model.md\n"
    out.write_text(header + yaml.safe_dump(model.to_dict(), sort_keys=False, width=120, default_flow_style=None))
    return out


def _run(args: argparse.Namespace) -> int:
    model = profile(args.model, args.gpu, args.tp, args.layers, args.device, not args.full, args.threads)
    path = write(model, Path(args.out or f"{model.name}.yaml"))
    c = model.coefficients
    print(f"wrote {path}: linear floor {c.linear_floor_ms:.4g} ms/layer, slope {c.linear_ms_per_token:.4g} "
          f"ms/token/layer, host floor {c.host_floor_ms:.4g} ms")
    if model.fit:
        print(f"fit: held-out max |rel error| {model.fit['heldout_max_abs_rel_error']:.1%}")
    return 0 if math.isfinite(c.linear_floor_ms) else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure the runner on a device and fit cost-model coefficients",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--gpu", default="cpu", help="label of the device in the cost model (a100, h100, cpu...)")
    p.add_argument("--tp", type=int, default=1, help="profile one rank's shard of TP=N")
    p.add_argument("--layers", type=int, default=None, help="measure this many layers (scaled to the real depth)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--full", action="store_true", help="the full sweep (GPU); default: the quick one")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="YAML path (default: <name>.yaml here)")
    p.set_defaults(func=_run)
