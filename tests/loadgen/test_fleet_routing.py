"""The simulated fleet routes with the core's prompt-aware choice (and keeps the blind one reachable)."""

from __future__ import annotations

import random

from calibration.cost_model import CostModel
from loadgen.sim.cluster import Fleet
from loadgen.sim.config import SimConfig
from loadgen.sim.runner import executor_factory, unit_config
from tidal_core import Request, SamplingParams, preset
from tidal_core.front_admission import published_load
from tidal_core.routing import would_refuse


def _fleet(cost: CostModel, routing: str, seed: int) -> Fleet:
    fleet = Fleet(SimConfig(preset("adaptive", unit_config(cost)), executor_factory(cost), num_units=3,
                            routing=routing), random.Random(seed))
    for uid in (0, 1):  # two units with a prefill backlog; unit 2 is empty
        sched = fleet.units[uid].sched
        for i in range(6):
            sched.add_request(Request(f"{uid}-{i}", 3000, SamplingParams(max_tokens=100), 0.0), 0.0)
    return fleet


def _uid(fleet: Fleet, prompt: int) -> int:
    unit = fleet.route(0.0, None, prompt)
    assert unit is not None
    return unit.uid


def test_a_long_prompt_is_routed_past_two_backlogged_units(cost: CostModel) -> None:
    prompt = 6000
    probe = _fleet(cost, "load", 0)
    loads = [published_load(u.sched, 0.0, str(u.uid)) for u in probe.units.values()]
    assert [would_refuse(u, prompt) for u in loads] == [True, True, False]
    assert {_uid(_fleet(cost, "load", seed), prompt) for seed in range(12)} == {2}
    blind = {_uid(_fleet(cost, "load-blind", seed), prompt) for seed in range(12)}
    assert blind & {0, 1}  # the previous rule: a backlogged unit whenever the empty one is not sampled
