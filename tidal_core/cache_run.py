"""A run of cached KV blocks: the unit the prefix cache keys, shares and evicts by.

Owns: `CachedRun` and `Hits`. A run is a stretch of consecutive full prompt blocks that one
request (its *owner*) computed itself, positions `[start, end)` of the owner's block table, with
the owner's chained block hashes. Only the run's first hash is a key of the cache's hash table:
a chained hash stands for its whole prefix, so a lookup that finds a run's first block goes on
comparing the query's next hashes with the run's own, position by position (a C-level slice
comparison), instead of one table entry per block. Registering, freeing and evicting then cost a
few operations per run, not per block.

Who holds what: while the owner lives, its table references the whole run; another request that
hit the run (a *holder*) references its leading blocks `[start, extent)`. Once the owner is gone,
blocks past every holder's extent (`held_to`) are *evictable*: still findable, counted as free,
evicted from the run's tail when clean blocks run out.

`Hits` is what a cache lookup returns: the hit block ids (a list) and the runs they come from,
each with the extent the request would hold.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence


class CachedRun:
    __slots__ = ("blocks", "closed", "end", "hashes", "held_to", "holders", "owner", "start")

    def __init__(self, owner: str, start: int, end: int, hashes: Sequence[int], blocks: list[int]) -> None:
        self.owner: str | None = owner  # None once the owner freed its table
        self.start = start
        self.end = end  # findable blocks: positions [start, end)
        self.hashes = hashes  # the owner's block hashes, by position (never mutated)
        self.blocks = blocks  # the owner's block table, by position (only ever appended to)
        self.holders: dict[str, int] = {}  # request id -> extent: it holds positions [start, extent)
        self.held_to = start  # the largest extent held (start with no holder)
        # The owner's later blocks duplicate a run already findable: the run grows no more.
        self.closed = False

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
