"""The HTTP front door: the FastAPI application and the Ray Serve `Ingress` deployment.

Owns: routes (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /v1/models/{id}`, `GET /health`), every HTTP error in OpenAI's shape (400 validation /
malformed JSON, 404, 405, 413, 415, 429 and 503 with `Retry-After`, 500 only for bugs),
`SSEResponse` (closing it cancels the engine request: client disconnects free KV) and the
`Ingress` deployment, which loads the tokenizer and the model's sampling defaults and builds one
`OpenAIServer` (over its unit's handle: serve_app/handle_client.py) and one `FrontGate`
(serve_app/front_gate.py: front-end admission, before any queue) per replica. Every 429 leaves
with its retry-after spread by the gate (`Retry-After` and `retry-after-ms`).

Wiring with `@serve.ingress(app)`: Serve runs a frozen copy of the module-level `app`; routes find
the replica's `OpenAIServer` in `request.app.state`, which `Ingress.__serve_build_asgi_app__`
fills on that copy after `__init__`. Tests build their own app with `build_app(server)`.
Deployment options (replicas, CPUs) are the configs' business, not set here.

Must not import: torch at module level (the tokenizer loader is imported inside `Ingress`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from serve_app.auth import ApiKeyGate, ApiKeyMiddleware, gate_from_args
from serve_app.front_gate import FrontGate, gate_headers
from serve_app.handle_client import HandleEngineClient
from serve_app.ingress_gate import FrontGateMiddleware
from serve_app.key_usage import MeteredEngine
from serve_app.memory_trim import start_trimming
from serve_app.metrics import aim_gauge, front_delay_histogram, refusal_counter
from serve_app.openai.arrival_stamp import ArrivalKey
from serve_app.openai.errors import OpenAIError, server_error, unavailable
from serve_app.openai.http_limits import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, error_response
from serve_app.openai.requests import ChatCompletionRequest, CompletionRequest
from serve_app.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from serve_app.openai.sampling_defaults import read_generation_config, resolve_sampling_defaults
from serve_app.openai.server import EventStream, OpenAIServer
from serve_app.openai.validation import format_validation_errors
from serve_app.openapi_doc import document_openapi
from serve_app.unit_api import ModelInfo
from tidal_core import AdmissionConfig

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m-instruct"

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "Invalid request (names the parameter)"), (413, "Request body too large"),
        (415, "Content-Type is not application/json"), (429, "Overloaded; see Retry-After"),
        (500, "Server bug"), (503, "No serving capacity; see Retry-After"), (504, "Request timeout"))
}
_SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or an SSE stream when `stream` is true"}}


class SSEResponse(StreamingResponse):
    """An event stream whose body is closed on every exit (end, error, disconnect, cancellation)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # an expected end of a stream, not a server error to log
            logger.debug("client disconnected from %s", scope.get("path"))
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, media_type="application/json")


def _server(request: Request) -> OpenAIServer:
    server = getattr(request.app.state, "openai_server", None)
    if server is None:  # fallback if Serve ever skips __serve_build_asgi_app__: ask the replica itself
        try:
            server = getattr(serve.get_replica_context().servable_object, "server", None)
        except Exception:  # not inside a Serve replica (tests, plain uvicorn)
            server = None
    if not isinstance(server, OpenAIServer):
        raise unavailable("the server is still starting", code="not_ready")
    return server


def _respond(result: BaseModel | EventStream, request_id_header: str) -> Response:
    if isinstance(result, EventStream):
        # No proxy buffering, no caching: each event must reach the client when it is produced.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id_header}
        return SSEResponse(result, headers=headers)
    response = _json(result)
    response.headers["X-Request-Id"] = request_id_header
    return response


def _arrival_s(request: Request) -> float:
    return float(getattr(request.state, "arrival_s", time.time()))


api = APIRouter()


@api.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_SSE})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    result = await _server(request).create_completion(body, _arrival_s(request))
    return _respond(result, result.request_id if isinstance(result, EventStream) else result.id)


@api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_SSE})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    result = await _server(request).create_chat_completion(body, _arrival_s(request))
    return _respond(result, result.request_id if isinstance(result, EventStream) else result.id)


@api.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    return _json(_server(request).list_models())


@api.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def retrieve_model(model_id: str, request: Request) -> Response:
    return _json(_server(request).retrieve_model(model_id))


@api.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(request: Request) -> Response:
    ok = await _server(request).health()
    return _json(HealthResponse(status="ok" if ok else "unavailable"), 200 if ok else 503)


async def _on_openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    response = error_response(exc)
    response.headers.update(gate_headers(getattr(request.app.state, "front_gate", None), exc, "unit"))
    return response


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param, code = format_validation_errors(exc.errors())
    return error_response(OpenAIError(400, message, "invalid_request_error", param, code))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        err = OpenAIError(404, f"Invalid URL ({where}).", "invalid_request_error", None, "unknown_url")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = OpenAIError(405, f"Method not allowed ({where}); allowed: {allowed}.", "invalid_request_error",
                          None, "method_not_allowed")
    else:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = OpenAIError(exc.status_code, str(exc.detail), kind, None, None)
    return error_response(err, exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(server_error("internal server error"))


def build_app(server: OpenAIServer | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              auth_gate: ApiKeyGate | None = None) -> FastAPI:
    """A FastAPI app with every route and handler; `server` and `auth_gate` may be attached later via
    `app.state`."""
    app = FastAPI(title="tidalserve", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions (see docs/api.md).")
    app.state.openai_server = server
    app.state.max_body_bytes = max_body_bytes
    app.state.front_gate = None
    app.state.arrival_key = None  # no proxy stamp is trusted until an Ingress sets its key
    app.state.on_front_delay = None
    app.include_router(api)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(FrontGateMiddleware)  # before any body is read
    # --- API keys (serve_app/auth.py): added last, so it runs first, before any other work ---
    app.state.auth_gate = auth_gate
    app.add_middleware(ApiKeyMiddleware)
    # --- end API keys ---
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    document_openapi(app)
    return app


app = build_app()


def _settings(model: str | Mapping[str, Any], served_model_name: str | None, max_body_bytes: int | None,
              request_timeout_s: float | None) -> tuple[str, list[str], int, float | None]:
    """(model to load the tokenizer of, accepted names, body limit, timeout) from either call form."""
    if isinstance(model, Mapping):
        from serve_app.config_loader import AppArgs

        args = AppArgs.model_validate(dict(model))
        name, served = args.engine.model, args.engine.served_model_name
        body = args.ingress.max_body_bytes
        timeout: float | None = args.ingress.request_timeout_s
    else:
        name, served, body, timeout = model, None, DEFAULT_MAX_BODY_BYTES, None
    served = served_model_name or served
    return (name, [n for n in (served, name) if n], max_body_bytes or body,
            request_timeout_s if request_timeout_s is not None else timeout)


def _config_sampling(model: str | Mapping[str, Any]) -> dict[str, Any]:
    """The serve config's `default_sampling` (fields it leaves unset are absent)."""
    if not isinstance(model, Mapping):
        return {}
    from serve_app.config_loader import AppArgs

    return AppArgs.model_validate(dict(model)).default_sampling.model_dump(exclude_none=True)


@serve.deployment
@serve.ingress(app)
class Ingress:
    async def __init__(  # type: ignore[misc]  # an async constructor: Serve awaits it
        self, router: DeploymentHandle[Any], model: str | Mapping[str, Any] = DEFAULT_MODEL, *,
        served_model_name: str | None = None, max_body_bytes: int | None = None,
        request_timeout_s: float | None = None, arrival_key: str | None = None,
    ) -> None:
        from actors import model_loader  # imports torch: only in the replica, not for the schema

        name, aliases, self.max_body_bytes, timeout = _settings(model, served_model_name, max_body_bytes,
                                                                request_timeout_s)
        path = await asyncio.to_thread(model_loader.prepare, name)
        tokenizer = await asyncio.to_thread(model_loader.load_tokenizer, path)
        info: ModelInfo = await router.model_info.remote()
        sampling = resolve_sampling_defaults(read_generation_config(path), _config_sampling(model))
        admission: AdmissionConfig = await router.admission_config.remote()
        handle_client = HandleEngineClient(router, info)
        app_name = serve.get_replica_context().replica_id.deployment_id.app_name
        self.gate = FrontGate(admission, handle_client.load, closed=handle_client.recovering_error,
                              on_refusal=refusal_counter("ingress"), on_aim=aim_gauge("ingress", app_name))
        handle_client.on_load = self.gate.observe
        engine: Any = handle_client
        # --- API keys (serve_app/auth.py): None when no key is configured ---
        from serve_app.config_loader import env_api_keys

        self.auth_gate = gate_from_args(model if isinstance(model, Mapping) else None, env_api_keys())
        if self.auth_gate is not None:
            engine = MeteredEngine(engine, self.auth_gate.usage)
        self.server = OpenAIServer(engine, tokenizer, model_aliases=aliases, request_timeout_s=timeout,
                                   sampling_defaults=sampling)
        # The proxy's arrival stamps are signed with this (serve_app/openai/arrival_stamp.py): one
        # key per application build, the same in every replica (serve_app/app.py); one of its own
        # when built alone.
        self.arrival_key = ArrivalKey(arrival_key)
        self._trim_task = start_trimming()  # freed heap back to the OS (serve_app/memory_trim.py)
        logger.info("ingress ready: model %r (aliases %s), max_model_len %d, sampling defaults %s", info.model_id,
                    aliases, info.max_model_len, sampling.describe())

    async def key_digests(self) -> Any:
        """The accepted keys as digests and ids (never a key), for the proxy's gate; None: no keys."""
        return None if self.auth_gate is None else self.auth_gate.store.current(self.auth_gate.usage.clock())

    async def arrival_key_hex(self) -> str:
        """The key the proxy's gate signs arrival stamps with (a cluster-internal call; never
        sent to a client)."""
        return self.arrival_key.hex

    def __serve_build_asgi_app__(self) -> Any:
        # Serve calls this after __init__ with the frozen copy of `app` already attached.
        asgi = self.app  # type: ignore[attr-defined]
        asgi.state.openai_server = self.server
        asgi.state.max_body_bytes = self.max_body_bytes
        asgi.state.front_gate = self.gate
        asgi.state.arrival_key = self.arrival_key
        asgi.state.on_front_delay = front_delay_histogram()
        asgi.state.auth_gate = self.auth_gate  # API keys (serve_app/auth.py)
        return asgi
