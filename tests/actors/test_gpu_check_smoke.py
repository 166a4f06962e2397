"""benchmarks/gpu_check.sh end to end in its CPU smoke mode (the tiny config): every stage runs,
every file RESULTS.md quotes is written, and the GPU goals are reported as not measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_writes_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in ("tests", "engine", "profile", "report"):
        assert f"== {stage}: exit 0" in run.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"gpu_tests.log", "engine.json", "profile.json", "costmodel.yaml",
                                                   "gpu_check.md"}
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert [(r["batch"], r["context"]) for r in engine["decode"]] == [(b, c) for c in (24, 60) for b in (1, 2, 4)]
    assert all(r["eager_ms"] > 0 and r["bound_ms"] > 0 for r in engine["decode"])
    assert [r["tokens"] for r in engine["prefill"]] == [16, 64] and engine["attention"] == "portable"
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["points"] and profile["heldout_max_abs_rel_error"] is not None
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "bandwidth bound: not measured" in summary and "identical: not measured" in summary
    assert "skipped" in summary  # the GPU tests, without CUDA


def test_gpu_check_plans_fit_their_engine() -> None:
    """The GPU plan is checked here, so no step of the one GPU run fails on a position or step size."""
    import pytest

    from benchmarks.gpu_check import FULL, SMOKE, check_plan

    check_plan(FULL)
    check_plan(SMOKE)
    assert FULL["model"] == "llama-3-8b" and 64 in FULL["batches"] and 4096 in FULL["contexts"]
    with pytest.raises(ValueError, match="max_model_len"):
        check_plan({**FULL, "prefill": (16384,)})
    with pytest.raises(ValueError, match="step_tokens"):
        check_plan({**FULL, "step_tokens": 32})
