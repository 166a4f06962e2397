"""Locust load test of an OpenAI-compatible server following the compressed tidal day.

    pip install locust          # optional extra, not a tidalserve dependency
    TIDAL_TRACE=day-in-life-sharp TIDAL_TIME_SCALE=0.01 TIDAL_PEAK_USERS=64 \\
        locust -f loadgen/locustfile.py --headless --host http://127.0.0.1:8000 --csv out/locust

Owns: `TidalUser` (one streamed request at a time, prompt and lengths sampled from the trace,
TTFT and E2E fired as custom request types "TTFT" and "E2E") and `TidalDayShape` (the number of
users follows the trace's arrival rate: users(t) = rate(t) / peak rate * TIDAL_PEAK_USERS).

Locust is CLOSED loop: each user waits for its response before sending the next request, so
when the server slows down the offered load falls with it. `tidal replay` is the open-loop tool
(requests leave on schedule whatever the server does); use locust for its UI and ecosystem,
and `tidal replay` for numbers that must not flatter a slow server.

Settings (environment, read once at import): TIDAL_TRACE (a named trace or a path; default
day-in-life-sharp), TIDAL_TIME_SCALE (0.01: a day in 14.4 min), TIDAL_HOURS, TIDAL_SEED,
TIDAL_PEAK_USERS (50), TIDAL_SPAWN_RATE (users/s, default 10), TIDAL_BIN_S (trace seconds per
step of the users curve, default 300), TIDAL_MODEL ("default"), TIDAL_ENDPOINT (completions or
chat), TIDAL_WORDS_PER_TOKEN (0.867), TIDAL_MAX_INPUT, TIDAL_MAX_OUTPUT, TIDAL_THINK_S (0).
Importing this module needs locust installed. Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Any

import numpy as np
from locust import HttpUser, LoadTestShape, constant, task

from loadgen.client import DEFAULT_WORDS_PER_TOKEN, ClientConfig, RequestSpec, chunk_text, request_body
from loadgen.traces import load_trace


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def _env_float(name: str, default: float | None) -> float | None:
    value = _env(name, None)
    return float(value) if value is not None else default


TIME_SCALE = _env_float("TIDAL_TIME_SCALE", 0.01) or 0.01
PEAK_USERS = int(_env_float("TIDAL_PEAK_USERS", 50) or 50)
SPAWN_RATE = _env_float("TIDAL_SPAWN_RATE", 10.0) or 10.0
BIN_S = _env_float("TIDAL_BIN_S", 300.0) or 300.0
THINK_S = _env_float("TIDAL_THINK_S", 0.0) or 0.0
_clip: dict[str, Any] = {k: int(v) for k, v in (("max_input", _env("TIDAL_MAX_INPUT", None)),
                                 ("max_output", _env("TIDAL_MAX_OUTPUT", None))) if v is not None}
TRACE = load_trace(_env("TIDAL_TRACE", "day-in-life-sharp") or "day-in-life-sharp",
                   hours=_env_float("TIDAL_HOURS", None), seed=int(_env_float("TIDAL_SEED", 0) or 0),
                   time_scale=TIME_SCALE, **_clip)
CONFIG = ClientConfig("http://unused", model=_env("TIDAL_MODEL", "default") or "default",
                      endpoint=_env("TIDAL_ENDPOINT", "completions"),  # type: ignore[arg-type]
                      words_per_token=_env_float("TIDAL_WORDS_PER_TOKEN", DEFAULT_WORDS_PER_TOKEN)
                      or DEFAULT_WORDS_PER_TOKEN)
PATH = CONFIG.url.removeprefix("http://unused")


def users_curve(arrival_s: np.ndarray, duration_s: float, bin_s: float, peak_users: int) -> list[int]:
    """Users per bin of `bin_s` seconds: the bin's arrival count scaled so the busiest bin has `peak_users`."""
    bins = max(1, math.ceil(duration_s / bin_s))
    counts, _ = np.histogram(arrival_s, bins=bins, range=(0.0, bins * bin_s))
    peak = max(int(counts.max(initial=0)), 1)
    # A bin with any traffic keeps at least one user, so a quiet night is quiet, not silent.
    return [max(1, round(peak_users * c / peak)) if c else 0 for c in counts.tolist()]


class TidalDayShape(LoadTestShape):
    """Users follow the trace's arrival rate over its (compressed) duration, then the test stops."""

    bin_wall_s = BIN_S * TIME_SCALE
    users = users_curve(TRACE.arrival_s, TRACE.duration_s, bin_wall_s, PEAK_USERS)

    def tick(self) -> tuple[int, float] | None:
        run_time: float = self.get_run_time()  # type: ignore[no-untyped-call]
        if run_time >= TRACE.duration_s:
            return None
        return self.users[min(int(run_time // self.bin_wall_s), len(self.users) - 1)], SPAWN_RATE


class TidalUser(HttpUser):
    """Sends one streamed completion at a time with a prompt and lengths drawn from the trace."""

    wait_time = constant(THINK_S)

    def on_start(self) -> None:
        self.rng = random.Random()

    def _fire(self, kind: str, seconds: float, length: int = 0) -> None:
        self.environment.events.request.fire(request_type=kind, name=PATH, response_time=seconds * 1000.0,
                                             response_length=length, exception=None, context={})

    @task
    def generate(self) -> None:
        i = self.rng.randrange(len(TRACE))
        spec = RequestSpec(i, int(TRACE.input_tokens[i]), int(TRACE.output_tokens[i]))
        body = request_body(CONFIG, spec)
        start = time.perf_counter()
        with self.client.post(PATH, json=body, stream=True, catch_response=True, name=PATH) as resp:
            try:
                error = f"HTTP {resp.status_code}" if resp.status_code != 200 else self._consume(resp, start)
            finally:
                resp.close()  # a streamed response must hand its connection back to the pool
            if error:
                resp.failure(error)
            else:
                resp.success()

    def _consume(self, resp: Any, start: float) -> str | None:
        first = False
        chunks = 0
        for line in resp.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self._fire("E2E", time.perf_counter() - start, chunks)
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                return f"SSE error event: {chunk['error']}"
            if chunk_text(chunk):
                chunks += 1
                if not first:
                    first = True
                    self._fire("TTFT", time.perf_counter() - start)
        return "stream ended before [DONE]"
