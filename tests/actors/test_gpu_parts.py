"""The parts of the GPU engine a CPU can check: block tables gathered from one tensor (equal to
the padded lists they replace), the context buckets of the CUDA graphs and the padding of a
step into one, step timing that ends on a device synchronize, and the KV-budget arithmetic
with the worst step it is profiled on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from actors.block_tables import BlockTableStore
from actors.cuda_graphs import CudaGraphRunner, DecodeGraphBuffers, context_widths, pick_width
from actors.input_batch import _decode_tables, build_inputs
from actors.kv_budget import GIB, MemoryProfile, WorstStep, _worst_step_inputs, kv_budget_bytes
from actors.kv_cache import allocate_kv_cache
from actors.step_timing import StepClock
from tests.model_helpers import GREEDY, generate_ids, local_executor, save_tiny_checkpoint
from tidal_core.plan import NewRequestData, StepPlan

PROMPTS = [list(range(5, 10)), list(range(40, 70)), [3, 4, 5], list(range(100, 120))]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpu-parts"), seed=2)


def _plan(step: int, sched: dict[str, int], ctx: dict[str, int], new: list[NewRequestData] | None = None,
          finished: list[str] | None = None, blocks: dict[str, list[int]] | None = None) -> StepPlan:
    n_dec = sum(1 for r in sched if r not in ctx)
    return StepPlan(step, sched, ctx, new or [], blocks or {}, finished or [], n_dec, sum(ctx.values()), 0, None)


# ---- block tables ------------------------------------------------------------------------
def test_table_store_gathers_what_padded_lists_give() -> None:
    rng = random.Random(7)
    store = BlockTableStore(pad=999, device=torch.device("cpu"), rows=2, width=2)  # forces both to grow
    lists: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.3 or not lists:
            rid, blocks = f"r{step}", [rng.randrange(500) for _ in range(rng.randrange(0, 6))]
            store.add(rid, blocks)
            lists[rid] = list(blocks)
        elif op < 0.7:
            rid = rng.choice(sorted(lists))
            more = [rng.randrange(500) for _ in range(rng.randrange(1, 9))]
            store.extend(rid, more)
            lists[rid].extend(more)
        else:
            rid = rng.choice(sorted(lists))
            store.drop(rid)
            del lists[rid]
        if lists:
            rids = rng.sample(sorted(lists), k=min(len(lists), 5))
            width = max(len(lists[r]) for r in rids) + rng.randrange(3)
            want = _decode_tables([lists[r] for r in rids], 999, max(width, 1))
            assert torch.equal(store.gather(rids, max(width, 1)), want)
    store.add("twice", [1])
    with pytest.raises(AssertionError, match="added twice"):
        store.add("twice", [])


def test_runner_with_gathered_tables_generates_the_same_tokens(tiny_path: Path) -> None:
    sched = dict(max_num_batched_tokens=24, max_batch_size=8)
    want = generate_ids(local_executor(tiny_path, block_size=4, device="cpu"), PROMPTS, GREEDY, **sched)
    ex = local_executor(tiny_path, block_size=4, device="cpu")
    assert ex.runner.tables is None  # CPU default: the per-request lists
    ex.runner.tables = BlockTableStore(ex.runner.scratch_block, torch.device("cpu"))
    assert generate_ids(ex, PROMPTS, GREEDY, **sched) == want
    # The store mirrors the runner's state (finished requests leave with the next plan's diffs).
    assert set(ex.runner.tables.rows) == set(ex.runner.states)
    for rid, st in ex.runner.states.items():
        assert ex.runner.tables.gather([rid], len(st.block_table)).tolist() == [st.block_table]


# ---- CUDA-graph context buckets ----------------------------------------------------------
def test_context_widths_and_choice() -> None:
    assert context_widths(8192, 16) == (32, 128, 512)  # 512, 2048, 8192 tokens
    assert context_widths(4096, 16) == (32, 128, 256)
    assert context_widths(100, 16) == (7,)
    assert context_widths(4096, 16, (1000, 100)) == (7, 63, 256)  # the full context is always covered
    assert pick_width((32, 128, 512), 1) == 32
    assert pick_width((32, 128, 512), 33) == 128
    assert pick_width((32, 128, 512), 512) == 512
    assert pick_width((32, 128, 512), 513) is None
    with pytest.raises(ValueError, match="positive"):
        context_widths(4096, 16, (0,))


def test_decode_step_padded_into_a_context_bucket_matches_eager(tiny_path: Path) -> None:
    """The graph input path at a (batch 4, width 8) bucket, run eagerly on CPU."""
    ex = local_executor(tiny_path, block_size=4, max_model_len=64, device="cpu")
    runner = ex.runner
    new = [NewRequestData(r, p, len(p), GREEDY, list(range(i * 10, i * 10 + 8)))
           for i, (r, p) in enumerate([("a", PROMPTS[0]), ("b", PROMPTS[3]), ("c", PROMPTS[2])])]
    ex.execute(_plan(1, {n.request_id: n.num_tokens for n in new}, {n.request_id: 0 for n in new}, new))
    plan = _plan(2, {"a": 1, "b": 1, "c": 1}, {})
    inputs = build_inputs(plan, runner.states, 4, runner.scratch_block, torch.device("cpu"))
    assert inputs.meta.decode_block_tables is not None and inputs.meta.decode_block_tables.shape[1] == 6
    buffers = DecodeGraphBuffers(8, 16, 4, runner.scratch_block, "cpu")
    buffers.block_tables.fill_(3)  # stale entries from an earlier, longer step must be reset
    buffers.load(inputs, 4, width=8)
    assert (buffers.block_tables[:3, 6:8] == runner.scratch_block).all()
    assert (buffers.block_tables[3, :8] == runner.scratch_block).all()
    with torch.inference_mode():
        eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches)
        ids, pos, meta = buffers.view(4, 8)
        padded = runner.model(ids, pos, meta, runner.kv_caches)
    assert meta.decode_block_tables is not None and meta.decode_block_tables.shape == (4, 8)
    assert torch.allclose(padded[:3], eager, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds"):
        buffers.load(inputs, 4, width=4)


def test_graph_runner_chooses_a_bucket_and_counts_padding(tiny_path: Path) -> None:
    """Bucket choice and padding accounting, with recorded stand-ins for captured graphs."""
    ex = local_executor(tiny_path, block_size=4, max_model_len=64, device="cpu")
    runner = ex.runner
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, [2, 4], 64, 4, runner.scratch_block,
                             contexts=(16, 32))
    assert graphs.widths == (4, 8, 16)
    replayed: list[tuple[int, int]] = []

    class Recorded:
        def __init__(self, key: tuple[int, int]) -> None:
            self.key = key

        def replay(self) -> None:
            replayed.append(self.key)

    for key in [(b, w) for b in (2, 4) for w in graphs.widths]:
        graphs.graphs[key] = Recorded(key)
        graphs.outputs[key] = torch.zeros(key[0], 1)
    new = [NewRequestData(r, p, len(p), GREEDY, list(range(i * 10, i * 10 + 8)))
           for i, (r, p) in enumerate([("a", PROMPTS[0]), ("b", PROMPTS[3]), ("c", PROMPTS[2])])]
    ex.execute(_plan(1, {n.request_id: n.num_tokens for n in new}, {n.request_id: 0 for n in new}, new))
    inputs = build_inputs(_plan(2, {"a": 1, "b": 1, "c": 1}, {}), runner.states, 4, runner.scratch_block,
                          torch.device("cpu"))
    kv_tokens = 6 + 21 + 4  # each decode's KV length with this step's token
    assert graphs.run(inputs, 4, kv_tokens) is not None
    assert replayed == [(4, 8)]  # 3 decodes -> batch 4; widest table 6 blocks -> width 8
    pad = graphs.padding()
    assert pad["batch_padding_waste"] == pytest.approx(1 / 4)
    assert pad["context_padding_waste"] == pytest.approx(1 - kv_tokens / (3 * 8 * 4))
    assert graphs.captured_batches == (2, 4)
    assert graphs.run(inputs, 8) is None  # no such batch bucket: eager


# ---- step timing -------------------------------------------------------------------------
class FakeDevice:
    """A timer that a synchronize advances: a step's time includes the queued device work only
    if it was read after the synchronize."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1
        self.now += 1.0  # the device work the host was waiting for

    def timer(self) -> float:
        return self.now


def test_step_clock_reads_the_timer_after_the_sync() -> None:
    dev = FakeDevice()
    clock = StepClock(dev.sync, dev.timer)
    t0 = clock.start()
    assert clock.elapsed(t0) == 1.0 and dev.syncs == 1


def test_every_step_ends_on_a_sync_including_steps_that_sample_nothing(tiny_path: Path) -> None:
    ex = local_executor(tiny_path, device="cpu")
    dev = FakeDevice()
    ex.runner.clock = StepClock(dev.sync, dev.timer)
    new = NewRequestData("a", PROMPTS[1], len(PROMPTS[1]), GREEDY, [0, 1])
    partial = ex.execute(_plan(1, {"a": 20}, {"a": 0}, [new]))  # a partial chunk: samples nothing
    assert partial.sampled_token_ids == {} and partial.device_time_s == 1.0 and dev.syncs == 1
    empty = ex.execute(_plan(2, {}, {}, finished=["a"]))  # nothing scheduled
    assert empty.device_time_s == 1.0 and dev.syncs == 2
    new_b = NewRequestData("b", PROMPTS[2], len(PROMPTS[2]), GREEDY, [2])
    sampled = ex.execute(_plan(3, {"b": 3}, {"b": 0}, [new_b]))
    assert set(sampled.sampled_token_ids) == {"b"} and sampled.device_time_s == 1.0 and dev.syncs == 3


# ---- KV budget ---------------------------------------------------------------------------
def test_worst_step_is_the_largest_decode_batch_at_full_context_plus_the_largest_chunk() -> None:
    step = WorstStep.for_limits(max_batch_size=64, max_model_len=8192, max_num_batched_tokens=2048)
    assert (step.decodes, step.decode_context, step.prefill_chunk, step.prefill_context) == (64, 8192, 1984, 6208)
    assert step.tokens == 2048
    only_decodes = WorstStep.for_limits(256, 4096, 256)
    assert (only_decodes.decodes, only_decodes.prefill_chunk, only_decodes.prefill_context) == (256, 0, 0)
    short = WorstStep.for_limits(4, 512, 8192)  # the chunk cannot exceed the model length
    assert (short.prefill_chunk, short.prefill_context) == (512, 0)
    with pytest.raises(ValueError, match="max_batch_size=0"):
        WorstStep.for_limits(0, 512, 512)


def test_kv_budget_subtracts_every_reserve() -> None:
    prof = MemoryProfile(total_bytes=140 * GIB, weights_bytes=16 * GIB, worst_step_bytes=3 * GIB,
                         graph_pool_bytes=1 * GIB, runtime_bytes=GIB // 2)
    assert kv_budget_bytes(prof, 0.9) == int(140 * GIB * 0.9) - (16 + 3 + 1 + 0.5) * GIB
    assert kv_budget_bytes(prof, 1.0) - kv_budget_bytes(prof, 0.5) == 70 * GIB
    no_graphs = MemoryProfile(140 * GIB, 16 * GIB, 3 * GIB, 0, GIB // 2)
    assert kv_budget_bytes(no_graphs, 0.9) - kv_budget_bytes(prof, 0.9) == GIB
    with pytest.raises(ValueError, match=r"no memory left for the KV cache.*weights 120\.00 GiB"):
        kv_budget_bytes(MemoryProfile(140 * GIB, 120 * GIB, 10 * GIB, 0, 0), 0.9)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1\.5"):
        kv_budget_bytes(prof, 1.5)
    with pytest.raises(ValueError, match="cannot be negative"):
        kv_budget_bytes(MemoryProfile(140 * GIB, -1, 0, 0, 0), 0.9)


def test_worst_step_inputs_run_through_the_model(tiny_path: Path) -> None:
    """The profiled step is a real step: every table points into a few throwaway blocks."""
    ex = local_executor(tiny_path, block_size=4, max_model_len=256, device="cpu")
    runner = ex.runner
    step = WorstStep.for_limits(max_batch_size=6, max_model_len=256, max_num_batched_tokens=40)
    pool = 3
    ids, pos, meta = _worst_step_inputs(step, 4, pool, torch.device("cpu"), "portable", 4)
    assert ids.shape == (40,) and meta.num_decodes == 6 and meta.prefills[0].length == 34
    assert meta.decode_block_tables is not None and meta.decode_block_tables.shape == (6, 64)
    assert int(meta.decode_block_tables.max()) < pool and int(meta.slot_mapping.max()) < pool * 4
    assert int(pos[0]) == 255 and int(pos[6]) == 256 - 34
    k_cache = runner.kv_caches[0][0]
    caches = allocate_kv_cache(_spec(runner, k_cache), pool)
    with torch.inference_mode():
        hidden = runner.model(ids, pos, meta, caches)
    assert hidden.shape[0] == 40 and torch.isfinite(hidden).all()


def _spec(runner: object, k_cache: torch.Tensor) -> object:
    from actors.kv_cache import KVCacheSpec

    return KVCacheSpec(len(runner.kv_caches), k_cache.shape[2], k_cache.shape[3], k_cache.shape[1],  # type: ignore[attr-defined]
                       k_cache.dtype)


class EagerReplay:
    """Stands in for a captured graph on CPU: replay runs the model on the static buffers' view
    and writes the graph's output tensor in place, as a replay would."""

    def __init__(self, graphs: CudaGraphRunner, key: tuple[int, int]) -> None:
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        g = self.graphs
        ids, pos, meta = g.buffers.view(*self.key)
        g.outputs[self.key].copy_(g.model(ids, pos, meta, g.kv_caches))


def test_runner_through_padded_graph_buffers_generates_the_eager_tokens(tiny_path: Path) -> None:
    """The runner's whole graph path (bucket and width choice, gathered tables, padding, output
    slicing) on CPU, with eager stand-ins for the captured graphs."""
    sched = dict(max_num_batched_tokens=24, max_batch_size=8, cuda_graph_buckets=(1, 2, 4, 8))
    want = generate_ids(local_executor(tiny_path, block_size=4, device="cpu"), PROMPTS, GREEDY, **sched)
    ex = local_executor(tiny_path, block_size=4, device="cpu")
    runner = ex.runner
    runner.tables = BlockTableStore(runner.scratch_block, torch.device("cpu"))
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, [1, 2, 4, 8], 512, 4, runner.scratch_block,
                             contexts=(16, 64))
    hidden = runner.model.cfg.hidden_size
    for key in [(b, w) for b in graphs.buckets for w in graphs.widths]:
        graphs.graphs[key] = EagerReplay(graphs, key)
        graphs.outputs[key] = torch.empty(key[0], hidden)
    runner.graphs = graphs
    assert generate_ids(ex, PROMPTS, GREEDY, **sched) == want
    assert graphs.batch_slots[0] > 0 and graphs.padding()["context_padding_waste"] > 0


def test_memory_profile_runs_the_worst_step_and_the_graph_batch(tiny_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile_memory`'s control flow on CPU: torch.cuda's memory counters replaced by a fake
    allocator whose peak grows with the tokens of the step that ran (the real one is tests/gpu's)."""
    import actors.kv_budget as kb
    from actors.models import LlamaForCausalLM

    ex = local_executor(tiny_path, block_size=4, max_model_len=256, device="cpu")
    runner = ex.runner
    seen: list[int] = []
    real_forward = LlamaForCausalLM.forward

    def forward(self: LlamaForCausalLM, ids: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(int(ids.shape[0]))
        return real_forward(self, ids, *args)  # type: ignore[arg-type]

    class FakeCuda:
        reserved = 1000

        def max_memory_reserved(self, device: object = None) -> int:
            return self.reserved + 10 * seen[-1]  # the step's peak: 10 bytes a token

    fake = FakeCuda()
    fakes = dict(synchronize=lambda *a: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda *a: None,
                 memory_allocated=lambda *a: 700, memory_reserved=lambda *a: fake.reserved,
                 max_memory_reserved=fake.max_memory_reserved, mem_get_info=lambda *a: (5000, 10_000))
    for name, value in fakes.items():
        monkeypatch.setattr(kb.torch.cuda, name, value)
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    k_cache = runner.kv_caches[0][0]
    step = WorstStep.for_limits(max_batch_size=6, max_model_len=256, max_num_batched_tokens=40)
    prof = kb.profile_memory(runner.model, _spec(runner, k_cache), step, 4, torch.device("cpu"), "portable")
    assert seen == [40, 4]  # the worst step, then the largest graph batch's decodes alone
    assert prof == MemoryProfile(10_000, 700, 400, 40, 10_000 - 5000 - 1000)


def test_attention_backend_choice() -> None:
    from actors.paged_attention import HAVE_TRITON
    from actors.worker_setup import EngineSpec

    assert EngineSpec(device="cpu").resolved_attention() == "portable"  # auto: Triton only on CUDA
    with pytest.raises(ValueError, match="use 'auto' or one of"):
        EngineSpec(device="cpu", attention="flash").resolved_attention()
    if not HAVE_TRITON:
        with pytest.raises(ValueError, match="needs Triton"):
            EngineSpec(device="cpu", attention="triton").resolved_attention()


def test_default_torch_threads_give_a_two_core_box_both_cores_and_leave_one_on_bigger_boxes() -> None:
    from actors.worker_setup import default_torch_threads

    assert [default_torch_threads(cores, 1) for cores in (1, 2, 3, 4, 8)] == [1, 2, 2, 3, 7]
    assert [default_torch_threads(cores, 2) for cores in (1, 2, 4, 8)] == [1, 1, 1, 3]
    assert default_torch_threads(16, 8) == 1


def test_worker_builder_sets_the_configured_torch_threads() -> None:
    from actors.worker_setup import EngineSpec, WorkerBuilder

    before = torch.get_num_threads()
    try:
        WorkerBuilder(EngineSpec(device="cpu", torch_threads=3))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
