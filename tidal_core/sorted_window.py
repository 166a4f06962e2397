"""A window of the last values added, kept sorted as they come.

Owns: `SortedWindow`. The output lengths of finished requests (core/load.py, `OutputLengths`:
the slot wait's distribution) and the `costly_prompt` rule's prompt lengths
(core/costly_prompts.py) are each read from one.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import bisect


class SortedWindow:
    """The last `size` values added, kept sorted as they come (`values`); `count` is how many were
    ever added."""

    __slots__ = ("_kept", "count", "size", "values")

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: list[int] = []
        self.values: list[int] = []
        self.count = 0

    def add(self, value: int) -> None:
        kept, ordered = self._kept, self.values
        if len(kept) < self.size:
            kept.append(value)
        else:
            slot = self.count % self.size
            del ordered[bisect.bisect_left(ordered, kept[slot])]
            kept[slot] = value
        bisect.insort(ordered, value)
        self.count += 1
