"""Retrying clients: the openai client's rules, and the simulator's model of them."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import OK, REJECTED, Slo, summarize
from loadgen.retry_policy import RetryPolicy, retry_after_header_s
from loadgen.sim.runner import executor_factory, unit_config
from loadgen.sim.simulation import SimConfig, simulate
from loadgen.traces import load_trace
from tidal_core import preset


def test_retry_after_is_honoured_as_sent_without_jitter() -> None:
    policy, rng = RetryPolicy(), random.Random(0)
    assert policy.delay_s(0, 3.0, rng) == 3.0
    assert policy.delay_s(1, 120.0, rng) == 120.0
    assert policy.delay_s(2, 3.0, rng) is None, "two retries by default, then the client gives up"
    assert policy.delay_s(0, 121.0, rng) is None, "a Retry-After over two minutes is not retried at all"


def test_backoff_without_a_header_doubles_with_up_to_a_quarter_off() -> None:
    policy, rng = RetryPolicy(max_retries=6), random.Random(1)
    for taken, nominal in ((0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0)):
        delays = [policy.delay_s(taken, None, rng) for _ in range(200)]
        assert all(d is not None and 0.75 * nominal <= d <= nominal for d in delays), (taken, min(delays))
        assert max(delays) - min(delays) > 0.1 * nominal, "the jitter spreads the retries"
    assert policy.delay_s(0, 0.0, rng) is not None and policy.delay_s(0, 0.0, rng) <= 0.5  # 0 means backoff


def test_statuses_the_client_retries() -> None:
    assert all(RetryPolicy.retryable_status(s) for s in (None, 408, 409, 429, 500, 503))
    assert not any(RetryPolicy.retryable_status(s) for s in (400, 404, 413, 422))


def test_header_is_whole_seconds_at_least_one() -> None:
    assert [retry_after_header_s(v) for v in (0.0, 0.2, 1.0, 1.01, 59.5, None)] == [1, 1, 1, 2, 60, 1]


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.load("a100-llama70b-tp8")


def _burst(n: int) -> Trace:
    rng = np.random.default_rng(0)
    return Trace("burst", np.zeros(n), rng.integers(200, 2000, n), rng.integers(20, 200, n), duration_s=60.0)


def _config(cost: CostModel, retries: RetryPolicy | None, queue: int = 8, seed: int = 0) -> SimConfig:
    base = unit_config(cost, max_batch_size=16)
    cfg = preset("adaptive", base)
    cfg = dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, max_queue_len=queue))
    return SimConfig(cfg, executor_factory(cost), retries=retries, seed=seed)


def test_refused_requests_come_back_at_retry_after_and_are_counted(cost: CostModel) -> None:
    trace = _burst(200)
    run = simulate(trace, _config(cost, RetryPolicy()))
    clients = run.retries
    assert clients is not None
    s = clients.summary()
    assert s["attempts"] == len(trace) + s["retries_sent"] == int(clients.attempts.sum())
    assert s["amplification"] == pytest.approx(s["attempts"] / len(trace), abs=1e-4)
    assert clients.attempts.max() == 3 and clients.attempts.min() == 1
    assert s["retries_sent"] == s["retries_at_retry_after"], "the server always sends Retry-After"
    # Everything arrived at 0: the door spread the first refusals' Retry-After over the unit's
    # capacity, so their retries went out one by one, none before the unit's own estimate (>= 1 s).
    retried = clients.attempts > 1
    assert retried.any()
    sent = clients.sent_s[retried]
    assert sent.min() >= 1.0 and len(np.unique(sent)) == len(sent)
    assert 0 < s["retries_admitted"] < s["retries_sent"]
    assert sum(row["admitted"] for row in s["by_attempt"].values()) == s["retries_admitted"]
    out = run.outcomes
    # A request admitted on a retry is one completed original request, timed from that retry's send.
    assert int((out.status == OK).sum()) == len(trace) - s["gave_up"]
    assert int((out.status == REJECTED).sum()) == s["gave_up"]
    client = summarize(clients.client_outcomes(out), Slo())
    server = summarize(out, Slo())
    assert client["completed"] == server["completed"] and client["ttft_p99_ms"] > server["ttft_p99_ms"]


def test_retries_are_deterministic_with_a_seed_and_off_changes_nothing(cost: CostModel) -> None:
    trace = load_trace("azure-conv", hours=5 / 60, rate_scale=2.0, seed=3).clipped(8191, 8191)
    a = simulate(trace, _config(cost, RetryPolicy(), queue=32, seed=4))
    b = simulate(trace, _config(cost, RetryPolicy(), queue=32, seed=4))
    assert a.retries is not None and b.retries is not None
    assert a.retries.summary() == b.retries.summary()
    assert summarize(a.outcomes, Slo()) == summarize(b.outcomes, Slo())
    off = simulate(trace, _config(cost, None, queue=32, seed=4))
    none = simulate(trace, _config(cost, RetryPolicy(max_retries=0), queue=32, seed=4))
    assert off.retries is None
    assert summarize(off.outcomes, Slo()) == summarize(none.outcomes, Slo())
    assert none.retries is not None and none.retries.summary()["retries_sent"] == 0
    assert summarize(a.outcomes, Slo())["completed"] > summarize(off.outcomes, Slo())["completed"]


def test_retry_after_is_spread_over_the_capacity_as_serves_door_sends_it() -> None:
    """Refusals at one instant are told to come back 1 / capacity apart (to the millisecond, as
    `retry-after-ms`), from the unit's own estimate on; without a measured capacity, the estimate
    in whole seconds (`Retry-After`)."""
    from loadgen.sim.retries import RetryingClients
    from tidal_core import Rejection

    trace = Trace("t", np.zeros(8), np.full(8, 100), np.full(8, 10), duration_s=10.0)
    refusal = Rejection("r", "prefill_backlog", 1.5, "busy")
    spread = RetryingClients(RetryPolicy(), trace, seed=1)
    delays = [spread.retry_after_s(0.0, refusal, capacity_rps=4.0) for _ in range(8)]
    assert delays == sorted(delays) and delays[0] >= 1.5
    assert all(0.0 < b - a < 0.5 for a, b in itertools.pairwise(delays)), delays
    assert delays[-1] == pytest.approx(1.5 + 7 * 0.25, abs=0.25) and all(round(d, 3) == d for d in delays)
    plain = RetryingClients(RetryPolicy(), trace, seed=1)
    assert [plain.retry_after_s(0.0, refusal, capacity_rps=0.0) for _ in range(3)] == [2.0, 2.0, 2.0]
    assert plain.retry_after_s(0.0, None, capacity_rps=4.0) == 5.0, "a 503 (no unit) is not spread"
    late = RetryingClients(RetryPolicy(), trace, seed=1, max_retry_after_s=2.0)
    assert max(late.retry_after_s(0.0, refusal, capacity_rps=4.0) for _ in range(20)) <= 2.0


def test_a_serve_shaped_burst_with_retrying_clients_is_served_in_the_end(cost: CostModel) -> None:
    """400 chat requests in 2 s (Serve's burst benchmark's shape) into the simulated A100 unit:
    with the door's spread, the retries return as the unit frees room and nearly every request
    is served in the end, as Serve served 395-400 of them (docs/reliability.md, section 6)."""
    rng = np.random.default_rng(1)
    n = 400
    trace = Trace("burst", np.arange(n) * 2.0 / n, rng.integers(70, 620, n), np.full(n, 128), duration_s=200.0)
    cfg = SimConfig(preset("adaptive", unit_config(cost)), executor_factory(cost), retries=RetryPolicy())
    run = simulate(trace, cfg)
    assert run.retries is not None
    served = int((run.outcomes.status == OK).sum())
    assert served >= 0.95 * n, served
    assert run.retries.summary()["retries_admitted"] > served / 2, "most are served on a retry, as in Serve"


def test_a_retry_after_beyond_the_clients_limit_is_not_retried(cost: CostModel) -> None:
    trace = _burst(100)
    run = simulate(trace, _config(cost, RetryPolicy(max_retry_after_s=0.5)))
    assert run.retries is not None
    s = run.retries.summary()
    assert s["retries_sent"] == 0 and s["gave_up"] == int((run.outcomes.status == REJECTED).sum()) > 0
