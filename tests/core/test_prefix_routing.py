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


def test_a_refused_prompt_is_taken_back_and_what_the_unit_held_before_is_kept() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    fleet = units(0.0, 0.0)
    first = r.choose(fleet, prompt(4, 16), 16 * 16)  # turn one, computed where it went
    assert first is not None and r.last_cached_tokens == 0
    turn_two = [*prompt(4, 16), *prompt(8, 16)]
    assert r.choose(fleet, turn_two, 32 * 16) == first and r.last_cached_tokens == 16 * 16
    r.refused(first, turn_two, r.last_cached_tokens)  # the unit refused turn two: it never computed it
    ix = r.indexes[first]
    assert ix.match_blocks(turn_two) == 16 and ix.match_blocks(prompt(4, 16)) == 16
    r.moved(first, "u9", prompt(4, 16), 0)  # a prompt sent elsewhere after all: forgotten here, kept there
    assert ix.match_blocks(prompt(4, 16)) == 0 and r.indexes["u9"].match_blocks(prompt(4, 16)) == 16


def test_affinity_goes_first_to_a_unit_that_would_admit_the_uncached_part() -> None:
    r = PrefixAwareRouter(CFG, random.Random(0))
    hashes = prompt(6, 70)  # 1,120 tokens; "hot" holds 120 of them, "calm" none
    r.indexes["hot"] = PrefixIndex(CFG.index_blocks, CFG.stride)
    r.indexes["hot"].add(prompt(6, 8))
    per_token = 1e-3
    hot = UnitLoad("hot", 4, 2, 0.5, 0.1, prefill_s_per_token=per_token, ttft_limit_s=1.0)  # 0.5 + 1.0 s: refuses
    calm = UnitLoad("calm", 4, 2, 0.9, 0.1, prefill_s_per_token=per_token, ttft_limit_s=3.0)  # 0.9 + 1.12 s: admits
    assert r.choose([hot, calm], hashes, 1120) == "calm"
    admitting = UnitLoad("hot", 4, 2, 0.5, 0.1, prefill_s_per_token=per_token, ttft_limit_s=2.0)
    r2 = PrefixAwareRouter(CFG, random.Random(0))
    r2.indexes["hot"] = r.indexes["hot"]
    assert r2.choose([admitting, calm], hashes, 1120) == "hot"  # both admit: the lower predicted TTFT
