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
    # The baselines defined by a capacity knob (vLLM's defaults, Sarathi's token budget, TGI's
    # prefill cap) set it; every other preset keeps the unit's capacity knobs.
    sized = {"vllm", "sarathi", "tgi"}
    for name, c in configs.items():
        assert c.num_kv_blocks == 1234
        if name not in sized:
            assert (c.max_batch_size, c.max_num_batched_tokens) == (32, base.max_num_batched_tokens)
    assert (configs["vllm"].max_batch_size, configs["vllm"].max_num_batched_tokens) == (256, 8192)
    assert configs["sarathi"].max_num_batched_tokens == 512 and configs["sarathi"].admission.enabled
    assert configs["tgi"].admission.max_concurrent_requests == 128 and configs["tgi"].max_prefill_tokens == 4096
    assert configs["ray-serve"].admission.max_queued_requests == 64
    assert not configs["adaptive-no-admission"].admission.enabled
    assert not configs["adaptive-no-step-sizing"].step_sizing.enabled and configs["adaptive"].step_sizing.enabled
    assert not configs["adaptive-no-regimes"].regime.enabled
    assert configs["adaptive-no-microwait"].batching.t_max_s == 0.0
    assert configs["continuous-admission"].admission.enabled and configs["continuous-admission"].batching.mode == "none"
    assert configs["eager"].max_new_requests_per_step == 1
    assert configs["fixed-wait"].batching.mode == "fixed"
    assert configs["static"].batching.mode == "static"
    assert configs["adaptive"].admission.enabled and not configs["continuous"].admission.enabled
    assert preset("adaptive", base, max_batch_size=8).max_batch_size == 8
    with pytest.raises(ValueError, match="unknown policy"):
        preset("magic", base)
