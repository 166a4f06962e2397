"""The in-place CPU decode attention (actors/models/cpu_attention.py, csrc/paged_decode.c) against
the gather + SDPA path and a dense float64 reference (tests/paged_reference.py): uneven lengths
around block edges and past 300 tokens, GQA groups of 1-8, the head dims with register-blocked
loops (32, 64, 96, 128) and without (8, 12, 40), the same bits on one thread and on the kernels'
pool (its helpers asleep or spinning, with concurrent callers), tables padded with the scratch
block, inputs it must copy or refuse, tables it must refuse; building, caching and the fallback without a
compiler; and an engine that generates the same greedy tokens with the kernel and without.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from actors.models import ckernel, cpu_attention, cpu_pool
from actors.models.attention import AttentionMetadata, PrefillSpan, decode_attention, paged_attention
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
from tests.paged_reference import Case, make_case, reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the kernel cannot be built")

LENS = [1, 15, 16, 17, 300, 333]
# (heads, kv_heads, head_dim, block_size)
SHAPES = [(9, 3, 64, 16),  # SmolLM2-135M
          (8, 8, 64, 16), (8, 1, 128, 16), (12, 4, 32, 16), (8, 2, 96, 8), (32, 8, 128, 16),
          (8, 2, 8, 4), (6, 2, 12, 16), (4, 4, 40, 16)]


def _tables(case: Case, width: int | None = None) -> torch.Tensor:
    scratch = case.k_cache.shape[0] - 1
    w = width or max(map(len, case.tables))
    return torch.tensor([t + [scratch] * (w - len(t)) for t in case.tables])


def _kernel(case: Case, tables: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(case.q)
    tables = _tables(case) if tables is None else tables
    cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, tables, torch.tensor(case.seq_lens), case.scale,
                               out)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_kernel_matches_gather_sdpa_and_the_dense_reference(shape: tuple[int, int, int, int]) -> None:
    heads, kv_heads, head_dim, block_size = shape
    case = make_case(LENS, [1] * len(LENS), heads, kv_heads, head_dim, block_size, seed=sum(shape))
    got = _kernel(case)
    ref = reference(case)
    sdpa = decode_attention(case.q, case.k_cache, case.v_cache, _tables(case), torch.tensor(case.seq_lens),
                            case.scale)
    assert (got - ref).abs().max().item() < 2e-6, shape
    assert torch.allclose(got, sdpa, atol=2e-6), shape
    assert (got[0] - case.v_cache[case.tables[0][0], 0].repeat_interleave(heads // kv_heads, 0)).abs().max() < 1e-6


def test_scores_far_apart_and_long_contexts() -> None:
    """Logits spread over hundreds (the exp's clamp at -87 is reached) and 2,000-token contexts."""
    case = make_case([2000, 1200, 5], [1, 1, 1], 9, 3, 64, 16, seed=4)
    case.q.mul_(40.0)
    got = _kernel(case)
    assert (got - reference(case)).abs().max().item() < 1e-4  # float32 logits of +-150: 1e-5 apart
    k = case.k_cache.view(-1, 3, 64)[[case.tables[0][p // 16] * 16 + p % 16 for p in range(2000)], 0]
    scores = torch.einsum("hd,ld->hl", case.q[0, :3], k) * case.scale
    assert (scores.max(-1).values - scores.min(-1).values).min().item() > 87  # the clamp is reached


def _threads(threads: int, case: Case) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _kernel(case)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_the_pool_gives_one_threads_bits(build: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared between threads (torch's thread count, the kernels' pool: actors/models/cpu_pool.py),
    each decode's KV head on one thread: every output the same float32 bits as on one thread, for
    every shape, one decode or many."""
    if build == "portable":
        use_portable_build(cpu_attention.KERNEL, tmp_path, monkeypatch)
    assert cpu_pool.runner() is not None
    for shape in SHAPES:
        for lens in (LENS, [300], [40, 7]):
            case = make_case(lens, [1] * len(lens), *shape, seed=len(lens) + sum(shape))
            one = _threads(1, case)
            for threads in (2, 3, 8):
                assert torch.equal(_threads(threads, case), one), (shape, lens, threads)


def test_the_pool_with_sleeping_helpers_and_concurrent_callers() -> None:
    """Helpers that sleep at once after each call (the futex path every call), and four Python
    threads calling at once (one holds the pool, the others compute alone): every result exact."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [make_case(lens, [1] * len(lens), *shape, seed=i)
             for i, (lens, shape) in enumerate([(LENS, SHAPES[0]), ([90, 3, 200], SHAPES[5]), ([64], SHAPES[4])])]
    want = [_threads(1, c) for c in cases]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for spin_ns in (0, cpu_pool.SPIN_NS):
            cpu_pool.set_spin(spin_ns)
            for _ in range(10):
                assert all(torch.equal(_kernel(c), w) for c, w in zip(cases, want, strict=True))

        def many(seed: int) -> bool:
            return all(torch.equal(_kernel(cases[i]), want[i]) for _ in range(10) for i in (seed % 3, 2, 1, 0))

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(many, range(4)))
    finally:
        torch.set_num_threads(before)
        cpu_pool.set_spin(cpu_pool.SPIN_NS)


def test_table_padding_and_the_scratch_block_are_never_read() -> None:
    case = make_case([5, 21, 64], [1, 1, 1], 9, 3, 64, 16, seed=3)
    ref = _kernel(case)
    case.k_cache[-1].fill_(float("nan"))  # the scratch block every padded entry points at
    case.v_cache[-1].fill_(float("nan"))
    assert torch.equal(_kernel(case, _tables(case, width=40)), ref)


def test_inputs_copied_or_refused() -> None:
    case = make_case([7, 40], [1, 1], 8, 2, 64, 16, seed=5)
    ref = _kernel(case)
    lens = torch.tensor(case.seq_lens)
    # a non-contiguous q and int32 tables / lengths are copied
    q_t = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_t.is_contiguous()
    out = torch.empty_like(case.q)
    cpu_attention.paged_decode(q_t, case.k_cache, case.v_cache, _tables(case).int(), lens.int(), case.scale, out)
    assert torch.equal(out, ref)
    wide = torch.stack([_tables(case), _tables(case)], dim=-1)[..., 0]  # the same table, strided
    assert not wide.is_contiguous()
    cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, wide, lens, case.scale, out)
    assert torch.equal(out, ref)
    # non-contiguous caches or output, other dtypes, mismatched shapes are refused
    bad_cache = case.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_attention.paged_decode(case.q, bad_cache, case.v_cache, _tables(case), lens, case.scale, out)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, _tables(case), lens, case.scale,
                                   torch.empty(8, 2, 64).transpose(0, 1))
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.paged_decode(case.q.double(), case.k_cache, case.v_cache, _tables(case), lens, case.scale, out)
    with pytest.raises(ValueError, match="shapes"):
        cpu_attention.paged_decode(case.q[:, :7], case.k_cache, case.v_cache, _tables(case), lens, case.scale,
                                   out[:, :7].contiguous())  # 7 query heads over 2 KV heads
    with pytest.raises(ValueError, match="shapes"):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, _tables(case), lens[:1], case.scale, out)


@pytest.mark.parametrize(("lens", "table", "message"), [
    ([40], [[0, 1]], "context length"),  # 40 tokens, a table of 2 blocks of 16
    ([0], [[0, 1]], "context length"),
    ([20], [[0, 99]], "block id"),  # past the cache's last block
    ([20], [[-1, 0]], "block id"),
])
def test_bad_tables_are_refused_not_read(lens: list[int], table: list[list[int]], message: str) -> None:
    case = make_case([20], [1], 8, 2, 64, 16, seed=6)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode(case.q, case.k_cache, case.v_cache, torch.tensor(table), torch.tensor(lens),
                                   case.scale, torch.empty_like(case.q))


def test_paged_attention_step_with_the_kernel_matches_the_reference() -> None:
    """A mixed step (decodes then prefill chunks) with `meta.cpu_decode`: decodes through the kernel."""
    case = make_case([9, 48, 333, 40, 23], [1, 1, 1, 40, 5], 9, 3, 64, 16, seed=21)
    bs, decodes = 16, 3
    slots = [t[p // bs] * bs + p % bs for t, length, n in zip(case.tables, case.seq_lens, case.q_lens, strict=True)
             for p in range(length - n, length)]
    spans = [PrefillSpan(3, 40, 0, torch.tensor(case.tables[3])), PrefillSpan(43, 5, 18, torch.tensor(case.tables[4]))]
    lens = torch.tensor(case.seq_lens[:decodes])
    tables = torch.tensor([t + [case.k_cache.shape[0] - 1] * (21 - len(t)) for t in case.tables[:decodes]])
    meta = AttentionMetadata(torch.tensor(slots), decodes, tables, lens, spans, cpu_decode=True)
    k = case.k_cache.view(-1, 3, 64)[meta.slot_mapping].clone()
    v = case.v_cache.view(-1, 3, 64)[meta.slot_mapping].clone()
    got = paged_attention(case.q, k, v, case.k_cache, case.v_cache, meta, case.scale)
    assert torch.allclose(got, reference(case), atol=2e-5)


def test_build_is_cached_and_named_by_source_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    path = cpu_attention.KERNEL.build()
    assert path.parent == tmp_path / "kernels" and path.exists()
    mtime = path.stat().st_mtime_ns
    assert cpu_attention.KERNEL.build() == path and path.stat().st_mtime_ns == mtime  # found, not rebuilt
    portable = cpu_attention.KERNEL.build(flags=())
    assert portable != path or ckernel.cpu_flags() == ()
    assert [p.name for p in (tmp_path / "kernels").iterdir() if p.suffix == ".tmp"] == []


def test_portable_build_matches_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library a CPU without AVX2 / FMA gets (no -m flags: the plain loops) computes the same."""
    use_portable_build(cpu_attention.KERNEL, tmp_path, monkeypatch)
    for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (8, 2, 12, 4)]:
        case = make_case(LENS, [1] * len(LENS), heads, kv_heads, head_dim, block_size, seed=head_dim)
        assert (_kernel(case) - reference(case)).abs().max().item() < 2e-6


def test_no_compiler_falls_back_with_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    without_compiler(cpu_attention.KERNEL, tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=ckernel.__name__):
        assert cpu_attention.load() is None
        assert cpu_attention.load() is None  # tried once per process
    lines = [r.getMessage() for r in caplog.records if r.name == ckernel.__name__]
    assert len(lines) == 1 and "no-such-compiler-here" in lines[0] and "gather + SDPA" in lines[0]
    tiny = save_tiny_checkpoint(tmp_path / "tiny", seed=2)
    ex = local_executor(tiny, block_size=4)
    assert ex.runner.cpu_decode is False  # the runner keeps gather + SDPA
    assert len(generate_ids(ex, [[1, 5, 9]])[0]) == GREEDY.max_tokens


def test_tiny_model_generates_the_same_tokens_with_and_without_the_kernel(tmp_path: Path) -> None:
    on, off, with_it, without = tiny_greedy_with_and_without(save_tiny_checkpoint(tmp_path / "tiny", seed=5),
                                                             "cpu_attention")
    assert on.runner.cpu_decode is True and off.runner.cpu_decode is False
    assert with_it == without


def test_smollm2_greedy_tokens_identical_with_and_without_the_kernel() -> None:
    on, off = smollm2_greedy_with_and_without("cpu_attention")
    assert on == off
