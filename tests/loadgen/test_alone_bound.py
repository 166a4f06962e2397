"""benchmarks/alone_bound.py: every arrival judged with nothing ahead, per prompt-length bin."""

from __future__ import annotations

import ast

import numpy as np
import pytest

from benchmarks.alone_bound import main, table
from tidal_core.admission import AdmissionController


def test_the_rows_count_what_admission_saw_and_the_check_is_restored(capsys: pytest.CaptureFixture[str]) -> None:
    check = AdmissionController.check
    # Ten minutes of Mooncake at its recorded rate: the A100 unit is in OVERLOAD, and prompts too
    # slow alone are refused; every such refusal is of a request with nothing ahead.
    assert main(["--trace", "mooncake-conv", "--rate", "1", "--hours", "0.17", "--bin", "2000"]) == 0
    assert AdmissionController.check is check
    out = capsys.readouterr().out.splitlines()
    refused = ast.literal_eval(out[0].split("rejected ", 1)[1])
    rows = [line.split("|")[1:-1] for line in out[3:]]
    assert rows and all(r[0].strip().split("-")[0].isdigit() for r in rows)
    nothing_ahead, admitted, too_slow = (sum(int(r[i]) for r in rows) for i in (1, 2, 3))
    assert too_slow == refused.get("prompt_over_target", 0) > 0
    assert 0 < admitted < nothing_ahead
    # Long prompts are the ones refused as too slow alone, short ones never.
    assert int(rows[0][3]) == 0 and int(rows[-1][3]) > 0


def test_table_bins_by_length_and_reads_measured_over_bound() -> None:
    seen = {"0": (500, 0.2, 1.0, None), "1": (1500, 0.5, 1.0, None), "2": (1700, 1.5, 1.0, "prompt_over_target"),
            "3": (1900, 0.5, 1.0, None)}
    ttft = np.array([0.3, 0.4, np.nan, 1.2])
    rows = table(seen, ttft, 1.0, 1000)
    assert rows[2].startswith("| 0-999 | 1 | 1 | 0 |") and rows[2].endswith("| 1 |")
    # 1000-1999: three seen, two admitted (0.8 and 2.4 of their bound), one refused; one within 1 s.
    assert rows[3].startswith("| 1000-1999 | 3 | 2 | 1 | 0.500 | 1.000 |")
    assert "| 0.96 / 1.60 / 2.24 |" in rows[3] and rows[3].endswith("| 1 |")
