"""`tidal fit-cost-model`: calibrate the step-time model from measured GPU data.

Owns: the two-stage calibration and the command. Stage 1 (device shape) fits the operator
profiles of Vidur: the non-attention ops and the all-reduce as rooflines, and attention as
a linear model of its work. Stage 2 (end to end) fits the host terms, the stack's scale on
the profile and the large-step gain to SplitwiseSim's measured step times of late-2023 vLLM,
on the training half of the points only, and reports the error on every point. Writes
calibration/costmodels/<gpu>-llama70b-tp<N>.yaml. The form lives in calibration/cost_model.py; the
reasoning and the error tables in docs/cost-model.md.

Must not import: ray, torch. (numpy is used here; the run-time model does not need it.)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np

from calibration import measured as data
from calibration.cost_model import COSTMODEL_DIR, CostCoefficients, CostModel
from calibration.lsq import fit_linear_rel, fit_roofline, levenberg_marquardt, nnls

MODEL = "llama-2-70b"
NUM_LAYERS = 80
TPS = (8, 4)
"""TP degrees fitted. TP2 is left out: its batch-64 rows are failed runs (prefill 0.8 s after 6.6 s at
batch 32; decode faster than at batch 32), so its batch slice has no large-batch point to fit."""
LARGE_STEP_BRACKET = (2048, 8192)
"""Largest training prefill step still on the small-step per-token trend, and the smallest one off it.
The knee is put at their geometric mean with a sharpness that puts them at 5% and 95% of the rise:
the training points say no more than that the knee lies between them."""
OVERLAP_GRID = (1.0, 2.0, 4.0, 8.0)
HOST_TERMS = ("step_ms", "prefill_step_ms", "per_seq_ms", "decode_ctx_ms_per_token")
SPLIT = ("held out: every other prompt size of the batch-1 slice (256, 1024, 4096) and every other batch "
         "size of the prompt-512 slice (2, 8, 32), prefill and decode alike; the rest is fitted")


def name_for(gpu: str, tp: int) -> str:
    return f"{gpu}-llama70b-tp{tp}"


# ---- stage 1: device shape from operator profiles ------------------------------------------------
def device_stage(gpu: str, tp: int, data_dir: Path) -> tuple[dict[str, float], list[dict[str, Any]]]:
    lin_floor, lin_slope, lin_p, lin_rms = fit_roofline(data.linear_ops_curve(gpu, tp, data_dir))
    ar_floor, ar_slope, ar_p, ar_rms = fit_roofline(data.allreduce_curve(gpu, tp, data_dir))
    pre, dec, pre_rms, dec_rms = _attention_a100_tp2(data_dir)
    # Attention work per GPU scales with its query heads (64/tp); H100 by the profiled ratio of
    # compute-bound (prefill) and memory-bound (decode) speed of the same layer's other ops.
    heads = data.ATTENTION_TP / tp
    compute_ratio = memory_ratio = 1.0
    if gpu != "a100":
        a_floor, a_slope, _, _ = fit_roofline(data.linear_ops_curve("a100", tp, data_dir))
        compute_ratio, memory_ratio = lin_slope / a_slope, lin_floor / a_floor
    coeffs = {"num_layers": NUM_LAYERS, "linear_floor_ms": lin_floor, "linear_ms_per_token": lin_slope,
              "linear_smoothness": lin_p, "allreduce_floor_ms": ar_floor, "allreduce_ms_per_token": ar_slope,
              "allreduce_smoothness": ar_p,
              "attn_prefill_ms_per_pair": pre[1] * heads * compute_ratio * NUM_LAYERS,
              "attn_prefill_ms_per_token": pre[2] * heads * compute_ratio * NUM_LAYERS,
              "attn_decode_ms_per_token": dec[1] * heads * memory_ratio * NUM_LAYERS}
    cite = {"cite": data.CITE[data.VIDUR]}
    mlp = data.source(data.VIDUR, data.MLP_FILE.format(gpu=data.GPUS[gpu][1]), data_dir)
    net = data.source(data.VIDUR, data.ALLREDUCE_FILE.format(net=data.GPUS[gpu][2]), data_dir)
    att = data.source(data.VIDUR, data.ATTENTION_FILE, data_dir)
    sources = [
        {"figures": ["linear_floor_ms", "linear_ms_per_token", "linear_smoothness"], **mlp, **cite,
         "rows": f"num_tensor_parallel_workers == {tp}; sum of the median of {', '.join(data.LINEAR_OPS)}",
         "method": f"roofline fit in log space, rms log error {lin_rms:.3f}"},
        {"figures": ["allreduce_floor_ms", "allreduce_ms_per_token", "allreduce_smoothness"], **net, **cite,
         "rows": f"num_workers == devices_per_node == {tp}; median; tokens = size / (8192 * 2)",
         "method": f"roofline fit in log space, rms log error {ar_rms:.3f}"},
        {"figures": ["attn_prefill_ms_per_pair", "attn_prefill_ms_per_token"], **att, **cite,
         "rows": "is_prefill, batch_size 1; time_stats.attn_prefill.median per layer at TP2",
         "method": f"per-layer ms = a + b*n*(ctx + n/2) + c*n (rms rel error {pre_rms:.3f}); b, c x (2/{tp} heads)"
                   f" x {NUM_LAYERS} layers" + (f" x {compute_ratio:.3f} (H100/A100 linear-op slope)" if gpu != "a100"
                                                else "")},
        {"figures": ["attn_decode_ms_per_token"], **att, **cite,
         "rows": "decode rows, batch_size >= 16 (bandwidth-bound); time_stats.attn_decode.median per layer",
         "method": f"per-layer ms = a + b*batch*kv_cache_size (rms rel error {dec_rms:.3f}); b x (2/{tp} heads)"
                   f" x {NUM_LAYERS} layers" + (f" x {memory_ratio:.3f} (H100/A100 linear-op floor)" if gpu != "a100"
                                                else "")},
    ]
    return coeffs, sources


def _attention_a100_tp2(data_dir: Path) -> tuple[np.ndarray, np.ndarray, float, float]:
    prefill, decode = data.attention_rows(data_dir)
    xp = np.array([[1.0, n * (c + n / 2), n] for n, c, _ in prefill])
    pre, pre_rms = fit_linear_rel(xp, np.array([t for _, _, t in prefill]))
    big = [(b, c, t) for b, c, t in decode if b >= 16]
    xd = np.array([[1.0, b * c] for b, c, _ in big])
    dec, dec_rms = fit_linear_rel(xd, np.array([t for _, _, t in big]))
    return pre, dec, pre_rms, dec_rms


# ---- stage 2: end to end on the measured steps ---------------------------------------------------
def _host_features(p: data.MeasuredPoint) -> list[float]:
    prefill = p.kind == "prefill"
    return [1.0, 1.0 if prefill else 0.0, float(p.batch), float(p.decode_context_tokens)]


def _build(gpu: str, tp: int, device: dict[str, float], **fitted: float) -> CostModel:
    lo, hi = LARGE_STEP_BRACKET
    knee = math.sqrt(lo * hi)
    sharpness = math.log(19.0) / math.log(knee / lo)  # 5% of the rise at lo, 95% at hi
    coeffs: dict[str, Any] = {**device, "large_step_knee_tokens": knee, "large_step_sharpness": sharpness,
                              **dict.fromkeys(HOST_TERMS, 0.0), **fitted}
    return CostModel(name_for(gpu, tp), gpu, MODEL, tp, CostCoefficients(**coeffs))


def end_to_end_stage(gpu: str, tp: int, device: dict[str, float],
                     train: list[data.MeasuredPoint]) -> dict[str, float]:
    """Nonlinear (host_floor, linear_scale, large_step_gain, and graph_host_floor when some training
    steps were replayed from CUDA graphs) by Levenberg-Marquardt in log space; for each, the host
    terms that enter linearly by non-negative least squares (variable projection)."""
    y = np.array([p.measured_ms for p in train])
    x_host = np.array([_host_features(p) for p in train]) / y[:, None]
    args = [p.step_args() for p in train]
    graphs = any(p.graph for p in train)

    def fitted(theta: np.ndarray) -> dict[str, float]:
        values = np.exp(np.clip(theta, -12.0, 12.0))  # keep wild LM trials finite
        out = {"host_floor_ms": float(values[0]), "linear_scale": float(values[1]),
               "large_step_gain": float(values[2])}
        if graphs:
            out["graph_host_floor_ms"] = float(values[3])
        return out

    def solve(theta: np.ndarray, r: float) -> tuple[np.ndarray, np.ndarray]:
        model = _build(gpu, tp, device, host_overlap=r, **fitted(theta))
        base = np.array([model.step_time_s(*a) * 1e3 for a in args])
        host = nnls(x_host, 1.0 - base / y)
        return base / y + x_host @ host - 1.0, host

    floor0 = float(min(p.measured_ms for p in train if p.kind == "decode"))
    best: tuple[float, float, np.ndarray] | None = None
    for r in OVERLAP_GRID:
        def residuals(theta: np.ndarray, r: float = r) -> np.ndarray:
            return solve(theta, r)[0]

        for start in ((0.9 * floor0, 1.0, 0.5), (0.5 * floor0, 1.0, 1.0), (0.9 * floor0, 0.8, 1.5)):
            start = (*start, 0.5 * floor0) if graphs else start
            theta, cost = levenberg_marquardt(residuals, [math.log(v) for v in start], max_iter=100)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, r, theta)
    assert best is not None
    _, r, theta = best
    host = solve(theta, r)[1]
    return {**fitted(theta), "host_overlap": r, **{k: float(v) for k, v in zip(HOST_TERMS, host, strict=True)}}


def _round(value: float, digits: int = 6) -> float:
    return 0.0 if value == 0 else float(f"{value:.{digits}g}")


def fit_cost_model(gpu: str, tp: int, data_dir: Path = data.DATA_DIR) -> CostModel:
    """Both stages; the returned model carries its sources and the error on every measured point."""
    points = data.splitwise_points(gpu, tp, data_dir)
    device, sources = device_stage(gpu, tp, data_dir)
    fitted = end_to_end_stage(gpu, tp, device, [p for p in points if not p.held_out])
    model = _build(gpu, tp, device, **fitted)
    coeffs = CostCoefficients.from_dict({k: (v if k == "num_layers" else _round(v))
                                         for k, v in model.coefficients.to_dict().items()})
    measured = data.source(data.SPLITWISE, "perf_model.csv", data_dir)
    rows = (f"model llama2-70b, hardware {data.GPUS[gpu][0]}, tensor_parallel {tp}, token_size 128; batch 1 "
            "(prompt slice) or prompt 512 (batch slice); median of the repeats; training points only")
    lo, hi = LARGE_STEP_BRACKET
    sources += [
        {"figures": ["linear_scale", "large_step_gain", "host_floor_ms", "host_overlap", *HOST_TERMS], **measured,
         "rows": rows, "cite": data.CITE[data.SPLITWISE],
         "method": "variable projection: Levenberg-Marquardt on the three nonlinear figures, non-negative least "
                   f"squares on the host terms, host_overlap the best of {list(OVERLAP_GRID)}; relative error"},
        {"figures": ["large_step_knee_tokens", "large_step_sharpness"], **measured, "rows": rows,
         "cite": data.CITE[data.SPLITWISE],
         "method": f"fixed by rule, not fitted: the training prefill steps of {lo} tokens are on the small-step "
                   f"per-token trend and those of {hi} are not; knee at their geometric mean, sharpness putting them "
                   "at 5% and 95% of the rise"},
        {"figures": ["num_layers"], "file": "Llama-2-70B architecture", "origin": "model config (80 layers, hidden "
         "8192, 64 query / 8 KV heads), as listed in data/vidur-profiling/SOURCE.md", "commit": "n/a"},
    ]
    final = CostModel(name_for(gpu, tp), gpu, MODEL, tp, coeffs, description=_description(gpu, tp), sources=sources)
    final.fit = fit_report(final, points)
    return final


def fit_report(model: CostModel, points: list[data.MeasuredPoint]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for p in points:
        pred = model.step_time_s(*p.step_args()) * 1e3
        rows.append({"kind": p.kind, "prompt": p.prompt, "batch": p.batch, "tokens": p.tokens,
                     "set": "held-out" if p.held_out else "train", "repeats": p.num_repeats,
                     "measured_ms": round(p.measured_ms, 3), "predicted_ms": round(pred, 3),
                     "rel_error": round(pred / p.measured_ms - 1.0, 4), **({"graph": True} if p.graph else {})})
    train: list[float] = [abs(r["rel_error"]) for r in rows if r["set"] == "train"]
    test: list[float] = [abs(r["rel_error"]) for r in rows if r["set"] == "held-out"]
    lo, hi = LARGE_STEP_BRACKET
    return {"split": SPLIT, "objective": "sum of squared relative errors on the training points",
            "hyperparameters": {"host_overlap_grid": list(OVERLAP_GRID), "large_step_bracket_tokens": [lo, hi]},
            "train_max_abs_rel_error": max(train), "heldout_max_abs_rel_error": max(test),
            "train_rms_rel_error": round(math.sqrt(sum(e * e for e in train) / len(train)), 4),
            "heldout_rms_rel_error": round(math.sqrt(sum(e * e for e in test) / len(test)), 4), "points": rows}


def _description(gpu: str, tp: int) -> str:
    return (f"Llama-2-70B fp16 at TP{tp} on {data.GPUS[gpu][0]} (DGX), late-2023 vLLM step times "
            "(SplitwiseSim measurements) with device shape from Vidur operator profiles. See docs/cost-model.md.")


def format_report(model: CostModel) -> str:
    fit = model.fit
    lines = [f"{model.name}: train max {fit['train_max_abs_rel_error']:.1%} (rms {fit['train_rms_rel_error']:.1%}), "
             f"held-out max {fit['heldout_max_abs_rel_error']:.1%} (rms {fit['heldout_rms_rel_error']:.1%})",
             "| set | kind | batch x prompt | tokens | measured ms | predicted ms | error |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(fit["points"], key=lambda r: (r["set"] != "held-out", r["kind"], r["batch"], r["prompt"])):
        flag = " **" if abs(r["rel_error"]) > 0.10 else ""
        lines.append(f"| {r['set']} | {r['kind']} | {r['batch']} x {r['prompt']} | {r['tokens']} | "
                     f"{r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['rel_error']:+.1%}{flag} |")
    return "\n".join(lines)


def write_yaml(model: CostModel, out_dir: Path) -> Path:
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{model.name}.yaml"
    header = "# Generated by `tidal fit-cost-model`; do not edit by hand. Form and sources: docs/cost-model.md\n"
    path.write_text(header + yaml.safe_dump(model.to_dict(), sort_keys=False, width=120, default_flow_style=None))
    return path


def _run(args: argparse.Namespace) -> int:
    gpus = ("a100", "h100") if args.gpu == "all" else (args.gpu,)
    tps = TPS if args.tp == "all" else (int(args.tp),)
    for gpu in gpus:
        for tp in tps:
            model = fit_cost_model(gpu, tp, Path(args.data_dir))
            print(format_report(model))
            if not args.dry_run:
                print(f"wrote {write_yaml(model, Path(args.out_dir))}")
            print()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("fit-cost-model", help="calibrate the GPU step-time model (calibration/costmodels)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", choices=("a100", "h100", "all"), default="all")
    p.add_argument("--tp", choices=("8", "4", "all"), default="all", help="tensor-parallel degree(s) to fit")
    p.add_argument("--data-dir", default=str(data.DATA_DIR), help="folder holding splitwise-sim-perf/ and "
                   "vidur-profiling/ (default: the repository's data/)")
    p.add_argument("--out-dir", default=str(COSTMODEL_DIR), help="where the YAML files go")
    p.add_argument("--dry-run", action="store_true", help="print the fit report, write nothing")
    p.set_defaults(func=_run)
