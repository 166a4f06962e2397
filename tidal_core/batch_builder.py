"""The batching policy: what one step holds, decode-first, with chunked prefill, within a budget.

Owns: `BatchBuilder`. A step is filled in one order for every policy:

1. every running decode, one token each (a decode opening a KV block gets one; when KV runs
   out the most recently admitted running request is preempted and recomputed later, vLLM's
   order);
2. unfinished prefill chunks, oldest first;
3. new requests from the head of the queue (FIFO), when the launch policy (core/microwait.py)
   says so, while the token budget, the sequence budget, the new-request limit and KV allow.
   KV for a whole prompt is reserved at admission, so a prefill never stalls half-way.
   With prefix caching (core/prefix_cache.py) a request's leading cached blocks are taken
   by reference: its prefill starts at its first uncached token, and the budget is charged
   for the uncached tokens only;
4. then, with what is left, the batch class's chunks and new batch requests (`batch=True`,
   driven by core/batch_lane.py). KV preemption takes a running batch request first.

A prompt that does not fit what is left of the budget is chunked (with chunked prefill on).
Static batching admits a whole batch at once; its later chunks follow step by step. How many
tokens the budget holds is the caller's: `max_num_batched_tokens`, or less where the step
sizer (core/step_sizer.py) or a prefill-token cap says so.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math

from tidal_core.budget import StepBudget
from tidal_core.config import SchedulerConfig
from tidal_core.kv_blocks import NO_NEW_BLOCK
from tidal_core.plan import NewRequestData
from tidal_core.prefix_cache import NO_HITS
from tidal_core.queues import UnitQueues
from tidal_core.request import Request
from tidal_core.stats import SchedulerStats

NO_PREEMPTIONS: list[Request] = []


class BatchBuilder:
    __slots__ = ("chunked", "new_limit", "queues", "static", "stats")

    def __init__(self, config: SchedulerConfig, queues: UnitQueues, stats: SchedulerStats | None = None) -> None:
        self.queues = queues
        self.stats = stats or SchedulerStats()
        self.chunked = config.enable_chunked_prefill
        self.static = config.batching.mode == "static"
        self.new_limit: float = (config.batching.static_batch_size if self.static
                                 else (config.max_new_requests_per_step or math.inf))

    def grow_decodes(self, new_block_ids: dict[str, list[int]]) -> list[Request]:
        """Give every decode opening a new block one; returns the requests preempted for KV."""
        q = self.queues
        blocks, decodes = q.blocks, q.decodes
        rids = decodes.needing_block_ids()
        if not rids:
            return NO_PREEMPTIONS
        granted = blocks.append_blocks(rids)
        if granted is not None:  # the common case: room for the whole phase group at once
            new_block_ids.update(granted)
            return NO_PREEMPTIONS
        preempted: list[Request] = []
        for req in [decodes.reqs[rid] for rid in rids]:
            rid = req.request_id
            while rid in decodes.reqs:
                block = blocks.append_slot(rid, req.num_tokens)
                if block is None:
                    victim = self._pick_victim()
                    q.preempt(victim)
                    new_block_ids.pop(victim.request_id, None)
                    preempted.append(victim)
                    continue
                if block != NO_NEW_BLOCK:
                    new_block_ids[rid] = [block]
                break
        return preempted

    def _pick_victim(self) -> Request:
        """The most recently admitted running batch request, else the most recently admitted
        running request (vLLM's recompute order)."""
        q = self.queues
        if q.num_batch_running:
            for req in (*reversed(q.prefilling.values()), *reversed(q.decodes.reqs.values())):
                if req.is_batch:
                    return req
        if q.prefilling:
            return next(reversed(q.prefilling.values()))
        return next(reversed(q.decodes.reqs.values()))

    def continue_prefills(self, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
                          new_reqs: list[NewRequestData], batch: bool = False) -> int:
        """Continue the unfinished chunks of one class (interactive, or `batch`), oldest first."""
        q = self.queues
        total = 0
        chunked = self.chunked
        mixed = q.num_batch_running > 0
        for rid, req in q.prefilling.items():
            if budget.exhausted:
                break
            if (mixed or batch) and req.is_batch is not batch:
                continue
            grant = budget.grant(req.num_tokens - req.num_computed_tokens, chunked)
            if grant:
                sched[rid] = grant
                prefill_ctx[rid] = req.num_computed_tokens
                budget.charge(grant)
                total += grant
                if rid not in q.announced:
                    q.announce(req, new_reqs)
        return total

    def admit(self, now: float, budget: StepBudget, sched: dict[str, int], prefill_ctx: dict[str, int],
              new_reqs: list[NewRequestData], room: float, batch: bool = False, keep_free: int = 0) -> int:
        """Move waiting requests into the step (FIFO), at most `room` more running requests;
        `batch`: from the batch queue, leaving at least `keep_free` KV blocks free."""
        q = self.queues
        waiting, blocks = q.batch.reqs if batch else q.waiting, q.blocks
        limit = min(self.new_limit, room)
        floor = keep_free
        keep_free = max(floor, blocks.watermark_blocks if (q.decodes.reqs or q.prefilling) else 0)
        chunked, static, cache = self.chunked, self.static, q.cache
        admitted = total = cached = 0
        queried = hit_requests = hit_tokens = 0  # with the cache: counted here, recorded once after the loop
        while waiting and admitted < limit:
            req = waiting[0]
            rid = req.request_id
            need = req.num_tokens
            if cache is None:
                grant = budget.grant(need, chunked)
                if not grant and not static:
                    break
                if blocks.try_allocate(rid, need, keep_free) is None:
                    break
            else:
                hashes = req.block_hashes
                if hashes and hashes[0] in cache.run_keys:  # else a miss, known from one probe
                    hits = cache.match(hashes, need)
                    cached = len(hits) * cache.block_size
                else:
                    hits, cached = NO_HITS, 0
                grant = budget.grant(need - cached, chunked)
                if not grant and not static:
                    break
                if not cache.allocate_with(rid, need, hits, keep_free):
                    break
                queried += need
                if cached:
                    hit_requests += 1
                    hit_tokens += cached
            q.start_prefill(req, now, cached)
            admitted += 1
            keep_free = max(floor, blocks.watermark_blocks)
            if grant:
                sched[rid] = grant
                prefill_ctx[rid] = cached
                budget.charge(grant)
                total += grant
                q.announce(req, new_reqs)
        if queried:  # every request admitted above asked the cache
            self.stats.record_prefix_queries(admitted, queried, hit_requests, hit_tokens)
        return total
