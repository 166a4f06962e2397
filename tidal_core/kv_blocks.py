"""Paged KV-cache bookkeeping: which block ids each request owns.

Owns: `BlockManager`, the single writer of a serving unit's block tables. Executors only
read the block ids carried by plans. "No room" is a `None` return, never an exception.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

NO_NEW_BLOCK = -1
"""`append_slot` result: the request's last block still had room."""


class BlockManager:
    """Fixed-size blocks handed out from a free list to per-request tables.

    A table holds `ceil(num_tokens / block_size)` blocks for the tokens whose KV it stores.
    The watermark is a number of blocks that admissions of *new* requests must leave free,
    so running decodes can keep growing without immediate preemption.
    """

    __slots__ = ("_free", "_tables", "block_size", "num_blocks", "watermark_blocks")

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        # Popped from the end: recently freed blocks are reused first (warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def num_references(self) -> int:
        """Table entries over all requests (here every used block has exactly one owner)."""
        return self.num_blocks - len(self._free)

    def table(self, request_id: str) -> list[int]:
        """The block table of a request (empty if it holds none). Do not mutate it."""
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table) if table else 0

    def extra_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_of(request_id))

    def can_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> bool:
        """Could the table grow to hold `num_tokens` tokens and leave `keep_free` blocks free?"""
        return self.extra_blocks_needed(request_id, num_tokens) + keep_free <= len(self._free)

    # ---- mutations -----------------------------------------------------------------------
    def try_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> list[int] | None:
        """Grow the table to hold `num_tokens`; return the new block ids, or None if no room."""
        table = self._tables.get(request_id)
        have = len(table) if table else 0
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return []
        free = self._free
        if need + keep_free > len(free):
            return None
        new = free[-need:]
        del free[-need:]
        new.reverse()
        if table is None:
            self._tables[request_id] = list(new)
        else:
            table.extend(new)
        return new

    def append_slot(self, request_id: str, num_tokens: int) -> int | None:
        """Make room for token number `num_tokens` (1-based) of a growing request.

        Returns the new block id if one was needed, `NO_NEW_BLOCK` if the last block had room,
        and None if a block was needed but none is free. Kept apart from `try_allocate`
        because it runs once per decode per step.
        """
        if (num_tokens - 1) % self.block_size:
            return NO_NEW_BLOCK
        if not self._free:
            return None
        block = self._free.pop()
        table = self._tables.get(request_id)
        if table is None:
            self._tables[request_id] = [block]
        else:
            table.append(block)
        return block

    def append_blocks(self, request_ids: list[str]) -> dict[str, list[int]] | None:
        """One new block for each request (all or none); returns {request_id: [block]}."""
        free = self._free
        n = len(request_ids)
        if n > len(free):
            return None
        if not n:
            return {}
        new = free[-n:]
        del free[-n:]
        tables = self._tables
        granted: dict[str, list[int]] = {}
        for rid, block in zip(request_ids, new, strict=True):  # one loop for both: it runs every step
            tables[rid].append(block)
            granted[rid] = [block]
        return granted

    def free(self, request_id: str) -> int:
        """Return all blocks of a request to the free list; returns how many."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block is either free or owned by exactly one table; nothing else exists."""
        seen: set[int] = set()
        for rid, table in self._tables.items():
            if not table:
                raise AssertionError(f"request {rid} has an empty block table entry")
            for b in table:
                if b in seen:
                    raise AssertionError(f"block {b} owned twice (second owner {rid})")
                seen.add(b)
        for b in self._free:
            if b in seen:
                raise AssertionError(f"block {b} is both free and owned")
            seen.add(b)
        owned = sum(map(len, self._tables.values()))
        if seen != set(range(self.num_blocks)) or len(self._free) + owned != self.num_blocks:
            raise AssertionError("block accounting does not cover exactly the pool")
