"""Hand freed heap memory back to the operating system every so often (glibc's `malloc_trim`).

Owns: `start_trimming()`, a background task of a Serve replica (the ServingUnit and the
Ingress start one each) that calls `malloc_trim(0)` in a thread every `TIDAL_MALLOC_TRIM_S`
seconds (default 30; 0 turns it off).

Why: a peak's hundreds of open streams leave memory that Python has freed but glibc's
allocator keeps mapped, so a replica's RSS stays at the peak's high-water mark (docs/
reliability.md, the soak: +6.2% for the ServingUnit from a cold start, flat afterwards, i.e.
not a leak). A container's memory limit and the dashboards see RSS, so the replica gives
that memory back. The call walks the heap, so it runs in a thread, off the event loop.
Where libc has no `malloc_trim` (musl, macOS) nothing is started.

Also `jemalloc_stats()`: when a process runs on jemalloc (Ray ships a copy; `benchmarks/soak.py
--allocator jemalloc` preloads it), the allocator's own count of live bytes beside what it
keeps resident, which tells memory still held by the program from memory the allocator
retains after a peak (docs/reliability.md, section 5).

Must not import: torch, ray.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("ray.serve")
ENV = "TIDAL_MALLOC_TRIM_S"
DEFAULT_PERIOD_S = 30.0


def period_s(environ: dict[str, str] | os._Environ[str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_PERIOD_S
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds (0 turns trimming off)") from None
    if value < 0:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 (0 turns trimming off)")
    return value


def malloc_trim() -> Callable[[int], Any] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    fn = getattr(libc, "malloc_trim", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


JEMALLOC_STATS = ("allocated", "active", "resident", "mapped", "retained")


def ray_jemalloc() -> Path | None:
    """The jemalloc that Ray's wheel ships (`ray/core/libjemalloc.so`; its own daemons run on it),
    found without importing Ray; None when this install has none."""
    spec = importlib.util.find_spec("ray")
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(root) / "core" / "libjemalloc.so" for root in roots]
    return next((path for path in found if path.is_file()), None)


def jemalloc_stats() -> dict[str, int] | None:
    """jemalloc's `stats.*` counters in bytes (live, in active pages, resident, mapped, retained),
    refreshed now; None when this process does not run on jemalloc."""
    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None:
        return None
    epoch = ctypes.c_uint64(1)
    if mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(ctypes.sizeof(epoch))) != 0:
        return None
    out: dict[str, int] = {}
    for name in JEMALLOC_STATS:
        value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0:
            out[name] = int(value.value)
    return out or None


async def _trim_forever(trim: Callable[[int], Any], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(trim, 0)
        except Exception:  # never let memory housekeeping take a replica down
            log.debug("malloc_trim failed", exc_info=True)


def start_trimming(environ: dict[str, str] | None = None) -> asyncio.Task[None] | None:
    """Start the trimming task on the running loop; None when it is off or unavailable."""
    every_s = period_s(environ)
    trim = malloc_trim() if every_s > 0 else None
    if trim is None:
        return None
    return asyncio.get_running_loop().create_task(_trim_forever(trim, every_s), name="tidal-malloc-trim")
