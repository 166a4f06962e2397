"""`tidal bench scheduler`'s harness on a tiny unit (no timing asserted): the interleaved units
run the same cycles, and the three cache modes fill the cache as they say."""

from __future__ import annotations

from loadgen.sim.bench import BenchUnit, bench_interleaved


def test_interleaved_units_each_run_every_cycle() -> None:
    modes = {"off": (False, False), "on_unhashed": (True, False), "on_hashed_no_hits": (True, True)}
    out = bench_interleaved(modes, num_running=8, num_waiting=16, cycles=40, seed=1)
    assert set(out) == set(modes)
    assert all(r["cycles"] == 40 and r["waiting"] >= 15 and r["p50_us"] > 0 for r in out.values())


def test_hashed_prompts_fill_the_cache_and_unhashed_ones_do_not() -> None:
    def cached(hashed: bool) -> tuple[int, int]:
        unit = BenchUnit(8, 16, seed=2, prefix_caching=True, hashed=hashed)
        for _ in range(60):
            unit.cycle()
        cache = unit.sched.q.cache
        assert cache is not None
        unit.sched.check_integrity()
        return cache.num_cached_blocks, unit.sched.stats.prefix_cache_hit_tokens

    blocks, hits = cached(True)
    assert blocks > 0 and hits == 0  # every prompt unique: consulted and filled, never hit
    assert cached(False) == (0, 0)
