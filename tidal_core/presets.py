"""The adaptive policy, the baselines users run and the ablations, as configurations of one Scheduler.

Owns: the preset table. A baseline differs from `adaptive` only in the knobs listed here, so
a comparison between them is a comparison of policies, not of implementations. Each
baseline's main knob is a plain field (a study sweeps it with `preset(..., **overrides)` or
`tidal simulate --set`): `max_num_batched_tokens` (sarathi), `admission.max_concurrent_requests`
(tgi), `admission.max_queued_requests` (ray-serve).

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal_core.config import AdmissionConfig, SchedulerConfig, StepSizingConfig

_NO_ADMISSION = AdmissionConfig(enabled=False)
_NO_SIZING = StepSizingConfig(enabled=False)
SARATHI_TOKEN_BUDGET = 512
"""sarathi's default token budget per step (the study picks the best with hindsight)."""
TGI_MAX_CONCURRENT = 128
TGI_MAX_PREFILL_TOKENS = 4096
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_MAX_NUM_SEQS = 256
RAY_SERVE_MAX_QUEUED = 64

PRESET_DESCRIPTIONS: dict[str, str] = {
    "eager": "no wait; each new request launched on its own (one new prefill per step); no admission control",
    "fixed-wait": "new prefills held a fixed 10 ms (Ray @serve.batch default) unless a batch fills; "
                  "no admission control",
    "continuous": "vLLM-like: no wait, decode-first, chunked prefill, unbounded queue, no admission control",
    "static": "classic static batching: wait for a full batch or a timeout, run it to completion, no joining",
    "adaptive": "step sizing for the TPOT target + micro-wait by load + regimes + SLO admission control + "
                "chunked prefill + CUDA-graph buckets",
    "vllm": f"continuous with vLLM's online-serving defaults for an 80 GB GPU unit "
            f"({VLLM_MAX_NUM_BATCHED_TOKENS} batched tokens, {VLLM_MAX_NUM_SEQS} sequences), unbounded queue",
    "sarathi": f"continuous with a fixed token budget (max_num_batched_tokens, default {SARATHI_TOKEN_BUDGET}) "
               "and the same SLO admission control as adaptive",
    "tgi": f"continuous with a cap on requests in the unit (admission.max_concurrent_requests, default "
           f"{TGI_MAX_CONCURRENT}; more get 429) and {TGI_MAX_PREFILL_TOKENS} prefill tokens per step",
    "ray-serve": f"continuous with max_ongoing_requests = max_batch_size per unit and a cap on queued requests "
                 f"(admission.max_queued_requests, default {RAY_SERVE_MAX_QUEUED}; more get 429)",
    "adaptive-no-admission": "adaptive without SLO admission control (unbounded queue)",
    "adaptive-no-step-sizing": "adaptive without the step sizer (steps bounded by the token budget only)",
    "adaptive-no-microwait": "adaptive without the micro-wait",
    "adaptive-no-regimes": "adaptive with the regime detector off (always STEADY)",
    "continuous-admission": "continuous with adaptive's SLO admission control only",
}

POLICIES = tuple(PRESET_DESCRIPTIONS)


def _baseline(name: str, base: SchedulerConfig) -> dict[str, Any] | None:
    """The fields of the presets that are not adaptive or one of its ablations."""
    none = dataclasses.replace(base.batching, mode="none")
    plain = {"batching": none, "max_new_requests_per_step": None, "admission": _NO_ADMISSION,
             "step_sizing": _NO_SIZING}
    slo_admission = base.admission if base.admission.enabled else AdmissionConfig()
    if name == "eager":
        return {**plain, "max_new_requests_per_step": 1}
    if name == "fixed-wait":
        return {**plain, "batching": dataclasses.replace(base.batching, mode="fixed")}
    if name == "continuous":
        return plain
    if name == "static":
        return {**plain, "batching": dataclasses.replace(base.batching, mode="static",
                                                         static_batch_size=min(base.batching.static_batch_size,
                                                                               base.max_batch_size))}
    if name == "vllm":
        return {**plain, "max_batch_size": VLLM_MAX_NUM_SEQS,
                "max_num_batched_tokens": max(VLLM_MAX_NUM_BATCHED_TOKENS, VLLM_MAX_NUM_SEQS)}
    if name == "sarathi":
        return {**plain, "admission": slo_admission,
                "max_num_batched_tokens": max(SARATHI_TOKEN_BUDGET, base.max_batch_size)}
    if name == "tgi":
        budget = max(base.max_num_batched_tokens, TGI_MAX_PREFILL_TOKENS + base.max_batch_size)
        return {**plain, "admission": dataclasses.replace(_NO_ADMISSION, max_concurrent_requests=TGI_MAX_CONCURRENT),
                "max_prefill_tokens": TGI_MAX_PREFILL_TOKENS, "max_num_batched_tokens": budget}
    if name == "ray-serve":
        return {**plain, "admission": dataclasses.replace(_NO_ADMISSION, max_queued_requests=RAY_SERVE_MAX_QUEUED)}
    if name == "continuous-admission":
        return {**plain, "admission": slo_admission}
    return None


def _preset_fields(name: str, base: SchedulerConfig) -> dict[str, Any]:
    fields = _baseline(name, base)
    if fields is not None:
        return fields
    if (name != "adaptive" and not name.startswith("adaptive-")) or name not in PRESET_DESCRIPTIONS:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    admission = base.admission if base.admission.enabled else AdmissionConfig()
    fields = {"batching": dataclasses.replace(base.batching, mode="adaptive"), "max_new_requests_per_step": None,
              "admission": admission, "step_sizing": dataclasses.replace(base.step_sizing, enabled=True)}
    if name == "adaptive-no-admission":
        fields["admission"] = dataclasses.replace(admission, enabled=False)
    elif name == "adaptive-no-step-sizing":
        fields["step_sizing"] = _NO_SIZING
    elif name == "adaptive-no-microwait":
        fields["batching"] = dataclasses.replace(base.batching, mode="adaptive", t_min_s=0.0, t_max_s=0.0)
    elif name == "adaptive-no-regimes":
        fields["regime"] = dataclasses.replace(base.regime, enabled=False)
    return fields


def preset(name: str, base: SchedulerConfig | None = None, **overrides: Any) -> SchedulerConfig:
    """The named policy on top of `base` (capacity knobs: batch size, budget, KV blocks...).

    `overrides` are applied last, so an experiment can change any field of the result.
    """
    base = base or SchedulerConfig()
    fields = _preset_fields(name, base)
    fields["policy"] = name
    fields.update(overrides)
    return dataclasses.replace(base, **fields)
