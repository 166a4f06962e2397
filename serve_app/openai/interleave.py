"""Several async iterators read as one, items in the order they are ready: the choices of a
request with `n` > 1 stream side by side, each event tagged with its choice's `index`.

Owns: `interleave`. Every source is read by at most one pending `anext` at a time; the first
error raised by any source ends the merged iterator with that error, and every source still open
is closed (so no engine stream is left running) on every exit: end, error, or the consumer
closing or abandoning the merged iterator.

Must not import: ray, torch, fastapi, tidal_core.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def _close(source: AsyncIterator[T]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def interleave(sources: Sequence[AsyncIterator[T]]) -> AsyncGenerator[T, None]:
    if len(sources) == 1:  # no tasks on the common path (n = 1): one stream, read directly
        try:
            async for item in sources[0]:
                yield item
        finally:
            await _close(sources[0])
        return
    pending: dict[asyncio.Task[T], AsyncIterator[T]] = {
        asyncio.ensure_future(anext(s)): s for s in sources}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                source = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[asyncio.ensure_future(anext(source))] = source
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
        for source in sources:
            await _close(source)
