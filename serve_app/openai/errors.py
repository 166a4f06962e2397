"""Errors as the OpenAI API shows them.

Owns: `OpenAIError` (HTTP status + the `{"error": {message, type, param, code}}` body + headers such
as `Retry-After`), constructors for the common kinds, and the mapping from the router's
`EngineError` to it.

Status policy: bad input is 400 `invalid_request_error` and never 500; overload is 429
`rate_limit_error` with `Retry-After`; no serving capacity is 503 with `Retry-After`; 500
`server_error` only for our own bugs.

Must not import: ray, torch, transformers, fastapi.
"""

from __future__ import annotations

import math
from typing import Any

from serve_app.openai.responses import ErrorInfo, ErrorResponse
from serve_app.unit_api import EngineError

DEFAULT_RETRY_AFTER_S = 1.0


def retry_after_header(seconds: float | None) -> str:
    """Whole seconds, rounded up; at least 1, because 0 invites an immediate retry storm."""
    value = DEFAULT_RETRY_AFTER_S if seconds is None or not math.isfinite(seconds) else seconds
    return str(max(1, math.ceil(value)))


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def body_dict(self) -> dict[str, Any]:
        return self.body().model_dump()

    def headers(self) -> dict[str, str]:
        if self.status in (429, 503):
            return {"Retry-After": retry_after_header(self.retry_after_s)}
        return {}

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.type!r}, {self.code!r}, {self.message!r})"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def server_error(message: str, code: str = "internal_error") -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, code)


def unavailable(message: str, code: str = "engine_unavailable", retry_after_s: float | None = None) -> OpenAIError:
    return OpenAIError(503, message, "server_error", None, code, retry_after_s)


_TYPE_BY_STATUS = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                   500: "server_error", 503: "server_error"}


def from_engine_error(err: EngineError) -> OpenAIError:
    """The router's verdict, as the client sees it; unknown statuses become 500 (a contract bug)."""
    status = err.status if err.status in _TYPE_BY_STATUS else 500
    kind = err.type or _TYPE_BY_STATUS[status]
    return OpenAIError(status, err.message, kind, None, err.code, err.retry_after_s)
