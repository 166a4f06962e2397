"""Linear layers on CPU with weights laid out for the shapes a serving step has.

Owns: `CpuWeights` (one weight matrix in two CPU layouts, picked per call by the number of rows)
and `prepare_cpu_gemm(model)` (gives every linear of a loaded model its `CpuWeights`).

Why: `F.linear` on a plain `[out, in]` float32 weight is slow at the row counts a decode step
has. Measured on the development box (one AVX2 core, the 576 x 49152 LM head of SmolLM2):
1 row 17 ms, 16 rows 72 ms, against 9 ms with a transposed `[in, out]` copy at one row and
36-38 ms with oneDNN's pre-packed layout (`torch.ops.mkldnn._reorder_linear_weight`) at 4-128
rows; the layer matmuls gain 10-45% the same way (benchmarks/cpu_gemm.py). So a single-row call
(one decode, the common single-stream case) multiplies by the transposed copy, every larger one
by the packed weight. Both are copies made once after loading; the model's own parameters stay
as they are (the loader, TP sharding and the tests read them), so a CPU model holds its linear
weights three times. Outputs match `F.linear` to float32 rounding (tests/actors/test_cpu_gemm.py).
A model loaded from a GGUF also gets the file's quantized blocks (actors/models/block_gemm.py):
calls of up to `MAX_ROWS` rows read those instead, and the transposed copy is not kept.

Used only on CPU, float32, with oneDNN available; anything else keeps `F.linear`.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.models.block_gemm import MAX_ROWS, BlockWeights


class CpuWeights:
    __slots__ = ("bias", "blocks", "packed", "transposed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool = True) -> None:
        w = weight.detach()
        self.weight = w  # the module's own tensor, not a copy
        # [in, out]: one row streams it once, in order. Not made up front when blocks are to come
        # (a linear left without them makes it on its first one-row call).
        self.transposed: torch.Tensor | None = w.t().contiguous() if transposed else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)  # oneDNN's blocked layout
        self.bias = None if bias is None else bias.detach()
        self.blocks: BlockWeights | None = None

    def use_blocks(self, blocks: BlockWeights) -> None:
        """Calls of up to `block_gemm.MAX_ROWS` rows read these quantized blocks (the same values);
        the transposed copy, which only one-row calls read, is dropped."""
        self.blocks, self.transposed = blocks, None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.blocks is not None and rows <= MAX_ROWS:
            out = self.blocks.matmul(x)
            return out if self.bias is None else out.add_(self.bias)
        if rows == 1:
            if self.transposed is None:
                self.transposed = self.weight.t().contiguous()
            out = x @ self.transposed
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cpu: CpuWeights | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the CPU layouts when the module has them."""
    if cpu is not None and x.dim() == 2:
        return cpu.linear(x)
    return F.linear(x, weight, bias)


def prepare_cpu_gemm(model: nn.Module, transposed: bool = True) -> int:
    """Give every module with a `cpu_weights()` hook its CPU layouts (call after the weights are
    loaded, and again if they change). Returns how many linears were prepared; 0 off CPU.
    `transposed=False` when a GGUF's blocks will be attached next: the one-row copies are not made."""
    count = 0
    for module in model.modules():
        hook = getattr(module, "cpu_weights", None)
        if hook is None:
            continue
        weight, bias = hook()
        module.cpu_layouts = CpuWeights(weight, bias, transposed) if supported(weight) else None
        count += module.cpu_layouts is not None
    return count
