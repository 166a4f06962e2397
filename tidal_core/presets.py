"""The adaptive policy and its baselines, as configurations of the one Scheduler.

Owns: the preset table. A baseline differs from `adaptive` only in the knobs listed here,
so a comparison between them is a comparison of policies, not of implementations.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal_core.config import AdmissionConfig, SchedulerConfig

_NO_ADMISSION = AdmissionConfig(enabled=False)

PRESET_DESCRIPTIONS: dict[str, str] = {
    "eager": "no wait; each new request launched on its own (one new prefill per step); no admission control",
    "fixed-wait": "new prefills held a fixed 10 ms (Ray @serve.batch default) unless a batch fills; "
                  "no admission control",
    "continuous": "vLLM-like: no wait, decode-first, chunked prefill, unbounded queue, no admission control",
    "static": "classic static batching: wait for a full batch or a timeout, run it to completion, no joining",
    "adaptive": "micro-wait by load + regimes + admission control + chunked prefill + CUDA-graph buckets",
}

POLICIES = tuple(PRESET_DESCRIPTIONS)


def _preset_fields(name: str, base: SchedulerConfig) -> dict[str, Any]:
    batching = base.batching
    if name == "eager":
        return {"batching": dataclasses.replace(batching, mode="none"), "max_new_requests_per_step": 1,
                "admission": _NO_ADMISSION}
    if name == "fixed-wait":
        return {"batching": dataclasses.replace(batching, mode="fixed"), "max_new_requests_per_step": None,
                "admission": _NO_ADMISSION}
    if name == "continuous":
        return {"batching": dataclasses.replace(batching, mode="none"), "max_new_requests_per_step": None,
                "admission": _NO_ADMISSION}
    if name == "static":
        return {"batching": dataclasses.replace(batching, mode="static",
                                                static_batch_size=min(batching.static_batch_size,
                                                                      base.max_batch_size)),
                "max_new_requests_per_step": None, "admission": _NO_ADMISSION}
    if name == "adaptive":
        admission = base.admission if base.admission.enabled else AdmissionConfig()
        return {"batching": dataclasses.replace(batching, mode="adaptive"), "max_new_requests_per_step": None,
                "admission": admission}
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def preset(name: str, base: SchedulerConfig | None = None, **overrides: Any) -> SchedulerConfig:
    """The named policy on top of `base` (capacity knobs: batch size, budget, KV blocks...).

    `overrides` are applied last, so an experiment can change any field of the result.
    """
    base = base or SchedulerConfig()
    fields = _preset_fields(name, base)
    fields["policy"] = name
    fields.update(overrides)
    return dataclasses.replace(base, **fields)
