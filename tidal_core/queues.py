"""A unit's requests and where each one is: waiting, prefilling or decoding.

Owns: `UnitQueues` (single writer: the Scheduler) - the FIFO of waiting interactive requests,
the batch class's own queue (`BatchQueue`, batch_queue.py), the
prefilling requests in admission order, the `DecodeSet`, the KV block tables
(`BlockManager`), the token counts that make the backlog O(1) to read, which requests the
executor knows (announced / to forget), the stop-token index, and `check_integrity`, every
invariant these must keep. Moving a request between places is done here and nowhere else.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from tidal_core.batch_queue import BatchQueue
from tidal_core.block_hash import block_hashes, hash_seed
from tidal_core.cached_fit import CachedFit
from tidal_core.config import SchedulerConfig
from tidal_core.decode_set import DecodeSet
from tidal_core.kv_blocks import BlockManager
from tidal_core.plan import NewRequestData, StepPlan
from tidal_core.prefix_cache import PrefixCachingBlockManager
from tidal_core.request import FinishReason, Request, RequestStatus


class UnitQueues:
    __slots__ = ("_hash_seed", "_stop_counts", "announced", "batch", "batch_prefill_remaining", "blocks", "cache",
                 "cached_fit", "decodes", "num_batch_running", "pending_finished", "prefill_remaining",
                 "prefilling", "requests", "stop_set", "waiting", "waiting_tokens")

    def __init__(self, config: SchedulerConfig) -> None:
        # With prefix caching the block manager is the caching one (`cache` names it, typed).
        self.cache: PrefixCachingBlockManager | None = None
        self.blocks: BlockManager
        if config.enable_prefix_caching:
            self.blocks = self.cache = PrefixCachingBlockManager(config.num_kv_blocks, config.block_size,
                                                                 config.kv_watermark)
        else:
            self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.kv_watermark)
        self._hash_seed = hash_seed(config.prefix_cache_namespace)
        self.cached_fit = CachedFit()  # what arriving prompts find cached, for the front ends (cached_fit.py)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: dict[str, Request] = {}
        self.decodes = DecodeSet(config.block_size, config.max_model_len)
        self.waiting_tokens = 0
        self.batch = BatchQueue()
        self.num_batch_running = 0  # batch requests prefilling or decoding
        self.batch_prefill_remaining = 0  # the batch part of prefill_remaining
        self.prefill_remaining = 0  # prompt tokens of admitted requests not yet computed
        self.announced: set[str] = set()
        self.pending_finished: list[str] = []
        self._stop_counts: Counter[int] = Counter()
        self.stop_set: frozenset[int] = frozenset()

    @property
    def num_running(self) -> int:
        return len(self.decodes.reqs) + len(self.prefilling)

    def oldest_arrival_s(self) -> float:
        """Arrival of the oldest interactive request whose prompt is not computed yet (inf with none)."""
        oldest = next((r.arrival_s for r in self.prefilling.values() if not r.is_batch), math.inf)
        return min(oldest, self.waiting[0].arrival_s) if self.waiting else oldest

    def num_batch_decoding(self) -> int:
        """Batch requests decoding (0 with none running)."""
        if not self.num_batch_running:
            return 0
        return self.num_batch_running - sum(r.is_batch for r in self.prefilling.values())

    def batch_kv_usage(self) -> float:
        """The share of the KV pool running batch requests hold (0 with none)."""
        if not self.num_batch_running:
            return 0.0
        blocks = self.blocks
        held = sum(blocks.num_blocks_of(r.request_id) for r in (*self.prefilling.values(), *self.decodes.reqs.values())
                   if r.is_batch)
        return held / blocks.num_blocks

    def expect_cached(self, req: Request) -> int:
        """With prefix caching: hash the prompt's blocks if the driver did not, and peek how many
        of its tokens the cache holds now (`req.expected_cached_tokens`). 0 without caching."""
        cache = self.cache
        if cache is None:
            return 0
        hashes = req.block_hashes
        if hashes is None and req.prompt_token_ids is not None:
            hashes = req.block_hashes = block_hashes(req.prompt_token_ids, cache.block_size, self._hash_seed)
        if not hashes or hashes[0] not in cache.run_keys:  # the common miss, from one probe
            req.expected_cached_tokens = 0
            return 0
        req.expected_cached_tokens = len(cache.match(hashes, req.num_tokens)) * cache.block_size
        return req.expected_cached_tokens

    def arriving_uncached(self, req: Request) -> int:
        """An arriving interactive prompt's tokens the cache does not hold now (`expect_cached`),
        its lookup taught to the fit a front end estimates cached tokens by (`cached_fit`)."""
        cached = self.expect_cached(req)
        if self.cache is not None:
            self.cached_fit.observe(req.num_prompt_tokens, cached)
        return req.num_prompt_tokens - cached

    def enqueue(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.is_batch:
            self.batch.append(req)
        else:
            self.waiting.append(req)
            self.waiting_tokens += req.num_tokens - req.expected_cached_tokens
        if req.stop_ids:
            before = len(self._stop_counts)
            self._stop_counts.update(req.stop_ids)
            if len(self._stop_counts) != before:
                self.stop_set = frozenset(self._stop_counts)

    def start_prefill(self, req: Request, now: float, num_cached_tokens: int = 0) -> None:
        """The head of its class's queue was admitted into a step (its KV is already reserved; its
        first `num_cached_tokens` tokens came from the prefix cache and count as computed)."""
        need = req.num_tokens
        if req.is_batch:
            self.batch.popleft()
            self.num_batch_running += 1
            self.batch_prefill_remaining += need - num_cached_tokens
        else:
            self.waiting.popleft()
            self.waiting_tokens -= need - req.expected_cached_tokens
        self.prefill_remaining += need - num_cached_tokens
        req.expected_cached_tokens = 0
        req.num_computed_tokens = req.num_cached_tokens = num_cached_tokens
        req.status = RequestStatus.RUNNING
        if req.admitted_s is None:
            req.admitted_s = now
        self.prefilling[req.request_id] = req

    def announce(self, req: Request, new_reqs: list[NewRequestData]) -> None:
        rid = req.request_id
        self.announced.add(rid)
        new_reqs.append(NewRequestData(rid, req.all_token_ids(), req.num_tokens, req.sampling,
                                       list(self.blocks.table(rid)), req.num_computed_tokens,
                                       req.num_prompt_tokens))

    def preempt(self, req: Request) -> None:
        """Free `req`'s KV and put it back at the head of the queue (recompute)."""
        rid = req.request_id
        if rid in self.decodes:
            self.decodes.remove(rid)
        else:
            del self.prefilling[rid]
            self._prefill_done(req, req.num_tokens - req.num_computed_tokens)
        self.blocks.free(rid)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        if req.is_batch:
            self.num_batch_running -= 1
            self.batch.appendleft(req)
        else:
            self.waiting.appendleft(req)
            # Its blocks stay cached: the resumed request may find them again.
            self.waiting_tokens += req.num_tokens - self.expect_cached(req)
        self._forget_executor_state(rid)

    def remove(self, req: Request, reason: FinishReason, now: float) -> None:
        """`req` ends: out of whichever place holds it, its KV freed, its status final."""
        rid = req.request_id
        if req.status is RequestStatus.WAITING:
            if req.is_batch:
                self.batch.remove(req)
            else:
                self.waiting.remove(req)
                self.waiting_tokens -= req.num_tokens - req.num_computed_tokens - req.expected_cached_tokens
        else:  # running: decoding, prefilling, or between the two (its prompt just completed)
            self.num_batch_running -= req.is_batch
            if rid in self.decodes:
                self.decodes.remove(rid)
                req.num_computed_tokens = req.num_tokens - 1
            elif self.prefilling.pop(rid, None) is not None:
                self._prefill_done(req, req.num_tokens - req.num_computed_tokens)
        self.blocks.free(rid)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_s = now
        del self.requests[rid]
        if req.stop_ids:
            counts = self._stop_counts
            counts.subtract(req.stop_ids)
            gone = [t for t in req.stop_ids if counts[t] <= 0]
            if gone:
                for t in gone:
                    del counts[t]
                self.stop_set = frozenset(counts)
        self._forget_executor_state(rid)

    @staticmethod
    def hit_stop(req: Request, tok: int) -> bool:
        return tok in req.stop_ids and len(req.output_token_ids) >= req.sampling.min_tokens

    def stop_hits(self, sampled: dict[str, int]) -> list[Request]:
        """Decodes whose sampled token ends them (a stop token, `min_tokens` reached)."""
        stop_set, reqs = self.stop_set, self.decodes.reqs
        if not stop_set:
            return []
        hits = (reqs.get(rid) for rid, tok in sampled.items() if tok in stop_set)
        return [r for r in hits if r is not None and self.hit_stop(r, sampled[r.request_id])]

    def complete_prefills(self, plan: StepPlan, sampled: dict[str, int]) -> tuple[int, list[Request]]:
        """Apply a step's prefill chunks: returns the prompt tokens computed and the requests
        whose prompt is now complete, out of `prefilling`, each with its sampled token."""
        prefilling, scheduled, cache = self.prefilling, plan.num_scheduled_tokens, self.cache
        computed, done = 0, []
        for rid in plan.prefill_context:
            req = prefilling.get(rid)
            if req is None:  # aborted during the step
                continue
            n = scheduled[rid]
            req.num_computed_tokens += n
            computed += n
            if cache is not None and req.block_hashes:  # its KV is written now: full blocks may be shared
                cache.register(rid, req.block_hashes, req.num_computed_tokens)
            if req.is_batch:
                self.batch_prefill_remaining -= n
            if req.num_computed_tokens < req.num_tokens:
                continue
            tok = sampled.get(rid)
            if tok is None:
                raise AssertionError(f"executor sampled no token for {rid} at the end of its prefill")
            del prefilling[rid]
            req.output_token_ids.append(tok)
            done.append(req)
        self.prefill_remaining -= computed
        return computed, done

    def _prefill_done(self, req: Request, num_tokens: int) -> None:
        """`num_tokens` of `req`'s prompt leave the prefill backlog uncomputed (preempted, ended)."""
        self.prefill_remaining -= num_tokens
        if req.is_batch:
            self.batch_prefill_remaining -= num_tokens

    def _forget_executor_state(self, rid: str) -> None:
        if rid in self.announced:
            self.announced.discard(rid)
            self.pending_finished.append(rid)

    def check_integrity(self) -> None:
        """Every invariant the scheduler relies on; tests call it after every operation."""
        blocks = self.blocks
        blocks.check_integrity()
        self.decodes.check_integrity()
        self.batch.check_integrity()
        waiting_ids = [r.request_id for r in (*self.waiting, *self.batch.reqs)]
        groups = (set(waiting_ids), set(self.prefilling), set(self.decodes.reqs))
        if len(waiting_ids) != len(groups[0]):
            raise AssertionError("a request is queued twice")
        if sum(map(len, groups)) != len(self.requests) or set().union(*groups) != set(self.requests):
            raise AssertionError("waiting, prefilling and decoding do not partition the live requests")
        for req in (*self.waiting, *self.batch.reqs):
            held = blocks.num_blocks_of(req.request_id)
            if req.status is not RequestStatus.WAITING or req.num_computed_tokens or held:
                raise AssertionError(f"waiting {req} is not pristine")
        for req in self.prefilling.values():
            held = blocks.num_blocks_of(req.request_id)
            if req.status is not RequestStatus.RUNNING or held != blocks.blocks_for(req.num_tokens):
                raise AssertionError(f"prefilling {req} does not hold exactly its prompt's blocks")
            if not 0 <= req.num_computed_tokens < req.num_tokens:
                raise AssertionError(f"prefilling {req} has an impossible computed count")
        for req in self.decodes.reqs.values():
            held = blocks.num_blocks_of(req.request_id)
            fits = blocks.blocks_for(req.num_tokens - 1) <= held <= blocks.blocks_for(req.num_tokens)
            if req.status is not RequestStatus.RUNNING or not fits:
                raise AssertionError(f"decoding {req} holds {held} blocks for {req.num_tokens} tokens")
            if len(req.output_token_ids) >= self.decodes.length_limit(req):
                raise AssertionError(f"{req} is past its length limit but still decodes")
        used = sum(blocks.num_blocks_of(rid) for rid in self.requests)
        if used != blocks.num_references():
            raise AssertionError(f"{blocks.num_references()} block references but live requests hold {used}")
        for req in self.prefilling.values():
            if req.num_cached_tokens % blocks.block_size or not req.num_cached_tokens < req.num_tokens:
                raise AssertionError(f"{req} took {req.num_cached_tokens} tokens from the cache")
        expected_waiting = sum(r.num_tokens - r.num_computed_tokens - r.expected_cached_tokens for r in self.waiting)
        if self.waiting_tokens != expected_waiting:
            raise AssertionError("waiting token count drifted")
        if self.prefill_remaining != sum(r.num_tokens - r.num_computed_tokens for r in self.prefilling.values()):
            raise AssertionError("prefill backlog count drifted")
        batch_prefilling = [r for r in self.prefilling.values() if r.is_batch]
        if self.batch_prefill_remaining != sum(r.num_tokens - r.num_computed_tokens for r in batch_prefilling):
            raise AssertionError("batch prefill backlog count drifted")
        running_batch = len(batch_prefilling) + sum(r.is_batch for r in self.decodes.reqs.values())
        if self.num_batch_running != running_batch or any(r.is_batch for r in self.waiting):
            raise AssertionError(f"{self.num_batch_running} batch requests counted running, {running_batch} are")
        expected = Counter[int]()
        for req in self.requests.values():
            expected.update(req.stop_ids)
        if +expected != +self._stop_counts or self.stop_set != frozenset(+expected):
            raise AssertionError("stop-token index drifted")
        if not self.announced <= set(self.requests):
            raise AssertionError("executor state announced for requests that are gone")
