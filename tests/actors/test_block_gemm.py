"""Linears on a GGUF's quantized blocks (actors/models/block_gemm.py, csrc/block_gemm.c): the blocks
widen to gguf-py's own dequantized values bit for bit; the kernel against a float64 product at
1-13 rows, odd row counts of W and both builds (AVX2 and portable); the same bits on one thread
and shared by the pool, its helpers asleep or spinning, with concurrent callers; the exactness check that
guards attaching; the GGUF reader against gguf-py's; bad inputs refused; and engines that
generate the same greedy tokens with the blocks and without (a tiny model whose GGUF has its
rows permuted and its fused projections split, and SmolLM2 itself).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from safetensors.torch import load_file, save_file

from actors import model_loader
from actors.models import block_gemm, cpu_pool
from actors.models.block_gemm import Q4_0, Q4_1, Q8_0, BlockWeights, _split_rows
from tests.model_helpers import (
    generate_ids,
    local_executor,
    save_tiny_checkpoint,
    smollm2_greedy_with_and_without,
    smollm2_path,
    use_portable_build,
)

pytestmark = pytest.mark.skipif(not block_gemm.KERNEL.available(), reason="no C compiler: the kernel cannot be built")

KINDS = [Q4_0, Q4_1, Q8_0]


def _quantized(kind: int, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the file's raw rows, gguf-py's dequantization of them) for random weights."""
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quants.quantize(x, GGMLQuantizationType(kind))
    return raw, quants.dequantize(raw, GGMLQuantizationType(kind))


def _blocks(raw: np.ndarray, kind: int) -> BlockWeights:
    return BlockWeights(kind, *(torch.from_numpy(a) for a in _split_rows(kind, raw)))


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_widen_to_gguf_py_values(kind: int) -> None:
    raw, ref = _quantized(kind, 37, 160, seed=kind)
    blocks = _blocks(raw, kind)
    assert blocks.shape == (37, 160)
    ours = blocks.dequantize().numpy()
    # The kernel widens them the same way: x = I gives W^T, each sum a single product.
    widened = blocks.matmul(torch.eye(160)).t().contiguous().numpy()
    assert np.array_equal(ours, ref) and np.array_equal(widened, ref)
    if kind != Q4_0:  # bit for bit; Q4_0's zero weights may differ in sign only (d * (q - 8) with d < 0)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
        assert np.array_equal(widened.view(np.uint32), ref.view(np.uint32))


@pytest.fixture(params=["native", "portable"])
def build(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "portable":
        use_portable_build(block_gemm.KERNEL, tmp_path, monkeypatch)
    return str(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_a_float64_product(kind: int, build: str) -> None:
    for n, k in [(1, 32), (2, 64), (7, 96), (97, 576)]:
        raw, w = _quantized(kind, n, k, seed=n + k)
        blocks = _blocks(raw, kind)
        for rows in [0, 1, 2, 3, 4, 5, 6, 7, 9, 13]:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            got = blocks.matmul(x)
            ref = x.double() @ torch.from_numpy(w).double().t()
            assert got.shape == (rows, n)
            if rows:
                assert (got.double() - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item()), (n, k, rows)


def _with_threads(threads: int, blocks: BlockWeights, x: torch.Tensor) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return blocks.matmul(x)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS)
def test_the_pool_gives_one_threads_bits(kind: int, build: str) -> None:
    """Shared between threads (torch's thread count), every output is the same float32 bits as on one
    thread: a value's sums do not depend on which chunk of W's rows it fell in. Shapes big enough
    for the pool (its minimum is 65,536 multiply-adds), N not a multiple of 3, any row count."""
    for n, k in [(1000, 96), (97, 1152), (6, 12288), (4001, 32)]:
        raw, _ = _quantized(kind, n, k, seed=n)
        blocks = _blocks(raw, kind)
        for rows in [1, 2, 5, 12, 13, 16]:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            one = _with_threads(1, blocks, x)
            for threads in (2, 3, 8):
                assert torch.equal(_with_threads(threads, blocks, x), one), (n, k, rows, threads)


def test_the_pool_with_sleeping_helpers_and_concurrent_callers() -> None:
    """Helpers that sleep at once after each call (the futex path every call), and four Python
    threads calling at once (one holds the pool, the others compute alone): every result exact."""
    from concurrent.futures import ThreadPoolExecutor

    mats = [_blocks(_quantized(Q4_1, n, k, seed=n)[0], Q4_1) for n, k in [(300, 576), (577, 64), (96, 1536)]]
    xs = [torch.randn(r, m.shape[1], generator=torch.Generator().manual_seed(r)) for m in mats for r in (1, 4, 9)]
    pairs = [(m, x) for m in mats for x in xs if x.shape[1] == m.shape[1]]
    want = [_with_threads(1, m, x) for m, x in pairs]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for spin_ns in (0, 50_000):
            cpu_pool.set_spin(spin_ns)
            for _ in range(20):
                assert all(torch.equal(m.matmul(x), w) for (m, x), w in zip(pairs, want, strict=True))

        def many(seed: int) -> bool:
            order = np.random.default_rng(seed).permutation(len(pairs))
            return all(torch.equal(pairs[i][0].matmul(pairs[i][1]), want[i]) for _ in range(15) for i in order)

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(many, range(4)))
    finally:
        torch.set_num_threads(before)
        cpu_pool.set_spin(cpu_pool.SPIN_NS)


def test_the_pool_across_rapid_calls_of_different_shapes() -> None:
    """A stress of the hand-off between calls: thousands of back-to-back calls whose shapes (and so
    chunk counts and sizes) change every call, with a busy thread beside them so helpers are
    descheduled mid-call. Every result exact: no helper claims, writes or counts a chunk of a
    call from a counter value it read during the one before (each call closes its counter
    before returning; the window it closes is too narrow to hit on purpose)."""
    import threading

    mats = [_blocks(_quantized(Q8_0, n, k, seed=n)[0], Q8_0) for n, k in [(129, 576), (1501, 64), (300, 224)]]
    xs = [torch.randn(r, m.shape[1], generator=torch.Generator().manual_seed(r))
          for m, r in zip(mats, (3, 1, 7), strict=True)]
    want = [_with_threads(1, m, x) for m, x in zip(mats, xs, strict=True)]
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(2000))

    neighbour = threading.Thread(target=busy, daemon=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        neighbour.start()
        bad = sum(not torch.equal(mats[i % 3].matmul(xs[i % 3]), want[i % 3]) for i in range(3000))
    finally:
        stop.set()
        neighbour.join()
        torch.set_num_threads(before)
    assert bad == 0


def test_mismatch_names_the_first_row_that_differs() -> None:
    raw, w = _quantized(Q4_1, 12, 64, seed=3)
    blocks, weight = _blocks(raw, Q4_1), torch.from_numpy(w.copy())
    assert block_gemm._mismatch(blocks, weight) == -1
    weight[5, 17] = float(np.nextafter(weight[5, 17].item(), np.float32(1), dtype=np.float32))  # one ulp
    weight[9, 0] += 1.0
    assert block_gemm._mismatch(blocks, weight) == 5


def test_bad_inputs_are_refused() -> None:
    raw, _ = _quantized(Q8_0, 4, 64, seed=1)
    blocks = _blocks(raw, Q8_0)
    for x in (torch.randn(2, 32), torch.randn(2, 64, dtype=torch.float64), torch.randn(64)):
        with pytest.raises(ValueError, match="x must be float32 CPU"):
            blocks.matmul(x)
    x = torch.randn(6, 64)
    for view in (x[::2], torch.randn(64, 3).t()):  # strided views are copied, not misread
        assert torch.equal(blocks.matmul(view), blocks.matmul(view.contiguous()))


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, int | None]]) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "test")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    writer.add_uint32("llama.block_count", 2)
    for name, (data, kind) in tensors.items():
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reader_finds_what_gguf_py_finds(tmp_path: Path) -> None:
    files = {"a": (_quantized(Q4_1, 24, 96, 1)[0], Q4_1), "b": (_quantized(Q8_0, 5, 64, 2)[0], Q8_0),
             "c": (_quantized(Q4_0, 3, 32, 3)[0], Q4_0), "norm": (np.ones(64, np.float32), None),
             "dense": (np.ones((4, 64), np.float32), None)}
    path = tmp_path / "t.gguf"
    _write_gguf(path, files)
    ours = {name: (kind, parts) for name, kind, *parts in block_gemm.read_gguf(path)}
    assert sorted(ours) == ["a", "b", "c"]  # float tensors are not blocks
    for t in GGUFReader(str(path)).tensors:
        if t.name in ours:
            kind, parts = ours[t.name]
            assert kind == int(t.tensor_type)
            for mine, theirs in zip(parts, _split_rows(kind, np.asarray(t.data)), strict=True):
                assert np.array_equal(mine, theirs)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        block_gemm.read_gguf(tmp_path / "not.gguf")
    # A value type this reader does not know (a newer file) is refused, not misread.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 99)
    (tmp_path / "new.gguf").write_bytes(header + bytes(16))
    with pytest.raises(ValueError, match="unknown type 99"):
        block_gemm.read_gguf(tmp_path / "new.gguf")
    # A file cut short: its blocks are refused, the loader keeps float32 (attach_blocks catches these).
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1500])  # into the block tensors (the float ones come last)
    with pytest.raises((ValueError, struct.error)):
        block_gemm.read_gguf(cut)


def _tiny_with_gguf(tmp_path: Path, tamper: str | None = None) -> Path:
    """A tiny checkpoint whose linear weights are exact Q4_0 / Q4_1 / Q8_0 values (Q4_0's zeros -0
    where its scale is negative, as gguf-py and transformers give them), with a GGUF of their
    blocks beside it as `source.gguf`: rows of the attention projections permuted and stored
    under names the loader never sees, as a converter's GGUF would hold them."""
    path = save_tiny_checkpoint(tmp_path / "tiny", seed=4)
    state = load_file(str(path / "model.safetensors"))
    tensors: dict[str, tuple[np.ndarray, int | None]] = {}
    rng = np.random.default_rng(0)
    for i, (name, w) in enumerate(sorted(state.items())):
        if w.dim() != 2 or "embed" in name:
            continue
        kind = Q8_0 if "lm_head" in name else Q4_0 if "o_proj" in name else Q4_1
        raw = quants.quantize(w.numpy(), GGMLQuantizationType(kind))
        state[name] = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(kind)).copy())
        order = rng.permutation(raw.shape[0]) if "proj" in name and "attn" in name else np.arange(raw.shape[0])
        tensors[f"t{i}"] = (np.ascontiguousarray(raw[order]), kind)
    if tamper is not None:
        state[tamper][0, 0] += 1e-3  # no longer what the file holds
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_gguf(path / model_loader.SOURCE_GGUF, tensors)
    return path


def _linears(ex: object) -> list[object]:
    return [m.cpu_layouts for m in ex.runner.model.modules()  # type: ignore[attr-defined]
            if getattr(m, "cpu_layouts", None) is not None]


def test_tiny_engine_on_blocks_generates_the_same_tokens(tmp_path: Path) -> None:
    path = _tiny_with_gguf(tmp_path)
    on, off = local_executor(path, block_size=4), local_executor(path, block_size=4, cpu_block_gemm=False)
    layouts = _linears(on)
    assert len(layouts) == 2 * 4 + 1 and all(x.blocks is not None for x in layouts)  # type: ignore[attr-defined]
    assert all(x.blocks is None for x in _linears(off))  # type: ignore[attr-defined]
    prompts = [[1, 17, 33, 5, 9], list(range(3, 80)), [1, 200, 7], list(range(20, 37))]
    assert generate_ids(on, prompts) == generate_ids(off, prompts)


def test_a_weight_the_file_does_not_hold_keeps_float32(tmp_path: Path) -> None:
    path = _tiny_with_gguf(tmp_path, tamper="model.layers.1.mlp.down_proj.weight")
    ex = local_executor(path, block_size=4)
    model = ex.runner.model
    left = model.layers[1].mlp.down_proj.cpu_layouts
    assert left.blocks is None and left.transposed is None  # no one-row copy made up front
    assert model.layers[0].mlp.down_proj.cpu_layouts.blocks is not None
    assert sum(x.blocks is not None for x in _linears(ex)) == 2 * 4  # type: ignore[attr-defined]
    off = local_executor(path, block_size=4, cpu_block_gemm=False)
    assert generate_ids(ex, [[1, 17, 33, 5, 9]]) == generate_ids(off, [[1, 17, 33, 5, 9]])  # one-row decodes
    assert left.transposed is not None  # made on its first one-row call


def test_keep_source_links_or_copies_once(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    dest = tmp_path / "cache"
    dest.mkdir()
    assert model_loader.gguf_source(dest) is None
    model_loader.keep_source(src, dest)
    kept = model_loader.gguf_source(dest)
    assert kept is not None and kept.read_bytes() == src.read_bytes()
    model_loader.keep_source(src, dest)  # already there: untouched
    assert [p.name for p in dest.iterdir()] == [model_loader.SOURCE_GGUF]


def test_prepare_adds_the_source_to_an_older_conversion_and_serves_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    dest = model_loader.cache_root() / model_loader.DEFAULT_MODEL
    dest.mkdir(parents=True)
    (dest / model_loader._MARKER).write_text("{}")  # converted before sources were kept
    package = tmp_path / "pkg"
    package.mkdir()
    alias = model_loader.ALIASES[model_loader.DEFAULT_MODEL]
    (package / alias.filename).write_bytes(b"GGUF" + bytes(16))
    monkeypatch.setattr(model_loader, "_package_dir", lambda name: package)
    assert model_loader.prepare(model_loader.DEFAULT_MODEL) == dest
    assert model_loader.gguf_source(dest) is not None
    (dest / model_loader.SOURCE_GGUF).unlink()

    def gone(name: str) -> Path:
        raise FileNotFoundError(name)

    monkeypatch.setattr(model_loader, "_package_dir", gone)  # the package uninstalled since
    assert model_loader.prepare(model_loader.DEFAULT_MODEL) == dest
    assert model_loader.gguf_source(dest) is None


def test_smollm2_greedy_tokens_identical_with_and_without_blocks() -> None:
    path = smollm2_path()
    assert model_loader.gguf_source(path) is not None  # prepare() keeps the GGUF beside the conversion
    on = local_executor(path)
    assert all(x.blocks is not None for x in _linears(on))  # type: ignore[attr-defined]
    with_blocks, without = smollm2_greedy_with_and_without("cpu_block_gemm", on)
    assert with_blocks == without
