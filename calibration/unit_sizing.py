"""How much KV cache a serving unit holds, from GPU memory and the model's shape (pure).

Owns: the KV-bytes-per-token arithmetic, the GPUs' memory and the models' shapes the shipped cost
models name (`GPU_MEMORY_GB`, `MODEL_SHAPES`), `kv_cache_blocks` and `pool_blocks` (the pool of a
cost model's unit), shared by the simulator (loadgen/sim) and the Serve "simulated GPU" backend, so
both size the pool the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """What a model's weights and KV take in memory (fp16/bf16)."""

    weights_gb: float
    kv_bytes_per_token: int


LLAMA_70B_KV_BYTES_PER_TOKEN = kv_bytes_per_token(80, 8, 128)
"""Llama-2/3-70B: K and V x 80 layers x 8 KV heads x 128 dims x 2 bytes (fp16) = 320 KiB."""
LLAMA_70B_WEIGHTS_GB = 141.0
"""70.6 B parameters x 2 bytes (fp16/bf16)."""

MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-2-70b": ModelShape(LLAMA_70B_WEIGHTS_GB, LLAMA_70B_KV_BYTES_PER_TOKEN),
    "llama-3-70b": ModelShape(LLAMA_70B_WEIGHTS_GB, LLAMA_70B_KV_BYTES_PER_TOKEN),
    # 8.03 B parameters; 32 layers x 8 KV heads x 128 dims: 128 KiB of KV a token.
    "llama-3-8b": ModelShape(16.06, kv_bytes_per_token(32, 8, 128)),
}
"""The models the cost models under calibration/costmodels name (a profiled model not here needs an
entry, or `sim_num_kv_blocks` in Serve)."""

GPU_MEMORY_GB: dict[str, float] = {"a100": 80.0, "h100": 80.0, "h200": 141.0}
"""Memory of one GPU of each kind the cost models name (the A100 and H100 of 80 GB)."""


class _UnitModel(Protocol):
    gpu: str
    model: str
    tp: int


def kv_cache_blocks(*, tp: int, gpu_memory_gb: float = 80.0, memory_utilization: float = 0.9,
                    weights_gb: float = LLAMA_70B_WEIGHTS_GB, activation_reserve_gb: float = 2.0,
                    bytes_per_token: int = LLAMA_70B_KV_BYTES_PER_TOKEN, block_size: int = 16) -> int:
    """Blocks that fit in `tp` GPUs after the weights and an activation reserve per GPU."""
    free = tp * (gpu_memory_gb * memory_utilization - activation_reserve_gb) * 1e9 - weights_gb * 1e9
    if free <= 0:
        raise ValueError(f"{weights_gb} GB of weights do not fit on {tp} x {gpu_memory_gb} GB GPUs at "
                         f"{memory_utilization:.0%} utilisation; raise tp or the memory")
    return int(free // (bytes_per_token * block_size))


def pool_blocks(cost_model: _UnitModel, *, block_size: int = 16, memory_utilization: float = 0.9) -> int:
    """The KV pool of one unit of `cost_model` (its GPU kind, model and TP): what the model's weights
    leave free on `tp` of its GPUs. A GPU or model not in the tables is a ValueError that names them
    (the Serve sim backend's `sim_num_kv_blocks` sets a pool by hand)."""
    gpu, model = cost_model.gpu.lower(), cost_model.model.lower()
    if gpu not in GPU_MEMORY_GB:
        raise ValueError(f"unknown GPU {cost_model.gpu!r} for sizing the KV pool; known: {', '.join(GPU_MEMORY_GB)}")
    if model not in MODEL_SHAPES:
        raise ValueError(f"unknown model {cost_model.model!r} for sizing the KV pool; "
                         f"known: {', '.join(MODEL_SHAPES)}")
    shape = MODEL_SHAPES[model]
    return kv_cache_blocks(tp=cost_model.tp, gpu_memory_gb=GPU_MEMORY_GB[gpu], memory_utilization=memory_utilization,
                           weights_gb=shape.weights_gb, bytes_per_token=shape.kv_bytes_per_token, block_size=block_size)
