"""Compile every Triton kernel of the engine for Hopper (sm_90) at Llama-3-8B's shapes in bf16,
without a GPU: Triton's compiler and the ptxas it ships with do the whole build. Run as a
separate process (tests/actors/test_fused_ops.py does) because the tests' own process runs
Triton's interpreter, which replaces the language the compiler needs.

    python -m tests.triton_compile     # prints one line per kernel: name, warps, shared memory
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _signature(fn: Any, constexprs: dict[str, Any], types: dict[str, str], default_int: str = "i32") -> dict[str, str]:
    return {p.name: "constexpr" if p.name in constexprs else types.get(p.name, default_int) for p in fn.params}


def kernels() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    from triton.runtime.jit import JITFunction

    from actors import paged_attention as pa
    from actors.models import fused_ops as fo

    group, head_dim, hidden, inter = 4, 128, 4096, 14336
    out = []
    attn = JITFunction(pa._paged_attention_kernel)
    for name, decode, split in (("decode", True, False), ("decode-split", True, True), ("prefill", False, False)):
        block_q = 1 if decode else pa.prefill_block_q(group)
        block_kv = pa.DECODE_LAUNCH["BLOCK_KV"] if decode else pa.BLOCK_N
        cx = dict(GROUP=group, GROUP_PAD=group, HEAD_DIM=head_dim, HEAD_PAD=head_dim, BLOCK_Q=block_q,
                  ROWS=max(16, block_q * group), BLOCK_KV=block_kv, DECODE=decode, SPLIT=split, IEEE=False)
        ints = "*i64" if decode else "*i32"
        types = {p.name: "*bf16" if p.name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr") else
                 "*fp32" if p.name in ("part_ptr", "part_ml_ptr") else ints if p.name.endswith("_ptr") else
                 "fp32" if p.name == "scale" else "i32" for p in attn.params}
        out.append((f"paged attention ({name})", attn, _signature(attn, cx, types), cx))
    merge = JITFunction(pa._merge_splits_kernel)
    cx = dict(HEAD_DIM=head_dim, HEAD_PAD=head_dim, SPLITS_PAD=pa.MAX_SPLITS)
    out.append(("merge splits", merge, _signature(merge, cx, {"part_ptr": "*fp32", "part_ml_ptr": "*fp32",
                                                               "out_ptr": "*bf16", "seq_lens_ptr": "*i64"}), cx))
    norm = JITFunction(fo._rms_norm_kernel)
    for res in (False, True):
        cx = dict(BLOCK=hidden, HAS_RES=res)
        types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")} | {"eps": "fp32"}
        out.append((f"rms norm (residual {res})", norm, _signature(norm, cx, types), cx))
    silu = JITFunction(fo._silu_and_mul_kernel)
    cx = dict(BLOCK=fo.SILU_BLOCK)
    out.append(("silu and mul", silu, _signature(silu, cx, {"x_ptr": "*bf16", "out_ptr": "*bf16"}), cx))
    rope = JITFunction(fo._rope_and_cache_kernel)
    cx = dict(HALF=head_dim // 2, HALF_PAD=head_dim // 2)
    types = {n: "*bf16" for n in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}
    out.append(("rope and cache", rope, _signature(rope, cx, types | {"slot_ptr": "*i64"}), cx))
    assert inter  # the MLP width only sizes the grid, not the kernel
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from actors import paged_attention as pa

    failed = 0
    for name, fn, signature, constexprs in kernels():
        options = {"enable_fp_fusion": False} if name == "rope and cache" else {}
        if name.startswith("paged attention (decode"):
            options = {k: v for k, v in pa.DECODE_LAUNCH.items() if k.startswith("num_")}
        try:
            k = compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                        options=options)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        ok = bool(k.asm.get("cubin")) and k.metadata.shared <= 228 * 1024
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} {name}: {k.metadata.num_warps} warps, {k.metadata.shared} B shared")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
