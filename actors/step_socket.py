"""Steps to TP workers on the serving unit's own node through a Unix socket instead of a Ray call.

Owns: `StepServer` (the worker's side: a thread that takes plans off a socket, runs them, and
writes back the results) and `StepChannel` (the unit's side: `execute(plan)` sends one plan to
every rank and reads their answers), with their framing (an 8-byte length, then a pickle).

Why: a step's round trip through Ray actor calls costs about 3 ms on a 2-core box (submitting
the task 0.6 ms, reaching the worker 0.9, the result back to the unit's loop 1.4; measured with
timestamps on both sides, benchmarks/RESULTS.md "Fused small ops on CPU, and the step's round
trip"), and the worker sits idle through all of it. At the 20-90 ms steps of a CPU model that
is 3-13% of the worker's time. Over a local socket a plan reaches a worker blocked in `recv`
in tens of microseconds.

Used by actors/replica.py for CPU workers on the unit's node when the group does not run a Ray
Compiled Graph (`ReplicaGroup(step_socket=...)`, `engine.step_socket` in a serve config; GPU
workers keep actor calls: a step thread of their own has not run on a GPU yet). Start-up,
health checks and shutdown stay Ray calls. A worker that dies closes its socket: the unit's
read ends at once and the step fails with `WorkerFailure` instead of waiting out the step
timeout.

Access: the socket file lives in a fresh temporary directory only its user may enter (mode 0700,
as `tempfile.mkdtemp` makes it), and goes as soon as the unit has connected; the messages are
pickles, so only that user's processes (the unit) must reach it, as with Ray's own sockets.

Protocol: the unit sends `pickle(plan)`; the worker answers `pickle((True, result))` or, when
its step raised, `pickle((False, "ExcType: message"))`. One connection at a time per worker, one
plan in flight: exactly the Ray path's contract. A step abandoned half-way (the unit's timeout,
or its caller cancelled) leaves the stream out of step, so the channel then refuses every
later step (the unit is rebuilt, as after any `WorkerFailure`).

Must not import: serve_app, torch (the unit's process never imports torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 1 << 31  # a length past this is a broken stream, not a plan


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from a blocking socket, or None at end of stream (or when the peer reset it)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except OSError:
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)


def frame(obj: object) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class StepServer:
    """The worker's end: `run_step(plan)` called on a thread of its own for each plan that arrives.

    Listens on a socket file in a fresh temporary directory (removed once the unit connects);
    serves one connection at a time, and takes the next when that one ends."""

    def __init__(self, run_step: Callable[[Any], Any]) -> None:
        self.run_step = run_step
        self._dir = tempfile.mkdtemp(prefix="tidal-step-")
        self.address = os.path.join(self._dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(1)
        self._closed = False
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, name="tidal-step-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._unlink()
            self._conn = conn
            with conn:
                self._serve_connection(conn)
            self._conn = None

    def _serve_connection(self, conn: socket.socket) -> None:
        while True:
            header = _recv_exactly(conn, _HEADER.size)
            if header is None:
                return
            (n,) = _HEADER.unpack(header)
            data = _recv_exactly(conn, n) if n <= MAX_MESSAGE else None
            if data is None:
                return
            try:
                reply: tuple[bool, Any] = (True, self.run_step(pickle.loads(data)))
            except Exception as exc:  # the unit turns it into WorkerFailure, as a failed Ray task
                log.exception("step failed")
                reply = (False, f"{type(exc).__name__}: {exc}")
            try:
                conn.sendall(frame(reply))
            except OSError:
                return

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def close(self) -> None:
        """Stop listening and end the connection (the unit's reads end, as when the process dies)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._unlink()


class ChannelError(RuntimeError):
    """A worker's socket closed, answered with an error, or was left out of step."""


class StepChannel:
    """The unit's end: one connected socket per worker, in rank order. Any event loop may drive
    it (the sockets are non-blocking and registered with the running loop per call)."""

    def __init__(self, addresses: list[str]) -> None:
        self.socks: list[socket.socket] = []
        try:
            for address in addresses:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.socks.append(sock)
                sock.connect(address)
                sock.setblocking(False)
        except OSError:
            self.close()
            raise
        self.broken: str | None = None

    async def execute(self, plan: Any) -> list[Any]:
        """Every rank's answer to `plan`. Raises ChannelError (a dead worker, a failed step, or a
        channel an earlier step left out of step); an abandoned call breaks the channel."""
        if self.broken is not None:
            raise ChannelError(self.broken)
        loop = asyncio.get_running_loop()
        message = frame(plan)
        done = False
        try:
            for rank, sock in enumerate(self.socks):
                try:
                    await loop.sock_sendall(sock, message)
                except (BrokenPipeError, ConnectionResetError) as exc:  # it closed before this step
                    self.broken = f"rank {rank}'s step socket closed (the worker died): {exc}"
                    raise ChannelError(self.broken) from exc
            results = await self._read_all(loop)
            done = True
        except OSError as exc:
            self.broken = f"a TP worker's step socket failed: {exc}"
            raise ChannelError(self.broken) from exc
        finally:
            if not done and self.broken is None:
                self.broken = "a step was abandoned half-way; the step socket is out of step"
        return results

    async def _read_all(self, loop: asyncio.AbstractEventLoop) -> list[Any]:
        """Every rank's answer, read side by side: the first rank to fail fails the step at once
        (a dead rank's peers may be blocked in a collective until their own timeout)."""
        if len(self.socks) == 1:
            return [await self._read(loop, self.socks[0], 0)]
        reads = [asyncio.ensure_future(self._read(loop, sock, rank)) for rank, sock in enumerate(self.socks)]
        try:
            await asyncio.wait(reads, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in reads:
                if not task.done():
                    task.cancel()
        # Every finished rank's outcome is read (a second failure is not left "never retrieved");
        # the first rank's failure is the step's.
        errors = [task.exception() for task in reads if task.done() and not task.cancelled()]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [task.result() for task in reads]

    async def _read(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, rank: int) -> Any:
        header = await self._exactly(loop, sock, _HEADER.size, rank)
        (n,) = _HEADER.unpack(header)
        if n > MAX_MESSAGE:
            self.broken = f"rank {rank} sent a {n}-byte message"
            raise ChannelError(self.broken)
        ok, value = pickle.loads(await self._exactly(loop, sock, n, rank))
        if not ok:
            raise ChannelError(f"a TP worker failed: {value}")
        return value

    async def _exactly(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, rank: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = await loop.sock_recv_into(sock, view[got:])
            except ConnectionResetError:
                k = 0
            if k == 0:
                self.broken = f"rank {rank}'s step socket closed (the worker died)"
                raise ChannelError(self.broken)
            got += k
        return bytes(buf)

    def close(self) -> None:
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.close()
        self.socks = []
        self.broken = "closed"
