"""The Triton backend's kernels against the PyTorch ops they replace: the fused RMSNorm (with and
without the residual add), SiLU-and-multiply, RoPE with the K/V cache write, and the split-KV
(flash-decoding) decode attention. On CPU under Triton's interpreter (tests/actors/conftest.py),
compiled on a GPU; skipped where Triton is not installed. The last test compiles every kernel
for Hopper without a GPU, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.models.attention import write_kv
from actors.models.llama import RMSNorm
from actors.models.rope import RotaryEmbedding, apply_rotary
from actors.paged_attention import (
    BLOCK_N,
    HAVE_TRITON,
    MAX_SPLITS,
    SPLIT_TOKENS,
    decode_splits,
    triton_decode,
)
from tests.actors.conftest import TRITON_READY
from tests.model_helpers import local_executor
from tests.paged_reference import make_case, reference

needs_triton = pytest.mark.skipif(not (HAVE_TRITON and TRITON_READY), reason="Triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to a bf16 rounding or two (a sum in another order; the interpreter truncates where the
    GPU rounds to nearest, up to 0.8% a rounding, and a kernel rounds two or three times)."""
    tol = 1e-2 if DEV == "cuda" else 2.5e-2
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _rounds_like_pytorch(dtype: torch.dtype) -> bool:
    """Where a kernel's roundings can be compared bit for bit with PyTorch's: float32 anywhere, bf16
    compiled. Triton's interpreter emulates bf16 by truncating, not rounding to nearest."""
    return dtype == torch.float32 or DEV == "cuda"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 72, 576])
def test_rms_norm_matches_the_module_with_and_without_the_residual(dtype: torch.dtype, hidden: int) -> None:
    from actors.models.fused_ops import rms_norm

    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, dtype).to(DEV)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype=dtype, device=DEV)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype=dtype, device=DEV)
    res = torch.randn(5, hidden, generator=gen).to(dtype=dtype, device=DEV)
    out, none = rms_norm(x, norm.weight, norm.eps)
    assert none is None
    summed = x + res
    out_r, new_res = rms_norm(x, norm.weight, norm.eps, res)
    assert new_res is not None
    if _rounds_like_pytorch(dtype):
        assert torch.equal(new_res, summed)  # the add rounds exactly as PyTorch's
    assert _bf16_close(new_res, summed)
    if dtype == torch.float32:
        assert torch.allclose(out, norm(x), rtol=1e-5, atol=1e-6)
        assert torch.allclose(out_r, norm(summed), rtol=1e-5, atol=1e-6)
    else:
        assert _bf16_close(out, norm(x)) and _bf16_close(out_r, norm(summed))
    empty, _ = rms_norm(x[:0], norm.weight, norm.eps)
    assert empty.shape == (0, hidden)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [12, 100, 2500])  # 2500 spans three programs of SILU_BLOCK
def test_silu_and_mul_matches_pytorch(dtype: torch.dtype, width: int) -> None:
    from actors.models.fused_ops import silu_and_mul

    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(3, 2 * width, generator=gen) * 4).to(dtype=dtype, device=DEV)
    want = F.silu(x[:, :width]) * x[:, width:]
    got = silu_and_mul(x)
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert _bf16_close(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 12), (8, 8, 8), (32, 8, 128)])
def test_rope_and_cache_matches_apply_rotary_and_write_kv(dtype: torch.dtype, heads: int, kv_heads: int,
                                                          head_dim: int) -> None:
    from actors.models.fused_ops import rope_and_cache

    gen = torch.Generator().manual_seed(heads * head_dim)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(head_dim, 512, 500000.0, scaling, dtype).to(DEV)
    t, blocks, bs = 7, 6, 4
    positions = torch.tensor([0, 5, 9, 100, 101, 300, 511], device=DEV)
    slots = torch.randperm(blocks * bs, generator=gen)[:t].to(DEV)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype=dtype, device=DEV)
    cos, sin = rope(positions)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = apply_rotary(q.reshape(t, heads, head_dim), cos, sin)
    want_k, want_v = (torch.zeros(blocks + 1, bs, kv_heads, head_dim, dtype=dtype, device=DEV) for _ in range(2))
    write_kv(apply_rotary(k.reshape(t, kv_heads, head_dim), cos, sin), v.reshape(t, kv_heads, head_dim),
             want_k, want_v, slots)
    k_cache, v_cache = torch.zeros_like(want_k), torch.zeros_like(want_v)
    got_q = rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, head_dim)
    if dtype == torch.float32:  # each product and the sum rounded as PyTorch rounds them: bit for bit
        assert torch.equal(got_q, want_q)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # other slots untouched (zero)
    assert _bf16_close(got_q, want_q) and _bf16_close(k_cache, want_k)
    assert torch.equal(v_cache, want_v)  # values are copied, never rounded
    assert torch.count_nonzero(k_cache.view(-1, kv_heads, head_dim).abs().sum((1, 2))) == t  # only the t slots


def _decode_case(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int,
                 pad_to: int = 0) -> tuple:
    case = make_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, block_size, seed=seed, device=DEV)
    scratch = case.k_cache.shape[0] - 1
    width = max(pad_to, max(len(t) for t in case.tables))
    tables = torch.tensor([t + [scratch] * (width - len(t)) for t in case.tables], device=DEV)
    return case, tables, torch.tensor(seq_lens, device=DEV)


@needs_triton
@pytest.mark.parametrize("share", [64, 128, 192, 640, 1024])  # 640 covers the longest row: one pass
def test_split_decode_matches_the_dense_reference(share: int) -> None:
    """Uneven lengths (1 token, shorter than one split, many blocks), GQA, a table padded far past the
    longest row (its padding points at a scratch block full of huge values, never read); the rows'
    last splits are empty, most of them for the short rows."""
    case, tables, lens = _decode_case([1, 5, 64, 65, 200, 333], 8, 2, 16, 16, seed=share, pad_to=40)
    case.k_cache[-1].fill_(1e4)
    case.v_cache[-1].fill_(1e4)
    out = torch.empty_like(case.q)
    triton_decode(case.q, case.k_cache, case.v_cache, tables, lens, case.scale, out, share=share)
    assert torch.allclose(out, reference(case), atol=2e-5)


@needs_triton
def test_split_decode_ignores_the_table_width_and_the_batch() -> None:
    """The splits depend on a row's length alone: a row decoded alone in a narrow table, or beside
    others in a table twice as wide (a graph's context bucket), gives the same bits."""
    case, tables, lens = _decode_case([700, 1030, 90], 4, 2, 8, 16, seed=9, pad_to=80)
    assert decode_splits(tables.shape[1] * 16)[0] > 1
    together = torch.empty_like(case.q)
    triton_decode(case.q, case.k_cache, case.v_cache, tables, lens, case.scale, together)
    assert torch.allclose(together, reference(case), atol=2e-5)
    for row in range(3):
        alone = torch.empty_like(case.q[row:row + 1])
        narrow = tables[row:row + 1, :-(-int(lens[row]) // 16)]
        triton_decode(case.q[row:row + 1], case.k_cache, case.v_cache, narrow, lens[row:row + 1], case.scale, alone)
        assert torch.equal(alone, together[row:row + 1]), row
    with pytest.raises(ValueError, match="multiple"):
        triton_decode(case.q, case.k_cache, case.v_cache, tables, lens, case.scale, together, share=100)


def test_decode_splits_are_fixed_shares_until_the_table_is_very_wide() -> None:
    assert decode_splits(256) == (1, 256)  # one split's worth: one pass, no merge
    assert decode_splits(4096) == (4096 // SPLIT_TOKENS, SPLIT_TOKENS)
    assert decode_splits(8192 + 16) == (33, SPLIT_TOKENS)  # a partial last split
    for width in (272, 1024, 16384, 16400, 131072, 10**6):
        splits, share = decode_splits(width)
        assert 1 < splits <= MAX_SPLITS and share % BLOCK_N == 0 and share >= SPLIT_TOKENS
        assert (splits - 1) * share < width <= splits * share  # the splits cover the table, none past it
        assert share == SPLIT_TOKENS or width > MAX_SPLITS * SPLIT_TOKENS


@needs_triton
def test_every_kernel_compiles_for_hopper() -> None:
    """Triton's compiler and its ptxas build each kernel for sm_90 at Llama-3-8B's shapes in bf16: a
    compile error shows here, not first on the GPU machine. Its own process: this one interprets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.triton_compile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(lines) == 8 and all(ln.startswith("ok ") for ln in lines), lines


@needs_triton
def test_gpu_check_times_the_decode_kernel_one_pass_and_split(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py's kernel rows, on a tiny Triton-backend runner (interpreted here): the
    one-pass launch and the engine's split choice, each with the KV bytes it read."""
    from benchmarks.gpu_check import _attention_rows
    from tests.model_helpers import save_tiny_checkpoint

    runner = local_executor(save_tiny_checkpoint(tmp_path / "tiny", seed=2), attention="triton", block_size=4,
                            dtype="float32", max_num_blocks=4096).runner
    rows = _attention_rows(runner, dict(batches=(1, 2), contexts=(24, 600), repeats=1), bandwidth=1e9)
    rows = [r for r in rows if not r["variant"]]  # on a GPU, launch variants follow each choice
    assert [(r["batch"], r["context"]) for r in rows if r["splits"] == 1] == [(2, 600), (1, 600), (2, 24)]
    split = [r for r in rows if r["splits"] > 1]
    assert [(r["splits"], r["context"], r["chosen"]) for r in split] == [(3, 600, True), (3, 600, True)]
    kvh, hd = runner.kv_caches[0][0].shape[2:]
    for r in rows:
        # ms is rounded to 4 decimals: on a GPU that is up to 0.3% of a 0.02 ms launch
        assert r["kv_bytes_per_s"] == pytest.approx(2 * r["batch"] * r["context"] * kvh * hd * 4 / r["ms"] * 1e3,
                                                    rel=1e-2)
