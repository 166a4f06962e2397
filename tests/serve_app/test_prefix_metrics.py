"""The prefix-cache counters a unit exports follow the scheduler's own cumulative counters: each
step adds what they gained since the last one (never a negative or repeated amount). The ray
metric objects are swapped for recorders; the real export is tests/integration/test_prometheus.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from serve_app import metric_defs as M
from serve_app.metrics import PREFIX_COUNTERS, UnitMetrics


class Recorder:
    def __init__(self) -> None:
        self.total = 0
        self.calls = 0

    def inc(self, value: float = 1, tags: Any = None) -> None:
        assert value > 0
        self.total += int(value)
        self.calls += 1


def _metrics() -> tuple[UnitMetrics, dict[str, Recorder]]:
    um = UnitMetrics("u1")
    recorders = {defn.name: Recorder() for _, defn in PREFIX_COUNTERS}
    um._m.update(recorders)
    return um, recorders


def test_counters_advance_by_the_scheduler_counters_gain() -> None:
    um, rec = _metrics()
    stats = SimpleNamespace(prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, prefix_cache_query_requests=0,
                            prefix_cache_hit_requests=0)
    sched: Any = SimpleNamespace(stats=stats)
    um._prefix_counters(sched)
    assert all(r.calls == 0 for r in rec.values())
    stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens = 700, 0
    stats.prefix_cache_query_requests = 1
    um._prefix_counters(sched)
    stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens = 1400, 608
    stats.prefix_cache_query_requests, stats.prefix_cache_hit_requests = 2, 1
    um._prefix_counters(sched)
    um._prefix_counters(sched)  # nothing new: nothing added
    assert rec[M.PREFIX_QUERIED_TOKENS.name].total == 1400 and rec[M.PREFIX_QUERIED_TOKENS.name].calls == 2
    assert rec[M.PREFIX_HIT_TOKENS.name].total == 608 and rec[M.PREFIX_HIT_TOKENS.name].calls == 1
    assert rec[M.PREFIX_QUERIED_REQUESTS.name].total == 2 and rec[M.PREFIX_HIT_REQUESTS.name].total == 1


def test_a_scheduler_without_the_cache_counters_exports_nothing() -> None:
    um, rec = _metrics()
    um._prefix_counters(SimpleNamespace(stats=SimpleNamespace()))  # type: ignore[arg-type]
    assert all(r.calls == 0 for r in rec.values())
