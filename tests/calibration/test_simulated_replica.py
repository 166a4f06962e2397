"""SimulatedReplica: the cost model behind the replica-group interface, sleeping each step's time."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

from calibration.cost_model import CostModel
from calibration.sim_executor import SimExecutor
from calibration.simulated_replica import SimulatedReplica
from tidal_core import Request, Run, SamplingParams, Scheduler, SchedulerConfig, VirtualClock, preset
from tidal_core.plan import NewRequestData, StepPlan

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NAME = "a100-llama70b-tp8"


def prefill_plan(rid: str = "s", tokens: int = 512) -> StepPlan:
    new = NewRequestData(rid, None, tokens, GREEDY, list(range(32)))
    return StepPlan(1, {rid: tokens}, {rid: 0}, [new], {}, [], 0, tokens, 0, None)


class VirtualSleep:
    """Stands in for asyncio.sleep / time.sleep: records each sleep and advances a virtual clock."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.slept: list[float] = []

    def blocking(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.advance_by(seconds)

    async def __call__(self, seconds: float) -> None:
        self.blocking(seconds)


def test_sim_backend_sleeps_the_modelled_time() -> None:
    """No Ray needed: the simulated GPU behind the same replica interface."""
    group = SimulatedReplica.from_cost_model(NAME, num_kv_blocks=1024, max_model_len=4096)
    assert group.num_kv_blocks == 1024 and group.max_model_len == 4096
    result = asyncio.run(group.execute(prefill_plan()))
    assert set(result.sampled_token_ids) == {"s"} and result.device_time_s > 0
    group.check_health()
    group.shutdown()


def test_a_served_workload_takes_the_cost_models_time(cost: CostModel) -> None:
    """The real scheduler drives the replica on a virtual clock: every step sleeps exactly the
    modelled step time, and every request gets its max_tokens placeholder tokens."""
    sleep = VirtualSleep()
    sim = SimulatedReplica(SimExecutor(cost, placeholder_token_id=7), 4096, block_size=16, max_model_len=2048,
                           sleep=sleep)
    cfg = SchedulerConfig(max_batch_size=16, max_num_batched_tokens=256, max_model_len=sim.max_model_len,
                          block_size=sim.block_size, num_kv_blocks=sim.num_kv_blocks)
    sched = Scheduler(preset("continuous", cfg))
    rng = random.Random(4)
    requests = [Request(f"r{i}", rng.randint(1, 600), SamplingParams(max_tokens=rng.randint(1, 20)), 0.0)
                for i in range(30)]
    for req in requests:
        assert sched.add_request(req, 0.0) is None
    modelled: list[float] = []

    async def serve() -> None:
        while sched.has_unfinished:
            decision = sched.schedule(sleep.clock.now())
            assert isinstance(decision, Run)
            modelled.append(cost.plan_time_s(decision.plan))
            result = await sim.execute(decision.plan)
            sched.on_step_done(decision.plan, result, sleep.clock.now())

    asyncio.run(serve())
    assert len(modelled) > 1 and sleep.slept == modelled
    assert sleep.clock.now() == pytest.approx(sum(modelled))
    for req in requests:
        assert req.output_token_ids == [7] * req.sampling.max_tokens, req
    assert sim.executor.num_tracked_requests == 0


def test_device_only_and_the_blocking_form_sleep_their_times(cost: CostModel) -> None:
    plan = prefill_plan(tokens=1024)
    sleep = VirtualSleep()
    device_only = SimulatedReplica.from_cost_model(cost, 64, include_host_time=False).executor
    sim = SimulatedReplica(device_only, 64, block_size=16, max_model_len=2048, sleep_blocking=sleep.blocking)
    result = sim.execute_blocking(plan)
    assert sleep.slept == [result.device_time_s] == [cost.device_only().plan_time_s(plan)]
    assert result.device_time_s < cost.plan_time_s(plan)  # the host terms are left out
    assert result.sampled_token_ids == {"s": 1}


def test_sizing_health_and_bad_input(cost: CostModel) -> None:
    sim = SimulatedReplica.from_cost_model(cost, 512, block_size=32, max_model_len=8192,
                                           cuda_graph_buckets=(1, 2, 4), eos_token_id=2)
    assert (sim.num_kv_blocks, sim.block_size, sim.max_model_len) == (512, 32, 8192)
    assert sim.cuda_graph_buckets == (1, 2, 4) and sim.eos_token_ids == (2,)
    assert sim.worker_names == ()
    assert SimulatedReplica.from_cost_model(cost, 8).eos_token_ids == ()
    assert sim.check_health(timeout_s=1.0) is None  # nothing to lose: always healthy
    with pytest.raises(ValueError, match="num_kv_blocks=0"):
        SimulatedReplica(sim.executor, 0, block_size=16, max_model_len=2048)


def test_no_ray_or_torch() -> None:
    code = ("import sys; import calibration.simulated_replica; "
            "print(','.join(m for m in ('torch', 'ray', 'transformers', 'actors', 'serve_app') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"calibration.simulated_replica loaded {out.stdout.strip()}"
