"""GPU-only checks of the engine: CUDA-graph replay vs eager, the flash-attn path vs SDPA, and
the GPU memory-budget sizing. Skipped without CUDA (CI has none); run on a GPU machine with
`pytest -m gpu tests/gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.models.attention import HAVE_FLASH_ATTN
from tests.model_helpers import GREEDY, generate_ids, local_executor, make_engine, save_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[1, 17, 33, 5, 9], list(range(3, 60)), [1, 200, 7], list(range(100, 131)), [5] * 20]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpu"), seed=3)


def _gpu(path: Path, **kw: object) -> object:
    kw.setdefault("device", "cuda")
    kw.setdefault("dtype", "float32")
    kw.setdefault("gpu_memory_utilization", 0.9)
    kw.setdefault("max_num_blocks", 4096)  # the tiny model would otherwise get millions of blocks
    return local_executor(path, **kw)


def test_gpu_eager_matches_cpu(tiny_path: Path) -> None:
    cpu = generate_ids(local_executor(tiny_path), PROMPTS, GREEDY)
    assert generate_ids(_gpu(tiny_path, enforce_eager=True), PROMPTS, GREEDY) == cpu


def test_cuda_graph_replay_matches_eager(tiny_path: Path) -> None:
    eager = _gpu(tiny_path, enforce_eager=True)
    graphed = _gpu(tiny_path, cuda_graph_buckets=(1, 2, 4, 8))
    assert graphed.runner.graphs is not None and sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8]
    # Buckets on: every pure-decode step of <= 8 sequences replays a padded graph.
    assert generate_ids(graphed, PROMPTS, GREEDY) == generate_ids(eager, PROMPTS, GREEDY)
    eager.runner.keep_logits = graphed.runner.keep_logits = True
    seen: list[dict[str, torch.Tensor]] = []
    for ex in (eager, graphed):
        engine = make_engine(ex)
        for i, p in enumerate(PROMPTS[:3]):
            engine.add_request(p, GREEDY, request_id=f"r{i}")
        for _ in range(4):
            engine.step()
        seen.append(dict(ex.runner.last_logits))
    assert set(seen[0]) == set(seen[1]) == {"r0", "r1", "r2"}
    for rid, logits in seen[0].items():
        assert torch.allclose(logits, seen[1][rid], atol=1e-4)


@pytest.mark.skipif(not HAVE_FLASH_ATTN, reason="flash-attn not installed")
def test_flash_attention_matches_sdpa(tiny_path: Path) -> None:
    sdpa = _gpu(tiny_path, enforce_eager=True, block_size=256)
    flash = _gpu(tiny_path, enforce_eager=True, block_size=256, dtype="bfloat16")
    sdpa_bf16 = _gpu(tiny_path, enforce_eager=True, block_size=256, dtype="bfloat16")
    sdpa_bf16.runner.use_flash = False
    assert flash.runner.use_flash and not sdpa.runner.use_flash
    assert generate_ids(flash, PROMPTS, GREEDY) == generate_ids(sdpa_bf16, PROMPTS, GREEDY)


def test_gpu_kv_budget_from_memory_utilization(tiny_path: Path) -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    small = _gpu(tiny_path, enforce_eager=True, gpu_memory_utilization=0.02, max_num_blocks=None)
    blocks_small = small.info.num_kv_blocks
    del small
    gc.collect()
    torch.cuda.empty_cache()
    large = _gpu(tiny_path, enforce_eager=True, gpu_memory_utilization=0.04, max_num_blocks=None)
    assert 0 < blocks_small < large.info.num_kv_blocks
