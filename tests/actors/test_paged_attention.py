"""Paged attention against a dense reference (tests/paged_reference.py): decodes of uneven
lengths, prefill chunks with and without earlier context, GQA groups of 1, 3 and 4 heads,
head dims that are and are not powers of two, shuffled block tables.

Both implementations: the portable one (SDPA over gathered blocks, what CPU serving runs) and
the Triton kernel that reads blocks in place (compiled on CUDA; here under Triton's
interpreter, skipped when Triton is not installed). tests/gpu runs the kernel compiled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.models.attention import AttentionMetadata, PrefillSpan, paged_attention
from actors.paged_attention import HAVE_TRITON, build_prefill
from tests.actors.conftest import TRITON_READY
from tests.model_helpers import GREEDY, generate_ids, local_executor, save_tiny_checkpoint
from tests.paged_reference import Case, make_case, reference

needs_triton = pytest.mark.skipif(not (HAVE_TRITON and TRITON_READY), reason="Triton not installed")

# (seq_lens, q_lens, heads, kv_heads, head_dim, block_size): decodes have q_len 1, chunks more
DECODES = [([5, 17, 40, 100], [1, 1, 1, 1], 8, 2, 8, 4),
           ([1, 16, 33], [1, 1, 1], 4, 4, 16, 16),
           ([70, 3, 129, 64, 65], [1, 1, 1, 1, 1], 6, 2, 12, 16)]
CHUNKS = [([30, 70, 9], [10, 70, 3], 6, 2, 16, 16),
          ([200, 17], [64, 17], 8, 2, 8, 4),
          ([130], [1 + 65], 9, 3, 64, 16)]


def _meta(case: Case, decodes: int, backend: str) -> AttentionMetadata:
    """Metadata of a flat batch: the first `decodes` sequences decode, the rest are chunks."""
    bs, scratch = case.k_cache.shape[1], case.k_cache.shape[0] - 1
    width = max((len(t) for t in case.tables[:decodes]), default=0)
    dev = case.q.device
    tables = (torch.tensor([t + [scratch] * (width - len(t)) for t in case.tables[:decodes]], device=dev)
              if decodes else None)
    lens = torch.tensor(case.seq_lens[:decodes], device=dev) if decodes else None
    slots = [t[p // bs] * bs + p % bs for t, length, n in zip(case.tables, case.seq_lens, case.q_lens, strict=True)
             for p in range(length - n, length)]
    spans, start = [], decodes
    for table, length, n in zip(case.tables[decodes:], case.seq_lens[decodes:], case.q_lens[decodes:], strict=True):
        spans.append(PrefillSpan(start, n, length - n, torch.tensor(table, device=dev)))
        start += n
    meta = AttentionMetadata(torch.tensor(slots, device=dev), decodes, tables, lens, spans, backend=backend)
    if backend == "triton" and spans:
        meta.triton_prefill = build_prefill(spans, scratch, case.q.shape[1] // case.k_cache.shape[2], case.q.device)
    return meta


def _attend(case: Case, decodes: int, backend: str) -> torch.Tensor:
    """paged_attention for a step whose new tokens' K/V are the ones the case put in the cache."""
    kvh, hd = case.k_cache.shape[2], case.k_cache.shape[3]
    meta = _meta(case, decodes, backend)
    k = case.k_cache.view(-1, kvh, hd)[meta.slot_mapping].clone()  # this step's K/V, written again
    v = case.v_cache.view(-1, kvh, hd)[meta.slot_mapping].clone()
    return paged_attention(case.q, k, v, case.k_cache, case.v_cache, meta, case.scale)


def _device(backend: str) -> str:
    """The kernel runs compiled on CUDA tensors where there is a GPU, interpreted on CPU ones elsewhere."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _cases(spec: list[tuple], seed: int, backend: str) -> list[Case]:
    return [make_case(s, q, h, kvh, hd, bs, seed=seed + i, device=_device(backend))
            for i, (s, q, h, kvh, hd, bs) in enumerate(spec)]


BACKENDS = ["portable", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_decodes_match_dense_reference(backend: str) -> None:
    for case in _cases(DECODES, 0, backend):
        got = _attend(case, len(case.q_lens), backend)
        assert torch.allclose(got, reference(case), atol=2e-5), (backend, case.seq_lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_chunks_with_context_match_dense_reference(backend: str) -> None:
    for case in _cases(CHUNKS, 10, backend):
        got = _attend(case, 0, backend)
        assert torch.allclose(got, reference(case), atol=2e-5), (backend, case.seq_lens, case.q_lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_decodes_then_chunks(backend: str) -> None:
    case = make_case([9, 48, 77, 40, 23], [1, 1, 1, 40, 5], 8, 2, 16, 16, seed=21, device=_device(backend))
    assert torch.allclose(_attend(case, 3, backend), reference(case), atol=2e-5)


@needs_triton
def test_triton_kernel_ignores_table_padding_and_scratch_contents() -> None:
    """A decode table padded far past its length (as in a CUDA-graph context bucket) reads nothing more."""
    case = make_case([5, 21], [1, 1], 4, 2, 8, 4, seed=3, device=_device("triton"))
    ref = reference(case)
    case.k_cache[-1].fill_(1e4)  # the scratch block, which padded entries point at
    case.v_cache[-1].fill_(1e4)
    scratch = case.k_cache.shape[0] - 1
    tables = torch.tensor([t + [scratch] * (40 - len(t)) for t in case.tables], device=case.q.device)
    meta = _meta(case, 2, "triton")
    meta.decode_block_tables = tables
    k = case.k_cache.view(-1, 2, 8)[meta.slot_mapping].clone()
    v = case.v_cache.view(-1, 2, 8)[meta.slot_mapping].clone()
    got = paged_attention(case.q, k, v, case.k_cache, case.v_cache, meta, case.scale)
    assert torch.allclose(got, ref, atol=2e-5)


@needs_triton
def test_model_with_triton_attention_generates_the_portable_tokens(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path / "tiny", seed=5)
    prompts = [[1, 17, 33, 5, 9], list(range(3, 40)), [1, 200, 7]]
    kw = dict(block_size=4, dtype="float32")  # float32 on a GPU too: the backends' rounding differs in bf16
    portable = generate_ids(local_executor(path, **kw), prompts, GREEDY)
    triton = local_executor(path, attention="triton", **kw)
    assert triton.runner.attention_backend == "triton"
    assert generate_ids(triton, prompts, GREEDY, max_num_batched_tokens=16, max_batch_size=8) == portable
