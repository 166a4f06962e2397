"""The ingress replica's front gate, as the ASGI middleware in front of FastAPI.

Owns: `FrontGateMiddleware`, the pure ASGI middleware that asks the replica's `FrontGate`
(serve_app/front_gate.py; `app.state.front_gate`) about every POST to a generation endpoint
before FastAPI parses or validates a body: a refused request costs no JSON parsing, no
tokenizing and no hop to a unit. The body is read ahead, and parsed only where it names
`service_tier` or `priority`, to let a batch-class request through to its unit's batch queue
(serve_app/openai/body_peek.py). The time the request already spent in front of this replica
(the proxy's signed arrival stamp) counts against its TTFT.

A request let through is answered from behind: the response's start tells the gate whether its
unit admitted it or refused it (`FrontGate.judged_behind`, the gate's `DoorAim`), and the
headers the proxy's gate learns from are added to it: how long the request had waited when its
unit received it (`UNIT_WAITED`) and its prompt's tokens (`PROMPT_TOKENS`).

Must not import: torch, transformers.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.front_gate import PROMPT_TOKENS, REFUSAL_REASON, UNIT_WAITED, FrontGate, current_ticket, gate_headers
from serve_app.openai.arrival_stamp import mark_arrival
from serve_app.openai.body_peek import peek_service_class
from serve_app.openai.http_limits import DEFAULT_MAX_BODY_BYTES, JSON_ENDPOINTS, error_response, route_path
from tidal_core.service_class import ServiceClass


class FrontGateMiddleware:
    """Asks `app.state.front_gate` (if set) about every POST to a generation endpoint, before the body is parsed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope.get("app"), "state", None)
        gate: Any = getattr(state, "front_gate", None)
        if scope["type"] != "http" or not isinstance(gate, FrontGate):
            await self.app(scope, receive, send)
            return
        gate.start()
        if scope["method"] == "POST" and route_path(scope) in JSON_ENDPOINTS:
            length = Headers(scope=scope).get("content-length", "")
            # The time it already spent in front of this replica (the proxy's signed stamp) counts.
            waited = time.time() - mark_arrival(scope, getattr(state, "arrival_key", None),
                                                on_stamped=getattr(state, "on_front_delay", None))
            limit = int(getattr(state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))
            receive, asked = await peek_service_class(receive, length, limit)
            if asked is ServiceClass.BATCH:  # never held to the TTFT target: its unit's batch queue decides
                await self.app(scope, receive, send)
                return
            err = gate.refusal(int(length) if length.isdigit() else 0, max(0.0, waited))
            if err is not None:
                response = error_response(err)
                response.headers.update(gate_headers(gate, err, "ingress"))
                await response(scope, receive, send)
                return
            ticket = current_ticket()

            async def send_with_wait(message: Message) -> None:
                if message["type"] == "http.response.start" and ticket is not None:
                    status = int(message.get("status", 0))  # only a refusal's headers are read for its rule
                    gate.judged_behind(status, Headers(raw=list(message.get("headers", []))).get(REFUSAL_REASON)
                                       if status == 429 else None)
                    waited, tokens = ticket.unit_waited_s, ticket.prompt_tokens
                    extra = [(UNIT_WAITED.encode(), f"{waited * 1e3:.1f}".encode())] if waited is not None else []
                    extra += [(PROMPT_TOKENS.encode(), str(tokens).encode())] if tokens else []
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            try:
                await self.app(scope, receive, send_with_wait)
            finally:
                gate.release()
            return
        await self.app(scope, receive, send)
