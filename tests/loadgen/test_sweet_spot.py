"""benchmarks/sweet_spot.py's `--against`: the policy alone, re-run on stored cells, compared with
their stored best budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sweet_spot import against, cell
from loadgen.report import Slo

SLO = Slo(1.0, 0.1)


def _stored(tmp_path: Path) -> Path:
    # A short window that starts 3 minutes in: `against` must replay that window, not the first one.
    c = cell("a100-llama70b-tp8", "azure-conv", 1.0, 0.02, (256, 2048), SLO, offset_min=3.0, eager=False)
    path = tmp_path / "cells.json"
    path.write_text(json.dumps([c]))
    return path


def test_against_reproduces_the_stored_run_and_sees_an_override(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    stored = json.loads(path.read_text())[0]
    assert stored["offset_min"] == 3.0 and stored["hours"] == 0.02

    same = against([path], SLO, "adaptive", {}, jobs=1)
    assert len(same) == 1
    assert same[0]["ratio"] == stored["ratio"] and same[0]["best"] == stored["best"]
    assert same[0]["run"] == stored["runs"]["adaptive"]

    # The override reaches the run: with step sizing off no step is held back by the TPOT banks,
    # and the run differs from the stored one (whose steps were).
    assert stored["runs"]["adaptive"]["steps"]["tpot_limited"] > 0
    off = against([path], SLO, "adaptive", {"step_sizing.enabled": "false"}, jobs=1)
    assert off[0]["run"]["steps"]["tpot_limited"] == 0 and off[0]["run"] != same[0]["run"]
    assert off[0]["stored_ratio"] == stored["ratio"]
    # Which answers missed TPOT: their output lengths, present exactly when some did (the fixed
    # budgets of this window miss TPOT for some requests, adaptive for none).
    assert stored["runs"]["sarathi-2048"]["tpot_missed"] > 0 and same[0]["run"]["tpot_missed"] == 0
    for run in (same[0]["run"], off[0]["run"], *(stored["runs"][k] for k in ("sarathi-256", "sarathi-2048"))):
        lengths = run["tpot_missed_output_tokens"]
        assert (lengths is None) == (run["tpot_missed"] == 0)
        assert lengths is None or 2 <= lengths[0] <= lengths[1] <= lengths[2]


def test_against_refuses_cells_that_do_not_say_their_window(tmp_path: Path) -> None:
    stored = json.loads(_stored(tmp_path).read_text())[0]
    del stored["offset_min"]  # as files written before cells recorded their window
    old = tmp_path / "old.json"
    old.write_text(json.dumps([stored]))
    with pytest.raises(SystemExit, match="without their window"):
        against([old], SLO, "adaptive", {}, jobs=1)
