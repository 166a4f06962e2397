"""build_replica_group: `backend: sim` gets the simulated GPU, sized and primed from its cost model."""

from __future__ import annotations

import asyncio

from calibration.cost_model import CostModel
from calibration.simulated_replica import SimulatedReplica
from calibration.unit_sizing import kv_cache_blocks, pool_blocks
from serve_app.config_loader import EngineArgs
from serve_app.unit import SIM_PLACEHOLDER_TOKEN, build_replica_group
from tidal_core import SamplingParams
from tidal_core.plan import NewRequestData, StepPlan

NAME = "a100-llama70b-tp8"


def test_sim_backend_builds_a_simulated_replica_with_the_cost_models_prior() -> None:
    engine = EngineArgs(backend="sim", cost_model=NAME, tp=8, max_model_len=8192, block_size=16)
    group, prior = build_replica_group(engine, 2048, (1, 2, 4, 8), "unused-prefix")
    cost = CostModel.load(NAME)
    assert isinstance(group, SimulatedReplica)
    assert prior == cost.service_prior()
    assert group.num_kv_blocks == kv_cache_blocks(tp=cost.tp, block_size=16)
    assert (group.block_size, group.max_model_len, group.cuda_graph_buckets) == (16, 8192, (1, 2, 4, 8))
    assert group.eos_token_ids == () and group.worker_names == ()
    new = NewRequestData("a", None, 4, SamplingParams(max_tokens=2), [0])
    plan = StepPlan(1, {"a": 4}, {"a": 0}, [new], {}, [], 0, 4, 0, None)
    result = asyncio.run(group.execute(plan))
    assert result.sampled_token_ids == {"a": SIM_PLACEHOLDER_TOKEN}
    assert result.device_time_s == cost.plan_time_s(plan)  # the whole modelled step, host time included


def test_sim_num_kv_blocks_overrides_the_sized_pool() -> None:
    engine = EngineArgs(backend="sim", cost_model=NAME, sim_num_kv_blocks=300)
    group, _ = build_replica_group(engine, 2048, ())
    assert isinstance(group, SimulatedReplica) and group.num_kv_blocks == 300


def test_sim_backend_sizes_another_gpus_unit_from_its_cost_model() -> None:
    engine = EngineArgs(backend="sim", cost_model="h200-llama-3-8b-tp1-profiled", tp=1, block_size=16)
    group, _ = build_replica_group(engine, 2048, ())
    assert isinstance(group, SimulatedReplica)
    assert group.num_kv_blocks == pool_blocks(CostModel.load("h200-llama-3-8b-tp1-profiled"), block_size=16) > 50_000


def test_hf_backend_passes_every_engine_field_the_workers_know(monkeypatch) -> None:
    # The serve config's engine section reaches the workers' EngineSpec field by field: a knob added to
    # EngineArgs and EngineSpec but not wired through build_replica_group fails here. (The group itself,
    # Ray workers loading a model, is the integration tests'; a recorder stands in for it.)
    import dataclasses

    import actors.replica
    from actors.engine_spec import EngineSpec

    seen = {}

    class Recorder:
        def __init__(self, spec: EngineSpec, **kwargs: object) -> None:
            seen["spec"], seen["kwargs"] = spec, kwargs

    monkeypatch.setattr(actors.replica, "ReplicaGroup", Recorder)
    engine = EngineArgs(device="cpu", torch_threads=3, cpu_fused_ops=False, cpu_attention=False, kv_cache_gb=0.5,
                        max_model_len=1024, block_size=8, step_socket=False, step_timeout_s=77.0)
    group, prior = build_replica_group(engine, 384, (1, 2), "p", max_batch_size=12)
    assert isinstance(group, Recorder) and prior is None
    spec = seen["spec"]
    shared = {f.name for f in dataclasses.fields(EngineSpec)} & set(EngineArgs.model_fields)
    assert {"torch_threads", "cpu_fused_ops", "kv_cache_gb", "tp", "dtype"} <= shared
    for name in sorted(shared):
        assert getattr(spec, name) == getattr(engine, name), name
    assert (spec.max_num_batched_tokens, spec.max_batch_size, tuple(spec.cuda_graph_buckets)) == (384, 12, (1, 2))
    assert seen["kwargs"] == {"step_timeout_s": 77.0, "compiled_graph": False, "name_prefix": "p", "step_socket": False}
