from __future__ import annotations

import math
import random

import pytest

from tidal_core import AdmissionConfig, Request, SamplingParams, Scheduler, SchedulerConfig, ServicePrior, preset
from tidal_core.load import LoadEstimator, RateEstimator, ServiceModel


def test_rate_estimator_tracks_a_poisson_rate() -> None:
    rng = random.Random(1)
    est = RateEstimator(tau_s=20.0)
    t = 0.0
    while t < 200.0:
        t += rng.expovariate(5.0)
        est.on_event(t)
    assert est.rate(t) == pytest.approx(5.0, rel=0.25)
    assert est.rate(t + 100.0) < 0.05 * est.rate(t)  # decays when traffic stops


def test_service_model_learns_true_coefficients_from_steps() -> None:
    true = (0.020, 0.0002, 0.0005)  # overhead, per prefill token, per decode seq
    model = ServiceModel(ServicePrior(step_overhead_s=0.05, prefill_s_per_token=0.001, decode_s_per_seq=0.001))
    rng = random.Random(3)
    for _ in range(3000):
        p = rng.choice([0, 0, rng.randint(1, 2048)])
        d = rng.randint(0, 128)
        t = true[0] + true[1] * p + true[2] * d
        model.observe(p, d, t * rng.uniform(0.97, 1.03))
    assert model.overhead_s == pytest.approx(true[0], rel=0.15)
    assert model.prefill_s_per_token == pytest.approx(true[1], rel=0.15)
    assert model.decode_s_per_seq == pytest.approx(true[2], rel=0.25)


def test_service_model_survives_degenerate_input() -> None:
    """Only one step shape for a long time (all decodes at one batch): no wind-up, no negatives."""
    model = ServiceModel(ServicePrior())
    for _ in range(50_000):
        model.observe(0, 32, 0.04)
    assert model.step_time(0, 32) == pytest.approx(0.04, rel=0.02)
    assert model.prefill_s_per_token > 0 and model.decode_s_per_seq >= 0 and model.overhead_s > 0
    model.observe(0, 0, float("nan"))
    assert math.isfinite(model.step_time(100, 10))


def test_load_is_arrival_rate_over_capacity() -> None:
    est = LoadEstimator(tau_s=10.0, prior=ServicePrior(0.03, 0.0001, 0.0005), max_batch_size=32, kv_tokens=10**6)
    for i in range(2000):
        est.on_arrival(i * 0.1, 500, 100)  # 10 req/s for 200 s
    for _ in range(50):
        est.on_finish(200.0, 100)
    cap = est.capacity_rps()
    per_req = 500 * 0.0001 + 100 * (0.03 + 0.0005 * 32) / 32
    assert cap == pytest.approx(1 / per_req, rel=1e-6)
    assert est.load(199.9) == pytest.approx(10.0 / cap, rel=0.05)


def _loaded_scheduler(max_batch_size: int = 8, **admission: object) -> Scheduler:
    cfg = preset("adaptive", SchedulerConfig(max_batch_size=max_batch_size, max_num_batched_tokens=512,
                                             num_kv_blocks=64, block_size=16, max_model_len=1024,
                                             service_prior=ServicePrior(0.05, 0.001, 0.001)),
                 admission=AdmissionConfig(**admission))  # type: ignore[arg-type]
    return Scheduler(cfg)


def test_queue_cap_rejects_with_retry_after() -> None:
    s = _loaded_scheduler(max_queue_len=3, target_ttft_s=100.0)
    results = [s.add_request(Request(f"r{i}", 10, SamplingParams(), 0.0), 0.0) for i in range(5)]
    assert results[:3] == [None, None, None]
    rej = results[3]
    assert rej is not None and rej.reason == "queue_full" and rej.retryable
    assert s.config.admission.min_retry_after_s <= rej.retry_after_s <= s.config.admission.max_retry_after_s
    assert "queued" in rej.message and s.stats.rejected["queue_full"] == 2


def _admitted_by_formula(limit_s: float, prompt: int = 100, per_token_s: float = 0.001, step_s: float = 0.05,
                         decode_s: float = 0.001, budget: int = 512) -> int:
    """How many equal prompts a cold unit admits: the k-th is admitted while prefilling the k
    prompts up to and including it is predicted within the limit (the first always is). Each
    token costs its own time plus its share of a step's fixed cost; the steps hold more decodes
    as the prompts ahead finish (from none to one per prompt, the new one included), averaged
    over eight equal shares of the tokens."""
    def predicted(n: int) -> float:
        mids = [n * (j + 0.5) / 8 for j in range(8)]
        return n * prompt * sum((step_s + decode_s * d) / (budget - d) + per_token_s for d in mids) / 8

    k = 1
    while predicted(k + 1) <= limit_s:
        k += 1
    return k


@pytest.mark.parametrize("burst_factor", [1.0, 2.0])
def test_prefill_backlog_cap_is_target_ttft_times_prefill_speed(burst_factor: float) -> None:
    # 1 ms per prefill token + 50 ms per step of 512 tokens (+1 ms per decode beside it), a batch
    # large enough that no slot wait applies: the cap is about target x prefill speed. Outside
    # OVERLOAD a burst may queue up to burst_factor x the target before refusals start.
    s = _loaded_scheduler(max_batch_size=64, target_ttft_s=1.0, max_queue_len=1000, burst_factor=burst_factor)
    admitted = sum(s.add_request(Request(f"r{i}", 100, SamplingParams(), 0.0), 0.0) is None for i in range(100))
    assert s.current_regime.value == "light"
    assert admitted == _admitted_by_formula(burst_factor * 1.0)
    rej = s.add_request(Request("late", 100, SamplingParams(), 0.0), 0.0)
    assert rej is not None and rej.reason == "prefill_backlog" and rej.retry_after_s >= 1.0


def test_full_batch_adds_the_wait_for_a_slot() -> None:
    roomy = _loaded_scheduler(max_batch_size=64, target_ttft_s=1.0, burst_factor=1.0)
    tight = _loaded_scheduler(max_batch_size=4, target_ttft_s=1.0, burst_factor=1.0)
    count = [sum(s.add_request(Request(f"r{i}", 100, SamplingParams(), 0.0), 0.0) is None for i in range(50))
             for s in (roomy, tight)]
    assert count[1] < count[0]


def test_time_spent_before_the_unit_counts_toward_the_predicted_ttft() -> None:
    # Two units with the same backlog: a request that arrives fresh is admitted, the same request
    # that already spent 0.8 s in the front end (arrival_s earlier than now) would reach its first
    # token past the 1 s target, so it is refused; and the prediction the TTFT correction learns
    # from includes that time, as the measured TTFT will.
    units = [_loaded_scheduler(max_batch_size=64, target_ttft_s=1.0, burst_factor=1.0) for _ in range(2)]
    for s in units:
        for i in range(3):
            assert s.add_request(Request(f"r{i}", 100, SamplingParams(), 10.0), 10.0) is None
    fresh, late = units
    assert fresh.add_request(Request("x", 100, SamplingParams(), 10.0), 10.0) is None
    rej = late.add_request(Request("x", 100, SamplingParams(), 9.2), 10.0)
    assert rej is not None and rej.reason == "prefill_backlog"
    own = Request("z", 10, SamplingParams(), 9.5)
    roomy = _loaded_scheduler(target_ttft_s=100.0)
    assert roomy.add_request(own, 10.0) is None
    assert own.predicted_ttft_s is not None and own.predicted_ttft_s >= 0.5


def test_a_request_with_nothing_ahead_is_admitted_outside_overload() -> None:
    idle = _loaded_scheduler(target_ttft_s=0.1)
    assert idle.add_request(Request("big", 1000, SamplingParams(), 0.0), 0.0) is None


def test_kv_pressure_rejects_only_when_requests_wait_for_room() -> None:
    s = _loaded_scheduler(target_ttft_s=1e6, kv_reject_usage=0.5)
    s.blocks.try_allocate("hog", 40 * 16)  # 62.5% of the pool
    assert s.add_request(Request("a", 10, SamplingParams(), 0.0), 0.0) is None  # nobody waits yet
    rej = s.add_request(Request("b", 10, SamplingParams(), 0.0), 0.0)
    assert rej is not None and rej.reason == "kv_pressure"


def test_baselines_never_reject_for_load() -> None:
    for name in ("eager", "fixed-wait", "continuous", "static"):
        s = Scheduler(preset(name, SchedulerConfig(max_model_len=64, num_kv_blocks=8, block_size=16)))
        assert all(s.add_request(Request(f"r{i}", 60, SamplingParams(), 0.0), 0.0) is None for i in range(500))


def test_protect_mode_queues_what_slo_mode_refuses() -> None:
    # The same backlog and KV pressure: SLO admission refuses (prefill_backlog, then kv_pressure);
    # protect mode (a dev server) queues every request up to the bounded queue, then says queue_full.
    slo = _loaded_scheduler(max_batch_size=64, target_ttft_s=1.0, max_queue_len=150)
    protect = _loaded_scheduler(max_batch_size=64, target_ttft_s=1.0, max_queue_len=150, mode="protect")
    results = {}
    for name, s in (("slo", slo), ("protect", protect)):
        s.blocks.try_allocate("hog", 40 * 16)
        results[name] = [s.add_request(Request(f"r{i}", 100, SamplingParams(), 0.0), 0.0) for i in range(151)]
    assert {r.reason for r in results["slo"] if r is not None} >= {"prefill_backlog"}
    assert all(r is None for r in results["protect"][:150])
    last = results["protect"][150]
    assert last is not None and last.reason == "queue_full" and last.retry_after_s >= 1.0
    kv = _loaded_scheduler(target_ttft_s=1e6, kv_reject_usage=0.5, mode="protect")
    kv.blocks.try_allocate("hog", 40 * 16)
    assert all(kv.add_request(Request(f"k{i}", 10, SamplingParams(), 0.0), 0.0) is None for i in range(5))
    tiny = _loaded_scheduler(mode="protect")
    too_long = tiny.add_request(Request("long", tiny.config.max_model_len, SamplingParams(), 0.0), 0.0)
    assert too_long is not None and too_long.reason == "too_long"


def test_admission_mode_is_validated_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"admission.mode='queue' is unknown; use 'slo'"):
        AdmissionConfig(mode="queue")
