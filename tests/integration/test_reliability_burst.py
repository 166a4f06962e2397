"""A burst (issue 14), short version: 400 chat requests in 2 s against the simulated unit (/sim).

Prompts of 50-450 words, max_tokens 128, streamed, sent with plain httpx (one attempt each).
Asserted: every request ends with a complete 200 stream (its `[DONE]`, no error event) or a 429 /
503 carrying `Retry-After` (whole seconds, >= 1) and, for a 429, `retry-after-ms`; no other
status, no transport error; both outcomes occur; the front end (Serve's proxy or the ingress)
decided some refusals itself, and every refusal says where it was decided; the 429s' retry-after
values are spread (not one value for the whole burst); afterwards the unit holds no request,
stream or KV block. Latencies (429 p50/p99, admitted TTFT) are printed and recorded as test
properties, never asserted: the timed figures come from `benchmarks/overload.py --burst`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.reliability.burst import BurstSpec, burst_figures, run_burst
from tests.integration.reliability.cluster import SIM_MODEL, is_drained, wait_drained

pytestmark = pytest.mark.ray


def test_a_burst_is_answered_200_or_refused_with_retry_after_and_leaks_nothing(
        sim_server_url: str, record_property: Callable[[str, Any], None]) -> None:
    run = asyncio.run(run_burst(sim_server_url, SIM_MODEL, BurstSpec(400, 2.0)))
    figures = burst_figures(run)
    record_property("burst_figures", json.dumps(figures))
    print(json.dumps(figures, indent=1))

    records = run["records"]
    assert len(records) == 400
    bad = [r for r in records if r.get("status") not in (200, 429, 503)]
    assert not bad, bad[:3]
    served = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] in (429, 503)]
    assert served and refused, figures["outcomes"]
    assert all(r.get("done") and not r.get("stream_error") and r.get("ttft_ms") is not None for r in served), \
        [r for r in served if not r.get("done") or r.get("stream_error")][:3]
    assert all(r["retry_after"] and r["retry_after"].isdigit() and int(r["retry_after"]) >= 1 for r in refused)
    limited = [r for r in refused if r["status"] == 429]
    assert all(r["retry_after_ms"] and int(r["retry_after_ms"]) >= 1 for r in limited)
    assert all(int(r["retry_after"]) * 1000 >= int(r["retry_after_ms"]) for r in limited)  # rounded up
    assert len({r["retry_after_ms"] for r in limited}) > len(limited) // 2, "the retries would come back as one wave"
    where = figures["refused_by"]
    assert set(where) <= {"proxy", "ingress", "unit"}, where
    assert where.get("proxy", 0) + where.get("ingress", 0) > 0, where

    state, _ = wait_drained("sim", timeout_s=120.0)
    assert is_drained(state), state
