"""`tidal simulate --batch-backlog`: a tiny sharp-day run with a backlog at 00:00, the interactive
and batch figures reported apart, the comparison runs, and the options' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.sim.backlog import clock_s
from tidal_cli import main as tidal

BASE = ["simulate", "--trace", "day-in-life-sharp", "--hours", "0.02", "--policy", "adaptive", "--quiet",
        "--no-requests"]


def test_backlog_run_reports_interactive_and_batch_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert tidal([*BASE, "--batch-backlog", "12", "--batch-lengths", "azure-code", "--batch-at", "00:00",
                  "--batch-due", "00:30", "--batch-compare", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"adaptive", "adaptive-no-batch-class", "adaptive-day"}
    day, flex, plain = summary["adaptive-day"], summary["adaptive"], summary["adaptive-no-batch-class"]
    assert "batch_arrived" not in day
    assert flex["arrived"] == plain["arrived"] == day["arrived"] > 0  # the SLO figures count interactive only
    for s in (flex, plain):
        assert s["batch_arrived"] == 12
        assert s["batch_completed"] + s["batch_refused"] + s["batch_lost"] == 12
        assert s["batch_done_by_due"] <= s["batch_completed"] and s["batch_due_s"] == 1800.0
    assert flex["batch_lost"] == 0 and flex["batch_completed"] + flex["batch_refused"] == 12
    assert flex["batch_completed"] > 0 and flex["batch_tokens"] > 0
    printed = capsys.readouterr().out
    assert "batch backlog (12 requests at 00:00, due 00:30" in printed
    table = (out / "batch.md").read_text()
    assert table in printed and "| adaptive-no-batch-class |" in table and "adaptive-day" not in table


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch-backlog", "5", "--batch-at", "8:5"], "HH:MM"),
    (["--batch-backlog", "5", "--batch-at", "02:00", "--batch-due", "01:00"], "must be after"),
    (["--batch-backlog", "-1"], ">= 0")])
def test_bad_backlog_options_fail_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 extra: list[str], message: str) -> None:
    assert tidal([*BASE, *extra, "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_clock_times() -> None:
    assert clock_s("00:00") == 0.0 and clock_s("08:00") == 28800.0 and clock_s("26:30") == 95400.0
    for bad in ("8", "08:60", "49:00", "ab:cd", "08:5"):
        with pytest.raises(ValueError, match="HH:MM"):
            clock_s(bad)
