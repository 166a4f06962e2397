"""Reading the router's chunk stream safely.

Owns: `EngineClient` (the seam between the HTTP layer and a router: a Serve handle in production,
a scripted fake in tests), `EngineStream` (next chunk with a deadline; `close`) and `open_stream`
(start a request and read its first chunk, so that an admission error becomes an HTTP error and not
a 200 event stream). Closing the engine's async iterator is how a request is cancelled in the
router (its KV blocks are freed), so it must happen on every exit path, even while the caller is
itself being cancelled.

Must not import: ray, torch, transformers, fastapi.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from serve_app.openai.errors import OpenAIError, from_engine_error, server_error
from serve_app.unit_api import GenerateChunk, GenerateRequest, ModelInfo

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the OpenAI server needs from a serving unit."""

    @property
    def model_info(self) -> ModelInfo: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Chunks for one request; closing the iterator (`aclose`) cancels the request."""
        ...

    async def health(self) -> bool: ...


class EngineStream:
    """One request's chunk stream. `close` cancels the request in the router; it is idempotent and
    finishes even if the calling task is being cancelled (a client disconnect)."""

    def __init__(self, chunks: AsyncIterator[GenerateChunk]) -> None:
        self._chunks = chunks
        self._closing: asyncio.Future[None] | None = None

    async def next(self, deadline: float | None = None) -> GenerateChunk:
        """The next chunk, checked; `deadline` is event-loop time (`loop.time()`) after which we give up."""
        try:
            if deadline is None:
                return check_chunk(await anext(self._chunks))
            async with asyncio.timeout_at(deadline):
                return check_chunk(await anext(self._chunks))
        except StopAsyncIteration:
            raise server_error("the engine stream ended without a finish reason", code="engine_protocol_error") \
                from None
        except TimeoutError:
            raise OpenAIError(504, "the request ran past the server's request timeout and was aborted",
                              "server_error", None, "request_timeout") from None

    async def close(self) -> None:
        if self._closing is None:
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is None:
                return
            self._closing = asyncio.ensure_future(aclose())
            self._closing.add_done_callback(_log_close_failure)
        try:
            # shield: a cancelled caller must not interrupt the close half-way.
            await asyncio.shield(self._closing)
        except asyncio.CancelledError:
            raise
        except Exception:  # already logged; a failing close must not hide the response or the first error
            pass

    @property
    def closed(self) -> bool:
        return self._closing is not None and self._closing.done()


def _log_close_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("closing the engine stream failed", exc_info=future.exception())


def check_chunk(chunk: GenerateChunk) -> GenerateChunk:
    """The chunk, or the OpenAI error it carries."""
    if chunk.error is not None:
        raise from_engine_error(chunk.error)
    if chunk.finish_reason == "abort":
        # The router dropped the request (shutdown, lost replica): retrying elsewhere may work.
        raise OpenAIError(503, "the engine aborted the request", "server_error", None, "engine_aborted", 1.0)
    return chunk


async def open_stream(engine: EngineClient, request: GenerateRequest, deadline: float | None = None
                      ) -> tuple[EngineStream, GenerateChunk]:
    """Start `request` and return its stream with the first chunk already read and checked."""
    stream = EngineStream(engine.generate(request))
    try:
        first = await stream.next(deadline)
    except BaseException:
        await stream.close()
        raise
    return stream, first
