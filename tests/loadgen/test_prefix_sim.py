"""Prefix caching in the simulator: trace prefix ids, their block hashes, hits, cost and routing."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from calibration.cost_model import CostModel
from loadgen.records import PREFIX_SALT, Trace
from loadgen.report import Slo
from loadgen.sim.cluster import Fleet
from loadgen.sim.config import SimConfig
from loadgen.sim.prefix_blocks import PrefixBlocks, ideal_hit_rate
from loadgen.sim.runner import RunSpec, executor_factory, run_policy, sim_config, unit_config
from loadgen.sim.simulation import simulate
from loadgen.trace_readers import read_jsonl, write_jsonl
from loadgen.traces import load_trace
from tidal_core import Scheduler, preset


def _toy(n: int = 4) -> Trace:
    # Three turns of one conversation (growing prefix) and an unrelated request.
    ids = [(1, 2), (1, 2, 3), (1, 2, 3, 4), (9,)][:n]
    inputs = [1000, 1536, 2100, 600][:n]
    return Trace("toy", [0.0, 10.0, 20.0, 30.0][:n], inputs, [5] * n, prefix_ids=ids, prefix_block_size=512)


def test_mooncake_reader_carries_hash_ids_and_transforms_keep_them() -> None:
    t = load_trace("mooncake-conv", hours=0.02)
    assert t.prefix_ids is not None and t.prefix_block_size == 512
    assert all(len(ids) == -(-n // 512) for ids, n in zip(t.prefix_ids, t.input_tokens.tolist(), strict=True))
    assert t.window(10.0, 40.0).prefix_ids == tuple(
        t.prefix_ids[i] for i in np.flatnonzero((t.arrival_s >= 10.0) & (t.arrival_s < 40.0)))
    assert t.clipped(4096, 512).prefix_ids == t.prefix_ids  # the simulator cuts them to the clipped prompt
    doubled = _toy().scaled(rate_scale=2.0)
    assert doubled.prefix_ids is not None
    originals = [p for p in doubled.prefix_ids if max(p) < PREFIX_SALT]
    copies = [p for p in doubled.prefix_ids if min(p) > PREFIX_SALT]
    assert sorted(originals) == sorted(_toy().prefix_ids or ()) and len(copies) == 4  # a copy is its own user


def test_jsonl_round_trip_keeps_prefix_ids(tmp_path: Path) -> None:
    write_jsonl(_toy(), tmp_path / "t.jsonl")
    assert read_jsonl(tmp_path / "t.jsonl") == _toy()


def test_trace_blocks_map_onto_unit_blocks_and_a_partial_block_gets_none() -> None:
    blocks = PrefixBlocks(_toy(), 16)
    h = blocks.hashes(0, 1000)  # 1000 tokens: one full 512-token trace block
    assert h is not None and len(h) == 32 and len(set(h)) == 32
    longer = blocks.hashes(1, 1536)
    assert longer is not None and longer[:32] == h and len(longer) == 96
    assert blocks.hashes(2, 700) == h  # clipped to 700 tokens: only the first trace block is full
    assert PrefixBlocks(load_trace("azure-conv", hours=0.01), 16).hashes(0, 5000) is None
    with pytest.raises(ValueError, match="divides 512"):
        PrefixBlocks(_toy(), 24)


def test_ideal_hit_rate_of_an_unbounded_cache() -> None:
    # Turn 2 finds trace block 1 (512), turn 3 finds blocks 1-3 (1536); the last request nothing.
    assert ideal_hit_rate(_toy(), 16, [1000, 1536, 2100, 600]) == pytest.approx((512 + 1536) / 5236)
    assert ideal_hit_rate(_toy(), 16, [1000, 1536, 2100, 600], [True, False, True, True]) == pytest.approx(
        512 / (1000 + 2100 + 600))  # a refused turn leaves nothing for the next one
    assert ideal_hit_rate(load_trace("azure-conv", hours=0.01), 16, [1]) is None


def test_caching_charges_only_uncached_tokens(cost: CostModel, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dataclasses.replace(preset("adaptive", unit_config(cost)), enable_prefix_caching=True)
    made: list[Scheduler] = []
    real_init = Scheduler.__init__

    def init(self: Scheduler, *a: object, **kw: object) -> None:
        real_init(self, *a, **kw)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(Scheduler, "__init__", init)
    run = simulate(_toy(), SimConfig(cfg, executor_factory(cost)))
    stats = made[0].stats
    assert stats.prefix_cache_hit_tokens == 512 + 1536 and stats.prefix_cache_hit_requests == 2
    assert stats.num_prompt_tokens_computed == sum([1000, 1536, 2100, 600]) - (512 + 1536)
    assert run.prefix_cache["hit_rate"] == pytest.approx(run.prefix_cache["ideal_hit_rate"])
    off = simulate(_toy(), SimConfig(preset("adaptive", unit_config(cost)), executor_factory(cost)))
    ok = np.isfinite(off.outcomes.ttft_s)
    # The third turn's prefill is 2100 tokens without the cache, 564 with it: a shorter TTFT.
    assert run.outcomes.ttft_s[2] < off.outcomes.ttft_s[2] and ok.all()


def test_a_trace_without_prefix_ids_gets_no_hits(cost: CostModel) -> None:
    trace = load_trace("azure-conv", hours=0.02).clipped(8191, 8191)
    spec = RunSpec(trace, unit_config(cost), cost, Slo(), overrides={"enable_prefix_caching": "true"})
    summary = run_policy(spec, "adaptive", progress=False).summary
    assert summary["prefix_hit_rate"] == 0.0 and summary["prefix_ideal_hit_rate"] == 0.0


def test_mooncake_hits_and_the_cache_aware_fleet_runs(cost: CostModel) -> None:
    trace = load_trace("mooncake-conv", hours=0.05, rate_scale=0.5).clipped(8191, 8191)
    spec = RunSpec(trace, unit_config(cost), cost, Slo(), units=2, overrides={"enable_prefix_caching": "true"},
                   routing="prefix")
    run = run_policy(spec, "adaptive", progress=False)
    pc = run.run.prefix_cache
    assert 0.0 < pc["hit_rate"] <= pc["ideal_hit_rate_served"] + 1e-9
    assert run.summary["arrived"] == run.summary["completed"] + run.summary["rejected"]
    with pytest.raises(ValueError, match="routing"):
        SimConfig(preset("adaptive", unit_config(cost)), executor_factory(cost), routing="nearest")


def test_the_cache_aware_routers_settings_reach_the_fleets_router(cost: CostModel) -> None:
    trace = load_trace("mooncake-conv", hours=0.01).clipped(8191, 8191)
    spec = RunSpec(trace, unit_config(cost), cost, Slo(), units=2, routing="prefix",
                   prefix_routing={"max_extra_delay_s": 0.25, "min_match_fraction": 0})
    router = Fleet(sim_config(spec, "adaptive"), random.Random(0)).prefix_router
    assert router is not None and router.config.max_extra_delay_s == 0.25 and router.config.min_match_fraction == 0
    assert router.config.index_blocks == spec.base.num_kv_blocks  # the unit's own size is kept
    with pytest.raises(TypeError, match="nearest"):
        Fleet(sim_config(dataclasses.replace(spec, prefix_routing={"nearest": 1.0}), "adaptive"), random.Random(0))


def test_a_prompt_the_chosen_unit_refused_leaves_the_routers_index(cost: CostModel) -> None:
    trace = load_trace("mooncake-conv", hours=0.01).clipped(8191, 8191)
    fleet = Fleet(sim_config(RunSpec(trace, unit_config(cost), cost, Slo(), units=2, routing="prefix"), "adaptive"),
                  random.Random(0))
    router = fleet.prefix_router
    assert router is not None
    first = list(range(1000, 1064))  # 64 blocks: a turn, then the next with 64 more
    unit = fleet.route(0.0, first, 64 * 16)
    assert unit is not None
    second = [*first, *range(5000, 5064)]
    assert fleet.route(0.1, second, 128 * 16) is unit  # affinity: the unit holds the first turn
    fleet.on_refused(unit, second)
    index = router.indexes[str(unit.uid)]
    assert index.match_blocks(second) == 64  # the refused turn is forgotten, the first kept
    fleet.on_refused(unit, first)  # no choice of the router's pending: nothing is taken back
    assert index.match_blocks(first) == 64
