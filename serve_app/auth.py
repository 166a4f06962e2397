"""API-key checking and per-key rate limits, before any other work on a request.

Owns: `bearer_token` (the key in an `Authorization: Bearer <key>` header, or None), `ApiKeyGate`
(one Ingress replica's keys, open paths and per-key limits; `gate_from_args` builds it from the
`auth:` block and `TIDAL_API_KEYS`, or returns None when no key is configured) and
`ApiKeyMiddleware` (a pure ASGI middleware, the outermost of the app: it reads only the headers,
never the body).

Answers: no key, a malformed header and an unknown key all get the same 401 (`invalid_api_key`,
same body, same headers, the same hashing work), so a caller learns nothing about which keys
exist; a valid key over its RPM or TPM gets 429 `rate_limit_exceeded` with its own
`Retry-After` (and `retry-after-ms`, which the official clients prefer), distinct from the
overload 429s of admission control (`queue_full`, `prefill_backlog`, ...). Paths in
`open_paths` (default `/health`) are served without a key.

Must not import: torch, fastapi (Starlette's ASGI types only); ray only inside `_gate`'s fallback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.api_keys import KeySet, KeyStore
from serve_app.key_usage import CURRENT_KEY, KeyUsage
from serve_app.openai.errors import OpenAIError
from serve_app.openai.http_limits import error_response, route_path
from tidal_core.rate_limit import KeyLimits, RateLimiter, Verdict

# A child of Serve's logger, so the lines reach the replica's log file (Serve keeps INFO only there).
logger = logging.getLogger(f"ray.serve.{__name__}")

INVALID_KEY = OpenAIError(401, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                          "invalid_request_error", None, "invalid_api_key")
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="tidalserve"'}


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """RFC 6750: exactly one Authorization header, scheme `Bearer` (any case), one or more spaces,
    then a token without whitespace. Anything else is None."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, rest = values[0].strip(b" \t").partition(b" ")
    token = rest.lstrip(b" ")
    if scheme.lower() != b"bearer" or not token or any(c in token for c in b" \t\r\n"):
        return None
    return token


def presented_key(headers: Iterable[tuple[bytes, bytes]], lookup: Callable[[bytes], str | None]) -> str | None:
    """The id of the key an `Authorization: Bearer` header carries, or None. The lookup runs even
    without a token, so a missing header costs the same work as a wrong key."""
    token = bearer_token(headers)
    key = lookup(token if token is not None else b"")
    return None if token is None else key


def rate_limited(key: str, verdict: Verdict) -> OpenAIError:
    kind = verdict.kind or "requests"
    wait = verdict.retry_after_s
    message = (f"Rate limit reached for {key} on {kind} per minute: limit {verdict.limit}. "
               f"Please try again in {wait:.3g}s.")
    return OpenAIError(429, message, kind, None, "rate_limit_exceeded", wait)


@dataclass
class ApiKeyGate:
    store: KeyStore
    usage: KeyUsage
    open_paths: frozenset[str] = frozenset({"/health"})

    def on_keys_changed(self, keys: KeySet) -> None:
        self.usage.keep_only(set(keys.ids))

    def check(self, scope: Scope) -> tuple[str | None, OpenAIError | None, dict[str, str]]:
        """(key id, error, extra headers): (None, None, {}) for an open path."""
        if route_path(scope) in self.open_paths:
            return None, None, {}
        now = self.usage.clock()
        key = presented_key(scope.get("headers") or (), lambda token: self.store.lookup(token, now))
        if key is None:
            self.usage.auth_failed()
            return None, INVALID_KEY, UNAUTHORIZED_HEADERS
        verdict = self.usage.admit(key)
        if not verdict.allowed:
            err = rate_limited(key, verdict)
            headers = {"retry-after-ms": str(max(1, math.ceil(verdict.retry_after_s * 1000))),
                       f"x-ratelimit-limit-{err.type}": str(verdict.limit)}
            return key, err, headers
        return key, None, {}


def gate_from_args(args: Mapping[str, Any] | None, env_keys: list[str], *, metrics: bool = True) -> ApiKeyGate | None:
    """The gate for an application's `args` (None when no key is configured and none is required)."""
    from serve_app.config_loader import AuthArgs

    auth = AuthArgs.model_validate(dict((args or {}).get("auth") or {}))
    if not (auth.required or auth.keys_file or env_keys):
        return None
    per_key = {k: KeyLimits(v.rpm, v.tpm) for k, v in auth.per_key.items()}
    usage = KeyUsage(RateLimiter(KeyLimits(auth.rpm, auth.tpm), per_key), metrics=metrics)
    store = KeyStore(env_keys, auth.keys_file, auth.reload_period_s)
    if auth.required and not len(store.keys) and not auth.keys_file:
        raise ValueError("auth.required is true but no API key is configured: set auth.keys_file or "
                         "the TIDAL_API_KEYS environment variable of the Ingress replicas")
    gate = ApiKeyGate(store, usage, frozenset(auth.open_paths))
    store.on_change = gate.on_keys_changed
    logger.info("API keys required: %d accepted (%s); open paths %s; per-key limits rpm=%s tpm=%s", len(store.keys),
                ", ".join(store.keys.ids) or "none yet", sorted(gate.open_paths), auth.rpm, auth.tpm)
    return gate


SECURITY_SCHEME = "apiKey"


def document_auth(schema: dict[str, Any], gate: ApiKeyGate, error_schema_ref: str) -> None:
    """Declare the key check in an OpenAPI schema: an HTTP bearer scheme, required by every
    operation outside `open_paths`, each of which may answer 401 `invalid_api_key` (and 429
    `rate_limit_exceeded`, documented with the overload 429)."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
        "type": "http", "scheme": "bearer",
        "description": "An API key of this server, sent as `Authorization: Bearer <key>`."}
    for path, operations in schema.get("paths", {}).items():
        if path in gate.open_paths:
            continue
        for operation in operations.values():
            operation["security"] = [{SECURITY_SCHEME: []}]
            operation.setdefault("responses", {})["401"] = {
                "description": "Missing, malformed or unknown API key (`invalid_api_key`)",
                "content": {"application/json": {"schema": {"$ref": error_schema_ref}}}}
            if "429" not in operation["responses"]:
                operation["responses"]["429"] = {
                    "description": "The key's requests or tokens per minute are used up "
                                   "(`rate_limit_exceeded`); see Retry-After",
                    "content": {"application/json": {"schema": {"$ref": error_schema_ref}}}}


def _gate(scope: Scope) -> ApiKeyGate | None:
    state = getattr(scope.get("app"), "state", None)
    gate: ApiKeyGate | None = getattr(state, "auth_gate", None)
    if gate is None and getattr(state, "openai_server", None) is None:
        # The app's state was never filled in (as serve_app/ingress.py's `_server` allows for): ask the
        # replica itself, so a configured key check cannot be skipped by accident (fail closed).
        try:
            from ray import serve

            gate = getattr(serve.get_replica_context().servable_object, "auth_gate", None)
        except Exception:  # not inside a Serve replica (tests, plain uvicorn)
            gate = None
    return gate


class ApiKeyMiddleware:
    """Runs `app.state.auth_gate` (if set) on every HTTP request before anything else."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = _gate(scope) if scope["type"] == "http" else None
        if gate is None:
            await self.app(scope, receive, send)
            return
        key, err, headers = gate.check(scope)
        if err is not None:
            await error_response(err, headers)(scope, receive, send)
            return
        token = CURRENT_KEY.set(key)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_KEY.reset(token)
