"""The runner's prefix-cache reuse on CUDA, both attention backends (the Triton kernel compiled):
the checks of tests/actors/test_prefix_reuse.py with the model on the GPU. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.paged_attention import HAVE_TRITON
from tests.actors.test_prefix_reuse import check_reuse
from tests.model_helpers import save_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = ["portable", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="no Triton"))]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpu-prefix"), seed=3)


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("chunks", [None, [3, 6]])
def test_cached_prefix_on_the_gpu(tiny_path: Path, attention: str, chunks: list[int] | None) -> None:
    check_reuse(tiny_path, chunks, device="cuda", dtype="float32", attention=attention, enforce_eager=True,
                max_num_blocks=4096)
