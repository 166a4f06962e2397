"""Bad input against the REAL server (issue 8, item 3): a hand matrix over HTTP through Ray Serve.

Every case must end with a clear answer: 200 where the input is valid (unknown fields are
ignored, as OpenAI does), otherwise a 4xx in OpenAI's error shape that names the problem. Never a
5xx, a dropped connection or a hang (each request has a 60 s client timeout), and after the whole
matrix the ingress and the unit are healthy and serve. The generated (schemathesis) cases run
in-process in tests/serve_app/test_bad_input_schema.py; this matrix is what a fuzzer does not reach:
raw bytes, framing, sizes and nesting depth through the real proxy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.reliability.cluster import LOCAL_MODEL, is_drained, wait_drained
from tests.serve_app.test_bad_input_matrix import CASES, check_answer, request_content

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def client(local_server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=local_server_url, timeout=httpx.Timeout(60.0, connect=10.0)) as c:
        yield c


@pytest.mark.parametrize(("path", "headers", "body", "allowed", "fragment"),
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_input_gets_a_clear_answer(client: httpx.Client, path: str, headers: dict[str, str], body: Any,
                                       allowed: set[int], fragment: str | None) -> None:
    t0 = time.perf_counter()
    r = client.post(path, content=request_content(body), headers=headers)
    print(f"{path} -> {r.status_code} in {(time.perf_counter() - t0) * 1e3:.0f} ms: {r.text[:160]!r}")
    check_answer(r, allowed, fragment)


def test_after_the_matrix_the_server_is_healthy_and_serves(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json={"model": LOCAL_MODEL, "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    state, _ = wait_drained("local", timeout_s=30.0)
    assert is_drained(state) and state["healthy"], state
