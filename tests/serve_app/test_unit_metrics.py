"""UnitMetrics feeds the batch class's metrics from a real scheduler: backlog gauges from the
snapshot, batch tokens and preemptions (by reason and class) as the change since the last
step, and latency histograms of interactive requests only. Ray's metric objects are replaced
by recorders (creating real ones needs a running Ray worker); everything else is real."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from serve_app import metric_defs as M
from serve_app import metrics as unit_metrics
from tests.helpers import FakeExecutor
from tidal_core import Request, Run, SamplingParams, Scheduler, SchedulerConfig, ServicePrior, preset
from tidal_core.service_class import ServiceClass

PRIOR = ServicePrior(step_overhead_s=0.005, prefill_s_per_token=0.0001, decode_s_per_seq=0.0002)


class _Recorder:
    def __init__(self, defn: M.MetricDef) -> None:
        self.defn = defn
        self.default_tags: dict[str, str] = {}
        self.incs: Counter[tuple[tuple[str, str], ...]] = Counter()
        self.value: float | None = None
        self.observed: list[float] = []

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.default_tags = dict(tags)

    def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        full = {**self.default_tags, **(tags or {})}
        assert set(full) == set(self.defn.tag_keys), f"{self.defn.name}: tags {full} vs {self.defn.tag_keys}"
        return tuple(sorted(full.items()))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value > 0
        self.incs[self._key(tags)] += value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._key(tags)
        self.value = value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._key(tags)
        self.observed.append(value)


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> unit_metrics.UnitMetrics:
    monkeypatch.setattr(unit_metrics, "_make", _Recorder)
    return unit_metrics.UnitMetrics("u0", gauge_period_s=0.0)


def _scheduler() -> Scheduler:
    base = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=512, max_model_len=1024, block_size=16,
                           num_kv_blocks=512, service_prior=PRIOR)
    cfg = preset("adaptive", base)
    return Scheduler(dataclasses.replace(cfg, admission=dataclasses.replace(cfg.admission, target_ttft_s=0.5,
                                                                            target_tpot_s=0.02)))


def _req(rid: str, prompt: int, out: int, now: float, cls: ServiceClass = ServiceClass.INTERACTIVE) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True), now, service_class=cls)


def _step(s: Scheduler, ex: FakeExecutor, m: unit_metrics.UnitMetrics, now: float) -> float:
    decision = s.schedule(now)
    assert isinstance(decision, Run)
    started = {rid for rid, r in s.requests.items() if r.first_token_s is not None}
    result = ex.execute(decision.plan)
    now += result.device_time_s
    s.on_step_done(decision.plan, result, now)
    m.on_step(s, decision.plan, result.device_time_s, result.device_time_s, now)
    for rid, req in s.requests.items():  # what the engine loop does for each request's first token
        if req.first_token_s is not None and rid not in started:
            m.on_first_token(req, now)
    return now


def _by(rec: Any, key: str) -> dict[str, float]:
    return {dict(k)[key]: v for k, v in rec.incs.items()}


def test_batch_backlog_tokens_and_preemptions_by_class(metrics: unit_metrics.UnitMetrics) -> None:
    s, ex, now, m = _scheduler(), FakeExecutor(), 0.0, metrics
    rec = m._m
    for i in range(8):
        s.add_request(_req(f"b{i}", 40, 400, now, ServiceClass.BATCH), now)
    for _ in range(20):
        now = _step(s, ex, m, now)
    snap = s.snapshot(now, "u0")
    assert snap.batch_running == 4 and snap.batch_waiting == 4
    assert (rec[M.BATCH_WAITING.name].value, rec[M.BATCH_BACKLOG_TOKENS.name].value,
            rec[M.BATCH_RUNNING.name].value) == (snap.batch_waiting, snap.batch_backlog_tokens, snap.batch_running)
    tokens = _by(rec[M.BATCH_TOKENS.name], "kind")
    assert tokens == {"prompt": s.stats.num_batch_prompt_tokens_computed,
                      "generation": s.stats.num_batch_generated_tokens}
    assert tokens["prompt"] == 160 and tokens["generation"] > 4 * 10
    assert rec[M.TTFT.name].observed == [] and rec[M.PROMPT_TOKENS.name].incs  # batch: tokens, no latency
    assert not rec[M.PREEMPTIONS.name].incs

    s.add_request(_req("i0", 40, 4, now), now)  # interactive demand returns: a batch request yields its slot
    now = _step(s, ex, m, now)
    now = _step(s, ex, m, now)
    preempted = rec[M.PREEMPTIONS.name].incs
    assert dict(preempted) == {(("class", "batch"), ("reason", "batch_yield"), ("unit", "u0")): 1}
    assert len(rec[M.TTFT.name].observed) == 1  # the interactive request's first token
    assert _by(rec[M.BATCH_TOKENS.name], "kind")["generation"] == s.stats.num_batch_generated_tokens


def test_interactive_kv_preemptions_keep_their_class(metrics: unit_metrics.UnitMetrics) -> None:
    base = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=512, max_model_len=384, block_size=16,
                           num_kv_blocks=24, service_prior=PRIOR)
    s, ex, now, m = Scheduler(preset("adaptive", base)), FakeExecutor(), 0.0, metrics
    for i in range(4):  # four long decodes on a tiny KV pool: they outgrow it
        s.add_request(_req(f"i{i}", 32, 300, now), now)
    for _ in range(200):
        if not s.decodes.reqs and not s.waiting and not s.prefilling:
            break
        now = _step(s, ex, m, now)
    assert s.stats.preempted["kv_exhausted"] > 0
    assert _by(m._m[M.PREEMPTIONS.name], "class") == {"interactive": s.stats.preempted["kv_exhausted"]}
    assert not m._m[M.BATCH_TOKENS.name].incs


def test_the_step_sizer_gauges_show_its_aim_and_borrow_scale(metrics: unit_metrics.UnitMetrics) -> None:
    s, m = _scheduler(), metrics
    m.refresh_gauges(s, 0.0)
    assert m._m[M.TPOT_AIM.name].value == pytest.approx(0.02 * 0.95)  # the TPOT target x the starting headroom
    assert m._m[M.BORROW_SCALE.name].value == 1.0
    assert s.sizer is not None
    s.sizer.on_step_done(0.0, 0)
    s.sizer.on_decode_start("late")
    s.sizer.on_step_done(0.1, 1)  # one token 100 ms after the first: 5x the 20 ms target
    s.sizer.on_request_end("late", 2)
    m.refresh_gauges(s, 0.2)
    assert m._m[M.BORROW_SCALE.name].value < 1.0 and m._m[M.TPOT_AIM.name].value < 0.02 * 0.95


def test_the_overload_prefill_cap_gauge_shows_what_the_step_limits_learned(metrics: unit_metrics.UnitMetrics) -> None:
    s, m = _scheduler(), metrics
    m.refresh_gauges(s, 0.0)
    assert m._m[M.OVERLOAD_PREFILL_CAP.name].value == 512  # max_num_batched_tokens: never lowered
    s.limits.slot_cap = 200.0  # as if an overload had held the batch at max_batch_size
    m.refresh_gauges(s, 0.1)
    assert m._m[M.OVERLOAD_PREFILL_CAP.name].value == 200.0


def test_the_slow_prompt_ratio_gauge_follows_what_admission_learned(metrics: unit_metrics.UnitMetrics) -> None:
    s, ex, now, m = _scheduler(), FakeExecutor(), 0.0, metrics
    s.add_request(_req("a", 40, 4, now), now)
    now = _step(s, ex, m, now)
    m.refresh_gauges(s, now)
    assert m._m[M.SLOW_PROMPT_RATIO.name].value == 1.0  # nothing learned yet: the bound itself
    s.admission.alone.value = 1.7  # as if long prompts had taken 1.7x their bound
    m.refresh_gauges(s, now + 1.0)
    assert m._m[M.SLOW_PROMPT_RATIO.name].value == 1.7
