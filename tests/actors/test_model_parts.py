"""Pure pieces of the engine: sampling, tensor-parallel partitioning, KV sizing, config parsing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from actors.kv_cache import KVCacheSpec, blocks_for_budget
from actors.models.config import from_hf_config
from actors.models.parallel import head_partition, split_evenly
from actors.models.rope import inverse_frequencies
from actors.sampler import Sampler
from tidal_core import SamplingParams


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_and_top_k_one_are_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.5, top_k=1)] * 2
    out = Sampler(seed=0).sample(logits, params, [0] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    sampler = Sampler(seed=1)
    top_p = Counter(sampler.sample(logits.clone(), [SamplingParams(top_p=0.7)] * 400, [0] * 400).token_ids)
    assert set(top_p) == {0, 1}
    top_k = Counter(sampler.sample(logits.clone(), [SamplingParams(top_k=3)] * 400, [0] * 400).token_ids)
    assert set(top_k) == {0, 1, 2}
    free = Counter(sampler.sample(logits.clone(), [SamplingParams()] * 400, [0] * 400).token_ids)
    assert set(free) == {0, 1, 2, 3} and free[0] > free[3]


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(500, 1)
    sampler = Sampler(seed=2)
    cold = Counter(sampler.sample(logits.clone(), [SamplingParams(temperature=0.2)] * 500, [0] * 500).token_ids)
    hot = Counter(sampler.sample(logits.clone(), [SamplingParams(temperature=2.0)] * 500, [0] * 500).token_ids)
    assert cold[0] > hot[0]


def test_seed_and_position_fix_the_draw_whatever_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(seed=42)
    alone = Sampler().sample(logits.clone(), [seeded], [17]).token_ids[0]
    batch = torch.cat([torch.randn(3, 1000), logits])
    in_batch = Sampler().sample(batch, [SamplingParams()] * 3 + [seeded], [1, 2, 3, 17]).token_ids[3]
    assert alone == in_batch
    draws = {Sampler().sample(logits.clone(), [seeded], [pos]).token_ids[0] for pos in range(40)}
    assert len(draws) > 1  # the position moves the noise


def test_logprobs_sampled_first_then_distinct_top_n() -> None:
    logits = _logits([0.0, 3.0, 1.0, 2.0, -1.0])
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [0])
    entries = out.logprobs[0]
    assert entries is not None and [t for t, _ in entries] == [1, 3, 2]
    ref = logits[0].log_softmax(-1)
    assert all(lp == pytest.approx(float(ref[t])) for t, lp in entries)
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)], [0]).logprobs == [None]


def test_penalties_follow_openai_and_transformers_definitions() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    from actors.sampler import apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    prompt, output = [3, 7, 7, 9], [7, 11, 11, 11, 4]
    history = (prompt + output, len(prompt))
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3),
              SamplingParams()]
    before = logits.clone()
    got = apply_penalties(logits, params, [history] * 3)
    # repetition: transformers' processor over every token id so far (prompt and output)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits[0:1].clone())
    assert torch.allclose(got[0], ref[0])
    # OpenAI: logit - frequency x count - presence x (count > 0), over the generated tokens only
    want = logits[1].clone()
    for token, n in Counter(output).items():
        want[token] -= 0.5 * n - 0.3
    assert torch.allclose(got[1], want) and got[1][3] == logits[1][3]  # a prompt-only token is untouched
    assert torch.equal(got[2], logits[2]) and torch.equal(logits, before)  # no penalty: as it was; input untouched


def test_a_penalized_greedy_row_takes_the_penalized_argmax_and_keeps_raw_logprobs() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, 4], logits[0, 6] = 3.0, 2.5
    history = ([1, 4, 4], 1)  # token 4 generated twice
    plain = SamplingParams(temperature=0.0, logprobs=1)
    penalized = SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=1.0)
    assert Sampler().sample(logits.clone(), [plain], [3], [history]).token_ids == [4]
    out = Sampler().sample(logits.clone(), [penalized], [3], [history])
    assert out.token_ids == [6]  # 3.0 - 2 x 1.0 < 2.5
    assert out.logprobs[0] is not None
    assert out.logprobs[0][0][1] == pytest.approx(float(logits[0].log_softmax(-1)[6]))  # the model's own


def test_split_evenly_and_head_partition() -> None:
    assert [split_evenly(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    smol = [head_partition(9, 3, 2, r) for r in range(2)]  # SmolLM2 at TP=2: uneven groups
    assert [(h.q_start, h.q_count, h.kv_start, h.kv_count) for h in smol] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    rep = [head_partition(64, 8, 16, r) for r in range(16)]  # more ranks than KV heads: replicate
    assert all(h.q_count == 4 and h.kv_count == 1 and h.q_start // 8 == h.kv_start for h in rep)
    with pytest.raises(ValueError, match="tp=6"):
        head_partition(64, 4, 6, 0)


def test_kv_blocks_from_budget() -> None:
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert blocks_for_budget(spec, 100 * spec.bytes_per_block) == 99  # one kept as the scratch block
    assert blocks_for_budget(spec, 100 * spec.bytes_per_block, max_blocks=10) == 10
    with pytest.raises(ValueError, match="holds no block"):
        blocks_for_budget(spec, spec.bytes_per_block)


def test_config_parsing_llama3_mistral_and_refusals() -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cfg = from_hf_config(LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                                     rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64},
                                     max_position_embeddings=1024))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is not None and cfg.num_queries_per_kv == 4
    inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta, None)
    assert torch.equal(inv[:1], plain[:1]) and inv[-1] == pytest.approx(float(plain[-1]) / 8.0)
    mistral = from_hf_config(MistralConfig(sliding_window=4096, architectures=["MistralForCausalLM"]))
    assert mistral.sliding_window == 4096 and mistral.architecture == "MistralForCausalLM"
    with pytest.raises(NotImplementedError, match="architecture"):
        from_hf_config(Qwen2Config(architectures=["Qwen2ForCausalLM"]))


def test_sliding_window_below_context_is_refused() -> None:
    from transformers import MistralConfig

    from actors.model_loader import check_servable

    cfg = from_hf_config(MistralConfig(sliding_window=512))
    check_servable(cfg, 512)
    with pytest.raises(NotImplementedError, match="sliding"):
        check_servable(cfg, 2048)


def test_decode_groups_split_where_the_width_doubles() -> None:
    from actors.input_batch import decode_groups

    assert decode_groups([3]) == [(0, 1, 3)]
    assert decode_groups([2, 2, 3, 4]) == [(0, 4, 4)]
    assert decode_groups([1, 1, 2, 3, 5, 8, 13, 21, 40]) == [(0, 3, 2), (3, 5, 5), (5, 7, 13), (7, 9, 40)]
    groups = decode_groups([1, 3, 7, 15, 31, 63], max_groups=3)
    assert len(groups) == 3 and groups[-1] == (2, 6, 63)  # the rest merge into the last run
