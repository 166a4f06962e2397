"""Serve request router: spreads requests over serving units with the core routing policy.

Owns: `TidalRequestRouter`, a `ray.serve` `RequestRouter` (alpha API in Ray 2.60) that runs in
the caller's process (the ingress replicas). Each unit reports its load through
`ServingUnit.record_routing_stats` (queue delay, KV usage, running/waiting, load, capacity, regime,
prefill cost per prompt token and the TTFT limit of its admission: `published_load`);
this class turns the reports into `UnitLoad`s and asks the core, with the prompt's size (its
token ids' count), so a long prompt goes to a unit that will admit it when one would. With `prefix_routing` (the
default) that is `PrefixAwareRouter` (tidal_core/prefix_routing.py): the request's block hashes
travel in its `GenerateRequest` (made once by the ingress, `prompt_hashes`), and it prefers the
unit it sent the same prefix to; otherwise `choose_unit`. Only a request that carries no hashes
of the router's scheme (its `block_size` and namespace) gets its prompt token ids hashed here,
the way the units do. A unit
that has not reported yet counts as empty. The chosen unit is ranked first, the rest follow
(Serve falls back to them if the first refuses).

Router kwargs (`request_router_kwargs`): `seed`, `prefix_routing`, `block_size` and
`index_blocks` (the units' KV block size and pool, which bound each unit's index) and
`prefix_cache_namespace` (the units' `SchedulerConfig.prefix_cache_namespace`).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tidal_core import UnitLoad, choose_unit
from tidal_core.block_hash import HashScheme, PromptHashes
from tidal_core.prefix_routing import PrefixAwareRouter, PrefixRoutingConfig


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt token ids of a `generate(GenerateRequest)` call, None for any other call."""
    if pending_request is None or not pending_request.args:
        return None
    ids = getattr(pending_request.args[0], "prompt_token_ids", None)
    return ids if isinstance(ids, list) else None


def carried_hashes(pending_request: PendingRequest | None) -> PromptHashes | None:
    """The block hashes a `generate(GenerateRequest)` call carries (made by the ingress), if any."""
    if pending_request is None or not pending_request.args:
        return None
    hashes = getattr(pending_request.args[0], "prompt_hashes", None)
    return hashes if isinstance(hashes, PromptHashes) else None


class TidalRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, seed: int | None = None, prefix_routing: bool = True, block_size: int = 16,
                         index_blocks: int = 65536, prefix_cache_namespace: str = "", **kwargs: Any) -> None:
        self._rng = random.Random(seed)
        self._prefix: PrefixAwareRouter | None = None
        if prefix_routing:
            self._prefix = PrefixAwareRouter(PrefixRoutingConfig(index_blocks=index_blocks, block_size=block_size),
                                             self._rng)
        self._scheme = HashScheme(block_size, prefix_cache_namespace)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        rng = getattr(self, "_rng", None) or random.Random()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [UnitLoad.from_stats(uid, r.routing_stats) for uid, r in by_id.items()]
        router: PrefixAwareRouter | None = getattr(self, "_prefix", None)
        tokens = prompt_token_ids(pending_request)
        if router is not None and tokens:
            carried = carried_hashes(pending_request)
            hashes = carried.usable_for(self._scheme, len(tokens)) if carried is not None else None
            if hashes is None:  # an older client or a direct call: hash here, as the units do
                hashes = self._scheme.hash(tokens).hashes
            chosen = router.choose(loads, hashes, len(tokens))
        else:  # with the prompt's size when known: sent where it will be admitted if a unit would
            chosen = choose_unit(loads, rng, len(tokens) if tokens else None)
        if chosen is None:
            return [candidate_replicas]
        first = by_id[chosen]
        return [[first], [r for r in candidate_replicas if r is not first]]
