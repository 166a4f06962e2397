"""HTTP-level guards that run before FastAPI reads a request: body size and content type.

Owns: `BodyLimitMiddleware` (a pure ASGI middleware: 415 for a non-JSON Content-Type on the JSON
endpoints; 413 for a body over `app.state.max_body_bytes`, decided from Content-Length without
reading anything, or while reading a chunked body, never buffering more than the limit; it stamps
`request.state.arrival_s` for TTFT accounting: the proxy's signed stamp when `app.state.arrival_key`
verifies it, else now, serve_app/openai/arrival_stamp.py) and `error_response` (an `OpenAIError` as a JSON
response with its headers).

Must not import: ray, torch, transformers.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.openai.arrival_stamp import mark_arrival
from serve_app.openai.errors import OpenAIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
JSON_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def error_response(err: OpenAIError, extra_headers: Mapping[str, str] | None = None) -> JSONResponse:
    headers = {**(extra_headers or {}), **err.headers()}
    return JSONResponse(err.body_dict(), status_code=err.status, headers=headers)


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def route_path(scope: Scope) -> str:
    """The request's path below the app's root path (where Serve mounts the app at a route prefix)."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    return path[len(root):] if root and path.startswith(root) else path


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        app_state = getattr(scope.get("app"), "state", None)
        mark_arrival(scope, getattr(app_state, "arrival_key", None),
                     on_stamped=getattr(app_state, "on_front_delay", None))
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = int(getattr(app_state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))
        headers = Headers(scope=scope)
        if route_path(scope) in JSON_ENDPOINTS:
            content_type = headers.get("content-type")
            if content_type is None:  # lenient, as OpenAI is: a body without Content-Type is JSON
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
            elif not _is_json(content_type):
                err = OpenAIError(415, f"Content-Type {content_type!r} is not supported; send 'application/json'.",
                                  "invalid_request_error", None, "unsupported_media_type")
                await error_response(err)(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(_too_large(limit))(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > limit:
                await error_response(_too_large(limit))(scope, receive, send)
                return
        await self.app(scope, _replay(bytes(body), receive), send)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                       "invalid_request_error", None, "request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the real channel (so disconnects still reach the app)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
