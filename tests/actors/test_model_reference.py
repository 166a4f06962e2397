"""Our runner against transformers' own Llama, with the same weights, through the core Scheduler.

Two models: a tiny random-weight Llama with GQA and Llama-3.1 RoPE scaling built in-process,
and SmolLM2-135M-Instruct (tied embeddings) from the cached GGUF conversion. Tolerance: both
sides compute in float32; logits agree to |diff| <= 2e-3 absolute (observed ~5e-5 on SmolLM2
logits of magnitude ~30; the bound leaves room for BLAS blocking differences between a
flattened varlen batch and HF's padded one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model_helpers import (
    GREEDY,
    generate_ids,
    hf_model,
    local_executor,
    make_engine,
    save_tiny_checkpoint,
    smollm2_path,
)
from tidal_core import SamplingParams

ATOL = 2e-3
PROMPTS = [[1, 17, 33, 5, 9], list(range(3, 60)), [1, 200, 7], list(range(100, 131))]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama3"))


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return smollm2_path()


def _hf_last_logits(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()  # type: ignore[operator]


def _check_logits_every_step(path: Path, prompts: list[list[int]], steps: int, **sched: object) -> int:
    """Drive prefill + `steps` decodes; compare every sampled position's logits with HF."""
    hf = hf_model(path)
    ex = local_executor(path)
    ex.runner.keep_logits = True
    engine = make_engine(ex, **sched)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    compared = 0
    while engine.has_unfinished:
        engine.step()
        for rid, logits in ex.runner.last_logits.items():
            state = ex.runner.states.get(rid)
            if state is None:
                continue
            ref = _hf_last_logits(hf, state.token_ids[:-1])
            assert torch.allclose(logits, ref, atol=ATOL, rtol=0), (rid, (logits - ref).abs().max())
            assert int(logits.argmax()) == state.token_ids[-1]
            compared += 1
        ex.runner.last_logits = {}
    return compared


def test_tiny_gqa_llama3_logits_match_transformers(tiny_path: Path) -> None:
    compared = _check_logits_every_step(tiny_path, PROMPTS, steps=4)
    assert compared >= len(PROMPTS) * 4  # the final step's requests are freed before we look


def test_smollm2_logits_match_transformers(smol_path: Path) -> None:
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(1000, 1023)), [42, 43]]
    assert _check_logits_every_step(smol_path, prompts, steps=3) >= len(prompts) * 3


def test_chunked_prefill_logits_match(tiny_path: Path) -> None:
    """A 16-token budget chunks the long prompts; every sampled position still matches HF."""
    assert _check_logits_every_step(tiny_path, PROMPTS, steps=3, max_num_batched_tokens=16, max_batch_size=4) > 0


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int, pad_token_id: int, **kw: Any) -> list[int]:
    """transformers' own greedy `generate` of `prompt`: the reference token ids."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad_token_id, **kw)
    return list(out[0, len(prompt):].tolist())


def test_greedy_equals_transformers_generate_smollm2(smol_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_path)
    texts = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
    prompts = [tok(t)["input_ids"] for t in texts]
    ours = generate_ids(local_executor(smol_path), prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                          ignore_eos=True))
    hf = hf_model(smol_path)
    for p, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, p, 12, tok.eos_token_id)


def test_greedy_with_a_repetition_penalty_equals_transformers_generate_smollm2(smol_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_path)
    prompts = [tok(t)["input_ids"] for t in ("Give me a tip for sleeping better:", "1, 2, 3, 4, 5,")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    ours = generate_ids(local_executor(smol_path), prompts, params)
    hf = hf_model(smol_path)
    for p, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, p, 16, tok.eos_token_id, repetition_penalty=1.3)


def test_greedy_equals_transformers_generate_tiny(tiny_path: Path) -> None:
    ours = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)
    hf = hf_model(tiny_path)
    for p, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(hf, p, GREEDY.max_tokens, 0)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_with_a_repetition_penalty_equals_transformers_generate(tiny_path: Path, penalty: float) -> None:
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
    ours = generate_ids(local_executor(tiny_path), PROMPTS, params)
    hf = hf_model(tiny_path)
    for p, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(hf, p, GREEDY.max_tokens, 0, repetition_penalty=penalty)
    assert ours != generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)  # the penalty changed the output


def test_chunked_prefill_equals_unchunked(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    whole = generate_ids(ex, PROMPTS, GREEDY, max_num_batched_tokens=512)
    chunked = generate_ids(ex, PROMPTS, GREEDY, max_num_batched_tokens=8, max_batch_size=4)
    assert chunked == whole
