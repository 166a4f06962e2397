"""The Triton kernels' tests run on CPU under Triton's interpreter (when Triton is installed):
it has to be switched on before anything imports Triton, so it is done here, first."""

from __future__ import annotations

from tests import triton_interpreter

TRITON_READY = triton_interpreter.enable()
