"""Cache-aware routing: send a request to the unit that likely holds its prefix, unless load says no.

Owns: `PrefixRoutingConfig`, `PrefixIndex` (one unit's approximate record of the prefixes routed
to it) and `PrefixAwareRouter` (the choice). The simulator's fleet and the Serve request router
both call it; it extends `choose_unit` (core/routing.py), which stays the choice for requests
with nothing to match.

A router cannot see the units' caches. It remembers, per unit, the block hashes of the prompts
it sent there, in least-recently-used order, bounded by the unit's KV blocks: what the unit
would still hold if it cached everything it was sent and evicted the oldest. Because block
hashes are chained (core/block_hash.py), one hash stands for its whole prefix, so the index
keeps only every `stride`-th hash of a prompt and a match is found in a few lookups.

The choice, for a request of `P` prompt tokens whose longest indexed prefix on unit u is `m_u`
tokens:

- if no unit matches at least `min_match_fraction` of the prompt, there is nothing to keep
  together: the load-only choice (`choose_unit` with the prompt's size: power-of-two on the
  predicted TTFT, falling back to the best unit when both sampled would refuse it), which
  spreads new prefixes;
- else each unit's score is what the request's time to first token would be there: the
  unit's routing score (predicted queueing delay plus its KV penalty) plus the prefill of the
  tokens it does not hold, `(P - m_u) x prefill_s_per_token`. Lowest wins. A match buys the
  request at most the prefill it saves, so a busier unit loses once its queue costs more;
- a unit more than `max_extra_delay_s` busier (queueing delay) than the least busy one is
  never chosen for affinity: a report may lag, and piling one conversation's turns onto a
  backed-up unit would cost more than the cache saves;
- a unit whose admission would refuse the request's uncached tokens for its backlog
  (`would_refuse`, core/routing.py) comes after every unit that would admit it, as in
  `choose_unit`: a refused turn breaks its conversation's chain of cached prefixes.

The chosen unit's index then records the prompt. If that unit refuses the request after all
(its own admission is the final authority), `refused` takes the record back: the unit never
computed the prompt, and an index that kept it would send the conversation's next turn after
a prefix no unit holds. (In Serve the front gates refuse most such requests before a unit is
chosen, so the index never records them; the simulator has no gates and reports every refusal.)

Two learnings from SGLang's cache-aware router and Ray Serve's prefix-aware router guide the
shape (a match threshold below which load alone decides, and a load guard over the match); the
score in seconds is this project's own, in the same unit as `unit_score`.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tidal_core.routing import choose_unit, unit_score, would_refuse
from tidal_core.snapshot import UnitLoad


@dataclass(frozen=True, slots=True)
class PrefixRoutingConfig:
    """`index_blocks` is the KV blocks of one unit (the index's bound); `block_size` the tokens
    per block of the hashes routed; `prefill_s_per_token` the prefill cost assumed where a unit
    publishes none."""

    index_blocks: int = 65536
    block_size: int = 16
    stride: int = 16
    min_match_fraction: float = 0.1
    max_extra_delay_s: float = 1.0
    prefill_s_per_token: float = 1e-4

    def __post_init__(self) -> None:
        if self.index_blocks < 1 or self.block_size < 1 or self.stride < 1:
            raise ValueError(f"prefix routing: index_blocks={self.index_blocks}, block_size={self.block_size} and "
                             f"stride={self.stride} must be >= 1")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"prefix routing: min_match_fraction={self.min_match_fraction} must be in [0, 1]")
        if self.max_extra_delay_s < 0.0 or self.prefill_s_per_token < 0.0:
            raise ValueError(f"prefix routing: max_extra_delay_s={self.max_extra_delay_s} and prefill_s_per_token="
                             f"{self.prefill_s_per_token} must be >= 0")


class PrefixIndex:
    """One unit's prefixes, as every `stride`-th block hash of the prompts routed to it (LRU)."""

    __slots__ = ("_keys", "capacity", "stride")

    def __init__(self, capacity_blocks: int, stride: int) -> None:
        self.stride = stride
        self.capacity = max(1, capacity_blocks // stride)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` this unit was sent (a multiple of `stride`)."""
        keys, stride, n = self._keys, self.stride, 0
        for j in range(stride - 1, len(hashes), stride):
            if hashes[j] not in keys:
                break
            n = j + 1
        return n

    def discard(self, hashes: Sequence[int], from_block: int = 0) -> None:
        """Forget the prompt's entries from block `from_block` on (those one `add` made new)."""
        keys = self._keys
        for j in range(self.stride - 1, len(hashes), self.stride):
            if j >= from_block:
                keys.pop(hashes[j], None)

    def add(self, hashes: Sequence[int]) -> None:
        """Record a prompt routed here (most recently used); the oldest entries go past capacity."""
        keys = self._keys
        for j in range(self.stride - 1, len(hashes), self.stride):
            h = hashes[j]
            if h in keys:
                keys.move_to_end(h)
            else:
                keys[h] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)


class PrefixAwareRouter:
    """Chooses a unit for each request and keeps one `PrefixIndex` per unit id it has routed to."""

    __slots__ = ("config", "indexes", "last_cached_tokens", "num_affinity", "num_load", "rng")

    def __init__(self, config: PrefixRoutingConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.indexes: dict[str, PrefixIndex] = {}
        self.num_affinity = 0  # choices made on a prefix match
        self.num_load = 0  # choices left to load alone
        self.last_cached_tokens = 0  # of the last choice: prompt tokens its unit's index already held

    def choose(self, units: Sequence[UnitLoad], hashes: Sequence[int] | None, num_prompt_tokens: int) -> str | None:
        """The unit for one new request (None when no unit is healthy); records the choice."""
        healthy = [u for u in units if u.healthy]
        if not healthy:
            return None
        size = num_prompt_tokens if num_prompt_tokens > 0 else None  # the load choice, aware of the prompt
        self.last_cached_tokens = 0
        if not hashes:
            self.num_load += 1
            return choose_unit(healthy, self.rng, size)
        chosen = self._by_prefix(healthy, hashes, num_prompt_tokens)
        if chosen is None:
            self.num_load += 1
            chosen = choose_unit(healthy, self.rng, size)
            if chosen is None:
                return None
        else:
            self.num_affinity += 1
        index = self._index(chosen)
        self.last_cached_tokens = min(num_prompt_tokens, index.match_blocks(hashes) * self.config.block_size)
        index.add(hashes)
        return chosen

    def _index(self, unit_id: str) -> PrefixIndex:
        index = self.indexes.get(unit_id)
        if index is None:
            index = self.indexes[unit_id] = PrefixIndex(self.config.index_blocks, self.config.stride)
        return index

    def _by_prefix(self, units: list[UnitLoad], hashes: Sequence[int], num_prompt_tokens: int) -> str | None:
        cfg = self.config
        matched = {u.unit_id: (ix.match_blocks(hashes) * cfg.block_size if (ix := self.indexes.get(u.unit_id))
                               else 0) for u in units}
        if max(matched.values()) < cfg.min_match_fraction * num_prompt_tokens or max(matched.values()) == 0:
            return None
        least_delay = min(u.queue_delay_s for u in units)
        best, best_key = None, (True, 0.0)
        for u in units:
            if u.queue_delay_s - least_delay > cfg.max_extra_delay_s:
                continue
            per_token = u.prefill_s_per_token or cfg.prefill_s_per_token
            uncached = max(0, num_prompt_tokens - matched[u.unit_id])
            key = (would_refuse(u, uncached), unit_score(u) + uncached * per_token)
            if best is None or key < best_key:
                best, best_key = u.unit_id, key
        return best

    def refused(self, chosen: str, hashes: Sequence[int], cached_tokens: int) -> None:
        """The prompt `choose` sent to `chosen` (whose index already held its first `cached_tokens`,
        `last_cached_tokens` then) was not computed there: refused, or sent elsewhere. `chosen`
        forgets what that choice added and keeps what it held before."""
        index = self.indexes.get(chosen)
        if index is not None:
            index.discard(hashes, cached_tokens // self.config.block_size)

    def moved(self, chosen: str, unit_id: str, hashes: Sequence[int], cached_tokens: int) -> None:
        """The prompt `choose` sent to `chosen` went to `unit_id` after all (the caller's transport
        chose another unit): `chosen` forgets it (`refused`), `unit_id` records it."""
        self.refused(chosen, hashes, cached_tokens)
        self._index(unit_id).add(hashes)

    def forget(self, unit_id: str) -> None:
        """A unit left the fleet: its index goes with it."""
        self.indexes.pop(unit_id, None)
