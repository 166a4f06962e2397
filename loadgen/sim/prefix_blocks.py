"""A trace's prefix ids as a unit's KV block hashes, and the hit rate an unbounded cache would get.

Owns: `PrefixBlocks` (per request, the block hashes the simulated scheduler and the router see)
and `ideal_hit_rate`. A trace block of `prefix_block_size` tokens (Mooncake: 512) maps onto
`prefix_block_size / block_size` unit blocks; only the trace blocks the (possibly clipped)
prompt fills completely get hashes, and a partial last block gets none, as in the core. The
trace's ids already name a whole prefix (equal id = equal prefix up to it), so the unit
block hashes are plain arithmetic on them (`id x blocks_per_id + k`), distinct for distinct
(id, k), with no hashing cost. A trace without prefix ids gives no hashes: no hits.

Imports only loadgen.records; must not import the event loop or the fleet.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadgen.records import Trace


class PrefixBlocks:
    __slots__ = ("block_size", "ids", "per_id", "trace_block")

    def __init__(self, trace: Trace, block_size: int) -> None:
        self.ids = trace.prefix_ids
        self.trace_block = trace.prefix_block_size
        self.block_size = block_size
        if self.ids is not None and self.trace_block % block_size:
            raise ValueError(f"the trace's prefix blocks of {self.trace_block} tokens do not split into "
                             f"unit blocks of {block_size}; use a block size that divides {self.trace_block}")
        self.per_id = self.trace_block // block_size

    @property
    def enabled(self) -> bool:
        return self.ids is not None

    def hashes(self, i: int, num_prompt_tokens: int) -> list[int] | None:
        """Block hashes of request `i`'s first full trace blocks (None without prefix data)."""
        if self.ids is None:
            return None
        ids = self.ids[i]
        per = self.per_id
        out: list[int] = []
        for h in ids[: min(len(ids), num_prompt_tokens // self.trace_block)]:
            base = h * per
            out.extend(range(base, base + per))
        return out


def ideal_hit_rate(trace: Trace, block_size: int, prompt_tokens: list[int],
                   served: Sequence[bool] | None = None) -> float | None:
    """Cached over prompt tokens for an unbounded cache that keeps every full block ever seen,
    over the requests in arrival order, with the core's rule that a request's last token is
    always computed. `prompt_tokens` are the prompt lengths as simulated (after clipping);
    `served` keeps only the requests a run admitted (a refused turn of a conversation leaves
    nothing for the next turn to hit, whatever the cache). None for a trace without prefix ids."""
    if trace.prefix_ids is None:
        return None
    seen: set[int] = set()
    tb = trace.prefix_block_size
    hit = total = 0
    keep = served if served is not None else [True] * len(trace)
    for ids, n, kept in zip(trace.prefix_ids, prompt_tokens, keep, strict=True):
        if not kept:
            continue
        full = ids[: min(len(ids), n // tb)]
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        hit += min(k * tb, (n - 1) // block_size * block_size)
        total += n
        seen.update(full)
    return hit / total if total else 0.0
