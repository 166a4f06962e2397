"""The CPU kernels' thread pool: `csrc/pool.c` built once, its run function handed to the kernels.

Owns: `KERNEL` (the pool as a shared library), `runner()` (the address of its `tidal_pool_run`,
which the block GEMM and the decode attention take as an argument, or None: they compute on the
calling thread) and `SPIN_NS`.

Why a pool of our own and one for every kernel: docs/engine.md, "CPU threads". A kernel splits
its call into chunks whose outputs do not overlap and passes a task; the caller and the pool's
helpers claim the chunks from one counter, so nothing waits for a helper the OS has not
scheduled. A call uses as many threads as torch does (`torch.get_num_threads()`, the worker's
`engine.torch_threads`); one pool means one helper per extra thread, still awake from a layer's
projection when its attention comes.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes

from actors.models.ckernel import CKernel

# How long an idle helper waits for the next call, yielding its core to whatever else is runnable,
# before it sleeps: a decode step's kernel calls come tens of microseconds apart.
SPIN_NS = 50_000


def _declare(lib: ctypes.CDLL) -> None:
    lib.tidal_pool_run.restype = ctypes.c_int
    lib.tidal_pool_spin.argtypes = [ctypes.c_long]
    lib.tidal_pool_spin.restype = None
    lib.tidal_pool_spin(SPIN_NS)


KERNEL = CKernel("pool.c", _declare, "the CPU kernels run on one thread", extra_flags=("-pthread",))
main = KERNEL.main


def runner() -> int | None:
    """The address of `tidal_pool_run` in this process's pool library, or None without one."""
    return KERNEL.address("tidal_pool_run")


def set_spin(ns: int) -> None:
    """How long idle helpers wait for the next call before they sleep (tests: 0, the futex path every call)."""
    lib = KERNEL.load()
    if lib is not None:
        lib.tidal_pool_spin(ns)
