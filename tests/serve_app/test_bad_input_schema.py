"""Generated bad input (issue 8, item 3): schemathesis against the app's own OpenAPI schema.

In-process (no Ray, no network): `build_app(OpenAIServer(FakeEngine, real tokenizer))`, the
schema read from its `/openapi.json`, every request sent through Starlette's test client. Cases:
schemathesis' coverage phase (deterministic boundary values, missing and wrongly typed fields,
unexpected methods) in positive and negative mode for every operation, plus hypothesis fuzzing of
both POST endpoints in both modes: well over 500 cases. Asserted: zero 5xx, and every error in
OpenAI's error shape. (schemathesis' own `case.call()` goes through `requests`, which breaks
when `urllib3-future` - pulled in by grafana-client - shadows urllib3; so cases are sent with
`as_transport_kwargs` through the test client instead.)

Against a running server instead (e.g. `serve run configs/local.yaml`): set TIDAL_FUZZ_URL to its
base URL; the schema is still this code's, the requests go over real HTTP through Ray Serve.

schemathesis is a test-only dependency (dev extra); without it this module is skipped.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette test client on per-request cookies
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
FUZZ_EXAMPLES = {"/v1/completions": 60, "/v1/chat/completions": 30}  # per mode; chat cases cost ~4x to generate
MIN_CASES = 500
MIN_POSITIVE_ACCEPTED = 1 / 3  # share of schema-valid generated requests that must get 200 (in-process)
BASE = "http://testserver"


@pytest.fixture(scope="module")
def client(app: Any) -> Iterator[TestClient | httpx.Client]:
    url = os.environ.get("TIDAL_FUZZ_URL")
    if url:  # a real server: same schema, real HTTP
        with httpx.Client(base_url=url, timeout=httpx.Timeout(120.0, connect=10.0)) as real:
            yield real
        return
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def schema(app: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def seen() -> collections.Counter[tuple[str, str, int]]:
    return collections.Counter()


def _send(client: TestClient | httpx.Client, case: Any, seen: collections.Counter[tuple[str, str, int]]) -> int:
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url).rstrip("/"))
    response = client.request(**kwargs)
    seen[(case.operation.path, case.method.upper(), response.status_code)] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500], kwargs)
    if response.status_code >= 400 and case.operation.path != "/health":
        body = response.json()
        assert set(body) == {"error"} and body["error"]["message"], (response.text[:500], kwargs)
    return response.status_code


def test_coverage_phase_has_no_5xx(schema: Any, client: TestClient | httpx.Client,
                                   seen: collections.Counter[tuple[str, str, int]]) -> None:
    for result in schema.get_all_operations():
        operation = result.ok()
        config = schema.config.generation_for(operation=operation)
        for case in schema.iter_coverage_cases(operation, generation_modes=list(MODES), generation_config=config):
            _send(client, case, seen)


@pytest.mark.parametrize("path", sorted(FUZZ_EXAMPLES))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_fuzzing_has_no_5xx(schema: Any, client: TestClient | httpx.Client,
                            seen: collections.Counter[tuple[str, str, int]], path: str, mode: Any) -> None:
    operation = schema[path]["POST"]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=FUZZ_EXAMPLES[path], deadline=None, database=None, derandomize=True,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        statuses.append(_send(client, case, seen))

    statuses: list[int] = []
    run()
    if mode is schemathesis.GenerationMode.POSITIVE and not os.environ.get("TIDAL_FUZZ_URL"):
        # The schema declares what the validators enforce (non-empty prompt and messages, n = 1,
        # penalties 0, at most 16 stop strings, ...), so most requests it calls valid are served.
        # What is left: rules across fields (stream_options needs stream, min_tokens <= max_tokens)
        # and values only the server knows (the model's name, its vocabulary and context length).
        accepted = statuses.count(200) / len(statuses)
        assert accepted >= MIN_POSITIVE_ACCEPTED, (path, accepted, collections.Counter(statuses))


def test_at_least_500_cases_ran(seen: collections.Counter[tuple[str, str, int]]) -> None:
    total = sum(seen.values())
    print(f"{total} generated cases:", dict(sorted(seen.items())))
    assert total >= MIN_CASES
    assert any(status == 200 for _, _, status in seen), "no generated case was valid: the fuzzer tested only errors"
