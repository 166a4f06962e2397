"""The calibrated cost model: monotone, cheap to call, faithful to the measured points it claims.

The fidelity bounds below are the ones docs/cost-model.md states: 10% on every point, except
the points listed in KNOWN_MISSES with the bound measured for them and the reason in the docs.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from calibration import measured as data
from calibration.cost_model import COSTMODEL_DIR, FORM_VERSION, CostCoefficients, CostModel, shipped_names
from tidal_core.config import ServicePrior
from tidal_core.plan import StepPlan

MODELS = ("a100-llama70b-tp8", "h100-llama70b-tp8", "a100-llama70b-tp4", "h100-llama70b-tp4")
GOAL = 0.10
KNOWN_MISSES: dict[tuple[str, str], float] = {
    # held out: the 4096-token steps sit in the large-step knee, which the training points do not place
    ("a100-llama70b-tp8", "prefill 1x4096"): 0.11,
    ("h100-llama70b-tp8", "prefill 1x4096"): 0.17,
    ("h100-llama70b-tp8", "prefill 8x512"): 0.14,
    ("a100-llama70b-tp4", "prefill 1x4096"): 0.15,
    ("a100-llama70b-tp4", "prefill 8x512"): 0.14,
    ("h100-llama70b-tp4", "prefill 1x4096"): 0.11,
    # training: A100 measures a batch of prompts far slower than one prompt of the same tokens
    ("a100-llama70b-tp8", "prefill 1x8192"): 0.18,
    ("a100-llama70b-tp8", "prefill 16x512"): 0.17,
    ("a100-llama70b-tp4", "prefill 1x8192"): 0.18,
    ("a100-llama70b-tp4", "prefill 16x512"): 0.14,
    ("a100-llama70b-tp4", "prefill 1x2048"): 0.14,
    ("a100-llama70b-tp4", "prefill 4x512"): 0.22,  # bimodal repeats (450-475 and 571-587 ms)
    # training: H100 prefill of 128-512 tokens is flat and noisy in the data
    ("h100-llama70b-tp8", "prefill 1x512"): 0.11,
    ("h100-llama70b-tp4", "prefill 1x512"): 0.14,
}


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> CostModel:
    return CostModel.load(request.param)


# ---- monotonicity --------------------------------------------------------------------------------
@pytest.mark.parametrize("host", [True, False])
def test_monotone_in_every_input(model: CostModel, host: bool) -> None:
    m = model if host else model.device_only()
    tokens = (1, 7, 64, 300, 1000, 2048, 3000, 4096, 6000, 8192, 20000)
    contexts = (0, 100, 1000, 4000, 16000)
    decodes = (0, 1, 2, 5, 16, 63, 64, 128, 256)
    for ctx, d in itertools.product(contexts, decodes):
        times = [m.step_time_s(((n, ctx),), d, 500 * d, None) for n in tokens]
        assert times == sorted(times), f"prefill tokens at ctx={ctx}, decodes={d}"
    for n, d in itertools.product(tokens, decodes):
        times = [m.step_time_s(((n, c),), d, 500 * d, None) for c in contexts]
        assert times == sorted(times), f"prefill context at n={n}, decodes={d}"
    for n, c in itertools.product((0, 64, 2048), (0, 1000, 100000, 1000000)):
        chunks = ((n, 0),) if n else ()
        times = [m.step_time_s(chunks, d, c, None) for d in range(0, 300, 3)]
        assert times == sorted(times), f"decode batch at prefill={n}, decode context={c}"
        times = [m.step_time_s(chunks, 1 + c % 5, s, None) for s in range(0, 2_000_000, 50_000)]
        assert times == sorted(times), "decode context"
    for d, c, n in itertools.product((1, 3, 8, 40), (100, 100000), (0, 1, 100)):
        chunks = ((n, 0),) if n else ()
        times = [m.step_time_s(chunks, d, c, p) for p in (None, d, 8, 64, 128, 256) if p is None or p >= d]
        assert times == sorted(times), f"padded batch at decodes={d}"
        padded = [m.step_time_s(((k, 0),) if k else (), d, c, 64) for k in (0, 1, 10, 100, 1000)]
        assert padded == sorted(padded), "prefill tokens on a padded step"


def test_chunks_add_up_and_plan_matches_step_args(model: CostModel) -> None:
    """plan_time_s reads the same figures from a StepPlan as step_time_s takes as arguments."""
    sched = {"d0": 1, "d1": 1, "d2": 1, "p0": 300, "p1": 40}
    plan = StepPlan(7, sched, {"p0": 1000, "p1": 0}, [], {}, [], 3, 340, 3 * 777, None)
    expected = model.step_time_s(((300, 1000), (40, 0)), 3, 3 * 777, None)
    assert model.plan_time_s(plan) == pytest.approx(expected, rel=1e-12)
    pure = StepPlan(8, {"d0": 1, "d1": 1, "d2": 1}, {}, [], {}, [], 3, 0, 999, 4)
    assert model.plan_time_s(pure) == pytest.approx(model.step_time_s((), 3, 999, 4), rel=1e-12)
    assert model.plan_time_s(pure) > model.step_time_s((), 3, 999, None)  # the bucket of 4 costs more than 3
    assert model.step_time_s((), 0, 0, None) == 0.0


def test_device_only_is_below_the_full_step_and_keeps_device_work(model: CostModel) -> None:
    dev = model.device_only()
    assert not dev.include_host and model.include_host
    for args in (((), 1, 1000, 1), (((2048, 0),), 0, 0, None), (((512, 3000),), 64, 64000, None)):
        assert 0 < dev.step_time_s(*args) < model.step_time_s(*args)


def test_service_prior_is_a_sane_linearisation(model: CostModel) -> None:
    prior = model.service_prior()
    assert isinstance(prior, ServicePrior)
    one_decode = model.step_time_s((), 1, 1024, 1)
    assert 0.5 * one_decode < prior.step_overhead_s < 1.5 * one_decode
    big = model.step_time_s(((2048, 0),), 0, 0, None)
    linear = prior.step_overhead_s + 2048 * prior.prefill_s_per_token
    assert abs(linear / big - 1) < 0.35
    assert prior.decode_s_per_seq > 0


# ---- persistence -----------------------------------------------------------------------------------
def test_round_trip_and_load_by_name_or_path(model: CostModel, tmp_path: Path) -> None:
    again = CostModel.from_dict(model.to_dict())
    assert again.coefficients == model.coefficients and again.tp == model.tp and again.gpu == model.gpu
    by_path = CostModel.load(COSTMODEL_DIR / f"{model.name}.yaml")
    assert by_path.coefficients == model.coefficients
    args = (((1000, 500),), 12, 12 * 900, None)
    assert by_path.step_time_s(*args) == model.step_time_s(*args)


def test_bad_names_versions_and_values_are_refused() -> None:
    with pytest.raises(FileNotFoundError, match="known names") as refused:
        CostModel.load("no-such-model")
    names = shipped_names()
    assert {"a100-llama70b-tp8", "h100-llama70b-tp4"} <= set(names) and str(names) in str(refused.value)
    assert all(CostModel.load(n).name == n for n in names)  # every shipped name loads by that name
    d = CostModel.load("a100-llama70b-tp8").to_dict()
    with pytest.raises(ValueError, match="form_version"):
        CostModel.from_dict({**d, "form_version": FORM_VERSION + 1})
    with pytest.raises(ValueError, match="host_floor_ms"):
        CostCoefficients.from_dict({**d["coefficients"], "host_floor_ms": -1.0})
    with pytest.raises(ValueError, match="missing"):
        CostCoefficients.from_dict({k: v for k, v in d["coefficients"].items() if k != "per_seq_ms"})


def test_run_time_modules_are_pure() -> None:
    code = ("import sys; from calibration.cost_model import CostModel; import calibration.sim_executor; "
            "CostModel.load('a100-llama70b-tp8'); "
            "print(','.join(m for m in ('numpy', 'torch', 'ray', 'transformers', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the cost model loaded {out.stdout.strip()}"


# ---- fidelity --------------------------------------------------------------------------------------
def test_every_measured_point_within_the_documented_bound(model: CostModel) -> None:
    stored = {(r["kind"], r["batch"], r["prompt"]): r for r in model.fit["points"]}
    points = data.splitwise_points(model.gpu, model.tp)
    assert len(points) == len(stored) == 26
    assert sum(p.held_out for p in points) == 12
    for p in points:
        err = model.step_time_s(*p.step_args()) * 1e3 / p.measured_ms - 1.0
        bound = KNOWN_MISSES.get((model.name, p.label), GOAL)
        assert abs(err) <= bound, f"{model.name} {p.label} ({'held out' if p.held_out else 'train'}): {err:+.1%}"
        row = stored[(p.kind, p.batch, p.prompt)]
        assert row["set"] == ("held-out" if p.held_out else "train")
        assert row["rel_error"] == pytest.approx(err, abs=2e-4), "the YAML's error table is stale"


def test_known_misses_are_still_misses() -> None:
    """A bound above the goal must not outlive the miss it documents."""
    for (name, label), bound in KNOWN_MISSES.items():
        m = CostModel.load(name)
        row = next(r for r in m.fit["points"] if f"{r['kind']} {r['batch']}x{r['prompt']}" == label)
        assert GOAL < abs(row["rel_error"]) <= bound, f"{name} {label}: {row['rel_error']:+.1%} vs bound {bound}"


def test_fit_reproduces_the_committed_coefficients() -> None:
    pytest.importorskip("numpy")
    from calibration.fit import fit_cost_model

    for name in MODELS:
        committed = CostModel.load(name)
        refit = fit_cost_model(committed.gpu, committed.tp)
        for key, value in committed.coefficients.to_dict().items():
            assert getattr(refit.coefficients, key) == pytest.approx(value, rel=1e-3, abs=1e-9), f"{name}.{key}"
        for a, b in zip(refit.fit["points"], committed.fit["points"], strict=True):
            assert a["predicted_ms"] == pytest.approx(b["predicted_ms"], rel=1e-3), f"{name} {a}"


# ---- the profiled GPU model (tidal profile on an H200: benchmarks/gpu_check.sh) --------------------
PROFILED = "h200-llama-3-8b-tp1-profiled"


def test_profiled_model_reproduces_its_recorded_fit() -> None:
    """The shipped YAML's error table is what the current form computes from its coefficients (its
    decode points were replayed from CUDA graphs, padded to their own batch), and it met the goal."""
    m = CostModel.load(PROFILED)
    assert m.coefficients.graph_host_floor_ms is not None
    assert len(m.fit["points"]) == 16 and m.fit["heldout_max_abs_rel_error"] <= GOAL
    for row in m.fit["points"]:
        graph = row["kind"] == "decode"
        point = data.MeasuredPoint(row["kind"], row["prompt"], row["batch"], row["measured_ms"], row["repeats"],
                                   row["set"] == "held-out", graph=graph)
        predicted = m.step_time_s(*point.step_args()) * 1e3
        assert predicted == pytest.approx(row["predicted_ms"], rel=1e-3), row
        assert abs(predicted / row["measured_ms"] - 1) <= GOAL, row


def test_graph_host_floor_applies_to_graph_steps_only() -> None:
    m = CostModel.load(PROFILED)
    eager, graph = m.step_time_s((), 1, 600, None), m.step_time_s((), 1, 600, 1)
    assert graph < eager  # a replay pays no per-kernel launches
    assert m.step_time_s(((128, 0),), 0, 0, None) > graph
    d = m.to_dict()
    without = CostModel.from_dict({**d, "coefficients": {k: v for k, v in d["coefficients"].items()
                                                         if k != "graph_host_floor_ms"}})
    assert without.coefficients.graph_host_floor_ms is None and "graph_host_floor_ms" not in without.to_dict()[
        "coefficients"]
    assert without.step_time_s((), 1, 600, 1) >= eager  # without it, a graph step pays the eager floor
    for padded in (None, 64):  # monotone in the batch and the context, eager and replayed alike
        times = [m.step_time_s((), b, 600 * b, padded and max(padded, b)) for b in range(1, 257, 5)]
        assert times == sorted(times)
        times = [m.step_time_s((), 8, c, padded) for c in range(0, 500_000, 25_000)]
        assert times == sorted(times)
    with pytest.raises(ValueError, match="graph_host_floor_ms"):
        CostCoefficients.from_dict({**d["coefficients"], "graph_host_floor_ms": -1.0})
