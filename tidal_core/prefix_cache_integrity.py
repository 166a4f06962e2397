"""The prefix cache's invariants, checked: what `PrefixCachingBlockManager.check_integrity` proves.

Owns: `CacheState` (a read-only view of the manager's tables, pools and runs) and
`check_cache_state`: reference counts equal table entries; every block is exactly one of
clean-free, evictable or referenced; each run (core/cache_run.py) is keyed by its first hash,
in range, its blocks findable in no other run, its owner's table its own, its holders' extents
what their tables hold; the eviction queue is exactly the runs with evictable blocks; no free
block is findable ("free and dirty": a later writer would corrupt a hit); the holders dict that
runs no one has hit share (`NO_HOLDERS`) is empty. Tests call it after
every operation; the scheduler never does.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidal_core.cache_run import NO_HOLDERS, CachedRun


@dataclass(frozen=True)
class CacheState:
    tables: Mapping[str, list[int]]
    free: Sequence[int]
    by_hash: Mapping[int, CachedRun]
    own: Mapping[str, CachedRun]
    holds: Mapping[str, list[tuple[CachedRun, int]]]
    start: Mapping[str, int]
    lru: Mapping[CachedRun, None]
    num_evictable: int
    num_blocks: int


def check_cache_state(s: CacheState) -> None:
    counts: Counter[int] = Counter()
    for rid, table in s.tables.items():
        if not table:
            raise AssertionError(f"request {rid} has an empty block table entry")
        if len(set(table)) != len(table):
            raise AssertionError(f"request {rid} holds a block twice")
        counts.update(table)
        if not 0 <= s.start.get(rid, 0) <= len(table):
            raise AssertionError(f"request {rid}: cached-block count out of range")
    if not set(s.start) | set(s.own) | set(s.holds) <= set(s.tables):
        raise AssertionError("cache bookkeeping kept for requests without a table")
    if NO_HOLDERS:
        raise AssertionError("the shared empty holders of runs no one hit were written to")
    findable, evictable = _check_runs(s)
    _check_references(s, counts, findable)
    for b in s.free:
        if b in counts or b in findable:
            raise AssertionError(f"free block {b} is referenced or still findable (free and dirty)")
    for b in evictable:
        if b in counts:
            raise AssertionError(f"evictable block {b} is referenced")
    if len(set(s.free)) != len(s.free) or len(evictable) != s.num_evictable \
            or len(s.free) + len(evictable) + len(counts) != s.num_blocks:
        raise AssertionError("clean-free, evictable and referenced blocks do not partition the pool")


def _check_runs(s: CacheState) -> tuple[dict[int, CachedRun], list[int]]:
    """Every run's key, extents, owner, holders and eviction queue entry; returns the findable
    blocks (each in one run) and the evictable ones."""
    findable: dict[int, CachedRun] = {}
    evictable: list[int] = []
    queued = set()
    for h, run in s.by_hash.items():
        if run.hashes[run.start] != h or not run.start < run.end <= min(len(run.blocks), len(run.hashes)):
            raise AssertionError(f"run at {run.start} is keyed by another hash or out of range")
        if run.owner is not None and (s.own.get(run.owner) is not run or s.tables.get(run.owner) is not run.blocks):
            raise AssertionError(f"run at {run.start}: its owner {run.owner} does not hold it")
        if any(not run.start < e <= run.end for e in run.holders.values()) \
                or run.held_to != max(run.holders.values(), default=run.start):
            raise AssertionError(f"run at {run.start}: holder extents out of range or held_to stale")
        for b in run.blocks[run.start:run.end]:
            if findable.setdefault(b, run) is not run:
                raise AssertionError(f"block {b} is findable in two runs")
        if run.num_evictable:
            evictable += run.blocks[run.referenced_to:run.end]
            queued.add(run)
    if set(s.lru) != queued or any(run.owner is not None for run in s.lru):
        raise AssertionError("the eviction queue disagrees with the runs holding evictable blocks")
    if any(s.by_hash.get(run.hashes[run.start]) is not run or run.owner != rid for rid, run in s.own.items()):
        raise AssertionError("a request's own run is not its, or no longer findable")
    return findable, evictable


def _check_references(s: CacheState, counts: Counter[int], findable: dict[int, CachedRun]) -> None:
    """Each table is its hits (the held extents of the runs it hit, from position 0) and then
    its own blocks; a cached block's references are its live owner and the holders whose extent
    covers it, any other block is in one table at most."""
    for rid, table in s.tables.items():
        pos = 0
        for run, extent in s.holds.get(rid, []):
            if run.start != pos or run.holders.get(rid) != extent or table[pos:extent] != run.blocks[pos:extent] \
                    or s.by_hash.get(run.hashes[run.start]) is not run:
                raise AssertionError(f"request {rid}: its hits disagree with the runs it holds")
            pos = extent
        if pos != s.start.get(rid, 0):
            raise AssertionError(f"request {rid}: {s.start.get(rid, 0)} cached blocks but holds runs to {pos}")
    holders = {(rid, id(run)) for run in s.by_hash.values() for rid in run.holders}
    if holders != {(rid, id(run)) for rid, spans in s.holds.items() for run, _ in spans}:
        raise AssertionError("runs' holders and requests' hits disagree")
    for run in s.by_hash.values():
        for k in range(run.start, run.end):
            want = (run.owner is not None) + sum(e > k for e in run.holders.values())
            if counts[run.blocks[k]] != want:
                raise AssertionError(f"block {run.blocks[k]}: reference count {want} but "
                                     f"{counts[run.blocks[k]]} table entries")
    for b, n in counts.items():
        if n != 1 and b not in findable:
            raise AssertionError(f"block {b}: reference count 1 but {n} table entries (not a cached block)")
