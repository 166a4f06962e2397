"""A decode step's layers in one C call (actors/models/cpu_decode_layers.py): the same float32 bits
as the layer-by-layer forward at every decode step of real engine runs (a tiny model on GGUF blocks
on one and two threads, SmolLM2 at 16 rows), the steps and models it must leave to that path, and
a refused op named in the error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from actors.models import block_gemm, cpu_decode_layers
from actors.models.llama import LlamaForCausalLM
from tests.actors.test_block_gemm import _tiny_with_gguf
from tests.model_helpers import TINY_PROMPTS, generate_ids, local_executor, smollm2_path
from tidal_core import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_decode_layers.KERNEL.available(), reason="no C compiler")


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every forward that takes the one-call path is run again layer by layer (the same KV slots
    written again with the same values) and must give the same bits; yields the rows of each."""
    rows: list[int] = []
    forward = LlamaForCausalLM.forward

    def both(self: LlamaForCausalLM, ids: torch.Tensor, pos: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        if not (meta.cpu_layers and cpu_decode_layers.for_step(self, meta, kv, ids.shape[0]) is not None):
            return forward(self, ids, pos, meta, kv)
        fast = forward(self, ids, pos, meta, kv)
        meta.cpu_layers = False
        try:
            ref = forward(self, ids, pos, meta, kv)
        finally:
            meta.cpu_layers = True
        assert torch.equal(fast, ref), f"{ids.shape[0]} rows: largest difference {(fast - ref).abs().max().item()}"
        rows.append(ids.shape[0])
        return fast

    monkeypatch.setattr(LlamaForCausalLM, "forward", both)
    yield rows


@pytest.mark.parametrize("threads", [1, 2])
def test_tiny_model_decode_steps_give_the_layer_by_layer_bits(tmp_path: Path, checked: list[int],
                                                              threads: int) -> None:
    path = _tiny_with_gguf(tmp_path)
    before = torch.get_num_threads()
    ex = local_executor(path, block_size=4, torch_threads=threads)
    try:
        on = generate_ids(ex, TINY_PROMPTS, max_num_batched_tokens=16, max_batch_size=8)
    finally:
        torch.set_num_threads(before)
    assert {1, len(TINY_PROMPTS)} <= set(checked)  # a lone decode and the whole batch took the path
    off = generate_ids(local_executor(path, block_size=4, cpu_decode_layers=False), TINY_PROMPTS,
                       max_num_batched_tokens=16, max_batch_size=8)
    assert on == off


def test_smollm2_sixteen_decodes_give_the_layer_by_layer_bits(checked: list[int]) -> None:
    before = torch.get_num_threads()
    ex = local_executor(smollm2_path(), torch_threads=2, max_model_len=1024, kv_cache_gb=0.25)
    prompts = [[1, *range(100 + 37 * i, 120 + 41 * i)] for i in range(16)]
    try:
        generate_ids(ex, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                     max_num_batched_tokens=4096, max_batch_size=16)
    finally:
        torch.set_num_threads(before)
    assert 16 in checked


def _step_meta(**kw: Any) -> SimpleNamespace:
    base = dict(cpu_layers=True, cpu_decode=True, cpu_fused=True, backend="portable", prefills=[], num_decodes=2)
    return SimpleNamespace(**{**base, **kw})


def test_steps_and_models_it_leaves_to_the_layer_by_layer_path(tmp_path: Path) -> None:
    path = _tiny_with_gguf(tmp_path)
    ex = local_executor(path, block_size=4)
    model, caches = ex.runner.model, ex.runner.kv_caches
    table = cpu_decode_layers.for_step(model, _step_meta(), caches, 2)
    assert table is not None and cpu_decode_layers.for_step(model, _step_meta(), caches, 2) is table  # built once
    assert cpu_decode_layers.for_step(model, _step_meta(prefills=[object()]), caches, 2) is None  # a prefill chunk
    assert cpu_decode_layers.for_step(model, _step_meta(num_decodes=1), caches, 2) is None
    rows = block_gemm.MAX_ROWS + 1  # past it the linears are oneDNN's, not the blocks'
    assert cpu_decode_layers.for_step(model, _step_meta(num_decodes=rows), caches, rows) is None
    assert cpu_decode_layers.for_step(model, _step_meta(cpu_layers=False), caches, 2) is None
    assert cpu_decode_layers.for_step(model, _step_meta(backend="triton"), caches, 2) is None
    float32 = local_executor(path, block_size=4, cpu_block_gemm=False)  # no blocks: nothing to call
    assert not cpu_decode_layers.eligible(float32.runner.model)
    assert cpu_decode_layers.for_step(float32.runner.model, _step_meta(), float32.runner.kv_caches, 2) is None
    off = local_executor(path, block_size=4, cpu_decode_layers=False)
    assert off.runner.cpu_layers is False and ex.runner.cpu_layers is True


def test_a_refused_op_is_named(tmp_path: Path) -> None:
    path = _tiny_with_gguf(tmp_path)
    ex = local_executor(path, block_size=4)
    model, caches = ex.runner.model, ex.runner.kv_caches
    table = cpu_decode_layers.for_step(model, _step_meta(num_decodes=1), caches, 1)
    assert table is not None
    hidden, head_dim = model.cfg.hidden_size, model.cfg.head_dim
    slots_in_cache = caches[0][0].shape[0] * caches[0][0].shape[1]
    meta = SimpleNamespace(slot_mapping=torch.tensor([slots_in_cache]), decode_block_tables=torch.zeros(1, 2,
                           dtype=torch.int64), decode_context_lens=torch.tensor([1]))
    ones = torch.ones(1, 1, head_dim)
    with pytest.raises(ValueError, match="KV slot of layer 0"):
        table.run(torch.zeros(1, hidden), ones, ones, meta)
    meta.slot_mapping = torch.tensor([0])
    meta.decode_context_lens = torch.tensor([9 * 4])  # longer than the table's two blocks
    with pytest.raises(ValueError, match="attention of layer 0"):
        table.run(torch.zeros(1, hidden), ones, ones, meta)
