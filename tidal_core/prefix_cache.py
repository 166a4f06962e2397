"""Paged KV blocks shared between requests by prefix: the block manager with prefix caching.

Owns: `PrefixCachingBlockManager`, the `BlockManager` a unit uses when
`SchedulerConfig.enable_prefix_caching` is on (the plain one stays as it is, and as fast, when
it is off). A full block whose KV is computed is registered under its chained hash
(core/block_hash.py); a later request whose prompt starts with the same blocks takes a
reference to them instead of computing them. The rules that keep shared KV correct:

- a block is registered only once its KV is *computed* (`register`, called when a step's
  chunk is applied), never at allocation: a request admitted in the same step as the one
  filling a block must not read it;
- a request never takes its whole prompt from the cache: at least its last token is computed
  (it samples the first output token), so hits stop at `(num_tokens - 1) // block_size`
  blocks, and cached tokens are always a whole number of blocks;
- a shared block is never written: a request's writes start at its first uncached block,
  and only full, computed blocks are ever shared;
- freeing (finish, abort, preemption) drops references. A block whose count reaches 0 and
  that holds a hash stays cached, *evictable*, in least-recently-freed order; it is evicted
  (its hash forgotten) only when the list of clean free blocks runs dry. Evictable blocks
  count as free for usage, admission and the watermark.

A block is in exactly one of three states: clean-free (no hash, in no table), evictable
(hashed, in no table) or referenced (in one table or more, maybe hashed); `check_integrity`
proves it. Speed: a block held by one request carries no count at all (only blocks in two
tables or more have an entry in `_shared`), and freeing or registering a request whose blocks
are not shared is a few C-level bulk operations, so the cache costs the scheduler little when
it saves nothing.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tidal_core.kv_blocks import NO_NEW_BLOCK, BlockManager


class PrefixCachingBlockManager(BlockManager):
    __slots__ = ("_by_hash", "_evictable", "_hash_of", "_lru", "_lru_head", "_registered", "_shared", "_stale",
                 "num_evictions")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._by_hash: dict[int, int] = {}  # hash -> block
        self._hash_of: dict[int, int] = {}  # block -> hash (referenced or evictable)
        # Unreferenced hashed blocks: the set, and their order in `_lru[_lru_head:]` (least
        # recently freed first). A block revived by a hit stays in `_lru` and is skipped when its
        # entry comes up (`_stale` counts such entries per block): every update is a bulk one
        # at C speed, where an OrderedDict costs a Python-level call per block.
        self._evictable: set[int] = set()
        self._lru: list[int] = []
        self._lru_head = 0
        self._stale: dict[int, int] = {}
        self._shared: dict[int, int] = {}  # block -> references beyond the first (blocks in 2+ tables)
        # request id -> leading blocks of its table already registered (or taken from the cache)
        self._registered: dict[str, int] = {}
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or evictable)."""
        return len(self._by_hash)

    def usage(self) -> float:
        return (self.num_blocks - len(self._free) - len(self._evictable)) / self.num_blocks

    def num_references(self) -> int:
        return sum(map(len, self._tables.values()))

    def can_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> bool:
        return self.extra_blocks_needed(request_id, num_tokens) + keep_free <= self.num_free_blocks

    def match(self, hashes: Sequence[int] | None, num_tokens: int) -> list[int]:
        """The cached blocks a request of `num_tokens` tokens with these block hashes would reuse:
        the longest run of leading hashes found, leaving its last token to compute. Peeks only."""
        if not hashes:
            return []
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        by_hash, hits = self._by_hash, []
        for i in range(limit):
            block = by_hash.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- mutations -----------------------------------------------------------------------
    def allocate_with(self, request_id: str, num_tokens: int, hits: list[int], keep_free: int = 0) -> bool:
        """A new table for `num_tokens` tokens whose first blocks are `hits` (from `match`, with
        nothing changed since); False, changing nothing, if it would leave under `keep_free` free."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        need = self.blocks_for(num_tokens) - len(hits)  # >= 1: the last token is never cached
        if not hits:
            if need + keep_free > len(self._free) + len(self._evictable):
                return False
            self._tables[request_id] = self._take(need)
            self._registered[request_id] = 0
            return True
        evictable, shared, stale = self._evictable, self._shared, self._stale
        reviving = sum(map(evictable.__contains__, hits))
        if need + reviving + keep_free > self.num_free_blocks:
            return False
        for b in hits:
            if b in evictable:
                evictable.remove(b)
                stale[b] = stale.get(b, 0) + 1
            else:
                shared[b] = shared.get(b, 0) + 1
        self._tables[request_id] = hits + self._take(need)
        self._registered[request_id] = len(hits)
        return True

    def register(self, request_id: str, hashes: Sequence[int] | None, num_computed_tokens: int) -> None:
        """The request's first `num_computed_tokens` tokens now have KV: make its full blocks
        among them findable by hash. A block whose hash another block already holds (two
        requests computed the same prefix at once) stays private and is freed clean."""
        done = self._registered.get(request_id)
        if done is None or not hashes:
            return
        upto = min(num_computed_tokens // self.block_size, len(hashes))
        if upto <= done:
            return
        new_hashes, blocks = hashes[done:upto], self._tables[request_id][done:upto]
        by_hash, hash_of = self._by_hash, self._hash_of
        if by_hash.keys().isdisjoint(new_hashes):  # the common case, in bulk
            by_hash.update(zip(new_hashes, blocks, strict=True))
            hash_of.update(zip(blocks, new_hashes, strict=True))
        else:
            for h, block in zip(new_hashes, blocks, strict=True):
                if h not in by_hash:
                    by_hash[h] = block
                    hash_of[block] = h
        self._registered[request_id] = upto

    def try_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> list[int] | None:
        table = self._tables.get(request_id)
        need = self.blocks_for(num_tokens) - (len(table) if table else 0)
        if need <= 0:
            return []
        if need + keep_free > self.num_free_blocks:
            return None
        new = self._take(need)
        if table is None:
            self._tables[request_id] = list(new)
            self._registered[request_id] = 0
        else:
            table.extend(new)
        return new

    def append_slot(self, request_id: str, num_tokens: int) -> int | None:
        if (num_tokens - 1) % self.block_size:
            return NO_NEW_BLOCK
        if not self._free and not self._evictable:
            return None
        block = self._take(1)[0]
        table = self._tables.get(request_id)
        if table is None:
            self._tables[request_id] = [block]
            self._registered[request_id] = 0
        else:
            table.append(block)
        return block

    def append_blocks(self, request_ids: list[str]) -> dict[str, list[int]] | None:
        n = len(request_ids)
        if n > self.num_free_blocks:
            return None
        new = self._take(n)
        tables = self._tables
        for rid, block in zip(request_ids, new, strict=True):
            tables[rid].append(block)
        return {rid: [block] for rid, block in zip(request_ids, new, strict=True)}

    def free(self, request_id: str) -> int:
        """Drop the request's references; blocks left unreferenced go back, hashed ones cached.
        The tail of a prompt goes to the evictable list first, so it is evicted before its head."""
        table = self._tables.pop(request_id, None)
        registered = self._registered.pop(request_id, 0)
        if not table:
            return 0
        shared, hash_of = self._shared, self._hash_of
        # Blocks past the registered ones were never hashed; the registered ones all are unless
        # a copy of theirs was registered first. Neither shared: bulk moves.
        unshared = not shared or shared.keys().isdisjoint(table)
        if unshared and not registered:
            self._free.extend(reversed(table))
            return len(table)
        head = table[:registered]
        if unshared and sum(map(hash_of.__contains__, head)) == registered:
            self._free.extend(reversed(table[registered:]))
            head.reverse()
            self._lru += head
            self._evictable.update(head)
            return len(table)
        free, evictable, lru = self._free, self._evictable, self._lru
        for b in reversed(table):
            extra = shared.get(b)
            if extra is not None:
                if extra == 1:
                    del shared[b]
                else:
                    shared[b] = extra - 1
            elif b in hash_of:
                evictable.add(b)
                lru.append(b)
            else:
                free.append(b)
        return len(table)

    def _take(self, n: int) -> list[int]:
        """`n` (>= 1, at most `num_free_blocks`) blocks: clean ones first, then the least
        recently freed cached ones, whose hashes are forgotten."""
        free = self._free
        if n <= len(free):
            new = free[-n:]
            del free[-n:]
            new.reverse()
            return new
        new = free[::-1]
        free.clear()
        victims = self._pop_lru(n - len(new))
        self._evictable.difference_update(victims)
        # A C-level loop: deque(map(...), maxlen=0) runs the map for its side effects.
        deque(map(self._by_hash.__delitem__, map(self._hash_of.pop, victims)), maxlen=0)
        self.num_evictions += len(victims)
        new += victims
        return new

    def _pop_lru(self, k: int) -> list[int]:
        """The `k` least recently freed evictable blocks, out of the order list."""
        lru, stale, head = self._lru, self._stale, self._lru_head
        victims = lru[head:head + k]
        head += k
        if stale and not stale.keys().isdisjoint(victims):
            victims = []
            head = self._lru_head
            while len(victims) < k:
                b = lru[head]
                head += 1
                left = stale.get(b)
                if left is None:
                    victims.append(b)
                elif left == 1:
                    del stale[b]
                else:
                    stale[b] = left - 1
        if head > 4096 and head * 2 > len(lru):
            del lru[:head]
            head = 0
        self._lru_head = head
        return victims

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Reference counts equal table entries; every block is exactly one of clean-free,
        evictable or referenced; the hash table and the per-block hashes agree; no block is
        both free and hashed (a free block could be rewritten while a lookup still finds it)."""
        counts: dict[int, int] = {}
        for rid, table in self._tables.items():
            if not table:
                raise AssertionError(f"request {rid} has an empty block table entry")
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid} holds a block twice")
            for b in table:
                counts[b] = counts.get(b, 0) + 1
            if not 0 <= self._registered.get(rid, -1) <= len(table):
                raise AssertionError(f"request {rid}: registered-block count out of range")
        if set(self._registered) != set(self._tables):
            raise AssertionError("registered-block counts kept for requests without a table")
        extra = {b: c - 1 for b, c in counts.items() if c > 1}
        if extra != self._shared:
            bad = next(b for b in set(extra) | set(self._shared) if extra.get(b) != self._shared.get(b))
            raise AssertionError(f"block {bad}: reference count {1 + self._shared.get(bad, 0)} but "
                                 f"{counts.get(bad, 0)} table entries")
        for b in self._free:
            if b in counts or b in self._hash_of:
                raise AssertionError(f"free block {b} is referenced or still hashed (free and dirty)")
        for b in self._evictable:
            if b in counts or b not in self._hash_of:
                raise AssertionError(f"evictable block {b} is referenced or has no hash")
        entries: dict[int, int] = {}
        for b in self._lru[self._lru_head:]:
            entries[b] = entries.get(b, 0) + 1
        live = {b: c - self._stale.get(b, 0) for b, c in entries.items()}
        if any(c not in (0, 1) for c in live.values()) or {b for b, c in live.items() if c} != self._evictable \
                or not set(self._stale) <= set(entries):
            raise AssertionError("the eviction order list disagrees with the evictable blocks")
        pools = set(self._free) | set(self._evictable)
        if len(pools) != len(self._free) + len(self._evictable) or len(counts) + len(pools) != self.num_blocks:
            raise AssertionError("clean-free, evictable and referenced blocks do not partition the pool")
        if len(self._by_hash) != len(self._hash_of) or any(self._hash_of.get(b) != h
                                                           for h, b in self._by_hash.items()):
            raise AssertionError("the hash table and the blocks' hashes disagree")
