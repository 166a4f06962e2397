"""What one replica's engine is, as plain data: importable without torch.

Owns: `EngineSpec` (the knobs of one replica; it crosses Ray to every TP rank) and `EngineInfo`
(what the scheduler must know of the built engine: KV blocks, block size, max model length, EOS
ids). The serving unit's own process reads both and starts the workers (actors/replica.py);
only the workers build the model (actors/worker_setup.py), so the unit's process never imports
torch: a unit reaches its first answer without paying torch's import before its workers pay
their own. The resolvers import torch (and the Triton probe) only when asked to resolve "auto".

Must not import (at module level): torch, ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str = DEFAULT_MODEL
    tp: int = 1
    device: str = "auto"  # "cpu", "cuda" or "auto"
    dtype: str = "auto"  # float32 on CPU (no fast bf16 on small CPUs), bfloat16 on CUDA
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048  # the largest step; sizes the GPU activation reserve
    max_batch_size: int = 64  # the scheduler's largest decode batch (the worst step's decodes)
    kv_cache_gb: float = 0.25  # CPU KV budget
    gpu_memory_utilization: float = 0.9
    max_num_blocks: int | None = None  # cap (tests force preemption with a tiny pool)
    cuda_graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    cuda_graph_contexts: tuple[int, ...] | None = None  # context buckets (tokens); None: 512 x4 .. max_model_len
    attention: str = "auto"  # "portable", "triton"; auto: triton on CUDA when Triton imports
    enforce_eager: bool = False
    random_config: dict[str, Any] | None = None  # build this HF config with random weights
    seed: int | None = None
    torch_threads: int | None = None  # default: worker_setup.default_torch_threads (all cores of a 2-core box)
    cpu_gemm: bool = True  # CPU float32: linears through pre-arranged weight layouts (models/cpu_gemm.py)
    cpu_attention: bool = True  # CPU float32: decodes read the KV blocks in place (models/cpu_attention.py)
    cpu_block_gemm: bool = True  # CPU float32 from a GGUF: small linears read its blocks (models/block_gemm.py)
    cpu_fused_ops: bool = True  # CPU float32: norms, SiLU and RoPE in one C call each (models/cpu_fused.py)
    cpu_decode_layers: bool = True  # CPU float32 on blocks: a decode step in one C call (models/cpu_decode_layers.py)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype={self.dtype!r}: use 'auto' or one of {DTYPES}")
            return getattr(torch, self.dtype)  # type: ignore[no-any-return]
        return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32

    def resolved_attention(self) -> str:
        from actors.models.attention import BACKENDS
        from actors.paged_attention import HAVE_TRITON

        if self.attention == "auto":
            return "triton" if HAVE_TRITON and self.resolved_device() == "cuda" else "portable"
        if self.attention not in BACKENDS:
            raise ValueError(f"attention={self.attention!r}: use 'auto' or one of {BACKENDS}")
        if self.attention == "triton" and not HAVE_TRITON:
            raise ValueError("attention='triton' needs Triton (it comes with CUDA builds of torch); use 'portable'")
        return self.attention


@dataclass(frozen=True, slots=True)
class EngineInfo:
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    model_path: str | None
    cuda_graph_buckets: tuple[int, ...] = ()  # captured decode sizes; () = every step eager
