"""Small C kernels for the CPU engine: built once by gcc, cached by source and flags, loaded by ctypes.

Owns: `CKernel` (one source file under csrc/: its library's path, `build()`, `load()`, which
builds first when missing, `available()`, `address(name)` of a function for kernels that call it
through a pointer, read once per library; `CKernel.instances`, every one made in the process) and
`cpu_flags()`.

Build: gcc `-O3 -ffp-contract=fast` (with `-mavx2 -mfma` when /proc/cpuinfo lists both, a
portable build otherwise), no torch headers, into `$TIDAL_CACHE_DIR/kernels/` (default
`~/.cache/tidalserve/kernels/`) under a name that hashes the source and the flags, so an edited
source or another CPU's flags build anew and an existing library is just loaded. `make setup`
builds every kernel; a process that finds one missing builds it on first use (about 1 s). Written
to a temporary file and renamed, so workers starting together never load a half-written library.
No gcc, or a failed build: `load()` returns None after one log line naming what the caller does
instead.

Users: actors/models/cpu_attention.py (decode attention in place), actors/models/block_gemm.py
(linears on quantized blocks), actors/models/cpu_fused.py (the ops between a layer's matmuls).

Must not import: ray, serve_app.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11")


def kernel_dir() -> Path:
    # actors/model_loader.py's cache root (imported there from actors.models: not importable here).
    return Path(os.environ.get("TIDAL_CACHE_DIR", "~/.cache/tidalserve")).expanduser() / "kernels"


def cpu_flags() -> tuple[str, ...]:
    """`-mavx2 -mfma` where this x86 CPU has both, nothing otherwise (gcc's baseline for the target)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return ("-mavx2", "-mfma") if {"avx2", "fma"} <= flags else ()
    return ()


class CKernel:
    """One C source built into a shared library; `bind` declares its functions' ctypes signatures.
    `fallback` says what callers do without it (the one log line when it cannot be had);
    `extra_flags` come after the base and CPU flags (so they win where they disagree).
    `instances`: every kernel made in this process (what a test that changes them puts back)."""

    instances: ClassVar[list[CKernel]] = []

    def __init__(self, source: str, bind: Callable[[ctypes.CDLL], None], fallback: str,
                 extra_flags: tuple[str, ...] = ()) -> None:
        self.source = CSRC / source
        self._declare = bind
        self.fallback = fallback
        self.extra_flags = extra_flags
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._addresses: dict[str, tuple[ctypes.CDLL, int | None]] = {}  # name -> (the library, its address)
        CKernel.instances.append(self)

    def library_path(self, flags: tuple[str, ...] | None = None) -> Path:
        flags = (cpu_flags() if flags is None else flags) + self.extra_flags
        digest = hashlib.sha256(self.source.read_bytes() + " ".join(BASE_FLAGS + flags).encode()).hexdigest()[:16]
        return kernel_dir() / f"{self.source.stem}-{digest}.so"

    def build(self, flags: tuple[str, ...] | None = None, compiler: str | None = None) -> Path:
        """Compile unless this source + flags already are; returns the library's path.
        Raises RuntimeError when there is no compiler or it fails."""
        flags = cpu_flags() if flags is None else flags
        path = self.library_path(flags)
        flags += self.extra_flags
        if path.exists():
            return path
        cc = compiler or os.environ.get("CC") or "gcc"
        if shutil.which(cc) is None:
            raise RuntimeError(f"no C compiler ({cc!r} not found)")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            cmd = [cc, *BASE_FLAGS, *flags, "-o", tmp, str(self.source)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:-3])} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def bind(self, path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        self._declare(lib)
        return lib

    def load(self) -> ctypes.CDLL | None:
        """This process's library (built first if missing), or None, logged once, when it cannot be
        built or loaded."""
        if self._tried:
            return self._lib
        self._tried = True
        try:
            self._lib = self.bind(self.build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("CPU kernel %s unavailable (%s): %s", self.source.name, exc, self.fallback)
            self._lib = None
        return self._lib

    def available(self) -> bool:
        return self.load() is not None

    def address(self, name: str) -> int | None:
        """The address of the library's function `name` (for a kernel that calls it through a
        pointer), or None without the library. Read once per library, so callers on a hot path
        need no cache of their own."""
        lib = self.load()
        if lib is None:
            return None
        hit = self._addresses.get(name)
        if hit is None or hit[0] is not lib:
            hit = self._addresses[name] = (lib, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
        return hit[1]

    def main(self) -> int:
        """Build (or find) the library and print its path and the seconds it took."""
        t0 = time.perf_counter()
        try:
            path = self.build()
        except RuntimeError as exc:
            print(f"CPU kernel {self.source.name} not built: {exc}", file=sys.stderr)
            return 1
        print(f"{path} ({time.perf_counter() - t0:.2f} s)")
        return 0
