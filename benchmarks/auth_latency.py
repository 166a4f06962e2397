"""How fast a request without a valid API key is turned away, against the overload 429, side by side.

One Ray cluster of this script's own serves configs/sim.yaml's simulated unit with API keys
required (`auth.required`, keys from a keys file, one key limited to 1 request per minute) and
admission control squeezed (`max_batch_size: 1`, `admission.max_queue_len: 1`). Two long
requests (ignore_eos, thousands of simulated tokens) fill the running slot and the queue, so every
further request with a valid key is an admission-control 429 `queue_full` from the unit: the
overload path (proxy -> ingress -> tokenize -> router -> scheduler -> back). Then, interleaved
round-robin so all paths see the same machine: no Authorization header (401), a wrong key (401),
the rate-limited key (429 `rate_limit_exceeded`, decided at the ingress), the overload 429, and
`GET /health` (open: the idle round trip through the proxy, ingress and unit). Each path is sent
`--n` times from `--concurrency` clients at once. Reported: p50/p99/max per path, the ratio of the
401's p99 to the overload 429's p99, and how many requests reached the unit meanwhile (its own
arrival count: only the overload probes and the two fillers may).

    RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled python benchmarks/auth_latency.py \
        [--n 300] [--concurrency 4] [--out runs/auth-latency]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness is the benchmark's too

from serve_app.api_keys import key_id
from tests.integration.reliability.cluster import app_from_config, machine, serve_cluster, unit_state
from tests.integration.reliability.load import spread_ms

KEY, LIMITED = "tk-bench-valid-4f1c2e", "tk-bench-limited-9a7b"
MODEL = "sim-llama-70b-a100"
BODY = {"model": MODEL, "prompt": "word " * 50, "max_tokens": 4}


def keyed_app(keys_file: Path) -> dict[str, Any]:
    app = app_from_config("sim", "keyed", "/keyed", max_batch_size=1)
    app["args"]["scheduler"]["admission"] = {**app["args"]["scheduler"].get("admission", {}), "max_queue_len": 1}
    app["args"]["auth"] = {"required": True, "keys_file": str(keys_file), "per_key": {key_id(LIMITED): {"rpm": 1}}}
    return app


PATHS: dict[str, tuple[str, dict[str, str], int, str | None]] = {
    "401 no key": ("POST", {}, 401, "invalid_api_key"),
    "401 wrong key": ("POST", {"Authorization": "Bearer tk-not-a-key-000"}, 401, "invalid_api_key"),
    "429 rate limit (ingress)": ("POST", {"Authorization": f"Bearer {LIMITED}"}, 429, "rate_limit_exceeded"),
    "429 overload (unit)": ("POST", {"Authorization": f"Bearer {KEY}"}, 429, "admission"),
    "200 GET /health": ("GET", {}, 200, None),
}


ADMISSION_CODES = ("queue_full", "prefill_backlog", "prompt_over_target", "costly_prompt", "kv_pressure",
                   "router_queue_full")


async def one(client: httpx.AsyncClient, url: str, path: str) -> tuple[float, str, bool]:
    """(seconds, 'status code' answered, passed the ingress's key and rate checks, i.e. reached the unit)."""
    method, headers = PATHS[path][:2]
    t0 = time.perf_counter()
    try:
        if method == "GET":
            r = await client.get(f"{url}/health", headers=headers)
        else:
            r = await client.post(f"{url}/v1/completions", json=BODY, headers=headers)
    except httpx.HTTPError as exc:  # no answer: the key checks answer in ms, so a valid key got past them
        return time.perf_counter() - t0, type(exc).__name__, "Bearer tk-bench-valid" in headers.get("Authorization", "")
    elapsed = time.perf_counter() - t0
    got = r.json()["error"]["code"] if r.status_code >= 400 else None
    passed = method == "POST" and r.status_code != 401 and got != "rate_limit_exceeded"
    return elapsed, f"{r.status_code} {got}", passed


def expected(path: str, answer: str) -> bool:
    _, _, status, code = PATHS[path]
    got_status, _, got_code = answer.partition(" ")
    if code == "admission":
        return got_status == "429" and got_code in ADMISSION_CODES
    if code == "rate_limit_exceeded" and got_status == "429" and got_code in ADMISSION_CODES:
        return True  # overloaded: the proxy's admission gate answers a valid key before the ingress's RPM
    return got_status == str(status) and (code is None or got_code == code)


async def measure(url: str, n: int, concurrency: int) -> tuple[dict[str, Any], int]:
    """Figures per path, and how many requests passed the ingress's checks (all with a valid key)."""
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    answers: dict[str, Counter[str]] = {p: Counter() for p in PATHS}
    passed = 0
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        for p in PATHS:  # warm-up: connections, first-call paths (the limited key's one request passes)
            passed += (await one(client, url, p))[2]
        for _ in range(n):
            for p in PATHS:  # round-robin: every path sees the same moment of the machine
                results = await asyncio.gather(*(one(client, url, p) for _ in range(concurrency)))
                for elapsed, answer, through in results:
                    samples[p].append(elapsed)
                    answers[p][answer] += 1
                    passed += through
    return {p: {**spread_ms(v), "answers": dict(answers[p]),
                "unexpected_answers": sum(n for a, n in answers[p].items() if not expected(p, a))}
            for p, v in samples.items()}, passed


def fill(url: str) -> list[Any]:
    """Two long requests: one running, one queued (max_batch_size 1, max_queue_len 1). Returns once
    both streams started (or after 120 s), so their retries are not counted as arrivals."""
    import threading

    started = [threading.Event(), threading.Event()]

    body = {**BODY, "max_tokens": 6000, "ignore_eos": True, "stream": True}

    def run(i: int) -> None:  # streamed, so the connection carries bytes for the whole run; retried until admitted
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}, timeout=900) as r:
                    if r.status_code != 200:
                        time.sleep(0.5)
                        continue
                    started[i].set()
                    for _ in r.iter_bytes():
                        pass
                    return
            except httpx.HTTPError as exc:
                print(f"filler ended: {exc!r}", file=sys.stderr)
                return

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t, event in zip(threads, started, strict=True):
        t.start()
        event.wait(120)
    time.sleep(1.0)  # the first tokens are out: both requests are in the unit
    return threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="rounds; each sends every path --concurrency times")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/auth-latency"))
    args = ap.parse_args()
    keys_file = Path(tempfile.mkdtemp(prefix="tidal-bench-keys-")) / "keys"
    keys_file.write_text(f"{KEY}\n{LIMITED}\n")
    with serve_cluster([keyed_app(keys_file)]) as base:
        url = f"{base}/keyed"
        fillers = fill(url)
        arrived_before = unit_state("keyed", check=False)["num_arrived"]
        figures, passed = asyncio.run(measure(url, args.n, args.concurrency))
        arrived = unit_state("keyed", check=False)["num_arrived"] - arrived_before
        result = {
            "machine": machine(), "n_per_path": args.n * args.concurrency, "concurrency": args.concurrency,
            "paths": figures,
            "p99_ratio_401_over_overload_429": round(max(figures["401 wrong key"]["p99_ms"],
                                                        figures["401 no key"]["p99_ms"])
                                                    / figures["429 overload (unit)"]["p99_ms"], 3),
            "unit_arrivals_during_measurement": arrived,
            "valid_key_requests_not_refused_at_a_key_check": passed,
            # Arrivals at the unit beyond the valid-key requests that could have reached it: 0 means no
            # request without a valid key did (the overload 429s are mostly the proxy's now, so fewer arrive).
            "arrivals_beyond_valid_key_requests": max(0, arrived - passed),
            "fillers_alive": sum(t.is_alive() for t in fillers),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
