"""Where a request's time went, from Ray Serve's own access logs.

Serve logs every request in the proxy (`POST /sim/v1/completions 429 218.0ms`), in the ingress
replica (the same line, its own duration) and every handle call in the router replica
(`CALL generate OK 8.7ms`), all three under the same request id. Joining them splits a request's
server-side time into proxy hop, ingress work (tokenizing, the router round trip, rendering) and
router work. Used by benchmarks/overload.py to say where the time of a 429 goes.

Must not import ray or torch (the session directory is passed in).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

_HTTP = re.compile(r" (?P<rid>[0-9a-f-]{36}) -- (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) (?P<ms>[\d.]+)ms")
_CALL = re.compile(r" (?P<rid>[0-9a-f-]{36}) -- CALL (?P<method>\w+) (?P<result>\w+) (?P<ms>[\d.]+)ms")


def _http_lines(paths: list[Path], status: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = _HTTP.search(line)
            if m and int(m["status"]) == status:
                out[m["rid"]] = float(m["ms"])
    return out


def _calls(paths: list[Path], method: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m = _CALL.search(line)
            if m and m["method"] == method:
                out[m["rid"]] = float(m["ms"])
    return out


def _spread(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    arr = np.asarray(values)
    return {"n": int(arr.size), "p50_ms": round(float(np.percentile(arr, 50)), 1),
            "p99_ms": round(float(np.percentile(arr, 99)), 1), "max_ms": round(float(arr.max()), 1)}


def breakdown(session_dir: str | Path, app: str, status: int = 429) -> dict[str, Any]:
    """Per request with `status` at `app`: time in the proxy (total), in the ingress replica, and in
    the router's `generate` call; and the hops between them (proxy - ingress, ingress - router)."""
    logs = Path(session_dir) / "logs" / "serve"
    proxy = _http_lines(sorted(logs.glob("proxy_*.log")), status)
    ingress = _http_lines(sorted(logs.glob(f"replica_{app}_Ingress_*.log")), status)
    router = _calls(sorted(logs.glob(f"replica_{app}_Router_*.log")), "generate")
    ids = [rid for rid in ingress if rid in proxy and rid in router]
    return {"requests": len(ids),
            "proxy_total": _spread([proxy[r] for r in ids]),
            "ingress_total": _spread([ingress[r] for r in ids]),
            "router_generate": _spread([router[r] for r in ids]),
            "proxy_hop": _spread([proxy[r] - ingress[r] for r in ids]),
            "ingress_own": _spread([ingress[r] - router[r] for r in ids])}
