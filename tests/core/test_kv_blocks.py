from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_core.kv_blocks import NO_NEW_BLOCK, BlockManager


def test_allocate_grow_and_free() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.try_allocate("a", 5) is not None  # 2 blocks
    assert bm.num_blocks_of("a") == 2
    assert bm.try_allocate("a", 8) == []  # still 2 blocks
    new = bm.try_allocate("a", 9)
    assert new is not None and len(new) == 1 and bm.num_blocks_of("a") == 3
    assert bm.usage() == pytest.approx(0.3)
    bm.check_integrity()
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def test_no_room_is_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.try_allocate("a", 6) is not None
    assert bm.try_allocate("b", 1) is None
    assert bm.num_blocks_of("b") == 0
    assert not bm.can_allocate("b", 1)
    bm.check_integrity()


def test_watermark_is_respected() -> None:
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.try_allocate("a", 91, keep_free=bm.watermark_blocks) is None
    assert bm.try_allocate("a", 90, keep_free=bm.watermark_blocks) is not None


def test_append_slot_only_at_block_boundaries() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.try_allocate("a", 4)
    assert bm.append_slot("a", 4) == NO_NEW_BLOCK  # token 4 still fits block 0
    block = bm.append_slot("a", 5)
    assert block is not None and block != NO_NEW_BLOCK and bm.num_blocks_of("a") == 2
    bm.try_allocate("b", 8)
    assert bm.append_slot("a", 9) is None  # pool exhausted
    bm.check_integrity()


def test_integrity_detects_double_ownership() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.try_allocate("a", 4)
    bm._tables["b"] = list(bm._tables["a"])
    with pytest.raises(AssertionError):
        bm.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 40), st.booleans()), max_size=60))
def test_random_operations_keep_the_pool_consistent(ops: list[tuple[str, int, bool]]) -> None:
    bm = BlockManager(num_blocks=20, block_size=3)
    for rid, tokens, free in ops:
        if free:
            bm.free(rid)
        else:
            before = bm.num_blocks_of(rid)
            got = bm.try_allocate(rid, tokens)
            if got is None:
                assert bm.num_blocks_of(rid) == before
            else:
                assert bm.num_blocks_of(rid) >= bm.blocks_for(tokens)
        bm.check_integrity()
        assert 0.0 <= bm.usage() <= 1.0
