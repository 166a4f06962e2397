"""The front end's aim (tidal_core/door_aim.py) and how `FrontAdmission` acts on it."""

from __future__ import annotations

import random

import pytest

from tidal_core import AdmissionConfig, Regime, UnitLoad
from tidal_core.door_aim import DOOR_AIM_FLOOR, DOOR_AIM_GAIN, DOOR_AIM_TAIL, DoorAim
from tidal_core.front_admission import FrontAdmission, Sighting

CFG = AdmissionConfig(target_ttft_s=1.0, burst_factor=2.0, max_queue_len=100)


def test_the_aim_falls_on_refusals_behind_rises_on_admissions_and_stays_in_its_bounds() -> None:
    aim = DoorAim()
    for _ in range(50):
        aim.observe(refused_behind=False)
    assert aim.value == 1.0 and aim.num_admitted == 50  # predictions that hold keep the whole limit
    aim.observe(refused_behind=True)
    assert aim.value == pytest.approx(1.0 - DOOR_AIM_GAIN * (1.0 - DOOR_AIM_TAIL)) and aim.num_refused == 1
    for _ in range(100):
        aim.observe(refused_behind=True)
    assert aim.value == DOOR_AIM_FLOOR
    aim.observe(refused_behind=False)
    assert aim.value == pytest.approx(DOOR_AIM_FLOOR + DOOR_AIM_GAIN * DOOR_AIM_TAIL)
    for bad in ({"gain": 0.0}, {"tail": 1.0}, {"floor": 0.0}, {"floor": 1.5}):
        with pytest.raises(ValueError):
            DoorAim(**bad)


@pytest.mark.parametrize("short_by", [0.6, 0.75, 0.9])
def test_a_door_that_predicts_short_learns_to_let_through_what_its_unit_admits(short_by: float) -> None:
    """A door whose prediction is `short_by` x the unit's (a stale snapshot, estimates) lets through
    requests whose true predicted TTFT is spread over 0-2x the limit. Learning from the refusals made
    behind it, it settles where about `tail` of what it lets through is refused there, with its aim
    near `short_by`'s inverse of the limit, and lets through nearly all the unit would admit."""
    rng = random.Random(7)
    aim = DoorAim()
    let_through = refused_behind = would_admit = admitted = 0
    for i in range(40_000):
        unit_s = 2.0 * rng.random()  # the unit's own prediction; its limit is 1 s
        if i >= 10_000:
            would_admit += unit_s <= 1.0
        if short_by * unit_s > aim.value:  # refused at the door
            continue
        aim.observe(refused_behind=unit_s > 1.0)
        if i >= 10_000:
            let_through += 1
            refused_behind += unit_s > 1.0
            admitted += unit_s <= 1.0
    assert refused_behind / let_through == pytest.approx(DOOR_AIM_TAIL, abs=0.01)
    assert aim.value == pytest.approx(short_by, abs=0.06)
    assert admitted / would_admit > 0.97


def test_admission_compares_the_prediction_with_the_aimed_share_of_the_limit() -> None:
    front = FrontAdmission(CFG)
    load = UnitLoad("u", num_running=8, num_waiting=5, queue_delay_s=0.8, kv_usage=0.1, capacity_rps=2.0,
                    regime=Regime.OVERLOAD)
    seen = [Sighting(load, 10.0)]
    assert front.check(seen, 10.0) is None and front.check(seen, 10.0, aim=0.85) is None  # 0.8 s of 1 s
    refusal = front.check(seen, 10.0, aim=0.75)
    assert refusal is not None and refusal.reason == "prefill_backlog"
    # Short of the target, the message says which limit it passed, not that the target is missed.
    assert "0.80s exceeds the 0.75s the door admits now" in refusal.message and "target" not in refusal.message
    late = front.check([Sighting(UnitLoad("u", 8, 5, 1.2, 0.1, capacity_rps=2.0, regime=Regime.OVERLOAD), 10.0)], 10.0,
                       aim=0.75)
    assert late is not None and "1.20s exceeds the 1.00s target" in late.message
    full = UnitLoad("u", num_running=8, num_waiting=100, queue_delay_s=0.0, kv_usage=0.1, capacity_rps=2.0)
    assert front.check([Sighting(full, 10.0)], 10.0, aim=1.0).reason == "queue_full"  # other rules: as before
    idle = UnitLoad("u", num_running=0, num_waiting=0, queue_delay_s=0.0, kv_usage=0.0, capacity_rps=2.0,
                    regime=Regime.OVERLOAD)
    assert front.check([Sighting(idle, 10.0)], 10.0, 500, aim=DOOR_AIM_FLOOR) is None  # nothing ahead: never
