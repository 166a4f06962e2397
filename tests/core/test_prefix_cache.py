"""The prefix-caching block manager and the block hashes, on their own (no scheduler)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_core.block_hash import block_hashes, hash_seed
from tidal_core.cache_run import NO_HOLDERS
from tidal_core.kv_blocks import NO_NEW_BLOCK
from tidal_core.prefix_cache import PrefixCachingBlockManager

SEED = hash_seed("test-model")


def test_hashes_cover_full_blocks_and_chain_the_whole_prefix() -> None:
    a = block_hashes(list(range(10)), 4, SEED)
    assert len(a) == 2  # the partial third block gets no hash
    # Same block content after a different first block: a different hash (the chain).
    b = block_hashes([99, 1, 2, 3, 4, 5, 6, 7], 4, SEED)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes([*list(range(8)), 42], 4, SEED) == a  # a longer prompt extends, never changes
    assert block_hashes(list(range(8)), 4, hash_seed("other-model")) != a  # the identity seeds the chain
    # Extending a computed list from block 1 gives the same hashes as hashing at once.
    assert block_hashes(list(range(12)), 4, SEED, start=1, parent=a[0]) == block_hashes(list(range(12)), 4, SEED)[1:]
    with pytest.raises(ValueError, match="parent"):
        block_hashes(list(range(12)), 4, SEED, start=1)


def _filled(bm: PrefixCachingBlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit `rid` with its cache hits, compute it whole, register its blocks; returns its hashes."""
    hashes = block_hashes(tokens, bm.block_size, SEED)
    assert bm.allocate_with(rid, len(tokens), bm.match(hashes, len(tokens)))
    bm.register(rid, hashes, len(tokens))
    return hashes


def test_second_request_shares_the_computed_prefix_and_keeps_its_last_token() -> None:
    bm = PrefixCachingBlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    hashes = _filled(bm, "a", prompt)
    hits = bm.match(hashes, len(prompt))
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks (8 tokens) at most.
    assert hits == bm.table("a")[:2]
    assert bm.allocate_with("b", 12, hits)
    assert bm.table("b")[:2] == bm.table("a")[:2] and bm.table("b")[2] != bm.table("a")[2]
    assert bm.num_used_blocks == 4 and bm.num_references() == 6
    bm.check_integrity()


def test_blocks_are_findable_only_once_computed() -> None:
    bm = PrefixCachingBlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    hashes = block_hashes(prompt, 4, SEED)
    assert bm.allocate_with("a", 12, [])
    assert bm.match(hashes, 12) == []  # allocated, not yet computed: nothing to share
    bm.register("a", hashes, 5)  # one chunk of 5 tokens done: only block 0 is full and computed
    assert bm.match(hashes, 12) == bm.table("a")[:1]
    bm.register("a", hashes, 12)
    assert len(bm.match(hashes, 12)) == 2
    bm.check_integrity()


def test_freed_blocks_stay_cached_and_are_evicted_lru_only_when_the_free_list_is_dry() -> None:
    bm = PrefixCachingBlockManager(num_blocks=6, block_size=2)
    ha = _filled(bm, "a", [1, 2, 3, 4, 5])  # 3 blocks, 2 hashed
    hb = _filled(bm, "b", [7, 8, 9, 10, 11])
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4 and bm.usage() == 0.0
    assert len(bm.match(ha, 5)) == 2 and len(bm.match(hb, 5)) == 2
    assert bm.try_allocate("c", 4) is not None  # takes the 2 clean blocks: nothing evicted
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 4
    assert bm.try_allocate("d", 2) is not None  # now one eviction: a's tail block went first
    assert bm.num_evictions == 1
    assert len(bm.match(ha, 5)) == 1 and len(bm.match(hb, 5)) == 2
    bm.check_integrity()


def test_a_hit_revives_an_evictable_block_and_counts_against_free_room() -> None:
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    h = _filled(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    hits = bm.match(h, 5)
    assert len(hits) == 2
    assert not bm.allocate_with("b", 5, hits, keep_free=2)  # 2 revived + 1 new + 2 kept > 4 free
    bm.check_integrity()
    assert bm.allocate_with("b", 5, hits, keep_free=1)
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == 2
    bm.check_integrity()


def test_duplicate_computation_stays_private_and_frees_clean() -> None:
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    hashes = block_hashes(prompt, 2, SEED)
    assert bm.allocate_with("a", 5, [])
    assert bm.allocate_with("b", 5, [])  # admitted in the same step: no hit
    bm.register("a", hashes, 5)
    bm.register("b", hashes, 5)
    assert bm.match(hashes, 5) == bm.table("a")[:2]
    bm.free("b")
    assert bm.num_cached_blocks == 2  # b's copies were never registered
    bm.check_integrity()


def test_decode_growth_and_appends_take_from_the_cache_when_needed() -> None:
    bm = PrefixCachingBlockManager(num_blocks=3, block_size=2)
    _filled(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    assert bm.try_allocate("b", 1) is not None
    assert bm.append_slot("b", 2) == NO_NEW_BLOCK
    assert bm.append_slot("b", 3) not in (None, NO_NEW_BLOCK)
    assert bm.append_blocks(["b"]) is not None
    assert bm.append_blocks(["b"]) is None and bm.append_slot("b", 7) is None
    assert bm.num_cached_blocks == 0 and bm.num_evictions == 2
    bm.check_integrity()


def test_a_prefix_spread_over_several_runs_is_found_whole() -> None:
    """System prompt, then two conversations on it, then a later turn of one: each request's
    own blocks are one run keyed by its first hash; a lookup walks from run to run."""
    bm = PrefixCachingBlockManager(num_blocks=64, block_size=2)
    system = list(range(100, 110))  # 5 blocks
    _filled(bm, "sys", [*system, 1])
    _filled(bm, "c1", [*system, 7, 7, 7, 7, 1])  # hits 5 blocks, computes 2 of its own
    _filled(bm, "c2", [*system, 8, 8, 8, 8, 1])
    turn = [*system, 7, 7, 7, 7, 9, 9, 9, 9, 1]
    hits = bm.match(block_hashes(turn, 2, SEED), len(turn))
    assert hits == [*bm.table("sys")[:5], *bm.table("c1")[5:7]] and len(hits.spans) == 2
    assert len(bm._by_hash) == 3 and bm.num_cached_blocks == 9
    bm.check_integrity()
    for rid in ("sys", "c1", "c2"):
        bm.free(rid)
    assert len(bm.match(block_hashes(turn, 2, SEED), len(turn))) == 7
    bm.check_integrity()


def test_a_run_stops_where_a_concurrent_copy_is_already_cached() -> None:
    """a registers its first block; b hits it and computes the rest of the same prompt, which a
    computes too: a's run ends where b's begins, and a lookup still finds every block once."""
    bm = PrefixCachingBlockManager(num_blocks=32, block_size=2)
    prompt = list(range(20, 31))  # 5 full blocks
    hashes = block_hashes(prompt, 2, SEED)
    assert bm.allocate_with("a", 11, [])
    bm.register("a", hashes, 2)
    assert bm.allocate_with("b", 11, bm.match(hashes, 11))
    bm.register("b", hashes, 11)  # b's own run: blocks 1-4
    bm.register("a", hashes, 11)  # a's copy of blocks 1-4 stays private
    assert bm._own["a"].closed and bm._own["a"].end == 1
    assert bm.match(hashes, 11) == [bm.table("a")[0], *bm.table("b")[1:5]]
    bm.check_integrity()
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 5 and len(bm.match(hashes, 11)) == 5
    bm.check_integrity()


def test_integrity_catches_a_free_block_still_in_the_hash_table() -> None:
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    _filled(bm, "a", [1, 2, 3])
    bm.free("a")
    run = next(iter(bm._lru))
    bm._free.append(run.blocks[run.start])  # free *and* still findable: a later writer would corrupt a hit
    bm._num_evictable -= 1
    with pytest.raises(AssertionError, match="free and dirty"):
        bm.check_integrity()


def test_integrity_catches_a_wrong_reference_count() -> None:
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    hashes = _filled(bm, "a", [1, 2, 3, 4, 5])
    assert bm.allocate_with("b", 5, bm.match(hashes, 5))
    bm.check_integrity()
    run = bm._own["a"]  # forget b's hit, as if it had taken the blocks without counting them
    del bm._holds["b"], run.holders["b"]
    run.held_to = run.start
    with pytest.raises(AssertionError, match="reference count"):
        bm.check_integrity()


def _references(bm: PrefixCachingBlockManager, live: dict[str, object], block: int) -> int:
    return sum(block in bm.table(rid) for rid in live)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [1, 2, 8], [5, 5, 5, 5, 5, 5, 5, 5, 5]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "compute", "grow", "free"]), st.sampled_from("abcdefg"),
                          st.integers(0, 3), st.integers(0, 9)), max_size=80))
def test_random_operations_keep_counts_hashes_and_contents_consistent(ops: list[tuple[str, str, int, int]]) -> None:
    """A model of the KV store rides along: each block remembers the prefix last computed into
    it. A hit must hand out blocks holding exactly the request's prefix; a write must only ever
    go to a block no other request references."""
    bm = PrefixCachingBlockManager(num_blocks=9, block_size=2, watermark=0.0)
    live: dict[str, tuple[list[int], list[int], int]] = {}  # rid -> (tokens, hashes, computed)
    content: dict[int, tuple[int, ...]] = {}
    for kind, rid, which, n in ops:
        if kind == "admit" and rid not in live:
            tokens = PROMPTS[which]
            hashes = block_hashes(tokens, 2, SEED)
            hits = bm.match(hashes, len(tokens))
            assert len(hits) * 2 <= len(tokens) - 1
            for k, block in enumerate(hits):
                assert content[block] == tuple(tokens[: 2 * k + 2]), "a hit handed out another prefix's KV"
            if bm.allocate_with(rid, len(tokens), hits):
                live[rid] = (tokens, hashes, len(hits) * 2)
        elif kind == "compute" and rid in live:
            tokens, hashes, done = live[rid]
            upto = min(len(tokens), done + n)
            table = bm.table(rid)
            for pos in range(done, upto):
                block = table[pos // 2]
                assert _references(bm, live, block) == 1, "wrote into a shared block"
                content[block] = tuple(tokens[: pos + 1])
            bm.register(rid, hashes, upto)
            live[rid] = (tokens, hashes, upto)
        elif kind == "grow" and rid in live:
            tokens, hashes, done = live[rid]
            if done == len(tokens) and bm.append_slot(rid, len(tokens) + 1) is not None:
                block = bm.table(rid)[len(tokens) // 2]
                assert _references(bm, live, block) == 1, "a decode wrote into a shared block"
                content[block] = tuple([*tokens, 0])
                live[rid] = ([*tokens, 0], hashes, done + 1)
        elif kind == "free":
            bm.free(rid)
            live.pop(rid, None)
        bm.check_integrity()
    for rid in list(live):
        bm.free(rid)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_run_no_one_hit_shares_the_empty_holders_until_its_first_hit() -> None:
    """A never-hit run costs no holders dict of its own; its first hit gives it one, and the
    shared empty one stays empty whatever is hit, released and evicted."""
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    hashes = _filled(bm, "a", [1, 2, 3, 4, 5])
    run = bm._own["a"]
    assert run.holders is NO_HOLDERS
    assert bm.allocate_with("b", 5, bm.match(hashes, 5))
    assert run.holders is not NO_HOLDERS and run.holders == {"b": 2} and not NO_HOLDERS
    bm.check_integrity()
    bm.free("b")
    bm.free("a")
    assert run.holders == {} and not NO_HOLDERS
    assert bm.try_allocate("c", 16) is not None  # evicts everything
    assert bm.num_cached_blocks == 0 and not NO_HOLDERS
    bm.check_integrity()


def test_integrity_catches_a_write_to_the_shared_empty_holders() -> None:
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    _filled(bm, "a", [1, 2, 3, 4, 5])
    NO_HOLDERS["b"] = 1  # as if a hit had been recorded in the dict every unhit run shares
    try:
        with pytest.raises(AssertionError, match="shared empty holders"):
            bm.check_integrity()
    finally:
        NO_HOLDERS.clear()
    bm.check_integrity()
