"""Running the Triton kernels on CPU in tests: Triton's interpreter, switched on before Triton is
imported, with one fix for NumPy 2.

The interpreter holds a scalar as a one-element 1-d array and converts it for `range()` with
`int(array)`, which NumPy 2 refuses ("only 0-dimensional arrays can be converted"), so a loop
whose bound was loaded from memory fails under the interpreter (compiled kernels are not
affected). `enable()` converts through the array's single element instead. Only tests use this.
"""

from __future__ import annotations

import os
import sys

import torch


def enable() -> bool:
    """Switch the interpreter on when there is no CUDA; True if Triton kernels can run here.

    False when Triton is not installed, or was imported before the interpreter was switched on.
    """
    if torch.cuda.is_available():
        return True
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = interpreter._patch_lang_tensor
    if getattr(original, "tidal_numpy2_fix", False):
        return True

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    patched.tidal_numpy2_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
    return True
