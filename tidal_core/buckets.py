"""CUDA-graph batch buckets: pad a decode batch up to the nearest captured size.

Owns: `CudaGraphBuckets`. A pure-decode step of n sequences runs the graph captured for
`bucket_for(n)` (the smallest captured size >= n); above the largest it runs eager (None).
The padded slots are wasted work, reported as `padding waste`.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from bisect import bisect_left


class CudaGraphBuckets:
    __slots__ = ("_lookup", "padded_slots", "sizes", "useful_slots")

    def __init__(self, sizes: tuple[int, ...] | list[int]) -> None:
        sizes = tuple(sizes)
        if any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"bucket sizes {sizes} must be strictly increasing positive integers")
        self.sizes = sizes
        # A direct table makes the per-step lookup one index (sizes are small: <= a few hundred).
        largest = sizes[-1] if sizes else 0
        self._lookup: list[int | None] = [None] * (largest + 1)
        for n in range(1, largest + 1):
            self._lookup[n] = sizes[bisect_left(sizes, n)]
        self.padded_slots = 0
        self.useful_slots = 0

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def bucket_for(self, n: int) -> int | None:
        """The captured size to pad `n` sequences to, or None to run eager."""
        if n < 1:
            raise ValueError(f"batch of {n} sequences has no bucket")
        lookup = self._lookup
        return lookup[n] if n < len(lookup) else None

    def record(self, n: int, padded: int | None) -> None:
        """Account one step: `padded - n` slots computed for nothing."""
        self.useful_slots += n
        if padded is not None:
            self.padded_slots += padded - n

    def pad_step(self, num_decodes: int, num_prefill_tokens: int) -> int | None:
        """The bucket of a pure-decode step (recorded), or None for a step holding prefill."""
        if num_prefill_tokens or not num_decodes:
            return None
        padded = self.bucket_for(num_decodes)
        self.record(num_decodes, padded)
        return padded

    def padding_waste(self) -> float:
        """Fraction of graph-replayed slots that were padding, over all recorded steps."""
        total = self.useful_slots + self.padded_slots
        return self.padded_slots / total if total else 0.0
