"""Front-end admission (tidal_core/front_admission.py) and retry spreading (tidal_core/retry_spread.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tidal_core import (
    AdmissionConfig,
    Regime,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    ServicePrior,
    UnitLoad,
    preset,
)
from tidal_core.front_admission import (
    BURST_REQUESTS,
    PROMPT_BYTES_PER_TOKEN,
    FrontAdmission,
    OnTheWay,
    PathModel,
    PromptSizeModel,
    Sighting,
    absorb_door_refusals,
    price_per_token,
    published_load,
)
from tidal_core.retry_spread import RetrySpread

CFG = AdmissionConfig(target_ttft_s=1.0, burst_factor=2.0, max_queue_len=100)


def _load(unit: str = "u", waiting: int = 5, delay: float = 3.0, regime: Regime = Regime.LIGHT,
          kv: float = 0.1, capacity: float = 2.0) -> UnitLoad:
    return UnitLoad(unit, num_running=8, num_waiting=waiting, queue_delay_s=delay, kv_usage=kv,
                    capacity_rps=capacity, regime=regime)


def test_a_backlog_past_the_regimes_limit_is_refused_with_the_units_retry_estimate() -> None:
    front = FrontAdmission(CFG)
    refusal = front.check([Sighting(_load(delay=3.0), seen_s=10.0)], now=10.0)
    assert refusal is not None and refusal.reason == "prefill_backlog" and refusal.unit_id == "u"
    assert refusal.retry_after_s == pytest.approx(2.0)  # predicted 3 s - the 1 s target
    assert "retry after 2.0s" in refusal.message
    # In LIGHT/STEADY a burst may queue up to burst_factor x the target; in OVERLOAD only the target.
    assert front.check([Sighting(_load(delay=1.5), 10.0)], 10.0) is None
    assert front.check([Sighting(_load(delay=1.5, regime=Regime.OVERLOAD), 10.0)], 10.0) is not None


def test_the_snapshot_ages_the_unit_drains_and_a_stale_one_is_not_believed() -> None:
    front = FrontAdmission(CFG, max_age_s=1.0)
    seen = Sighting(_load(delay=2.5), seen_s=10.0)
    assert front.check([seen], now=10.2) is not None  # 2.3 s still ahead
    assert front.check([seen], now=10.8) is None  # 1.7 s ahead: within 2 x 1 s, the unit decides
    assert front.check([Sighting(_load(delay=30.0), seen_s=10.0)], now=11.5) is None  # stale
    assert front.check([Sighting(_load(delay=30.0), seen_s=10.0)], now=9.0) is None  # from the future
    assert front.check([], now=10.0) is None  # nothing heard: the unit decides


def test_time_already_waited_and_the_own_prompt_count_and_an_idle_unit_is_never_refused() -> None:
    front = FrontAdmission(CFG)
    assert front.check([Sighting(_load(delay=1.5), 10.0)], 10.0, waited_s=0.7) is not None
    priced = dataclasses.replace(_load(delay=1.5), prefill_s_per_token=0.001)
    assert front.check([Sighting(priced, 10.0)], 10.0, prompt_tokens=400) is None  # 1.9 s
    assert front.check([Sighting(priced, 10.0)], 10.0, prompt_tokens=600) is not None  # 2.1 s
    # Nothing ahead (the unit would start it at once), however full the KV cache and long the wait.
    assert front.check([Sighting(_load(waiting=0, delay=0.0, kv=1.0), 10.0)], 10.0, 5000, waited_s=5.0) is None


def test_queue_full_and_kv_pressure_follow_the_units_rules() -> None:
    front = FrontAdmission(CFG)
    full = front.check([Sighting(_load(waiting=100, delay=0.1, capacity=10.0), 0.0)], 0.0)
    assert full is not None and full.reason == "queue_full" and full.retry_after_s == pytest.approx(10.0)
    kv = front.check([Sighting(_load(delay=0.1, kv=0.99), 0.0)], 0.0)
    assert kv is not None and kv.reason == "kv_pressure" and kv.retry_after_s == CFG.min_retry_after_s
    assert FrontAdmission(AdmissionConfig(enabled=False)).check([Sighting(_load(delay=99.0), 0.0)], 0.0) is None


def test_with_several_units_a_request_is_refused_only_if_every_fresh_one_refuses() -> None:
    front = FrontAdmission(CFG)
    busy_a, busy_b = Sighting(_load("a", delay=5.0), 0.0), Sighting(_load("b", delay=3.0), 0.0)
    refusal = front.check([busy_a, busy_b], 0.0)
    assert refusal is not None and refusal.unit_id == "b"  # the one that frees up first
    assert front.check([busy_a, busy_b, Sighting(_load("c", waiting=0, delay=0.0), 0.0)], 0.0) is None
    stale_c = Sighting(_load("c", waiting=0, delay=0.0), -10.0)
    assert front.check([busy_a, stale_c], 0.0) is not None  # c's view is stale


def test_retry_after_is_clamped_like_the_units() -> None:
    cfg = AdmissionConfig(target_ttft_s=1.0, min_retry_after_s=1.0, max_retry_after_s=5.0)
    front = FrontAdmission(cfg)
    overload = _load(delay=1.5, regime=Regime.OVERLOAD)
    assert front.check([Sighting(overload, 0.0)], 0.0).retry_after_s == 1.0  # type: ignore[union-attr]
    assert front.check([Sighting(_load(delay=60.0), 0.0)], 0.0).retry_after_s == 5.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="max_age_s=0"):
        FrontAdmission(cfg, max_age_s=0)


def _unit(target_ttft_s: float = 1.0) -> Scheduler:
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=64, max_num_batched_tokens=512, num_kv_blocks=4096,
                                             block_size=16, max_model_len=4096,
                                             service_prior=ServicePrior(0.05, 0.001, 0.001)),
                 admission=AdmissionConfig(target_ttft_s=target_ttft_s, max_queue_len=1000))
    return Scheduler(cfg)


@pytest.mark.parametrize("seed", range(5))
def test_what_the_front_end_refuses_the_unit_refuses_too(seed: int) -> None:
    """With a prompt estimate no larger than the prompt, the front end's rules are lower bounds
    of the unit's: on a real scheduler's published snapshot, a front-end refusal is never a
    request the unit would have admitted (the converse is the unit's job: it stays the final
    authority). With the exact prompt length the two agree on nearly every request."""
    rng = random.Random(seed)
    unit = _unit()
    front = FrontAdmission(unit.config.admission)
    refused_front = agreed = refused_unit = 0
    for i in range(300):
        now = i * 0.002
        seen = Sighting(published_load(unit, now, "u"), now)
        prompt = rng.randint(60, 600)
        low, exact = front.check([seen], now, prompt // 2), front.check([seen], now, prompt)
        rejection = unit.add_request(Request(f"r{i}", prompt, SamplingParams(), now), now)
        refused_unit += rejection is not None
        if low is not None:
            refused_front += 1
            assert rejection is not None and rejection.reason == low.reason
        agreed += (exact is None) == (rejection is None)
    assert refused_front > 100, "the burst never filled the unit"
    assert agreed >= 0.95 * 300, (agreed, refused_unit)


def test_the_published_snapshot_prices_a_prompt_as_the_unit_does() -> None:
    unit = _unit()
    for i in range(3):  # a backlog the unit admits (burst_factor 1: about 1 s of predicted prefill)
        assert unit.add_request(Request(f"r{i}", 300, SamplingParams(), 0.0), 0.0) is None
    load = published_load(unit, 0.0, "u")
    assert load.prefill_s_per_token > 0 and load.unit_id == "u"
    assert load.queue_delay_s == unit.snapshot(0.0).queue_delay_s
    assert UnitLoad.from_stats("u", load.to_stats()) == load  # travels in the wire form


def test_retries_are_given_slots_at_the_units_rate_after_its_own_estimate() -> None:
    spread = RetrySpread(max_s=60.0)
    delays = [spread.delay_s(now=100.0, base_s=1.0, capacity_rps=4.0, u=0.0) for _ in range(5)]
    assert delays == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])
    assert spread.delay_s(100.0, 1.0, 4.0, u=0.5) == pytest.approx(2.25 + 0.125)  # jitter inside its slot
    # Later refusals queue behind the promised slots; a longer estimate starts later.
    assert spread.delay_s(101.0, 1.0, 4.0, u=0.0) == pytest.approx(1.5)
    assert spread.delay_s(101.0, 10.0, 4.0, u=0.0) == pytest.approx(10.0)


def test_past_the_horizon_retries_spread_uniformly_and_the_schedule_stops() -> None:
    spread = RetrySpread(max_s=5.0)
    delays = [spread.delay_s(0.0, 1.0, 1.0, u=0.0) for _ in range(5)]
    assert delays == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spread.delay_s(0.0, 1.0, 1.0, u=0.5) == pytest.approx(3.0)  # uniform over [1, 5]
    assert spread.next_slot_s == pytest.approx(6.0)  # not advanced by refusals past the horizon
    rng = random.Random(0)
    burst = [spread.delay_s(0.0, 1.0, 1.0, rng.random()) for _ in range(1000)]
    assert all(1.0 <= d <= 5.0 for d in burst)
    assert max(sum(1 for d in burst if lo <= d < lo + 1) for lo in range(1, 5)) < 300  # no wave of all 1000


def test_without_a_rate_the_units_estimate_is_used_and_bad_draws_are_refused() -> None:
    spread = RetrySpread(max_s=60.0)
    assert spread.delay_s(0.0, 2.0, 0.0, u=0.9) == 2.0
    assert spread.delay_s(0.0, 99.0, 0.0, u=0.9) == 60.0
    with pytest.raises(ValueError, match=r"u=1\.0"):
        spread.delay_s(0.0, 1.0, 1.0, u=1.0)
    with pytest.raises(ValueError, match="max_s=0"):
        RetrySpread(max_s=0.0)


def test_protect_mode_refuses_only_a_full_queue_as_the_unit_does() -> None:
    """A dev server (admission mode 'protect') queues: the front end must not refuse on a TTFT
    prediction or KV pressure where the unit would not."""
    protect = FrontAdmission(AdmissionConfig(target_ttft_s=1.0, max_queue_len=10, mode="protect"))
    backed_up = UnitLoad("u", 4, 9, 30.0, 0.99, capacity_rps=1.0, regime=Regime.OVERLOAD, prefill_s_per_token=1e-3)
    assert protect.unit_verdict(backed_up, 0.0, 4000) is None
    full = dataclasses.replace(backed_up, num_waiting=10)
    refusal = protect.unit_verdict(full, 0.0, 10)
    assert refusal is not None and refusal.reason == "queue_full"
    slo = FrontAdmission(AdmissionConfig(target_ttft_s=1.0, max_queue_len=10))
    assert slo.unit_verdict(backed_up, 0.0, 4000) is not None  # the same snapshot, production rules


def test_the_front_end_watches_closely_only_where_a_verdict_could_refuse_soon() -> None:
    """In protect mode only a full queue is refused: under half the limit a second-old snapshot
    decides as a fresh one would. SLO admission always watches; admission off never does."""
    protect = FrontAdmission(AdmissionConfig(max_queue_len=10, mode="protect"))
    assert not protect.watch_closely(_load(waiting=4))
    assert protect.watch_closely(_load(waiting=5))
    assert protect.watch_closely(_load(waiting=12))
    assert FrontAdmission(CFG).watch_closely(_load(waiting=0))
    assert not FrontAdmission(AdmissionConfig(enabled=False)).watch_closely(_load(waiting=10_000))


def test_the_burst_price_follows_the_units_own_prediction_for_prompts_arriving_together() -> None:
    """Each prompt admitted becomes a decode in the steps that prefill the ones behind it, so the
    unit prices the last of a burst higher per token than one prompt alone. Priced from the
    snapshot of an idle unit, the front end's estimate for the k-th prompt of a burst stays
    within 1% of the unit's own prediction when it arrives (a flat price ran 2-6% low)."""
    from calibration.cost_model import CostModel
    from loadgen.sim.runner import unit_config

    # The A100 70B unit of configs/sim.yaml, admitting the whole burst: every prediction is compared.
    unit = Scheduler(preset("adaptive", unit_config(CostModel.load("a100-llama70b-tp8")),
                            admission=AdmissionConfig(target_ttft_s=100.0, target_tpot_s=0.1)))
    load = published_load(unit, 0.0, "u")
    assert load.burst_s_per_token > load.prefill_s_per_token > 0
    assert price_per_token(load, 1) == load.prefill_s_per_token
    assert price_per_token(load, BURST_REQUESTS) == pytest.approx(load.burst_s_per_token)
    assert price_per_token(load, 10 * BURST_REQUESTS) == pytest.approx(load.burst_s_per_token)  # held past the probe
    flat_low = 0
    for k in range(1, BURST_REQUESTS + 1):
        req = Request(f"r{k}", 400, SamplingParams(max_tokens=128), 0.0)
        assert unit.add_request(req, 0.0) is None
        assert req.predicted_ttft_s is not None
        front = 400 * k * price_per_token(load, k)
        assert front == pytest.approx(req.predicted_ttft_s, rel=0.01), k
        flat_low += 400 * k * load.prefill_s_per_token < 0.98 * req.predicted_ttft_s
    assert flat_low >= BURST_REQUESTS // 2
    assert UnitLoad.from_stats("u", load.to_stats()) == load


def test_the_path_model_learns_the_time_per_request_on_the_way() -> None:
    path = PathModel(gain=0.5, prior_s=0.01)
    assert path.path_s(5) == pytest.approx(0.05)  # nothing learned: its prior, 10 ms per request on the way
    path.observe(0.3, on_the_way=10)  # 30 ms per request on the way: halfway there
    assert path.path_s(1) == pytest.approx(0.02) and path.path_s(10) == pytest.approx(0.2)
    path.observe(0.04, on_the_way=1)  # halfway to 40 ms
    assert path.per_request_s == pytest.approx(0.03)
    path.observe(-1.0, 3)  # a clock step: ignored
    path.observe(0.5, 0)
    assert path.num_observed == 2
    assert PathModel(prior_s=0.0).path_s(100) == 0.0
    with pytest.raises(ValueError, match="gain=0"):
        PathModel(gain=0.0)


def test_the_prompt_size_model_learns_the_bytes_of_body_per_prompt_token() -> None:
    """Before any verdict, the prior; then the ratio of the weighted sums of bytes and tokens, so a
    mix of short and long prompts is turned into about the tokens the unit will count in all (a
    short prompt's JSON overhead does not inflate a long one's estimate); a body much larger than
    its prompt counts at the cap."""
    sizes = PromptSizeModel(gain=0.1)
    assert sizes.bytes_per_token == pytest.approx(PROMPT_BYTES_PER_TOKEN)
    assert sizes.tokens(900) == int(900 / PROMPT_BYTES_PER_TOKEN)
    assert sizes.tokens(0) == 0
    mix = [(300, 40), (2600, 520)] * 60  # (bytes, tokens): 7.5 and 5 bytes a token, 5.18 over both
    for body, tokens in mix:
        sizes.observe(body, tokens)
    assert sizes.bytes_per_token == pytest.approx(2900 / 560, rel=0.03)
    assert sum(sizes.tokens(b) for b, _ in mix) == pytest.approx(sum(t for _, t in mix), rel=0.03)
    sizes.observe(-1, 10)
    sizes.observe(100, 0)  # nothing to learn from
    assert sizes.num_observed == len(mix)
    huge = PromptSizeModel(gain=1.0)
    huge.observe(1_000_000, 10)  # a body of 1 MB around a 10-token prompt: 64 bytes a token at most
    assert huge.bytes_per_token == pytest.approx(64.0)
    with pytest.raises(ValueError, match="prior_bytes_per_token=0"):
        PromptSizeModel(prior_bytes_per_token=0.0)


def test_one_slow_request_does_not_close_the_gates_but_a_longer_way_is_learned() -> None:
    """A client uploading its body for 30 s reaches its unit 30 s after the proxy's stamp: it
    counts as 4x the mean at most, and the next ordinary verdicts bring the mean back; a way that
    really grows (every request on it slower) is learned within a few dozen verdicts."""
    path = PathModel(gain=0.1, prior_s=0.01)
    path.observe(30.0, on_the_way=1)
    assert path.per_request_s == pytest.approx(0.01 + 0.1 * (0.04 - 0.01))  # not 3 s
    for _ in range(20):
        path.observe(0.01, 1)
    assert path.per_request_s < 0.0115
    for _ in range(40):  # the way now takes 100 ms a request: followed up, 4x at a time at most
        path.observe(0.1, 1)
    assert path.per_request_s == pytest.approx(0.1, rel=0.05)
    with pytest.raises(ValueError, match="outlier_factor=1"):
        PathModel(outlier_factor=1.0)


def test_work_let_through_starts_when_it_arrives_and_a_unit_idle_at_arrival_decides_itself() -> None:
    """An idle unit's snapshot and ten requests let through 50 ms ago, 0.8 s of prefill: with no
    path known the front end lets an 0.1 s prompt through (0.9 s); with a 0.25 s path the work
    cannot start before the oldest arrives (0.2 s from now) and the prompt is refused (1.1 s)."""
    front = FrontAdmission(CFG)
    idle = UnitLoad("u", 0, 0, 0.0, 0.0, regime=Regime.OVERLOAD, prefill_s_per_token=1e-3, ttft_limit_s=1.0)
    sent = OnTheWay(tokens=800, requests=10, oldest_s=0.05)
    assert front.check([Sighting(idle, 0.0)], 0.0, 100, on_the_way=sent) is None
    refusal = front.check([Sighting(idle, 0.0)], 0.0, 100,
                          on_the_way=dataclasses.replace(sent, path_s=0.25, head_path_s=0.25))
    assert refusal is not None and "1.10s" in refusal.message
    # A path longer than the work ahead: the unit will have nothing ahead when it arrives.
    far = OnTheWay(tokens=100, requests=1, oldest_s=0.45, path_s=0.5)  # arrives in 50 ms, done in 150
    assert front.check([Sighting(idle, 0.0)], 0.0, 5000, on_the_way=far) is None
    # A busy unit drains its queue while the requests travel: the path adds nothing then.
    busy = dataclasses.replace(idle, queue_delay_s=0.5, num_waiting=3)
    assert front.check([Sighting(busy, 0.0)], 0.0, 100, on_the_way=OnTheWay(300, 3, 0.0, 0.3)) is None  # 0.9 s
    assert front.check([Sighting(busy, 0.0)], 0.0, 100, on_the_way=OnTheWay(500, 5, 0.0, 0.3)) is not None  # 1.1 s
    # The work on the way starts as its oldest arrives, not when the request behind it does: five
    # requests ahead on a way of 40 ms a request, 0.45 s of their prefill, 0.49 s of its own. The
    # unit starts the first at 40 ms, so this one's first token comes at 0.98 s, not at 0.24 s
    # (when it arrives, sixth) + 0.45 + 0.49 = 1.18 s.
    serial = OnTheWay(tokens=450, requests=5, oldest_s=0.0, path_s=0.24, head_path_s=0.04)
    assert front.check([Sighting(idle, 0.0)], 0.0, 490, on_the_way=serial) is None
    late = front.check([Sighting(idle, 0.0)], 0.0, 490, on_the_way=dataclasses.replace(serial, head_path_s=0.24))
    assert late is not None and "1.18s" in late.message
    # Nor does it start before it arrives itself: a way longer than the work ahead leaves none.
    assert front.check([Sighting(idle, 0.0)], 0.0, 5000, on_the_way=dataclasses.replace(serial, path_s=0.6)) is None
    # Several units share what is on the way.
    assert OnTheWay(800, 3, 0.1, 0.2).share(2) == OnTheWay(400, 2, 0.1, 0.2)


def test_the_doors_refusals_count_in_the_units_load_so_its_regime_sees_the_overload() -> None:
    """A unit behind a front gate sees only what the door lets through, about its capacity: its
    regime stays short of OVERLOAD unless the door's refusals count as its arrivals."""
    def unit() -> Scheduler:
        return Scheduler(preset("adaptive", SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512,
                                                            num_kv_blocks=256, block_size=16, max_model_len=4096,
                                                            service_prior=ServicePrior(0.05, 0.001, 0.001))))

    told, blind = unit(), unit()
    capacity = told.load.capacity_rps()
    for step in range(400):  # 20 s: arrivals at the unit's capacity, three times that at the door
        now = step * 0.05
        for sched in (told, blind):
            sched.load.arrivals.on_event(now, capacity * 0.05)
            sched.observe(now)  # what every schedule() of a unit with work does each OBSERVE_PERIOD_S
        absorb_door_refusals(told, now, [(300, "prefill_backlog")] * round(2 * capacity * 0.05 * 10)
                             if step % 10 == 0 else [])
    assert blind.current_regime is not Regime.OVERLOAD
    assert told.current_regime is Regime.OVERLOAD
    assert told.view.refusals.fraction(20.0) > 0.5 and told.stats.num_arrived == blind.stats.num_arrived == 0
    absorb_door_refusals(told, 20.0, [])  # nothing to count: nothing changes
    assert told.stats.num_arrived == 0
    # The regime's own signal counts the refusals for the work ahead only: a prompt refused for its
    # own length (in OVERLOAD) would otherwise hold the unit there.
    assert told.regime.refusals.fraction(20.0) == 1.0
    own = unit()
    absorb_door_refusals(own, 0.0, [(8000, "prompt_over_target")] * 3 + [(300, "prefill_backlog")])
    assert own.view.refusals.fraction(0.0) == 1.0 and own.regime.refusals.fraction(0.0) == 0.25
