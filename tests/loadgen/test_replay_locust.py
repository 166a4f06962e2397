"""loadgen/locustfile.py, run headless by the real `locust` command against the fake server.

Locust is an optional extra: without it these tests skip. Locust is never imported into the
test process (importing it monkey-patches the standard library with gevent); the locustfile
runs in a `locust` subprocess, and `users_curve` is checked through that subprocess's output.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadgen.records import Trace
from loadgen.traces import write_jsonl
from tests.loadgen.replay_fake_server import Behavior, FakeServer

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust not installed (extra)")


def _locust_env(trace_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env.update({"TIDAL_TRACE": str(trace_path), "TIDAL_TIME_SCALE": "1", "TIDAL_BIN_S": "1",
                "TIDAL_PEAK_USERS": "4", "TIDAL_SPAWN_RATE": "50", "TIDAL_MODEL": "fake-model", **extra})
    return env


def test_headless_locust_follows_the_day_and_records_ttft(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    trace_path = tmp_path / "small.jsonl"
    write_jsonl(Trace("small", np.sort(rng.uniform(0, 3, 40)), [20] * 40, [4] * 40, duration_s=3.0), trace_path)
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or "locust"
    with FakeServer(Behavior(first_token_delay_s=0.02, token_delay_s=0.005)) as srv:
        result = subprocess.run(
            [locust, "-f", str(REPO / "loadgen" / "locustfile.py"), "--headless", "--host", srv.url,
             "--csv", str(tmp_path / "loc"), "--only-summary", "--loglevel", "WARNING"],
            env=_locust_env(trace_path), cwd=tmp_path, capture_output=True, text=True, timeout=120)
        bodies = list(srv.log.bodies)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "loc_stats.csv").open() as fh:
        stats = {row["Type"]: row for row in csv.DictReader(fh) if row["Type"]}
    assert {"POST", "TTFT", "E2E"} <= set(stats)
    assert int(stats["TTFT"]["Request Count"]) > 0 and int(stats["POST"]["Failure Count"]) == 0
    assert float(stats["TTFT"]["Median Response Time"]) <= float(stats["E2E"]["Median Response Time"])
    assert bodies and all(b["max_tokens"] == 4 and b["ignore_eos"] and b["stream"] for b in bodies)
    assert {b["model"] for b in bodies} == {"fake-model"}


def test_users_curve_scales_the_rate_to_peak_users(tmp_path: Path) -> None:
    code = ("import numpy as np; from loadgen.locustfile import users_curve, TidalDayShape; "
            "print(users_curve(np.array([0.1, 0.2, 0.3, 0.4, 1.5, 3.2]), 4.0, 1.0, 8)); "
            "print(TidalDayShape.users)")
    trace_path = tmp_path / "t.jsonl"
    write_jsonl(Trace("t", [0.5, 1.5, 1.6, 2.5], [5] * 4, [2] * 4, duration_s=3.0), trace_path)
    result = subprocess.run([sys.executable, "-c", code], env=_locust_env(trace_path), cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    curve, shape = result.stdout.strip().splitlines()
    # Busiest bin (4 arrivals) gets 8 users; 1 arrival -> 2 users; an empty bin none.
    assert curve == "[8, 2, 0, 2]"
    assert shape == "[2, 4, 2]"  # 1, 2, 1 arrivals per second, peak 4 users
