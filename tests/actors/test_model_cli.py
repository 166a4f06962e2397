"""`tidal generate` and `tidal profile` end to end on CPU (SmolLM2 and the tiny config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import model_helpers  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
from tidal_cli import main


def test_generate_json_raw_and_chat(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--json", "--max-tokens", "6", "--max-model-len", "256",
                 "--prompt", "The capital of France is", "--prompt", "1, 2, 3,"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "1, 2, 3,"]
    for r in rows:
        assert set(r) == {"prompt", "text", "token_ids", "finish_reason"}
        assert 1 <= len(r["token_ids"]) <= 6 and r["finish_reason"] in ("stop", "length")
    assert main(["generate", "--json", "--chat", "--max-tokens", "12", "--max-model-len", "256",
                 "--prompt", "What is the capital of France?"]) == 0
    chat = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in chat["text"]


def test_profile_tiny_writes_a_loadable_cost_model(tmp_path: Path) -> None:
    from calibration.cost_model import CostModel

    out = tmp_path / "tiny.yaml"
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--threads", "1", "--out", str(out)]) == 0
    model = CostModel.load(out)
    assert model.coefficients.num_layers == 2 and model.tp == 1
    small = model.step_time_s(((32, 0),), 0, 0, None)
    large = model.step_time_s(((512, 0),), 0, 0, None)
    assert 0 < small <= large
    assert model.fit["points"], "every measured step is reported with its error"
