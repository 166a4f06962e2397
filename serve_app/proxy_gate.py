"""Front-end admission in Serve's HTTP proxy: a refusal that never leaves the proxy.

Owns: `middlewares()` (the callback Serve's proxy calls when `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
is `serve_app.proxy_gate:middlewares`) and `ProxyGateMiddleware`, which keeps one `FrontGate`
(serve_app/front_gate.py) per tidalserve application and answers a generation request the gate
refuses right there: no hop to an `Ingress` replica, no body parsed, no tokenizing. The body is
read (not parsed, unless it names `service_tier` or `priority`) to tell a batch-class request,
which no gate holds to the TTFT target (serve_app/openai/body_peek.py).

Why in the proxy: on a small box the proxy's own per-request cost (parsing, routing, the streamed
actor call to the ingress replica) and the ingress replica's are what a burst queues on, before
any gate in the ingress runs (docs/reliability.md, the burst section). Requests the proxy lets
through meet the ingress's gate and then the unit's admission, the final authority.

API keys first: for an application whose Ingress checks keys (serve_app/auth.py), the gate
copies the Ingress's accepted keys as digests and ids (never a key; re-read every 2 s, so a
rotation reaches it within the Ingress's reload period plus 2 s) and answers a missing or unknown
key with the Ingress's own canonical 401 before any admission verdict: a caller without a valid
key never learns the server's load, and a 429 always means a known caller. Until the digests
arrive, requests go on to the Ingress, which checks them itself (fail closed there).

How it sees the units: every 2 s the applications with a `ServingUnit` deployment and their route
prefixes are read from the controller; each gets a gate that polls its unit's `load_stats` every
0.1 s. The proxy never sees a unit's verdict, so the requests on the way are counted from the
units' own arrival counters (`UnitLoad.num_arrived`): let through, less received since the gate
first saw each unit, less those answered without reaching one (refused by the ingress: its
`x-tidal-refused-by`; a 400), and never more than the requests still open. The time the way to a
unit takes is learned from the Ingress's `x-tidal-unit-waited-ms` on each response (how long the
request had waited since this proxy's stamp when its unit received it), and the bytes of body per
prompt token from its `x-tidal-prompt-tokens` (the prompt's tokens as its unit counted them).
However congested the path from here to the unit, they count until they arrive (a time horizon
would open the gate exactly when the path is slowest), and none counts past its end. What the
Ingress's gate or the unit then answers teaches the gate its aim: a `prefill_backlog` refusal
behind it (`x-tidal-refusal-reason`) says its prediction fell short (front_gate.py `judged_behind`).

Arrival stamps: a request the gate lets through carries the proxy's signed arrival time
(serve_app/openai/arrival_stamp.py; the key read from an Ingress with the key digests), so the
Ingress's gate and the unit's admission judge the client's TTFT from here, the time it then spends
queued in this process and on the way to a replica included.

Must not import: torch, transformers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.api_keys import KeySet
from serve_app.auth import INVALID_KEY, UNAUTHORIZED_HEADERS, presented_key
from serve_app.front_gate import PROMPT_TOKENS, REFUSAL_REASON, REFUSED_BY, UNIT_WAITED, FrontGate, gate_headers
from serve_app.metrics import aim_gauge, refusal_counter
from serve_app.openai.arrival_stamp import ArrivalKey, restamp
from serve_app.openai.body_peek import peek_service_class
from serve_app.openai.http_limits import DEFAULT_MAX_BODY_BYTES, JSON_ENDPOINTS, error_response
from tidal_core.front_admission import DoorRefusal
from tidal_core.service_class import ServiceClass

logger = logging.getLogger("ray.serve")  # the proxy's own log (logs/serve/proxy_*.log)
REFRESH_APPS_S = 2.0
UNIT_DEPLOYMENT = "ServingUnit"
INGRESS_DEPLOYMENT = "Ingress"


def middlewares() -> list[Middleware]:
    """What Serve's proxy adds in front of its routing (see the module docstring)."""
    return [Middleware(ProxyGateMiddleware)]


class ProxyGateMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.gates: dict[str, tuple[str, FrontGate]] = {}  # route prefix -> (application, its gate)
        self.keys: dict[str, KeySet] = {}  # application -> its Ingress's accepted keys (digests)
        self.arrival_keys: dict[str, ArrivalKey] = {}  # application -> its arrival-stamp key
        self._auth_failures: Any = None
        self._refusals: Callable[[str], None] | None = None  # tidal_front_refusals{where="proxy"}, made on first use
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_apps())
        found = self._gate_for(scope) if scope["method"] == "POST" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        arrived = time.time()
        name, gate = found
        keys = self.keys.get(name)  # with keys: the same work and answer as the Ingress's check
        if keys is not None and presented_key(scope.get("headers") or (), keys.lookup) is None:
            self._count_auth_failure()
            await error_response(INVALID_KEY, UNAUTHORIZED_HEADERS)(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        receive, asked = await peek_service_class(receive, length, DEFAULT_MAX_BODY_BYTES)
        batch = asked is ServiceClass.BATCH  # never held to the TTFT target: its unit's batch queue decides
        err = None if batch else gate.refusal(int(length) if length.isdigit() else 0)
        if err is not None:
            response = error_response(err)
            response.headers.update(gate_headers(gate, err, "proxy"))
            await response(scope, receive, send)
            return

        stamp_key = self.arrival_keys.get(name)
        if stamp_key is not None:  # the Ingress and the unit count the time spent from here on
            restamp(scope, stamp_key, arrived)
        if batch:
            await self.app(scope, receive, send)
            return

        async def send_and_release(message: Message) -> None:
            if message["type"] == "http.response.start":  # the unit's verdict, or none came
                status = int(message.get("status", 0))
                headers = Headers(raw=list(message.get("headers", [])))
                tokens = headers.get(PROMPT_TOKENS, "")
                gate.judged_behind(status, headers.get(REFUSAL_REASON))
                gate.answered(reached_a_unit=status == 200 or headers.get(REFUSED_BY) == "unit",
                              unit_waited_s=_seconds(headers.get(UNIT_WAITED)),
                              prompt_tokens=int(tokens) if tokens.isdigit() else None)
            await send(message)

        try:
            await self.app(scope, receive, send_and_release)
        finally:
            gate.release()

    def _gate_for(self, scope: Scope) -> tuple[str, FrontGate] | None:
        path = str(scope.get("path", ""))
        for prefix, found in sorted(self.gates.items(), key=lambda kv: -len(kv[0])):
            root = prefix.rstrip("/")
            if path.startswith(root + "/") and path[len(root):] in JSON_ENDPOINTS:
                return found
        return None

    def _count_auth_failure(self) -> None:
        if self._auth_failures is None:
            from ray.util import metrics as ray_metrics

            from serve_app.metric_defs import AUTH_FAILURES as D

            self._auth_failures = ray_metrics.Counter(D.name, description=D.description, tag_keys=D.tag_keys)
        self._auth_failures.inc(1)

    def _count_refusal(self, reason: str) -> None:
        if self._refusals is None:
            self._refusals = refusal_counter("proxy")
        self._refusals(reason)

    async def _refresh_keys(self) -> None:
        from ray import serve

        for name, _ in list(self.gates.values()):
            ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=name)
            keys = await ingress.key_digests.remote()
            if keys is None:
                self.keys.pop(name, None)
            else:
                self.keys[name] = keys
            key_hex = await ingress.arrival_key_hex.remote()
            known = self.arrival_keys.get(name)
            if known is None or known.hex != key_hex:
                self.arrival_keys[name] = ArrivalKey(key_hex)

    async def _refresh_apps(self) -> None:
        while True:
            try:
                await self._sync_apps(await asyncio.to_thread(_tidal_apps))
                await self._refresh_keys()
            except asyncio.CancelledError:
                raise
            except Exception:  # the controller is busy or restarting: keep the gates we have
                logger.debug("proxy gate: reading the applications failed", exc_info=True)
            await asyncio.sleep(REFRESH_APPS_S)

    async def _sync_apps(self, apps: dict[str, str]) -> None:
        from ray import serve

        for prefix in [p for p, (name, _) in self.gates.items() if apps.get(name) != p]:
            gone_name, gone = self.gates.pop(prefix)
            self.keys.pop(gone_name, None)
            self.arrival_keys.pop(gone_name, None)
            await gone.stop()
        for name, prefix in apps.items():
            if prefix in self.gates:
                continue
            handle = serve.get_deployment_handle(UNIT_DEPLOYMENT, app_name=name)
            admission = await handle.admission_config.remote()

            async def poll(refused_at_door: list[DoorRefusal], handle: Any = handle) -> Any:
                return await handle.load_stats.remote(refused_at_door)

            gate = FrontGate(admission, poll, count_arrivals=True, on_refusal=self._count_refusal,
                             on_aim=aim_gauge("proxy", name))
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


def _seconds(ms: str | None) -> float | None:
    try:
        return float(ms) / 1e3 if ms is not None else None
    except ValueError:
        return None


def _tidal_apps() -> dict[str, str]:
    """{application: route prefix} of the running applications that have a serving unit (a
    blocking controller call: run it in a thread). `get_serve_details` is what `serve status`
    and the dashboard read; the public `serve.status()` carries no route prefixes."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return {name: app["route_prefix"] for name, app in details.get("applications", {}).items()
            if app.get("route_prefix") and UNIT_DEPLOYMENT in app.get("deployments", {})
            and app.get("status") == "RUNNING"}
