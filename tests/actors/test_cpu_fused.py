"""The fused CPU ops between a layer's matmuls (actors/models/cpu_fused.py, csrc/fused_cpu.c) against
the PyTorch ops they replace: rotary bit for bit; RMSNorm's residual add bit for bit and its output
within float32 rounding; SiLU x up within rounding, at extreme gates too; both builds (AVX2 and
the portable loops); rows at a stride (a slice of a wider tensor); inputs they refuse; the
runner's switch; and engines that generate the same greedy tokens with the kernels and without.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.models import ckernel, cpu_fused
from actors.models.rope import RotaryEmbedding, apply_rotary
from tests.model_helpers import (
    GREEDY,
    generate_ids,
    local_executor,
    save_tiny_checkpoint,
    smollm2_greedy_with_and_without,
    tiny_greedy_with_and_without,
    use_portable_build,
    without_compiler,
)

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler: the kernel cannot be built")


@pytest.fixture(params=["native", "portable"])
def build(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "portable":
        use_portable_build(cpu_fused.KERNEL, tmp_path, monkeypatch)
    return str(request.param)


def _torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # models/llama.py's RMSNorm
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 128), (4, 1, 32), (2, 2, 6)], ids=str)
def test_rope_gives_pytorchs_bits(shape: tuple[int, int, int], build: str) -> None:
    heads, kv_heads, hd = shape
    torch.manual_seed(hd)
    t = 37
    wide = torch.randn(t, (heads + 2 * kv_heads) * hd + 5) * 4
    qkv = wide[:, :-5]  # rows at a stride wider than their width, as a slice of a bigger output is
    rotary = RotaryEmbedding(hd, 8192, 10000.0, None, torch.float32)
    cos, sin = rotary(torch.randint(0, 8000, (t,)))
    q, k = cpu_fused.rope_qk(qkv, cos, sin, heads, kv_heads, hd)
    q_ref = apply_rotary(qkv[:, :heads * hd].reshape(t, heads, hd), cos, sin)
    k_ref = apply_rotary(qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(t, kv_heads, hd), cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("n", [576, 4096, 13])
def test_rms_norm_adds_exactly_and_normalizes_within_rounding(n: int, build: str) -> None:
    torch.manual_seed(n)
    x, res, w = torch.randn(29, n) * 3, torch.randn(29, n), torch.randn(n)
    out, res_out = cpu_fused.rms_norm(x, w, 1e-5, res)
    assert res_out is not None and torch.equal(res_out, x + res)
    ref = _torch_norm(x + res, w, 1e-5)
    assert torch.allclose(out, ref, rtol=2e-6, atol=1e-6)
    alone, none = cpu_fused.rms_norm(x, w, 1e-6)
    assert none is None and torch.allclose(alone, _torch_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    zeros, _ = cpu_fused.rms_norm(torch.zeros(2, n), w, 1e-5)  # eps keeps an all-zero row finite
    assert torch.equal(zeros, torch.zeros(2, n))


def test_silu_and_mul_within_rounding_at_any_gate(build: str) -> None:
    torch.manual_seed(3)
    n = 1536
    x = torch.randn(17, 2 * n) * 6
    x[0, :9] = torch.tensor([-200.0, -90.0, -87.5, -1e-30, 0.0, 1e-30, 88.5, 90.0, 300.0])
    got = cpu_fused.silu_and_mul(x)
    gate, up = x.split([n, n], dim=-1)
    ref = F.silu(gate) * up
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, rtol=2e-6, atol=1e-30)
    odd = torch.randn(3, 2 * 13)  # a width that is not a multiple of 8: the scalar tail
    assert torch.allclose(cpu_fused.silu_and_mul(odd), F.silu(odd[:, :13]) * odd[:, 13:], rtol=2e-6, atol=1e-30)


def test_empty_batches_and_refused_inputs() -> None:
    w = torch.ones(8)
    out, res = cpu_fused.rms_norm(torch.empty(0, 8), w, 1e-5, torch.empty(0, 8))
    assert out.shape == (0, 8) and res is not None and res.shape == (0, 8)
    assert cpu_fused.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    q, k = cpu_fused.rope_qk(torch.empty(0, 5 * 4), torch.empty(0, 4), torch.empty(0, 4), 1, 2, 4)
    assert q.shape == (0, 1, 4) and k.shape == (0, 2, 4)
    with pytest.raises(ValueError, match="float32 CPU"):
        cpu_fused.rms_norm(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_fused.silu_and_mul(torch.ones(8, 4).t())
    with pytest.raises(ValueError, match="weight"):
        cpu_fused.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        cpu_fused.rms_norm(torch.ones(2, 8), w, 1e-5, torch.ones(3, 8))
    with pytest.raises(ValueError, match="even"):
        cpu_fused.silu_and_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="heads"):  # the rows are narrower than the heads asked for
        cpu_fused.rope_qk(torch.ones(2, 12), torch.ones(2, 4), torch.ones(2, 4), 2, 2, 4)
    with pytest.raises(ValueError, match="heads"):  # an odd head dim has no half split
        cpu_fused.rope_qk(torch.ones(2, 15), torch.ones(2, 3), torch.ones(2, 3), 2, 1, 3)


def test_build_has_its_own_flags_and_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    path = cpu_fused.KERNEL.build()
    assert path.exists() and path.name.startswith("fused_cpu-")
    assert cpu_fused.KERNEL.extra_flags == ("-ffp-contract=off",)  # what makes rotary bit-exact
    assert cpu_fused.KERNEL.build(flags=()) != path or ckernel.cpu_flags() == ()


def test_no_compiler_keeps_pytorchs_ops_with_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    without_compiler(cpu_fused.KERNEL, tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=ckernel.__name__):
        assert cpu_fused.load() is None
    lines = [r.getMessage() for r in caplog.records if r.name == ckernel.__name__ and "fused_cpu" in r.getMessage()]
    assert len(lines) == 1 and "PyTorch's ops" in lines[0]
    ex = local_executor(save_tiny_checkpoint(tmp_path / "tiny", seed=2), block_size=4)
    assert ex.runner.cpu_fused is False
    assert len(generate_ids(ex, [[1, 5, 9]])[0]) == GREEDY.max_tokens


def test_tiny_model_same_tokens_and_close_logits_with_and_without(tmp_path: Path) -> None:
    on, off, with_it, without = tiny_greedy_with_and_without(save_tiny_checkpoint(tmp_path / "tiny", seed=7),
                                                             "cpu_fused_ops")
    assert on.runner.cpu_fused is True and off.runner.cpu_fused is False
    assert with_it == without
    # the last step's logits, request by request (each engine names its requests its own way)
    last_on, last_off = list(on.runner.last_logits.values()), list(off.runner.last_logits.values())
    assert last_on and len(last_on) == len(last_off)
    for a, b in zip(last_on, last_off, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


def test_smollm2_greedy_tokens_identical_with_and_without() -> None:
    on, off = smollm2_greedy_with_and_without("cpu_fused_ops")
    assert on == off
