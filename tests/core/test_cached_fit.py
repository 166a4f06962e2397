"""The line of cached tokens a unit publishes for its front ends (tidal_core/cached_fit.py), and the
door's estimates on it: a shared system prompt (the same tokens cached whatever the length), a
chat's history (a share of the prompt), a mix, and no cache at all."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from tests.helpers import FakeExecutor, run_until_idle
from tidal_core import Request, SamplingParams, Scheduler, SchedulerConfig, preset
from tidal_core.cached_fit import REFIT_EVERY, CachedFit, uncached_tokens
from tidal_core.front_admission import FrontAdmission, OnTheWay, Sighting, published_load


def _fit(pairs: list[tuple[int, int]], gain: float = 1.0 / 256) -> CachedFit:
    fit = CachedFit(gain)
    for p, c in pairs:
        fit.observe(p, c)
    return fit


def test_a_shared_system_prompt_is_a_fixed_number_of_tokens_whatever_the_length() -> None:
    # Mooncake's shape: 9 in 10 prompts find the 512-token system prompt only, a few most of a long
    # history, a few nothing; the few must not swing the line.
    rng = random.Random(1)
    pairs = []
    for _ in range(2000):
        p = rng.randint(600, 7000)
        r = rng.random()
        pairs.append((p, p - 400 if r < 0.03 else 0 if r < 0.06 else 512))
    fit = CachedFit()
    for i, (p, c) in enumerate(pairs):
        fit.observe(p, c)
        if i >= 100:
            fixed, share = fit.line()
            assert fixed == 512 and share < 0.06, (i, fixed, share)
    window = pairs[-256:]

    def mean_error(uncached: Callable[[int], float]) -> float:
        return sum(abs(uncached(p) - (p - c)) for p, c in window) / len(window)

    mean_share = sum(c for _, c in window) / sum(p for p, _ in window)
    assert mean_error(fit.uncached) < 0.6 * mean_error(lambda p: p * (1.0 - mean_share))
    # Estimated in all, the window's prompts' uncached tokens come out about right.
    assert sum(fit.uncached(p) for p, _ in window) == pytest.approx(sum(p - c for p, c in window), rel=0.03)


def test_a_chats_history_is_a_share_of_the_prompt() -> None:
    rng = random.Random(2)
    fit = CachedFit()
    for p in (rng.randint(500, 8000) for _ in range(500)):
        fit.observe(p, int(0.8 * p))
    assert fit.line() == (0.0, pytest.approx(0.8, abs=0.005))  # a share alone fits it best
    for p in (700, 2000, 5000, 8000):
        assert fit.uncached(p) == pytest.approx(0.2 * p, rel=0.03)


def test_nothing_is_assumed_cached_before_any_arrival_or_when_nothing_is_found() -> None:
    assert CachedFit().line() == (0.0, 0.0) and CachedFit().uncached(3000) == 3000
    fit = CachedFit()
    for p in range(500, 3000, 10):
        fit.observe(p, 0)
    assert fit.line() == (0.0, 0.0) and fit.uncached(2000) == 2000
    with pytest.raises(ValueError):
        CachedFit(window=0)


def test_the_fit_follows_a_change_in_the_traffic() -> None:
    rng = random.Random(4)
    fit = CachedFit()
    for p in (rng.randint(500, 4000) for _ in range(300)):
        fit.observe(p, 0)
    for p in (rng.randint(500, 4000) for _ in range(256)):
        fit.observe(p, 512)
    assert fit.line() == (512.0, 0.0)
    # Fitted again every REFIT_EVERY arrivals, not at each (a fit is a few hundred microseconds).
    for p in (rng.randint(500, 4000) for _ in range(REFIT_EVERY - 1)):
        fit.observe(p, p)
    assert fit.line() == (512.0, 0.0)
    fit.observe(1000, 1000)
    assert fit.line()[1] > 0.05


def test_a_units_first_arrival_meets_a_cold_cache_and_the_line_does_not_stay_there() -> None:
    # Fitted at the first arrival only (nothing cached yet) and then every 32, a unit of a fleet
    # behind the door published "nothing cached" for its first 32 arrivals (minutes, in overload).
    fit, rng = CachedFit(), random.Random(5)
    fit.observe(3000, 0)
    assert fit.line() == (0.0, 0.0)
    for _ in range(15):
        fit.observe(rng.randint(600, 7000), 512)
        fit.line()
    assert fit.line()[0] == 512.0


def test_uncached_tokens_of_several_prompts_count_the_fixed_part_once_each() -> None:
    assert uncached_tokens(3000, 512, 0.0, num_prompts=3) == 3000 - 3 * 512
    assert uncached_tokens(3000, 500, 0.5, num_prompts=2) == 1000
    assert uncached_tokens(800, 512, 0.0, num_prompts=2) == 0  # never below nothing
    assert uncached_tokens(0, 512, 0.5) == 0 and uncached_tokens(1000, 0.0, 0.0) == 1000


def _caching_unit() -> Scheduler:
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512, num_kv_blocks=2048,
                                             block_size=16, max_model_len=8192, enable_prefix_caching=True))
    return Scheduler(cfg)


def _prompt(system: list[int], n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return system + [rng.randrange(1000, 30000) for _ in range(n - len(system))]


def test_a_unit_publishes_the_line_its_arrivals_found_cached() -> None:
    # Every prompt opens with the same 512-token system prompt; the first one puts it in the cache.
    unit, ex, system, now = _caching_unit(), FakeExecutor(), list(range(100, 612)), 0.0
    for i in range(40):
        ids = _prompt(system, 600 + 97 * i, i)
        req = Request(f"r{i}", len(ids), SamplingParams(max_tokens=1), now, prompt_token_ids=ids)
        assert unit.add_request(req, now) is None
        now = run_until_idle(unit, ex, now)  # served: its blocks stay cached
    load = published_load(unit, now, "u")
    assert load.cached_fixed_tokens == pytest.approx(512, rel=0.05) and load.cached_share < 0.02
    assert load.uncached_tokens(3000) == pytest.approx(2488, abs=40)
    # A unit without a cache publishes nothing cached.
    bare = Scheduler(preset("adaptive", SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512,
                                                        num_kv_blocks=256, block_size=16, max_model_len=4096)))
    bare.add_request(Request("x", 900, SamplingParams(), 0.0), 0.0)
    assert (published_load(bare, 0.0).cached_fixed_tokens, published_load(bare, 0.0).cached_share) == (0.0, 0.0)


def test_the_door_prices_a_short_prompt_behind_others_by_what_the_cache_leaves_of_each() -> None:
    # A shared system prompt of 512 tokens: a 1,100-token prompt behind two of 2,900 and 1,700 tokens
    # costs the unit 588 + 2,388 + 1,188 tokens of prefill, not the 5,700 of their prompts.
    base = published_load(_caching_unit(), 0.0, "u")
    load = dataclasses.replace(base, prefill_s_per_token=0.2e-3, burst_s_per_token=0.2e-3, ttft_limit_s=1.0,
                               queue_delay_s=0.0, cached_fixed_tokens=512.0, cached_share=0.0)
    front = FrontAdmission(_caching_unit().config.admission)
    way = OnTheWay(tokens=2900 + 1700, requests=2, oldest_s=0.0, path_s=0.0)
    assert front.check([Sighting(load, 0.0)], 0.0, 1100, on_the_way=way) is None  # ~0.83 s: the unit admits it
    nothing_cached = dataclasses.replace(load, cached_fixed_tokens=0.0)
    refusal = front.check([Sighting(nothing_cached, 0.0)], 0.0, 1100, on_the_way=way)
    assert refusal is not None and refusal.reason == "prefill_backlog"  # 5,700 tokens: ~1.14 s
