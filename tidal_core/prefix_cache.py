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

A block is in exactly one of three states: clean-free (no hash, count 0), evictable (hash,
count 0) or referenced (count > 0, maybe hashed); `check_integrity` proves it.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tidal_core.kv_blocks import NO_NEW_BLOCK, BlockManager


class PrefixCachingBlockManager(BlockManager):
    __slots__ = ("_by_hash", "_evictable", "_hash_of", "_ref", "_registered", "num_evictions")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count-0 hashed blocks, oldest first
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
        return self.num_used_blocks / self.num_blocks

    def num_references(self) -> int:
        return sum(self._ref)

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
        ref, evictable = self._ref, self._evictable
        need = self.blocks_for(num_tokens) - len(hits)
        reviving = sum(1 for b in hits if ref[b] == 0)
        if need + reviving + keep_free > self.num_free_blocks:
            return False
        for b in hits:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
        self._tables[request_id] = hits + self._take(need) if need > 0 else list(hits)
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
        table, by_hash, hash_of = self._tables[request_id], self._by_hash, self._hash_of
        for k in range(done, upto):
            h, block = hashes[k], table[k]
            if hash_of[block] is None and h not in by_hash:
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
        self._registered.pop(request_id, None)
        if not table:
            return 0
        ref, hash_of, free, evictable = self._ref, self._hash_of, self._free, self._evictable
        for b in reversed(table):
            left = ref[b] - 1
            ref[b] = left
            if left == 0:
                if hash_of[b] is None:
                    free.append(b)
                else:
                    evictable[b] = None
        return len(table)

    def _take(self, n: int) -> list[int]:
        """`n` (>= 1, at most `num_free_blocks`) blocks, referenced once: clean ones first, then
        the least recently freed cached ones, whose hashes are forgotten."""
        free = self._free
        if n <= len(free):
            new = free[-n:]
            del free[-n:]
            new.reverse()
        else:
            new = free[::-1]
            free.clear()
            by_hash, hash_of, evictable = self._by_hash, self._hash_of, self._evictable
            evict = n - len(new)
            for _ in range(evict):
                block, _ = evictable.popitem(last=False)
                del by_hash[hash_of[block]]  # type: ignore[arg-type]  # evictable blocks are hashed
                hash_of[block] = None
                new.append(block)
            self.num_evictions += evict
        ref = self._ref
        for b in new:
            ref[b] = 1
        return new

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Reference counts equal table entries; every block is exactly one of clean-free,
        evictable or referenced; the hash table and the per-block hashes agree; no block is
        both free and hashed (a free block could be rewritten while a lookup still finds it)."""
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            if not table:
                raise AssertionError(f"request {rid} has an empty block table entry")
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid} holds a block twice")
            for b in table:
                counts[b] += 1
            if not 0 <= self._registered.get(rid, -1) <= len(table):
                raise AssertionError(f"request {rid}: registered-block count out of range")
        if set(self._registered) != set(self._tables):
            raise AssertionError("registered-block counts kept for requests without a table")
        if counts != self._ref:
            bad = next(b for b in range(self.num_blocks) if counts[b] != self._ref[b])
            raise AssertionError(f"block {bad}: reference count {self._ref[bad]} but {counts[bad]} table entries")
        for b in self._free:
            if self._ref[b] or self._hash_of[b] is not None:
                raise AssertionError(f"free block {b} is referenced or still hashed (free and dirty)")
        for b in self._evictable:
            if self._ref[b] or self._hash_of[b] is None:
                raise AssertionError(f"evictable block {b} is referenced or has no hash")
        referenced = sum(1 for c in counts if c)
        pools = set(self._free) | set(self._evictable)
        if len(pools) != len(self._free) + len(self._evictable) or referenced + len(pools) != self.num_blocks:
            raise AssertionError("clean-free, evictable and referenced blocks do not partition the pool")
        for h, b in self._by_hash.items():
            if self._hash_of[b] != h:
                raise AssertionError(f"hash table maps to block {b}, which holds another hash")
        if sum(1 for h in self._hash_of if h is not None) != len(self._by_hash):
            raise AssertionError("a block holds a hash the hash table does not know")
