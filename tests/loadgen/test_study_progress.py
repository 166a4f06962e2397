"""`tidal study`'s constant-rate sweep shows its progress, and `--quiet` silences it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import loadgen.sim.study as study
from calibration.cost_model import CostModel
from loadgen.report import Slo
from loadgen.sim.runner import unit_config


@pytest.mark.parametrize("progress", [True, False])
def test_the_sweep_has_a_bar_over_its_runs_unless_quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], progress: bool) -> None:
    monkeypatch.setattr(study, "SWEEP_LOADS", (0.5,))
    monkeypatch.setattr(study, "POLICIES", ("continuous", "adaptive"))
    cost = CostModel.load("a100-llama70b-tp8")
    study.run_sweep(tmp_path, cost, unit_config(cost), Slo(), seed=0, minutes=0.5, progress=progress)
    err = capsys.readouterr().err
    assert ("constant-rate sweep" in err and "2/2" in err) is progress
    assert ("constant-rate sweep" not in err and "req" not in err) is not progress
    curves = json.loads((tmp_path / "sweep" / "curves.json").read_text())
    assert set(curves) == {"continuous", "adaptive"} and all(len(c) == 1 for c in curves.values())
