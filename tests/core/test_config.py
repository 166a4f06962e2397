from __future__ import annotations

import re

import pytest

from tidal_core import POLICIES, BatchingConfig, SamplingParams, SchedulerConfig, preset


@pytest.mark.parametrize("kwargs, fragment", [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_num_batched_tokens": 8, "max_batch_size": 16}, "max_num_batched_tokens"),
    ({"num_kv_blocks": 1, "block_size": 16, "max_model_len": 4096}, "num_kv_blocks"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 4096}, "chunked"),
    ({"cuda_graph_buckets": (4, 2)}, "cuda_graph_buckets"),
])
def test_invalid_scheduler_configs_name_the_value(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        SchedulerConfig(**kwargs)


def test_batching_mode_must_be_known() -> None:
    with pytest.raises(ValueError, match=r"batching\.mode"):
        BatchingConfig(mode="turbo")


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"logprobs": 50},
                                    {"min_tokens": 5, "max_tokens": 2}])
def test_invalid_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_presets_differ_only_in_policy_knobs() -> None:
    base = SchedulerConfig(max_batch_size=32, num_kv_blocks=1234)
    configs = {name: preset(name, base) for name in POLICIES}
    assert {c.policy for c in configs.values()} == set(POLICIES)
    for c in configs.values():
        assert (c.max_batch_size, c.num_kv_blocks, c.max_num_batched_tokens) == (32, 1234, base.max_num_batched_tokens)
    assert configs["eager"].max_new_requests_per_step == 1
    assert configs["fixed-wait"].batching.mode == "fixed"
    assert configs["static"].batching.mode == "static"
    assert configs["adaptive"].admission.enabled and not configs["continuous"].admission.enabled
    assert preset("adaptive", base, max_batch_size=8).max_batch_size == 8
    with pytest.raises(ValueError, match="unknown policy"):
        preset("magic", base)
