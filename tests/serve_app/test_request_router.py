"""The Serve request router's choice: the core policy over the units' reports, prefix-aware."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.request_router import TidalRequestRouter, prompt_token_ids
from serve_app.unit_api import GenerateRequest
from tidal_core import SamplingParams, UnitLoad
from tidal_core.block_hash import HashScheme, PromptHashes


def replica(uid: str, delay: float = 0.0) -> Any:
    stats = UnitLoad(uid, 1, 0, delay, 0.1, prefill_s_per_token=1e-3).to_stats()
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats=stats)


def pending(tokens: list[int]) -> Any:
    return SimpleNamespace(args=[GenerateRequest("r", tokens, SamplingParams(), 0.0)], kwargs={})


def router(**kw: Any) -> TidalRequestRouter:
    r = TidalRequestRouter.__new__(TidalRequestRouter)  # the choice only: no Serve controller needed
    r.initialize_state(seed=0, **kw)
    return r


def choose(r: TidalRequestRouter, replicas: list[Any], req: Any, *, reported: bool = True) -> str:
    """The unit chosen first; `reported`: that unit then reports the request arrived, its load
    otherwise as before (a fresh report for every choice: the choice on the reports alone)."""
    ranked = asyncio.run(r.choose_replicas(replicas, req))
    assert sorted(x.replica_id.unique_id for tier in ranked for x in tier) == sorted(
        x.replica_id.unique_id for x in replicas), "every replica stays a fallback"
    first = ranked[0][0]
    if reported:
        first.routing_stats = {**first.routing_stats, "num_arrived": first.routing_stats["num_arrived"] + 1}
    return str(first.replica_id.unique_id)


def test_a_shared_prompt_prefix_sticks_to_one_unit() -> None:
    r = router(block_size=16, index_blocks=4096)
    replicas = [replica(f"u{i}") for i in range(4)]
    system = list(range(1000, 1512))  # 512 tokens of shared system prompt
    first = choose(r, replicas, pending([*system, 1, 2, 3]))
    assert all(choose(r, replicas, pending([*system, 7, i])) == first for i in range(8))


def test_a_much_busier_unit_loses_its_affinity() -> None:
    r = router(block_size=16, index_blocks=4096)
    system = list(range(512))
    first = choose(r, [replica("a"), replica("b")], pending(system))
    other = "b" if first == "a" else "a"
    busy = [replica(first, delay=5.0), replica(other)]
    assert choose(r, busy, pending([*system, 9])) == other


def test_without_prompt_ids_or_with_prefix_routing_off_it_is_load_only() -> None:
    assert prompt_token_ids(SimpleNamespace(args=["not a request"], kwargs={})) is None
    assert prompt_token_ids(None) is None
    r = router(prefix_routing=False)
    assert choose(r, [replica("a", 0.5), replica("b", 0.0)], pending(list(range(600)))) == "b"
    assert choose(router(), [replica("a", 0.5), replica("b", 0.0)], SimpleNamespace(args=[], kwargs={})) == "b"


def test_the_router_reads_the_carried_hashes_and_hashes_only_without_them(monkeypatch: Any) -> None:
    import tidal_core.block_hash as block_hash

    calls: list[int] = []
    original = block_hash.block_hashes

    def counted(ids: list[int], *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(ids))
        return original(ids, *args, **kwargs)

    monkeypatch.setattr(block_hash, "block_hashes", counted)
    system = list(range(2000, 2512))
    scheme = HashScheme(16, "")
    made = [scheme.hash([*system, i]) for i in range(3)]
    calls.clear()

    def carrying(i: int, hashes: PromptHashes | None) -> Any:
        return SimpleNamespace(args=[GenerateRequest("r", [*system, i], SamplingParams(), 0.0,
                                                     prompt_hashes=hashes)], kwargs={})

    r = router(block_size=16, index_blocks=4096)
    replicas = [replica(f"u{i}") for i in range(3)]
    first = choose(r, replicas, carrying(0, made[0]))
    assert choose(r, replicas, carrying(1, made[1])) == first and calls == []  # used as carried
    # Another namespace, another block size, no hashes: hashed here, under the router's own scheme.
    other = [HashScheme(16, "other-model").hash([*system, 2]), HashScheme(8, "").hash([*system, 2]), None]
    calls.clear()
    assert all(choose(r, replicas, carrying(2, h)) == first for h in other)
    assert calls == [513, 513, 513]


def test_a_long_prompt_goes_to_the_unit_that_would_admit_it() -> None:
    def unit(uid: str, delay: float) -> Any:
        stats = UnitLoad(uid, 4, 2, delay, 0.1, prefill_s_per_token=1e-4, ttft_limit_s=1.0).to_stats()
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats=stats)

    # 4,000 tokens (0.4 s of prefill) would be refused at either busy unit: 1.2 s and 1.3 s past a 1 s limit.
    replicas = [unit("busy1", 0.8), unit("busy2", 0.9), unit("free", 0.25)]
    for kw in ({"prefix_routing": False}, {}):
        r = router(**kw)
        assert {choose(r, replicas, pending(list(range(4000)))) for _ in range(30)} == {"free"}


def test_requests_sent_between_reports_count_against_their_unit() -> None:
    # Two idle units and no new report for a burst of ten: without the requests on the way,
    # every one goes to the same unit (with two units the choice is the minimum).
    for kw in ({"prefix_routing": False}, {}):
        r = router(**kw)
        replicas = [replica("a"), replica("b")]
        sent = [choose(r, replicas, pending([5000 + i, *range(300)]), reported=False) for i in range(10)]
        assert sorted(sent.count(u) for u in "ab") == [5, 5], sent


@pytest.fixture
def clock(monkeypatch: Any) -> list[float]:
    """The router's clock, moved by hand."""
    import serve_app.request_router as rr

    now = [100.0]
    monkeypatch.setattr(rr.time, "monotonic", lambda: now[0])
    return now


def test_a_newer_report_retires_the_requests_it_counts(clock: list[float]) -> None:
    import serve_app.request_router as rr

    r = router(prefix_routing=False)
    a, b = replica("a"), replica("b", delay=0.2)
    # 400 tokens at 1 ms/token: 0.4 s at a against 0.6 s at b (0.2 s reported queue); once one is held
    # against a (0.8 s), the next goes to b.
    assert [choose(r, [a, b], pending(list(range(400))), reported=False) for _ in range(2)] == ["a", "b"]
    a.routing_stats = {**a.routing_stats, "num_arrived": a.routing_stats["num_arrived"] + 1}  # counts a's one
    b.routing_stats = {**b.routing_stats, "num_arrived": b.routing_stats["num_arrived"] + 1}
    assert choose(r, [a, b], pending(list(range(400))), reported=False) == "a"
    # A report that never comes: what is held expires.
    assert choose(r, [a, b], pending(list(range(400))), reported=False) == "b"
    clock[0] += rr.ON_THE_WAY_S + 0.1
    assert choose(r, [a, b], pending(list(range(400))), reported=False) == "a"


def test_a_prompt_the_unit_holds_is_held_against_it_for_its_uncached_tokens_only() -> None:
    r = router(block_size=16, index_blocks=4096)
    replicas = [replica("a"), replica("b")]
    system = list(range(3000, 3512))
    first = choose(r, replicas, pending([*system, 1]))  # reported: the unit now holds the prefix
    # Its repeats cost ~1 token of prefill each on the way (not 513): they keep their affinity.
    assert [choose(r, replicas, pending([*system, 10 + i]), reported=False) for i in range(6)] == [first] * 6


def test_a_held_request_drains_so_a_quick_next_turn_keeps_its_unit(clock: list[float]) -> None:
    r = router(prefix_routing=False)
    a, b = replica("a"), replica("b", delay=0.5)
    # 400 tokens at 1 ms/token: a 0.4 s against b 0.9 s, then a 0.8 s against 0.9 s.
    assert [choose(r, [a, b], pending(list(range(400))), reported=False) for _ in range(2)] == ["a", "a"]
    # No report yet, 0.6 s later: a's 0.8 s held has 0.2 s left (0.6 s in all against b's 0.9 s);
    # held undrained it would be 1.2 s and the request would go to b.
    clock[0] += 0.6
    assert choose(r, [a, b], pending(list(range(400))), reported=False) == "a"


def test_a_prompt_that_serve_sent_elsewhere_is_followed_there() -> None:
    # Serve may send a request past the chosen unit (a probe timed out, the unit was full): the
    # prompt's next turn must go where its KV is, not to the first choice.
    r = router(block_size=16, index_blocks=4096)
    replicas = [replica("a"), replica("b")]
    system = list(range(4000, 4512))
    req = pending([*system, 1])
    first = choose(r, replicas, req)
    other = next(x for x in replicas if x.replica_id.unique_id != first)
    r.on_request_routed(req, other.replica_id, None)
    assert [choose(r, replicas, pending([*system, 20 + i])) for i in range(4)] == [other.replica_id.unique_id] * 4
    r.on_request_routed(pending([1]), other.replica_id, None)  # a request it never chose: ignored


def poll() -> Any:
    return SimpleNamespace(args=[[]], kwargs={}, metadata=SimpleNamespace(call_method="load_stats"))


def test_the_front_gates_polls_visit_every_unit_in_turn_whatever_their_load() -> None:
    # Placed by load, the polls went to the least-loaded units: a gate that sees units only
    # through its polls lost sight of the busiest one.
    r = router()
    replicas = [replica("idle-a"), replica("idle-b"), replica("busy", delay=3.0), replica("busier", delay=9.0)]
    seen = [choose(r, replicas, poll(), reported=False) for _ in range(8)]
    assert sorted(seen[:4]) == sorted(["idle-a", "idle-b", "busy", "busier"]) and seen[4:] == seen[:4]
    grown = [*replicas, replica("new")]  # a unit added: polled next; one removed: forgotten
    assert choose(r, grown, poll(), reported=False) == "new"
    rest = [x for x in grown if x.replica_id.unique_id != seen[0]]  # the next in line, removed
    assert choose(r, rest, poll(), reported=False) == seen[1] and seen[0] not in r._polled
    # A generate call is still placed by load.
    assert choose(r, replicas, pending(list(range(100))), reported=False) in ("idle-a", "idle-b")
