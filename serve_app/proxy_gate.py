"""Front-end admission in Serve's HTTP proxy: a refusal that never leaves the proxy.

Owns: `middlewares()` (the callback Serve's proxy calls when `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
is `serve_app.proxy_gate:middlewares`) and `ProxyGateMiddleware`, which keeps one `FrontGate`
(serve_app/front_gate.py) per tidalserve application and answers a generation request the gate
refuses right there: no hop to an `Ingress` replica, no body read, no tokenizing.

Why in the proxy: on a small box the proxy's own per-request cost (parsing, routing, the streamed
actor call to the ingress replica) and the ingress replica's are what a burst queues on, before
any gate in the ingress runs (docs/reliability.md, the burst section). Requests the proxy lets
through meet the ingress's gate and then the unit's admission, the final authority.

How it sees the units: every 2 s the applications with a `ServingUnit` deployment and their route
prefixes are read from the controller; each gets a gate that polls its unit's `load_stats` every
0.1 s. The proxy never sees a unit's verdict, so the requests on the way are counted from the
units' own arrival counters (`UnitLoad.num_arrived`): let through, less received since the gate
first saw each unit, less those answered without reaching one (refused by the ingress: its
`x-tidal-refused-by`; a 400), and never more than the requests still open. However congested the
path from here to the unit, they count until they arrive (a time horizon would open the gate
exactly when the path is slowest), and none counts past its end.

Must not import: torch, transformers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.front_gate import REFUSED_BY, FrontGate, gate_headers
from serve_app.openai.http_limits import JSON_ENDPOINTS, error_response

logger = logging.getLogger("ray.serve")  # the proxy's own log (logs/serve/proxy_*.log)
REFRESH_APPS_S = 2.0
UNIT_DEPLOYMENT = "ServingUnit"


def middlewares() -> list[Middleware]:
    """What Serve's proxy adds in front of its routing (see the module docstring)."""
    return [Middleware(ProxyGateMiddleware)]


class ProxyGateMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.gates: dict[str, tuple[str, FrontGate]] = {}  # route prefix -> (application, its gate)
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_apps())
        gate = self._gate_for(scope) if scope["method"] == "POST" else None
        if gate is None:
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        err = gate.refusal(int(length) if length.isdigit() else 0)
        if err is not None:
            response = error_response(err)
            response.headers.update(gate_headers(gate, err, "proxy"))
            await response(scope, receive, send)
            return

        async def send_and_release(message: Message) -> None:
            if message["type"] == "http.response.start":  # the unit's verdict, or none came
                status = int(message.get("status", 0))
                where = Headers(raw=list(message.get("headers", []))).get(REFUSED_BY)
                gate.answered(reached_a_unit=status == 200 or where == "unit")
            await send(message)

        try:
            await self.app(scope, receive, send_and_release)
        finally:
            gate.release()

    def _gate_for(self, scope: Scope) -> FrontGate | None:
        path = str(scope.get("path", ""))
        for prefix, (_, gate) in sorted(self.gates.items(), key=lambda kv: -len(kv[0])):
            root = prefix.rstrip("/")
            if path.startswith(root + "/") and path[len(root):] in JSON_ENDPOINTS:
                return gate
        return None

    async def _refresh_apps(self) -> None:
        while True:
            try:
                await self._sync_apps(await asyncio.to_thread(_tidal_apps))
            except asyncio.CancelledError:
                raise
            except Exception:  # the controller is busy or restarting: keep the gates we have
                logger.debug("proxy gate: reading the applications failed", exc_info=True)
            await asyncio.sleep(REFRESH_APPS_S)

    async def _sync_apps(self, apps: dict[str, str]) -> None:
        from ray import serve

        for prefix in [p for p, (name, _) in self.gates.items() if apps.get(name) != p]:
            _, gone = self.gates.pop(prefix)
            await gone.stop()
        for name, prefix in apps.items():
            if prefix in self.gates:
                continue
            handle = serve.get_deployment_handle(UNIT_DEPLOYMENT, app_name=name)
            admission = await handle.admission_config.remote()

            async def poll(handle: Any = handle) -> Any:
                return await handle.load_stats.remote()

            gate = FrontGate(admission, poll, count_arrivals=True)
            gate.start()
            self.gates[prefix] = (name, gate)
            logger.info("proxy gate: admission for application %r at %r", name, prefix)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, gate in self.gates.values():
            await gate.stop()


def _tidal_apps() -> dict[str, str]:
    """{application: route prefix} of the running applications that have a serving unit (a
    blocking controller call: run it in a thread). `get_serve_details` is what `serve status`
    and the dashboard read; the public `serve.status()` carries no route prefixes."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return {name: app["route_prefix"] for name, app in details.get("applications", {}).items()
            if app.get("route_prefix") and UNIT_DEPLOYMENT in app.get("deployments", {})
            and app.get("status") == "RUNNING"}
