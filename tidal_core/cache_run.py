"""A run of cached KV blocks: the unit the prefix cache keys, shares and evicts by.

Owns: `CachedRun`, `Hits` and `NO_HOLDERS`. A run is a stretch of consecutive full prompt
blocks that one request (its *owner*) computed itself, positions `[start, end)` of the owner's
block table, with the owner's chained block hashes. Only the run's first hash is a key of the cache's hash table:
a chained hash stands for its whole prefix, so a lookup that finds a run's first block goes on
comparing the query's next hashes with the run's own, position by position (a C-level slice
comparison), instead of one table entry per block. Registering, freeing and evicting then cost a
few operations per run, not per block.

Who holds what: while the owner lives, its table references the whole run; another request that
hit the run (a *holder*) references its leading blocks `[start, extent)`. Once the owner is gone,
blocks past every holder's extent (`held_to`) are *evictable*: still findable, counted as free,
evicted from the run's tail when clean blocks run out.

A run no one has hit has no holders dict of its own: it shares the empty `NO_HOLDERS`, which is
never written (the first hit gives the run its own), so a request that is never hit costs the
cache one small object, its run.

`Hits` is what a cache lookup returns: the hit block ids (a list) and the runs they come from,
each with the extent the request would hold.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence

_new = object.__new__

NO_HOLDERS: dict[str, int] = {}
"""The holders of every run no one has hit: one shared empty dict, never written (a run's first
hit gives it a dict of its own), so a run that is never hit costs no dict of its own."""


class CachedRun:
    """Make one with `CachedRun.new`."""

    __slots__ = ("blocks", "closed", "end", "hashes", "held_to", "holders", "owner", "start")

    owner: str | None  # None once the owner freed its table
    start: int
    end: int  # findable blocks: positions [start, end)
    hashes: Sequence[int]  # the owner's block hashes, by position (never mutated)
    blocks: list[int]  # the owner's block table, by position (only ever appended to)
    holders: dict[str, int]  # request id -> extent: it holds positions [start, extent); NO_HOLDERS with none yet
    held_to: int  # the largest extent held (start with no holder)
    closed: bool  # the owner's later blocks duplicate a run already findable: the run grows no more

    @staticmethod
    def new(owner: str, start: int, end: int, hashes: Sequence[int], blocks: list[int]) -> CachedRun:
        """A run its owner computed, positions `[start, end)`, held by no one else yet. Made
        without a class call (whose `__init__` dispatch costs more than the run's whole setup):
        a run is made per request that computes blocks, on the scheduler's path."""
        run = _new(CachedRun)
        run.owner, run.start, run.end, run.hashes, run.blocks = owner, start, end, hashes, blocks
        run.holders, run.held_to, run.closed = NO_HOLDERS, start, False
        return run

    @property
    def referenced_to(self) -> int:
        """Positions `[start, referenced_to)` are in some table; the rest to `end` is evictable."""
        return self.end if self.owner is not None else self.held_to

    @property
    def num_evictable(self) -> int:
        return self.end - self.referenced_to

    def agreed_to(self, hashes: Sequence[int], i: int, limit: int) -> int:
        """How far `hashes` agree with this run's from position `i` (where they agree), up to
        `limit`: the largest `m` with equal hashes on `[i, m)`. Slice comparisons, bisected."""
        mine, end = self.hashes, min(self.end, limit)
        if mine[i:end] == hashes[i:end]:
            return end
        lo, hi = i + 1, end - 1  # they agree on [i, lo); the answer is at most hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mine[lo:mid] == hashes[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def release(self, request_id: str) -> int:
        """A holder is gone; returns how many blocks became evictable."""
        extent = self.holders.pop(request_id)
        if extent < self.held_to:
            return 0
        before = self.referenced_to
        self.held_to = max(self.holders.values(), default=self.start)
        return before - self.referenced_to


class Hits(list[int]):
    """Hit block ids, in table order, and `spans`: (run, extent) for each run they come from."""

    __slots__ = ("spans",)

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[CachedRun, int]] = []
