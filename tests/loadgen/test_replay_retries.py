"""`tidal replay --retries`: refused requests are sent again the way the openai client does it.

The fake server listens on a real 127.0.0.1 socket and refuses by arrival order (1-based).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadgen.client import ClientConfig
from loadgen.records import Trace
from loadgen.replay import ReplayConfig, ReplayReport, replay
from loadgen.retry_policy import RetryPolicy
from tests.loadgen.replay_fake_server import Behavior, FakeServer


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer() as srv:
        yield srv


def _run(server: FakeServer, behavior: Behavior, trace: Trace, out: Path, retries: RetryPolicy | None
         ) -> tuple[ReplayReport, list[dict[str, Any]]]:
    server.reset(behavior)
    report = replay(trace, ClientConfig(server.url, model="fake-model"),
                    ReplayConfig(progress=False, plots=False, retries=retries, drain_timeout_s=10.0), out)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return report, sorted(rows, key=lambda r: r["index"])


def _trace(n: int, gap_s: float) -> Trace:
    return Trace("t", np.arange(n) * gap_s, [20] * n, [3] * n, duration_s=n * gap_s)


def test_a_refused_request_is_retried_at_retry_after_and_then_served(server: FakeServer, tmp_path: Path) -> None:
    # Arrivals 2, 4, 6 are refused; each is the first send of requests 1, 2, 3, whose retry 0.2 s later gets in.
    report, rows = _run(server, Behavior(reject_every=2, retry_after="0.2"), _trace(4, 0.5), tmp_path, RetryPolicy())
    s = report.summary
    assert len(server.log.arrivals) == 7 and s["completed"] == 4 and s["rejected"] == 0
    assert [r["attempts"] for r in rows] == [1, 2, 2, 2]
    r = s["retries"]
    assert (r["attempts"], r["retries_sent"], r["retries_admitted"], r["admitted_at_retry_after"]) == (7, 3, 3, 3)
    assert r["amplification"] == pytest.approx(1.75) and r["retry_after_admit_rate"] == 1.0
    arrivals = server.log.arrivals
    for refused, retry in ((1, 2), (3, 4), (5, 6)):
        assert 0.2 <= arrivals[retry] - arrivals[refused] < 0.4, "the retry waits the server's Retry-After"
    for row in rows[1:]:
        assert row["retries"] == [[0.2, True]]
        assert row["client_ttft_s"] >= row["ttft_s"] + 0.2 and row["first_sent_s"] < row["sent_s"]
        assert row["drift_s"] < 0.2, "drift is the first send's lateness, not the retry's wait"
    assert s["client_goodput_rps"] <= s["goodput_rps"]


def test_the_client_gives_up_after_two_retries(server: FakeServer, tmp_path: Path) -> None:
    report, rows = _run(server, Behavior(reject_every=1, retry_after="0.1"), _trace(3, 0.05), tmp_path, RetryPolicy())
    s = report.summary
    assert len(server.log.arrivals) == 9 and s["rejected"] == 3 and s["completed"] == 0
    assert [r["attempts"] for r in rows] == [3, 3, 3] and all(r["http_status"] == 429 for r in rows)
    assert all(r["refused_by"] == "proxy" and r["error_code"] == "queue_full" for r in rows)
    assert s["retries"]["retries_sent"] == 6 and s["retries"]["retries_admitted"] == 0
    assert s["retries"]["amplification"] == 3.0 and s["retries"]["retry_after_admit_rate"] == 0.0


def test_a_500_without_retry_after_backs_off_with_jitter(server: FakeServer, tmp_path: Path) -> None:
    report, rows = _run(server, Behavior(fail_every=1), _trace(1, 1.0), tmp_path, RetryPolicy(max_retries=1))
    gap = server.log.arrivals[1] - server.log.arrivals[0]
    assert len(server.log.arrivals) == 2 and 0.375 <= gap < 0.6
    (delay, honoured), = rows[0]["retries"]
    assert report.summary["errors"] == 1
    assert 0.375 <= delay <= 0.5 and not honoured
    assert rows[0]["status"] == "error" and rows[0]["http_status"] == 500


def test_without_retries_each_request_is_sent_once(server: FakeServer, tmp_path: Path) -> None:
    report, rows = _run(server, Behavior(reject_every=2, retry_after="0.2"), _trace(4, 0.2), tmp_path, None)
    assert len(server.log.arrivals) == 4 and report.summary["rejected"] == 2
    assert "retries" not in report.summary and "attempts" not in rows[0]


def test_the_command_retries_like_the_openai_client_by_default() -> None:
    from tidal_cli import build_parser

    args = build_parser().parse_args(["replay", "--url", "http://x", "--trace", "azure-conv", "--out", "o"])
    assert args.retries == 2
    assert build_parser().parse_args(["replay", "--url", "u", "--trace", "t", "--out", "o",
                                      "--retries", "0"]).retries == 0
