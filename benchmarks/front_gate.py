"""What a refusal at the front door costs by itself: the gate's decision and its 429, in process.

No Ray, no network: (1) `tidal_core.FrontAdmission.check` on one busy unit's snapshot; (2) the
whole refusal through the ASGI stack the proxy's gate runs in (`ProxyGateMiddleware`: read the
`Content-Length`, decide, spread the retry-after, render the 429 and send it), driven by direct ASGI
calls; (3) beside it, for scale, the same request let through to the full FastAPI app of the
ingress (validation, chat template, tokenizing, a fake engine's first chunk), as the request
would cost once admitted. Per-call wall time, median of `--repeat` rounds of `--n` calls.

    python benchmarks/front_gate.py [--n 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_app.front_gate import FrontGate
from serve_app.ingress import build_app
from serve_app.openai.server import OpenAIServer
from serve_app.proxy_gate import ProxyGateMiddleware
from tidal_core import AdmissionConfig, Regime, UnitLoad
from tidal_core.front_admission import FrontAdmission, Sighting

BUSY = UnitLoad("u", num_running=40, num_waiting=30, queue_delay_s=6.0, kv_usage=0.2, capacity_rps=3.0,
                regime=Regime.OVERLOAD, prefill_s_per_token=1e-4)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 128,
                   "stream": True}).encode()


def _scope(path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
            "client": ("127.0.0.1", 1), "server": ("bench", 80)}


async def _asgi_calls(app: Any, path: str, n: int) -> tuple[float, int]:
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    t0 = time.perf_counter()
    for _ in range(n):
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.sleep(3600)  # the client stays: no disconnect
            return {"type": "http.disconnect"}

        await app(_scope(path), receive, send)
    return (time.perf_counter() - t0) / n, statuses[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    front = FrontAdmission(AdmissionConfig())
    seen = [Sighting(BUSY, 0.0)]
    decide = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for _ in range(args.n):
            front.check(seen, 0.5, 400, 0.0, 0, 0)
        decide.append((time.perf_counter() - t0) / args.n)

    async def downstream(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a refused request reached the app behind the gate")

    proxy = ProxyGateMiddleware(downstream)
    proxy._task = asyncio.Future()  # type: ignore[assignment]  # no controller here
    gate = FrontGate(AdmissionConfig())
    proxy.gates["/sim"] = ("sim", gate)

    from tests.serve_app.openai_fakes import MODEL, FakeEngine, smollm2_tokenizer

    tok = smollm2_tokenizer()
    served = build_app(OpenAIServer(FakeEngine(tok, reply="ok"), tok, model_aliases=["m", MODEL]))

    async def run() -> tuple[list[float], list[float], int, int]:
        refused, admitted = [], []
        for _ in range(args.repeat):
            gate.observe(BUSY)
            cost, status_refused = await _asgi_calls(proxy, "/sim/v1/chat/completions", args.n)
            refused.append(cost)
            cost, status_admitted = await _asgi_calls(served, "/v1/chat/completions", max(1, args.n // 20))
            admitted.append(cost)
        return refused, admitted, status_refused, status_admitted

    refused, admitted, s_refused, s_admitted = asyncio.run(run())
    out = {"n": args.n, "repeat": args.repeat,
           "decision_us": round(statistics.median(decide) * 1e6, 2),
           "refusal_through_the_gate_middleware_us": round(statistics.median(refused) * 1e6, 1),
           "refused_status": s_refused,
           "admitted_through_the_ingress_app_us": round(statistics.median(admitted) * 1e6, 1),
           "admitted_status": s_admitted}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
