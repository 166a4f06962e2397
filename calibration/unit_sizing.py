"""How much KV cache a serving unit holds, from GPU memory and the model's shape (pure).

Owns: the KV-bytes-per-token arithmetic and `kv_cache_blocks`, shared by the simulator
(loadgen/sim) and the Serve "simulated GPU" backend, so both size the pool the same way.
"""

from __future__ import annotations

LLAMA_70B_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2
"""Llama-2/3-70B: K and V x 80 layers x 8 KV heads x 128 dims x 2 bytes (fp16) = 320 KiB."""
LLAMA_70B_WEIGHTS_GB = 141.0
"""70.6 B parameters x 2 bytes (fp16/bf16)."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_cache_blocks(*, tp: int, gpu_memory_gb: float = 80.0, memory_utilization: float = 0.9,
                    weights_gb: float = LLAMA_70B_WEIGHTS_GB, activation_reserve_gb: float = 2.0,
                    bytes_per_token: int = LLAMA_70B_KV_BYTES_PER_TOKEN, block_size: int = 16) -> int:
    """Blocks that fit in `tp` GPUs after the weights and an activation reserve per GPU."""
    free = tp * (gpu_memory_gb * memory_utilization - activation_reserve_gb) * 1e9 - weights_gb * 1e9
    if free <= 0:
        raise ValueError(f"{weights_gb} GB of weights do not fit on {tp} x {gpu_memory_gb} GB GPUs at "
                         f"{memory_utilization:.0%} utilisation; raise tp or the memory")
    return int(free // (bytes_per_token * block_size))
