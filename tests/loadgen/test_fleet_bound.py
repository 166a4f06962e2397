"""benchmarks/fleet_bound.py: the clairvoyant whole-unit fleet on made-up attainment curves."""

from __future__ import annotations

import numpy as np

from benchmarks.fleet_bound import clairvoyant, met_share

# One unit meets every request up to 1 req/s and none past 1.05; a fleet of two pools a little better.
RATES = np.array([0.5, 1.0, 1.05, 1.1, 3.0])
CURVES = np.array([[1.0, 1.0, 0.0, 0.0, 0.0],
                   [1.0, 1.0, 1.0, 0.0, 0.0]])


def test_every_moment_runs_the_fewest_units_that_cover_the_rate() -> None:
    day = np.array([0.4, 0.9, 1.5, 2.0, 2.6, 3.3])
    fleet, met = clairvoyant(CURVES, RATES, day, 1.0, most=8, every_moment=True)
    # 1.5 req/s: two units at 0.75 each; 2.6: three at 0.867; 3.3: four at 0.825 (fleets past two
    # use the two-unit curve).
    assert fleet.tolist() == [1, 1, 2, 2, 3, 4]
    assert met == 1.0


def test_the_days_target_may_run_a_quiet_moment_hot_and_spends_no_more() -> None:
    # A long busy stretch and one short quiet one: 99% of the day's requests can be met while the
    # quiet moment's few requests are dropped by running one unit fewer there.
    day = np.concatenate([np.full(99, 2.0), [1.9]])
    every, met_every = clairvoyant(CURVES, RATES, day, 0.99, most=8, every_moment=True)
    floor, met_floor = clairvoyant(CURVES, RATES, day, 0.99, most=8)
    assert met_every == 1.0 and met_floor >= 0.99
    assert floor.sum() <= every.sum()
    assert floor.sum() == every.sum() - 1  # exactly the quiet moment gives a unit up


def test_met_share_is_flat_outside_the_grid() -> None:
    assert met_share(CURVES, RATES, 1, np.array([0.1, 10.0])).tolist() == [1.0, 0.0]
    assert met_share(CURVES, RATES, 5, np.array([1.05])).tolist() == [1.0]  # five units: the largest curve
