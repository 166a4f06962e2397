"""The CPU weight layouts (actors/models/cpu_gemm.py) compute what `F.linear` computes, at every
row count a step can have, and the engine generates the same greedy tokens with them as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.models.cpu_gemm import CpuWeights, linear, prepare_cpu_gemm, supported
from tests.model_helpers import generate_ids, local_executor, save_tiny_checkpoint
from tidal_core import SamplingParams

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_both_layouts_match_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    got = CpuWeights(weight, bias).linear(x)
    want = F.linear(x, weight, bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_3d_input_or_no_layouts_falls_back_to_f_linear() -> None:
    weight, x3 = torch.randn(8, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(linear(x3, weight, None, CpuWeights(weight, None)), F.linear(x3, weight))
    torch.testing.assert_close(linear(x3[0], weight, None, None), F.linear(x3[0], weight))


def test_only_float32_cpu_weights_are_supported() -> None:
    assert supported(torch.zeros(4, 4))
    assert not supported(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not supported(torch.zeros(4))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gemm"), seed=3)


def test_every_linear_of_a_loaded_model_gets_its_layouts(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    model = ex.runner.model
    prepared = [m for m in model.modules() if getattr(m, "cpu_layouts", None) is not None]
    hooks = [m for m in model.modules() if hasattr(m, "cpu_weights")]
    assert hooks and len(prepared) == len(hooks)
    assert prepare_cpu_gemm(model) == len(hooks)  # preparing again replaces, does not add


def test_greedy_tokens_identical_with_and_without_the_layouts(tiny_path: Path) -> None:
    prompts = [list(range(5, 12)), [3], list(range(40, 90)), list(range(200, 233))]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on = generate_ids(local_executor(tiny_path, cpu_gemm=True), prompts, sampling)
    off = generate_ids(local_executor(tiny_path, cpu_gemm=False), prompts, sampling)
    assert on == off
    assert all(len(t) == 12 for t in on)
