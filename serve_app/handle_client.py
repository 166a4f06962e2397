"""A ServingUnit deployment's Serve handle as the ingress's `EngineClient`.

Owns: `HandleEngineClient`: Serve-level failures become `EngineError` chunks (429 when the
router's queue is full, 503 when no unit is there or a unit failed), a request the client leaves
is cancelled in its unit, and after a unit fails new requests get 503 + Retry-After at once until
a bounded health probe says a unit serves again.

Must not import: torch.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.openai.errors import OpenAIError, from_engine_error
from serve_app.unit_api import UNIT_REPLACED, EngineError, GenerateChunk, GenerateRequest, ModelInfo
from tidal_core import UnitLoad
from tidal_core.front_admission import DoorRefusal

logger = logging.getLogger(__name__)


class _UnitLost(Exception):
    """A unit failed while this request waited for its first chunk."""


class HandleEngineClient:
    """A router deployment as an `EngineClient`. Serve-level failures become `EngineError` chunks.

    After a unit fails (its router answers `engine_failed`, or the call dies with the actor),
    new requests get 503 + Retry-After at once until a health probe, bounded in time, says a unit
    serves again: Serve's handle would otherwise hold them, while no ServingUnit replica exists,
    until the rebuilt one is up (a model load: minutes for a 70B). With several units the
    probe reaches a healthy one within a period and traffic resumes on it. Requests already on
    their way when the failure is noticed, still without a first chunk, get the same 503: over
    Serve's gRPC data plane (serve_app/cluster_env.py) a request routed to a replica that died
    before taking it is routed again, and with no replica left it would wait for the rebuild.
    """

    PROBE_PERIOD_S = 0.5
    PROBE_TIMEOUT_S = 1.0
    RECOVERING_RETRY_AFTER_S = 5.0

    def __init__(self, router: DeploymentHandle[Any], model_info: ModelInfo,
                 on_load: Callable[[UnitLoad, float | None, int], None] | None = None) -> None:
        self._router = router
        self.model_info = model_info
        # each unit's snapshot, its request's wait and prompt tokens, as its verdicts bring them (the
        # front gate's feed)
        self.on_load = on_load
        self.recovering = False
        self._probe: asyncio.Task[None] | None = None  # a strong reference keeps the task alive
        self._awaiting_first: set[asyncio.Future[None]] = set()  # set when a unit fails: see _first_chunk

    def recovering_error(self) -> OpenAIError | None:
        """503 + Retry-After while a failed unit is rebuilt (answered at the door by the front gate)."""
        if not self.recovering:
            return None
        return from_engine_error(EngineError.unavailable("engine_recovering", UNIT_REPLACED,
                                                         self.RECOVERING_RETRY_AFTER_S))

    async def load(self, refused_at_door: Sequence[DoorRefusal] = ()) -> UnitLoad:
        """One unit's published snapshot (the front gate's poll, passing on its refusals since the last,
        one (prompt estimate, reason) each)."""
        return cast(UnitLoad, await self._router.load_stats.remote(list(refused_at_door)))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self.recovering:
            yield GenerateChunk(error=EngineError.unavailable("engine_recovering", UNIT_REPLACED,
                                                              self.RECOVERING_RETRY_AFTER_S))
            return
        if self.on_load is not None:
            request = dataclasses.replace(request, report_load=True)
        response = cast(DeploymentResponseGenerator[GenerateChunk],
                        self._router.generate.options(stream=True).remote(request))
        finished = False  # the router is done once it sent a finish reason or an error (the contract)
        chunks = aiter(response)
        try:
            first = True
            while True:
                try:
                    chunk = await (self._first_chunk(chunks) if first else anext(chunks))
                except StopAsyncIteration:
                    break
                first = False
                if chunk.load is not None and self.on_load is not None:
                    self.on_load(chunk.load, chunk.waited_s, chunk.num_prompt_tokens)
                    if not chunk.token_ids and chunk.finish_reason is None and chunk.error is None:
                        continue  # the admission verdict's snapshot alone: nothing to render
                finished = chunk.finish_reason is not None or chunk.error is not None
                if chunk.error is not None and chunk.error.code == "engine_failed":
                    self._unit_failed()
                yield chunk
            finished = True
        except _UnitLost:
            yield GenerateChunk(error=EngineError.unavailable("engine_failed", UNIT_REPLACED,
                                                              self.RECOVERING_RETRY_AFTER_S))
        except BackPressureError as err:  # the router's max_queued_requests is full
            # Status and Retry-After come from the ServingUnit's `backpressure_config` (Serve's default is 503).
            status = 429 if getattr(err, "status_code", 503) == 429 else 503
            kind = "rate_limit_error" if status == 429 else "server_error"
            yield GenerateChunk(error=EngineError(status, kind, "router_queue_full", str(err),
                                                  getattr(err, "retry_after_s", None)))
        except (DeploymentUnavailableError, ReplicaUnavailableError) as err:
            yield GenerateChunk(error=EngineError.unavailable("engine_unavailable", str(err), 1.0))
        except Exception:  # a dead actor or a router bug: the client gets a clean 5xx, the log the cause
            logger.exception("router call for %s failed", request.request_id)
            self._unit_failed()
            yield GenerateChunk(error=EngineError.unavailable("engine_failed", "the serving unit failed; retry", 1.0))
        finally:
            if not finished:
                response.cancel()  # type: ignore[no-untyped-call]  # disconnect, stop string, timeout or failure: abort in the router

    async def health(self) -> bool:
        return bool(await self._router.health.remote())

    async def _first_chunk(self, chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk:
        """The stream's first chunk, or `_UnitLost` if a unit is noticed failed before it comes."""
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._awaiting_first.add(lost)
        first = asyncio.ensure_future(anext(chunks))
        try:
            await asyncio.wait((first, lost), return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                return first.result()
            raise _UnitLost
        finally:
            self._awaiting_first.discard(lost)
            first.cancel()

    def _unit_failed(self) -> None:
        for waiting in self._awaiting_first:
            if not waiting.done():
                waiting.set_result(None)
        if self.recovering:
            return
        self.recovering = True
        logger.warning("a serving unit failed: answering 503 until a health probe succeeds")
        # A fresh context: the probe must not be a child of the request that saw the failure
        # (Serve cancels a request's children when its client leaves).
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_healthy(),
                                                             context=contextvars.Context())

    async def _probe_until_healthy(self) -> None:
        while True:
            response = self._router.health.remote()
            try:
                healthy = bool(await asyncio.wait_for(response, self.PROBE_TIMEOUT_S))
            except Exception:  # timed out (no replica to take it) or the replica failed
                response.cancel()
                healthy = False
            if healthy:
                self.recovering = False
                logger.info("a serving unit answers healthy again: taking requests")
                return
            await asyncio.sleep(self.PROBE_PERIOD_S)
