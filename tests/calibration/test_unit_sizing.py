"""The KV pool of a cost model's unit: sized from its own GPU and model, not a 70B on 80 GB."""

from __future__ import annotations

import pytest

from calibration.cost_model import CostModel
from calibration.unit_sizing import GPU_MEMORY_GB, MODEL_SHAPES, kv_cache_blocks, pool_blocks
from loadgen.sim.runner import unit_config


@pytest.mark.parametrize("name", ["a100-llama70b-tp4", "a100-llama70b-tp8", "h100-llama70b-tp4", "h100-llama70b-tp8"])
def test_the_70b_units_keep_the_pool_of_70b_on_80_gb(name: str) -> None:
    cost = CostModel.load(name)
    assert pool_blocks(cost) == kv_cache_blocks(tp=cost.tp)
    assert unit_config(cost).num_kv_blocks == kv_cache_blocks(tp=cost.tp)


def test_the_profiled_h200_8b_unit_is_sized_from_its_own_gpu_and_model() -> None:
    cost = CostModel.load("h200-llama-3-8b-tp1-profiled")
    # 141 GB x 0.9 - 2 GB reserve - 16.06 GB of weights, in blocks of 16 tokens x 128 KiB.
    expected = int((141.0 * 0.9 - 2.0 - 16.06) * 1e9 // (32 * 8 * 128 * 2 * 2 * 16))
    assert pool_blocks(cost) == expected == unit_config(cost).num_kv_blocks
    assert 50_000 < expected < 55_000
    with pytest.raises(ValueError, match="do not fit"):  # the old sizing: 70B weights on one 80 GB GPU
        kv_cache_blocks(tp=cost.tp)


def test_an_unknown_gpu_or_model_is_an_error_that_names_the_known_ones() -> None:
    cost = CostModel.load("a100-llama70b-tp8")
    cost.gpu = "mi300x"
    with pytest.raises(ValueError, match="unknown GPU 'mi300x'.*" + ", ".join(GPU_MEMORY_GB)):
        pool_blocks(cost)
    cost.gpu, cost.model = "A100", "mixtral-8x7b"  # the GPU's case does not matter
    with pytest.raises(ValueError, match="unknown model 'mixtral-8x7b'.*" + ", ".join(MODEL_SHAPES)):
        pool_blocks(cost)
