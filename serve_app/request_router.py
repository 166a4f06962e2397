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
the way the units do. A unit that has not reported yet counts as empty. The chosen unit is
ranked first, the rest follow (Serve falls back to them if the first refuses).

Requests on the way. A unit's report reaches the router once per `request_routing_stats_period_s`
(1 s in configs/prod.yaml); a request this router sent since is in no report yet, and with the
reports alone a burst would all go to the unit that looked best at the last one (with two units
the choice is the minimum: herding). So each request sent is held against its unit (`_OnTheWay`:
its estimated prefill, the prompt's tokens less those the prefix index says the unit holds, x the
unit's published `prefill_s_per_token`) and added to that unit's reported waiting count and, as
what is left of it (the held prefill drains one second per second, so a prompt's quick next turn
is not kept off the unit that just served its first), to its reported queue delay, until a
newer report counts it: a report whose `num_arrived` grew by k retires the k oldest
(other routers' requests count as this router's, so this errs low, towards the report), and none
is held past `ON_THE_WAY_S`. The simulator's fleet routes on a fresh snapshot per arrival and
needs none of this.

Where a request really went. The chosen unit is only ranked first: Serve sends the request
elsewhere when the first cannot take it in time (its queue-length probe times out on a busy
machine, or it is full). `on_request_routed` (Serve calls it with the replica that accepted the
request) corrects the record: the prompt's hashes leave the chosen unit's prefix index (what
this choice added) and join the accepting unit's, and its hold moves there, so a later turn of
the prompt follows its KV, not the first choice.

The front gates' polls. Each front gate (serve_app/front_gate.py, in the proxy and in each
ingress replica) keeps one snapshot per unit, refreshed by polling `ServingUnit.load_stats`
through this router, and believes a snapshot for 5 s. A poll is not a request to place: it goes
to the unit this router polled least recently (`POLL_METHOD`), so that with N units each gate
sees every one of them every N polls. Placed by load, as a generate call is, the polls went to
the least-loaded units and the proxy's gate, which sees units only through its polls, lost sight
of the busiest: it then counted the requests it had sent them as still on their way and priced
them all onto the units it saw, and refused at the door what the fleet would have served
(benchmarks/RESULTS.md, "Cache-aware routing in Serve").

Router kwargs (`request_router_kwargs`): `seed`, `prefix_routing`, `block_size` and
`index_blocks` (the units' KV block size and pool, which bound each unit's index) and
`prefix_cache_namespace` (the units' `SchedulerConfig.prefix_cache_namespace`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import time
from collections.abc import Mapping
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


POLL_METHOD = "load_stats"
"""The front gates' poll (`ServingUnit.load_stats`): sent to each unit in turn, not placed by load."""

ON_THE_WAY_S = 5.0
"""A request sent counts against its unit's report at most this long (a report lost on the way)."""


@dataclasses.dataclass(eq=False)
class _OnTheWay:
    """Requests this router sent to one unit that its latest report may not count yet: their
    count, and their prefill as a queue of its own that drains one second per second (`finish_s`:
    when the last of them would be done), so a request that has long been served stops counting
    even before the report that shows it."""

    report: Mapping[str, Any] | None  # the report they are held against (by identity)
    arrived: int  # its num_arrived
    sent: collections.deque[tuple[float, float]] = dataclasses.field(default_factory=collections.deque)
    finish_s: float = 0.0

    def add(self, now: float, prefill_s: float) -> None:
        self.sent.append((now, prefill_s))
        self.finish_s = max(self.finish_s, now) + prefill_s

    def _retire_oldest(self) -> None:
        self.finish_s -= self.sent.popleft()[1]

    def drop(self, entry: tuple[float, float]) -> None:
        """A request held here went to another unit after all."""
        try:
            self.sent.remove(entry)
        except ValueError:  # retired already
            return
        self.finish_s -= entry[1]

    def against(self, report: Mapping[str, Any] | None, load: UnitLoad, now: float) -> UnitLoad:
        """`load` (read from `report`) with the requests still on the way added."""
        if report is not self.report:  # a newer report: it counts the requests that arrived since
            for _ in range(min(len(self.sent), max(0, load.num_arrived - self.arrived))):
                self._retire_oldest()
            self.report, self.arrived = report, load.num_arrived
        while self.sent and now - self.sent[0][0] > ON_THE_WAY_S:
            self._retire_oldest()
        if not self.sent:
            return load
        return dataclasses.replace(load, num_waiting=load.num_waiting + len(self.sent),
                                   queue_delay_s=load.queue_delay_s + max(0.0, self.finish_s - now))


class TidalRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, seed: int | None = None, prefix_routing: bool = True, block_size: int = 16,
                         index_blocks: int = 65536, prefix_cache_namespace: str = "", **kwargs: Any) -> None:
        self._rng = random.Random(seed)
        self._prefix: PrefixAwareRouter | None = None
        if prefix_routing:
            self._prefix = PrefixAwareRouter(PrefixRoutingConfig(index_blocks=index_blocks, block_size=block_size),
                                             self._rng)
        self._scheme = HashScheme(block_size, prefix_cache_namespace)
        self._polled: dict[str, float] = {}  # unit -> when this router last sent it a front gate's poll
        self._on_the_way: dict[str, _OnTheWay] = {}
        # id(pending request) -> (unit chosen, its block hashes or None, the tokens of it the chosen unit's
        # index held before, its hold entry), until Serve says
        # which unit accepted it (`on_request_routed`)
        self._chosen: collections.OrderedDict[int, tuple[str, list[int] | None, int, tuple[float, float]]] = (
            collections.OrderedDict())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if getattr(getattr(pending_request, "metadata", None), "call_method", None) == POLL_METHOD:
            return self._next_to_poll(candidate_replicas)
        rng = getattr(self, "_rng", None) or random.Random()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        on_the_way = self._on_the_way
        loads = []
        for uid, r in by_id.items():
            load = UnitLoad.from_stats(uid, r.routing_stats)
            held = on_the_way.get(uid)
            loads.append(held.against(r.routing_stats, load, now) if held is not None else load)
        router: PrefixAwareRouter | None = getattr(self, "_prefix", None)
        tokens = prompt_token_ids(pending_request)
        cached = 0  # prompt tokens the chosen unit likely holds (its prefill skips them)
        hashes: list[int] | None = None
        if router is not None and tokens:
            carried = carried_hashes(pending_request)
            hashes = carried.usable_for(self._scheme, len(tokens)) if carried is not None else None
            if hashes is None:  # an older client or a direct call: hash here, as the units do
                hashes = self._scheme.hash(tokens).hashes
            chosen = router.choose(loads, hashes, len(tokens))
            cached = router.last_cached_tokens
        else:  # with the prompt's size when known: sent where it will be admitted if a unit would
            chosen = choose_unit(loads, rng, len(tokens) if tokens else None)
        if chosen is None:
            return [candidate_replicas]
        first = by_id[chosen]
        if tokens is not None:  # a generate call: held against its unit until a report counts it
            held = on_the_way.get(chosen)
            if held is None:
                report = first.routing_stats
                held = on_the_way[chosen] = _OnTheWay(report, UnitLoad.from_stats(chosen, report).num_arrived)
            per_token = next(u.prefill_s_per_token for u in loads if u.unit_id == chosen)
            entry = (now, (len(tokens) - cached) * per_token)
            held.add(*entry)
            for gone in [u for u in on_the_way if u not in by_id]:  # replicas replaced or scaled away
                del on_the_way[gone]
            if pending_request is not None:
                chosen_for = self._chosen
                # Oldest first: requests Serve never reported routed (rejected, cancelled) age out.
                while chosen_for and (len(chosen_for) >= 4096
                                      or now - next(iter(chosen_for.values()))[3][0] > ON_THE_WAY_S):
                    chosen_for.popitem(last=False)
                chosen_for[id(pending_request)] = (chosen, hashes or None, cached, entry)
        return [[first], [r for r in candidate_replicas if r is not first]]

    def _next_to_poll(self, candidate_replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        """The unit polled least recently (never polled first), then the rest: each in turn."""
        polled = getattr(self, "_polled", None)
        if polled is None:
            polled = self._polled = {}
        ids = {r.replica_id.unique_id for r in candidate_replicas}
        for gone in [u for u in polled if u not in ids]:
            del polled[gone]
        first = min(candidate_replicas, key=lambda r: (polled.get(r.replica_id.unique_id, -math.inf),
                                                       r.replica_id.unique_id))
        polled[first.replica_id.unique_id] = time.monotonic()
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        """Serve's word on which unit accepted the request: when it is not the one chosen, the
        prompt's index entry and its hold follow it there (see the module doc)."""
        record = self._chosen.pop(id(pending_request), None)
        if record is None:
            return
        chosen, hashes, cached, entry = record
        actual = replica_id.unique_id
        if actual == chosen:
            return
        held = self._on_the_way.get(chosen)
        if held is not None:
            held.drop(entry)
        moved = self._on_the_way.get(actual)
        if moved is not None:
            moved.add(*entry)
        if hashes and self._prefix is not None:
            self._prefix.moved(chosen, actual, hashes, cached)
