"""Cache-aware routing: affinity on a prefix match, load where the match is small or the unit busy."""

from __future__ import annotations

import random

import pytest

from tidal_core import UnitLoad
from tidal_core.prefix_routing import PrefixAwareRouter, PrefixIndex, PrefixRoutingConfig

CFG = PrefixRoutingConfig(index_blocks=4096, block_size=16, stride=4, prefill_s_per_token=1e-3)


def units(*delays: float) -> list[UnitLoad]:
    return [UnitLoad(f"u{i}", 1, 0, d, 0.1) for i, d in enumerate(delays)]


def prompt(family: int, n_blocks: int) -> list[int]:
    return [family * 10_000 + k for k in range(n_blocks)]


def test_index_matches_whole_strides_and_forgets_the_oldest_past_capacity() -> None:
    ix = PrefixIndex(capacity_blocks=8, stride=4)  # two entries
    ix.add(prompt(1, 9))
    assert ix.match_blocks(prompt(1, 9)) == 8 and ix.match_blocks(prompt(1, 5)) == 4
    assert ix.match_blocks(prompt(2, 9)) == 0
    ix.add(prompt(2, 4))  # three entries: the oldest (family 1's first) goes
    assert len(ix) == 2 and ix.match_blocks(prompt(1, 9)) == 0 and ix.match_blocks(prompt(2, 4)) == 4


def test_a_follow_up_goes_where_its_prefix_went() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    fleet = units(0.0, 0.0, 0.0, 0.0)
    first = r.choose(fleet, prompt(7, 40), 40 * 16)
    assert first is not None
    for _ in range(10):
        assert r.choose(fleet, prompt(7, 48), 48 * 16 + 5) == first
    assert r.num_affinity == 10 and r.num_load == 1


def test_a_small_match_is_left_to_load() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    fleet = units(0.0, 0.5)
    r.indexes["u1"] = PrefixIndex(CFG.index_blocks, CFG.stride)
    r.indexes["u1"].add(prompt(3, 4))  # 64 tokens of a 2000-token prompt: 3% < 10%
    assert r.choose(fleet, [*prompt(3, 4), *prompt(9, 120)], 2000) == "u0"
    assert r.num_load == 1


def test_a_match_is_worth_its_prefill_and_no_more() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    r.indexes["u1"] = PrefixIndex(CFG.index_blocks, CFG.stride)
    r.indexes["u1"].add(prompt(5, 64))  # 1024 tokens cached there: 1.024 s of prefill at 1 ms/token
    hashes = prompt(5, 64)
    assert r.choose(units(0.0, 0.5), hashes, 1100) == "u1"  # 0.5 s busier, saves ~1 s
    r2 = PrefixAwareRouter(CFG, random.Random(0))
    r2.indexes["u1"] = r.indexes["u1"]
    assert r2.choose(units(0.0, 0.9), hashes, 1100) == "u1"
    guard = PrefixRoutingConfig(index_blocks=4096, block_size=16, stride=4, prefill_s_per_token=1e-2,
                                max_extra_delay_s=1.0)
    r3 = PrefixAwareRouter(guard, random.Random(0))
    r3.indexes["u1"] = r.indexes["u1"]
    # Saving 10 s of prefill, but the unit is 1.5 s busier than the idlest: past the guard.
    assert r3.choose(units(0.0, 1.5), hashes, 1100) == "u0"


def test_units_without_a_report_of_prefill_speed_use_the_prior_and_unhealthy_units_are_skipped() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    r.indexes["u0"] = PrefixIndex(CFG.index_blocks, CFG.stride)
    r.indexes["u0"].add(prompt(1, 16))
    sick = [UnitLoad("u0", 0, 0, 0.0, 0.0, healthy=False), UnitLoad("u1", 0, 0, 0.0, 0.0)]
    assert r.choose(sick, prompt(1, 16), 300) == "u1"
    assert r.choose([UnitLoad("u0", 0, 0, 0.0, 0.0, healthy=False)], prompt(1, 16), 300) is None
    r.forget("u0")
    assert "u0" not in r.indexes


def test_config_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="min_match_fraction=2"):
        PrefixRoutingConfig(min_match_fraction=2)
