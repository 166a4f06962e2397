"""GPU-only checks of the engine: eager GPU vs CPU, CUDA-graph replay vs eager (per batch x
context bucket, both attention backends), the Triton kernel compiled vs a dense reference, and
the KV budget: it scales with the utilisation and a max-size step never runs out of memory.
Skipped without CUDA; `make test` runs them where `torch.cuda.is_available()`."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from actors.kv_budget import WorstStep, _worst_step_inputs
from actors.paged_attention import HAVE_TRITON
from actors.worker_setup import EngineSpec, WorkerBuilder
from tests.model_helpers import GREEDY, generate_ids, local_executor, make_engine, save_tiny_checkpoint
from tests.paged_reference import make_case, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
PROMPTS = [[1, 17, 33, 5, 9], list(range(3, 60)), [1, 200, 7], list(range(100, 131)), [5] * 20]
BACKENDS = ["portable", pytest.param("triton", marks=needs_triton)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpu"), seed=3)


def _gpu(path: Path, **kw: object) -> object:
    kw.setdefault("device", "cuda")
    kw.setdefault("dtype", "float32")
    kw.setdefault("gpu_memory_utilization", 0.9)
    kw.setdefault("max_num_blocks", 4096)  # the tiny model would otherwise get millions of blocks
    return local_executor(path, **kw)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("attention", BACKENDS)
def test_gpu_eager_matches_cpu(tiny_path: Path, attention: str) -> None:
    cpu = generate_ids(local_executor(tiny_path, device="cpu"), PROMPTS, GREEDY)
    gpu = _gpu(tiny_path, enforce_eager=True, attention=attention)
    assert gpu.runner.attention_backend == attention and gpu.runner.tables is not None
    assert generate_ids(gpu, PROMPTS, GREEDY, max_num_batched_tokens=64, max_batch_size=8) == cpu


@pytest.mark.parametrize("attention", BACKENDS)
def test_cuda_graph_replay_matches_eager(tiny_path: Path, attention: str) -> None:
    # block 4 and context buckets of 16 and 64 tokens: widths 4, 16, and 128 (max_model_len 512)
    kw = dict(attention=attention, block_size=4)
    eager = _gpu(tiny_path, enforce_eager=True, **kw)
    graphed = _gpu(tiny_path, cuda_graph_buckets=(1, 2, 4, 8), cuda_graph_contexts=(16, 64), **kw)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captured_batches == (1, 2, 4, 8) and graphs.widths == (4, 16, 128)
    assert len(graphs.graphs) == 12
    assert generate_ids(graphed, PROMPTS, GREEDY) == generate_ids(eager, PROMPTS, GREEDY)
    assert graphs.batch_slots[0] > 0  # steps were replayed
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


@needs_triton
# bf16: probabilities are rounded to bf16 before P.V and both outputs to bf16 (1 ulp is 1.6e-2 at 2-4)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_triton_kernel_compiled_matches_dense_reference(dtype: torch.dtype, atol: float) -> None:
    from tests.actors.test_paged_attention import CHUNKS, DECODES, _attend

    for i, (lens, q_lens, h, kvh, hd, bs) in enumerate(DECODES + CHUNKS):
        case = make_case(lens, q_lens, h, kvh, hd, bs, seed=i, dtype=dtype, device="cuda")
        decodes = len(q_lens) if i < len(DECODES) else 0
        got = _attend(case, decodes, "triton")
        want = reference(case)
        assert torch.allclose(got.float(), want.float(), atol=atol), (dtype, lens, q_lens)
    # Llama-3-8B's heads (32 over 8 KV heads, dim 128): 8 decodes at 4k and a 512-token chunk at 2488
    big = make_case([4096] * 8 + [3000], [1] * 8 + [512], 32, 8, 128, 16, seed=99, dtype=dtype, device="cuda")
    assert torch.allclose(_attend(big, 8, "triton").float(), reference(big).float(), atol=atol)


def test_gpu_kv_budget_from_memory_utilization(tiny_path: Path) -> None:
    _free()
    # Shares that leave 1 and 2 GiB above what the process already holds on this device (its
    # CUDA context and libraries, measured at 4.8 GiB of an H200 after the tests before this one):
    # a fixed share such as 2% is below that on one GPU and gigabytes above it on another.
    free, total = torch.cuda.mem_get_info()
    used = total - free
    small = _gpu(tiny_path, enforce_eager=True, gpu_memory_utilization=(used + 2**30) / total, max_num_blocks=None)
    blocks_small = small.info.num_kv_blocks
    del small
    _free()
    large = _gpu(tiny_path, enforce_eager=True, gpu_memory_utilization=(used + 2**31) / total, max_num_blocks=None)
    assert 0 < blocks_small < large.info.num_kv_blocks


MID = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, max_position_embeddings=4096)


@pytest.mark.parametrize("attention", BACKENDS)
def test_kv_budget_survives_a_max_size_step(attention: str) -> None:
    """Utilisation 0.95, the KV cache allocated, graphs captured: the worst step over the real
    cache runs, and the process never holds more than the budgeted share of the device."""
    _free()
    spec = EngineSpec(random_config=MID, device="cuda", dtype="bfloat16", max_model_len=2048,
                      max_num_batched_tokens=4096, max_batch_size=64, gpu_memory_utilization=0.95,
                      cuda_graph_buckets=(1, 8, 64), attention=attention)
    builder = WorkerBuilder(spec)
    blocks, _ = builder.load()
    runner = builder.finish(blocks)
    assert builder.memory is not None and builder.memory.graph_pool_bytes > 0
    step = WorstStep.for_limits(64, 2048, 4096)
    attn = runner.model.layers[0].self_attn
    ids, pos, meta = _worst_step_inputs(step, spec.block_size, blocks, runner.device, attention,
                                        attn.shard.q_count // attn.shard.kv_count)
    with torch.inference_mode():
        hidden = runner.model(ids, pos, meta, runner.kv_caches)
        logits = runner.model.compute_logits(hidden[: step.decodes + 1])
    torch.cuda.synchronize()
    assert logits is not None and torch.isfinite(logits).all()
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.95 * total + 256 * 2**20, (total - free) / total
    del runner, builder, hidden, logits
    _free()
