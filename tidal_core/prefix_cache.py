"""Paged KV blocks shared between requests by prefix: the block manager with prefix caching.

Owns: `PrefixCachingBlockManager`, the `BlockManager` a unit uses when
`SchedulerConfig.enable_prefix_caching` is on (the plain one stays as it is, and as fast, when
it is off). Full blocks whose KV is computed are registered under their chained hashes
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
- freeing (finish, abort, preemption) drops references. A block no table holds any more that
  is cached stays *evictable*, findable, least recently freed first; it is evicted only when
  the list of clean free blocks runs dry. Evictable blocks count as free for usage, admission
  and the watermark.

Blocks are cached by run (core/cache_run.py): the stretch of prompt blocks one request
computed itself, keyed by its first hash only. A lookup compares the rest of a prompt's hashes
with the run's by slices and goes on at the next run's key. A request that computed blocks a
findable run already holds keeps its copies private (freed clean); a run whose owner would go
on computing what a newer run holds stops there. Registering, freeing and evicting are a few
operations per run and list slices per block, so the cache costs the scheduler little when it
saves nothing, and requests without hashes never touch a run. A request that hits nothing has
its own path through each step (registering its first chunk makes its run inline, freeing it is
one queue entry, the first eviction branch takes it whole), and its run has no holders dict of
its own until a hit (core/cache_run.py `NO_HOLDERS`). When clean blocks run out, a
run's evictable tail is evicted whole if that is at most 1/512 of the pool more than needed.

A block is in exactly one of three states: clean-free (in `_free`), evictable (in a run, held
by no table) or referenced (in one table or more); `check_integrity` proves it.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from tidal_core.cache_run import NO_HOLDERS, CachedRun, Hits
from tidal_core.kv_blocks import NO_NEW_BLOCK, BlockManager
from tidal_core.prefix_cache_integrity import CacheState, check_cache_state

_NO_HITS = Hits()  # the empty lookup result, shared: never mutated
_new = object.__new__
NO_HITS = _NO_HITS
"""What `match` returns on a miss: callers that test `run_keys` themselves pass it to `allocate_with`."""


class PrefixCachingBlockManager(BlockManager):
    __slots__ = ("_by_hash", "_evict_batch", "_holds", "_lru", "_num_evictable", "_own", "num_evictions", "run_keys")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        super().__init__(num_blocks, block_size, watermark)
        self._by_hash: dict[int, CachedRun] = {}  # a run's first hash -> the run
        # The same table, read-only, for callers' one-probe miss test: a prompt whose first hash
        # is not among `run_keys` hits nothing (`match` need not be called).
        self.run_keys: Mapping[int, CachedRun] = self._by_hash
        self._own: dict[str, CachedRun] = {}  # request id -> the run of blocks it computed
        # request id -> the runs it hit, with extents (the last extent: the blocks it took cached)
        self._holds: dict[str, list[tuple[CachedRun, int]]] = {}
        # Runs with evictable blocks, least recently freed first; each is evicted from its tail.
        self._lru: OrderedDict[CachedRun, None] = OrderedDict()
        self._num_evictable = 0
        # Evicting a run's whole tail at once may take this many blocks more than asked (1/512
        # of the pool: none in a small one): one eviction then serves many takes.
        self._evict_batch = num_blocks // 512
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or evictable)."""
        return sum(run.end - run.start for run in self._by_hash.values())

    def usage(self) -> float:
        return (self.num_blocks - len(self._free) - self._num_evictable) / self.num_blocks

    def num_references(self) -> int:
        return sum(map(len, self._tables.values()))

    def can_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> bool:
        return self.extra_blocks_needed(request_id, num_tokens) + keep_free <= self.num_free_blocks

    def match(self, hashes: Sequence[int] | None, num_tokens: int) -> Hits:
        """The cached blocks a request of `num_tokens` tokens with these block hashes would reuse:
        the longest run of leading hashes found, leaving its last token to compute. Peeks only;
        the result is for `allocate_with` (do not mutate it)."""
        if not hashes or hashes[0] not in self._by_hash:  # the common miss, at once
            return _NO_HITS
        limit = (num_tokens - 1) // self.block_size
        if limit > len(hashes):
            limit = len(hashes)
        return self._walk(hashes if type(hashes) is list else list(hashes), limit)

    def _walk(self, hashes: list[int], limit: int) -> Hits:
        """The findable blocks agreeing with `hashes` from position 0, at most `limit`."""
        by_hash, hits, i = self._by_hash, _NO_HITS, 0
        while i < limit:
            run = by_hash.get(hashes[i])
            if run is None or run.start != i:
                break
            m = run.agreed_to(hashes, i, limit)
            if hits is _NO_HITS:
                hits = Hits()
            hits += run.blocks[i:m]
            hits.spans.append((run, m))
            i = m
        return hits

    # ---- mutations -----------------------------------------------------------------------
    def allocate_with(self, request_id: str, num_tokens: int, hits: list[int], keep_free: int = 0) -> bool:
        """A new table for `num_tokens` tokens whose first blocks are `hits` (from `match`, with
        nothing changed since); False, changing nothing, if it would leave under `keep_free` free."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        need = -(-num_tokens // self.block_size) - len(hits)  # >= 1: the last token is never cached
        if not hits:
            free = self._free
            if need + keep_free > len(free) + self._num_evictable:
                return False
            if need <= len(free):  # `_take`'s clean case, inlined: a miss's allocation is one slice
                table = free[-need:]
                del free[-need:]
                table.reverse()
                self._tables[request_id] = table
            else:
                self._tables[request_id] = self._take(need)
            return True
        if not isinstance(hits, Hits):
            raise ValueError("allocate_with takes the hits `match` returned")
        reviving = sum(extent - run.held_to for run, extent in hits.spans if run.owner is None and extent > run.held_to)
        if need + reviving + keep_free > self.num_free_blocks:
            return False
        lru = self._lru
        for run, extent in hits.spans:
            if run.holders is NO_HOLDERS:  # its first hit: a dict of its own
                run.holders = {}
            run.holders[request_id] = extent
            if extent > run.held_to:
                run.held_to = extent
            if run in lru:  # a hit is a use
                if run.end == run.held_to:
                    del lru[run]
                else:
                    lru.move_to_end(run)
        self._num_evictable -= reviving
        self._tables[request_id] = [*hits, *self._take(need)]
        self._holds[request_id] = hits.spans
        return True

    def register(self, request_id: str, hashes: Sequence[int] | None, num_computed_tokens: int) -> None:
        """The request's first `num_computed_tokens` tokens now have KV: make its full blocks
        among them findable by hash. Blocks that duplicate findable ones (two requests computed
        the same prefix at once) stay private and are freed clean."""
        if not hashes:
            return
        upto = num_computed_tokens // self.block_size
        if upto > len(hashes):
            upto = len(hashes)
        run = self._own.get(request_id)
        if run is not None:  # the common case: one more chunk of its own run
            if upto > run.end and not run.closed:
                run.end = upto
            return
        if not upto:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        if type(hashes) is not list:
            hashes = list(hashes)
        by_hash = self._by_hash
        if hashes[0] not in by_hash and request_id not in self._holds:  # no hit, nothing like it cached
            run = _new(CachedRun)  # `CachedRun.new`, inlined: this runs once per request that computes blocks
            run.owner, run.start, run.end, run.hashes, run.blocks = request_id, 0, upto, hashes, table
            run.holders, run.held_to, run.closed = NO_HOLDERS, 0, False
            self._own[request_id] = by_hash[hashes[0]] = run
            return
        spans = self._holds.get(request_id)
        start = spans[-1][1] if spans else 0  # the blocks it took from the cache
        if upto <= start:
            return
        reach, last = self._reach(hashes, upto)
        p = reach if reach > start else start  # the findable path is never shorter than the request's hits
        if p >= upto or hashes[p] in by_hash:
            return  # a copy of findable blocks so far: asked again as more is computed
        if last is not None and last.end == p and last.owner is not None and len(last.hashes) > p \
                and last.hashes[p] == hashes[p]:
            last.closed = True  # its owner would go on computing what this run holds: it stops here
        self._own[request_id] = by_hash[hashes[p]] = CachedRun.new(request_id, p, upto, hashes, table)

    def _reach(self, hashes: list[int], limit: int) -> tuple[int, CachedRun | None]:
        """How far (at most `limit`) the findable blocks agree with `hashes`, and the last run
        of that path."""
        by_hash, i, last = self._by_hash, 0, None
        while i < limit:
            run = by_hash.get(hashes[i])
            if run is None or run.start != i:
                break
            i, last = run.agreed_to(hashes, i, limit), run
        return i, last

    def try_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> list[int] | None:
        table = self._tables.get(request_id)
        need = self.blocks_for(num_tokens) - (len(table) if table else 0)
        if need <= 0:
            return []
        if need + keep_free > len(self._free) + self._num_evictable:
            return None
        new = self._take(need)
        if table is None:
            self._tables[request_id] = list(new)
        else:
            table.extend(new)
        return new

    def append_slot(self, request_id: str, num_tokens: int) -> int | None:
        if (num_tokens - 1) % self.block_size:
            return NO_NEW_BLOCK
        free = self._free
        if free:
            block = free.pop()
        elif self._num_evictable:
            block = self._take(1)[0]
        else:
            return None
        table = self._tables.get(request_id)
        if table is None:
            self._tables[request_id] = [block]
        else:
            table.append(block)
        return block

    def append_blocks(self, request_ids: list[str]) -> dict[str, list[int]] | None:
        n, free = len(request_ids), self._free
        if not n:
            return {}
        if n <= len(free):
            new = free[-n:]
            del free[-n:]
        elif n <= len(free) + self._num_evictable:
            new = self._take(n)
        else:
            return None
        tables = self._tables
        granted: dict[str, list[int]] = {}
        for rid, block in zip(request_ids, new, strict=True):  # one loop for both: it runs every step
            tables[rid].append(block)
            granted[rid] = [block]
        return granted

    def free(self, request_id: str) -> int:
        """Drop the request's references; its private blocks go back clean, its cached ones stay
        findable. Its own run is queued for eviction before the runs it hit (the tail of a
        prompt is evicted before its head)."""
        table = self._tables.pop(request_id, None)
        run = self._own.pop(request_id, None)
        if run is not None and not run.start:  # it hit nothing (hits end where its own run starts)
            blocks = run.blocks  # its table
            self._free.extend(reversed(blocks[run.end:]))
            run.owner = None
            if run.end > run.held_to:
                self._num_evictable += run.end - run.held_to
                self._lru[run] = None
            return len(blocks)
        spans = self._holds.pop(request_id, None) if self._holds else None
        if not table:
            return 0
        free, lru = self._free, self._lru
        start = spans[-1][1] if spans else 0  # the blocks it took from the cache
        if run is None:
            free.extend(reversed(table[start:] if start else table))
        else:
            free.extend(reversed(table[run.end:]))
            if run.start > start:
                free.extend(reversed(table[start:run.start]))
            run.owner = None
            if run.end > run.held_to:
                self._num_evictable += run.end - run.held_to
                lru[run] = None
        if spans:
            for hit_run, _ in reversed(spans):
                self._num_evictable += hit_run.release(request_id)
                if hit_run.owner is None and hit_run.end > hit_run.held_to:
                    lru[hit_run] = None
                    lru.move_to_end(hit_run)
        return len(table)

    def _take(self, n: int) -> list[int]:
        """`n` (>= 1, at most `num_free_blocks`) blocks: every clean one before any eviction, then
        blocks evicted from the tails of the least recently freed runs (a run evicted to its start
        is forgotten), moved onto the clean list and taken from it with the clean ones. A run's
        evictable tail goes whole when that is at most `_evict_batch` blocks more than asked; the
        surplus stays on the clean list, so the next takes are plain pops."""
        free = self._free
        if n <= len(free):
            new = free[-n:]
            del free[-n:]
            new.reverse()
            return new
        k, lru = n - len(free), self._lru
        evicted = 0
        while evicted < k:  # a run's tail at a time, the least recently freed run first, into the clean list
            run = lru.popitem(False)[0]  # positional: no keyword parsing
            end, keep = run.end, run.held_to
            if end - keep > k - evicted + self._evict_batch:  # a long tail: only what is asked, it stays first
                keep = end - (k - evicted)
                lru[run] = None
                lru.move_to_end(run, last=False)
            elif keep == run.start:  # evicted to its start: forgotten
                del self._by_hash[run.hashes[keep]]
            free += run.blocks[keep:end]  # taken from the end below: the tail first
            evicted += end - keep
            run.end = keep
        self._num_evictable -= evicted
        self.num_evictions += evicted
        new = free[-n:]
        del free[-n:]
        new.reverse()
        return new

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Reference counts equal table entries; every block is exactly one of clean-free,
        evictable or referenced; each run is keyed by its first hash, its blocks are findable
        nowhere else, its owner and holders hold what it says; no free block is findable
        (core/prefix_cache_integrity.py)."""
        start = {rid: spans[-1][1] for rid, spans in self._holds.items()}
        check_cache_state(CacheState(self._tables, self._free, self._by_hash, self._own, self._holds, start,
                                     self._lru, self._num_evictable, self.num_blocks))
