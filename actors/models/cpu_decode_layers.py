"""A CPU decode step's decoder layers in one C call (`csrc/decode_layers.c`).

Owns: `KERNEL`, `DecodeLayers` (one model's layer table for the kernel: `run(x, cos, sin, meta)`)
and `for_step(model, meta, kv_caches, rows)` (the model's table when this step can take it, else
None: the layer-by-layer path).

Why: with the CPU kernels on (the block GEMM, the decode attention, the fused small ops), a decode
step's own work is all C, but the layer-by-layer forward reaches it through ~10 Python calls a
layer (module calls, tensor allocations, ctypes marshalling), a share of the step that grows as
the batch shrinks, while the pool's helper waits and the second core idles (what the switch
saves: benchmarks/RESULTS.md, "A decode step's layers in one C call"). The kernel makes the same
calls with the same arguments in the same order, so the hidden states are the same float32 bits
(tests/actors/test_cpu_decode_layers.py).

When: `engine.cpu_decode_layers` (on by default) and every condition of the layer-by-layer path
that would have run these kernels: the portable backend on CPU in float32 with the decode
attention and fused-ops kernels on; a step of decodes only, of at most `block_gemm.MAX_ROWS`
rows; TP = 1; every layer's four linears on GGUF blocks, without bias. Anything else (a prefill
chunk in the step, a model converted without blocks) takes the layer-by-layer path.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from actors.models import block_gemm, cpu_attention, cpu_fused, cpu_pool
from actors.models.ckernel import CKernel

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Blocks(ctypes.Structure):
    _fields_ = [("kind", _i64), ("qs", _ptr), ("scale", _ptr), ("offset", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr), ("qkv", _Blocks), ("o", _Blocks), ("gate_up", _Blocks),
                ("down", _Blocks), ("k_cache", _ptr), ("v_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("gemm", _ptr), ("attn", _ptr), ("rms", _ptr), ("silu", _ptr), ("rope", _ptr), ("run", _ptr),
                ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("block_size", _i64), ("num_blocks", _i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("final_norm", _ptr)]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_decode_layers
    fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int, _ptr]
    fn.restype = ctypes.c_int
    lib.tidal_decode_layers_scratch.argtypes = [_ptr, _i64]
    lib.tidal_decode_layers_scratch.restype = _i64


KERNEL = CKernel("decode_layers.c", _declare, "decode steps run layer by layer")
main = KERNEL.main
_OPS = {1: "input norm", 2: "QKV projection", 3: "rotary", 4: "KV slot", 5: "attention", 6: "O projection",
        7: "post-attention norm", 8: "gate / up projection", 9: "SiLU", 10: "down projection"}


def _blocks(linear: nn.Module) -> block_gemm.BlockWeights | None:
    cpu = getattr(linear, "cpu_layouts", None)
    if cpu is None or cpu.blocks is None or cpu.bias is not None or getattr(linear, "bias", None) is not None:
        return None
    return cpu.blocks


class DecodeLayers:
    """One model's layers as the kernel reads them (pointers into the model's own tensors and the
    KV caches, which this object keeps alive); built by `for_step`."""

    def __init__(self, lib: ctypes.CDLL, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ops: dict[str, int]) -> None:
        attn0 = model.layers[0].self_attn
        k0 = kv_caches[0][0]
        self.lib = lib
        self.hidden = model.cfg.hidden_size
        self._keep: list[Any] = [kv_caches]
        layers = (_Layer * len(model.layers))()
        for i, (layer, (k, v)) in enumerate(zip(model.layers, kv_caches, strict=True)):
            a, mlp = layer.self_attn, layer.mlp
            entry = layers[i]
            entry.in_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in (("qkv", a.qkv_proj), ("o", a.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                b = _blocks(linear)
                assert b is not None
                self._keep.append(b)
                setattr(entry, name, _Blocks(b.kind, b.quants.data_ptr(), b.scale.data_ptr(), b.offset.data_ptr()))
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        self.layers = layers
        self.model = _Model(ops["gemm"], ops["attn"], ops["rms"], ops["silu"], ops["rope"], ops["run"] or 0,
                            len(model.layers), self.hidden, attn0.shard.q_count, attn0.shard.kv_count,
                            attn0.head_dim, model.layers[0].mlp.local, k0.shape[1], k0.shape[0], model.norm.eps,
                            attn0.scale, model.norm.weight.data_ptr())
        self._scratch: torch.Tensor | None = None

    def _work(self, rows: int) -> torch.Tensor:
        need = self.lib.tidal_decode_layers_scratch(ctypes.byref(self.model), rows)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any) -> torch.Tensor:
        """The final norm's output [T, hidden] for embeddings x [T, hidden] of a decodes-only step."""
        t = x.shape[0]
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        x = x.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.decode_block_tables.to(torch.int64).contiguous()
        lens = meta.decode_context_lens.to(torch.int64).contiguous()
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        rc = self.lib.tidal_decode_layers(ctypes.byref(self.model), self.layers, x.data_ptr(), out.data_ptr(), t,
                                          cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(),
                                          tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                          torch.get_num_threads(), self._work(t).data_ptr())
        if rc:
            layer, op = divmod(rc - 10, 16) if rc >= 10 else (-1, 0)
            where = f"{_OPS.get(op, 'the final norm')} of layer {layer}" if rc >= 10 else "sizes or the final norm"
            raise ValueError(f"decode layers: the kernels refused ({where}; code {rc})")
        return out


def _key(model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    """What a table is built from: the caches' and the blocks' storage (new weights or caches, a new table)."""
    layer = model.layers[0]
    return (kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr(), id(layer.self_attn.qkv_proj.cpu_layouts),
            id(model.layers[-1].mlp.down_proj.cpu_layouts))


def _ops() -> dict[str, int] | None:
    """The addresses of the kernels' functions, or None when one of them cannot be had."""
    fused = cpu_fused.KERNEL
    ops = {"gemm": block_gemm.KERNEL.address("tidal_block_gemm"),
           "attn": cpu_attention.KERNEL.address("tidal_paged_decode"), "rms": fused.address("tidal_rms_norm"),
           "silu": fused.address("tidal_silu_mul"), "rope": fused.address("tidal_rope_qk")}
    if any(v is None for v in ops.values()):
        return None
    return {**ops, "run": cpu_pool.runner() or 0}  # type: ignore[dict-item]


def eligible(model: Any) -> bool:
    """The model's own conditions: TP = 1, float32, every layer's four linears on GGUF blocks without bias."""
    if getattr(model, "tp", None) is None or model.tp.size != 1 or model.dtype is not torch.float32:
        return False
    return all(_blocks(lin) is not None for layer in model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj))


def for_step(model: Any, meta: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
             rows: int) -> DecodeLayers | None:
    """The model's `DecodeLayers` when this step can run on them (see the module's docstring), else None."""
    if not (getattr(meta, "cpu_layers", False) and meta.cpu_decode and meta.cpu_fused and meta.backend == "portable"
            and not meta.prefills and meta.num_decodes == rows and 0 < rows <= block_gemm.MAX_ROWS):
        return None
    key = _key(model, kv_caches)
    cached: tuple[tuple[int, ...], DecodeLayers | None] | None = getattr(model, "_decode_layers", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    lib = KERNEL.load()
    ops = _ops() if lib is not None else None
    table = DecodeLayers(lib, model, kv_caches, ops) if lib is not None and ops and eligible(model) else None
    model._decode_layers = (key, table)  # also "not this model", until its weights or caches change
    return table
