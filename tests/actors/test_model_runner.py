"""The runner's side of the StepPlan contract, driven by the real core Scheduler where it matters:
preemption with recompute, aborts, seeded sampling, logprobs, contract violations, and the
CPU-testable half of CUDA graphs (padding a decode batch into static buffers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.cuda_graphs import DecodeGraphBuffers
from actors.input_batch import build_inputs
from tests.model_helpers import GREEDY, generate_ids, local_executor, make_engine, save_tiny_checkpoint
from tidal_core import SamplingParams
from tidal_core.plan import NewRequestData, StepPlan

PROMPTS = [list(range(5, 10)), list(range(40, 70)), [3, 4, 5], list(range(100, 120))]
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-runner"), seed=1)


def _plan(step: int, sched: dict[str, int], ctx: dict[str, int], new: list[NewRequestData] | None = None,
          finished: list[str] | None = None) -> StepPlan:
    n_dec = sum(1 for r in sched if r not in ctx)
    return StepPlan(step, sched, ctx, new or [], {}, finished or [], n_dec, sum(ctx and [sched[r] for r in ctx]), 0,
                    None)


def test_preemption_recompute_continues_identically(tiny_path: Path) -> None:
    roomy = generate_ids(local_executor(tiny_path, block_size=4, max_model_len=80), PROMPTS, LONG)
    ex = local_executor(tiny_path, block_size=4, max_model_len=80, max_num_blocks=20)
    engine = make_engine(ex)
    got = [c.token_ids for c in engine.generate(PROMPTS, LONG)]
    assert sum(engine.scheduler.stats.preempted.values()) > 0, "the tiny pool must force a preemption"
    assert got == roomy


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(tiny_path: Path) -> None:
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=s, ignore_eos=True)
              for s in (11, 12, 13, 14)]
    ex = local_executor(tiny_path, block_size=4, max_model_len=80)
    batched = [c.token_ids for c in make_engine(ex).generate(PROMPTS, params)]
    alone = [c.token_ids for c in make_engine(ex).generate(PROMPTS[1:2], params[1])]
    assert alone[0] == batched[1]
    tight = local_executor(tiny_path, block_size=4, max_model_len=72, max_num_blocks=18)
    engine = make_engine(tight)
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == batched
    assert sum(engine.scheduler.stats.preempted.values()) > 0
    other_seeds = [SamplingParams(max_tokens=20, temperature=0.9, seed=s + 100, ignore_eos=True) for s in range(4)]
    assert [c.token_ids for c in make_engine(ex).generate(PROMPTS, other_seeds)] != batched


def test_penalties_count_the_tokens_generated_before_a_preemption(tiny_path: Path) -> None:
    # A resumed request's token ids come back as prompt + generated; the penalties must still tell them apart.
    penalized = SamplingParams(max_tokens=LONG.max_tokens, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                               presence_penalty=0.5)
    roomy = generate_ids(local_executor(tiny_path, block_size=4, max_model_len=80), PROMPTS, penalized)
    engine = make_engine(local_executor(tiny_path, block_size=4, max_model_len=80, max_num_blocks=20))
    got = [c.token_ids for c in engine.generate(PROMPTS, penalized)]
    assert sum(engine.scheduler.stats.preempted.values()) > 0, "the tiny pool must force a preemption"
    assert got == roomy
    assert roomy != generate_ids(local_executor(tiny_path, block_size=4, max_model_len=80), PROMPTS, LONG)


def test_abort_frees_runner_state(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    engine = make_engine(ex)
    rids = [engine.add_request(p, LONG) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert set(ex.runner.states) == set(rids)
    engine.abort(rids[0])
    engine.abort(rids[2])
    engine.step()  # the next plan carries the aborted ids in finished_ids
    assert set(ex.runner.states) == {rids[1], rids[3]}
    for rid in rids[1:2] + rids[3:]:
        engine.abort(rid)
    last = engine.add_request(PROMPTS[0], GREEDY)
    engine.run_until_done()
    assert set(ex.runner.states) <= {last}
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_logprobs_sampled_first_then_top_n(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    ex.runner.keep_logits = True
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    new = NewRequestData("a", PROMPTS[0], len(PROMPTS[0]), sp, [0])
    result = ex.execute(_plan(1, {"a": 5}, {"a": 0}, [new]))
    assert result.logprobs is not None
    entries = result.logprobs["a"]
    assert entries[0][0] == result.sampled_token_ids["a"] and len(entries) == 4
    ref = ex.runner.last_logits["a"].log_softmax(-1)
    top = ref.topk(4).indices.tolist()
    assert [t for t, _ in entries] == [top[0], *[t for t in top if t != top[0]][:3]]
    for tok, lp in entries:
        assert lp == pytest.approx(float(ref[tok]), abs=1e-5)


def test_contract_violations_raise(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    new = NewRequestData("a", PROMPTS[1], len(PROMPTS[1]), GREEDY, [0, 1])
    with pytest.raises(AssertionError, match="prefill context"):
        ex.execute(_plan(1, {"a": 8}, {"a": 3}, [new]))
    ex = local_executor(tiny_path)
    ex.execute(_plan(1, {"a": 8}, {"a": 0}, [new]))  # partial chunk: samples nothing
    assert ex.runner.context_len("a") == 8
    with pytest.raises(AssertionError, match="never introduced"):
        ex.execute(_plan(2, {"b": 1}, {}))
    short = NewRequestData("c", PROMPTS[1], len(PROMPTS[1]), GREEDY, [5])  # 30 tokens, one 16-token block
    with pytest.raises(AssertionError, match="needs 2 blocks"):
        ex.execute(_plan(3, {"c": 30}, {"c": 0}, [short]))


def test_partial_chunk_samples_nothing_and_final_chunk_samples(tiny_path: Path) -> None:
    ex = local_executor(tiny_path)
    new = NewRequestData("a", PROMPTS[1], len(PROMPTS[1]), GREEDY, [0, 1])
    assert ex.execute(_plan(1, {"a": 20}, {"a": 0}, [new])).sampled_token_ids == {}
    assert set(ex.execute(_plan(2, {"a": 10}, {"a": 20})).sampled_token_ids) == {"a"}
    assert len(ex.runner.states["a"].token_ids) == 31


def test_padded_decode_buffers_match_unpadded(tiny_path: Path) -> None:
    """The CUDA-graph input path, run eagerly on CPU: padding rows change nothing real."""
    ex = local_executor(tiny_path, block_size=4, max_model_len=64)
    runner = ex.runner
    new = [NewRequestData(r, p, len(p), GREEDY, list(range(i * 10, i * 10 + 8)))
           for i, (r, p) in enumerate([("a", PROMPTS[0]), ("b", PROMPTS[3]), ("c", PROMPTS[2])])]
    ex.execute(_plan(1, {n.request_id: n.num_tokens for n in new}, {n.request_id: 0 for n in new}, new))
    plan = _plan(2, {"a": 1, "b": 1, "c": 1}, {})
    width = 16
    inputs = build_inputs(plan, runner.states, 4, runner.scratch_block, torch.device("cpu"), decode_width=width)
    buffers = DecodeGraphBuffers(8, width, 4, runner.scratch_block, "cpu")
    buffers.load(inputs, 4)
    with torch.inference_mode():
        eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches)
        ids, pos, meta = buffers.view(4)
        padded = runner.model(ids, pos, meta, runner.kv_caches)
    assert torch.allclose(padded[:3], eager, atol=1e-5)
    assert buffers.slot_mapping[3].item() == runner.scratch_block * 4
    assert buffers.context_lens[3].item() == 1
    with pytest.raises(ValueError, match="cannot pad"):
        buffers.load(inputs, 2)
