"""tidal compare on a replay directory and a simulator-style directory; the CLI wiring; purity."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadgen.cli import parse_duration, register
from loadgen.client import ClientConfig
from loadgen.compare import compare, load_run_dir
from loadgen.records import Trace
from loadgen.replay import ReplayConfig, replay
from loadgen.report import OK, REJECTED, RunOutcomes, Slo, per_hour, summarize, write_json
from tests.loadgen.replay_fake_server import Behavior, FakeServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("runs") / "real"
    trace = Trace("t", np.arange(12) / 30.0, [20] * 12, [3] * 12, duration_s=0.4)
    with FakeServer(Behavior(first_token_delay_s=0.01, reject_every=4)) as srv:
        replay(trace, ClientConfig(srv.url, model="m"), ReplayConfig(progress=False, plots=False), out)
    yield out


def _sim_dir(path: Path) -> Path:
    """A directory shaped like `tidal simulate`'s: two policies, per-hour rows, per-request lines."""
    path.mkdir(parents=True, exist_ok=True)
    summaries, hours = {}, {}
    for k, policy in enumerate(("adaptive", "eager")):
        n = 8
        out = RunOutcomes(np.arange(n) / 20.0, np.full(n, 20), np.full(n, 3), np.array([OK] * 7 + [REJECTED], np.int8),
                          np.r_[np.linspace(0.05, 0.2 + k, 7), np.nan], np.r_[np.linspace(0.2, 0.6 + k, 7), np.nan],
                          0.4, gpu_hours=0.001)
        summaries[policy], hours[policy] = summarize(out, Slo()), per_hour(out, Slo())
        lines = [json.dumps({"index": i, "status": "ok" if out.status[i] == OK else "rejected",
                             "ttft_s": None if np.isnan(out.ttft_s[i]) else float(out.ttft_s[i])}) for i in range(n)]
        (path / f"{policy}.requests.jsonl").write_text("\n".join(lines) + "\n")
    write_json(path / "summary.json", summaries)
    write_json(path / "per_hour.json", hours)
    return path


def test_load_run_dir_reads_replays_and_simulations(replay_dir: Path, tmp_path: Path) -> None:
    (real,) = load_run_dir(replay_dir)
    assert real.label == "real/replay" and real.summary["arrived"] == 12 and len(real.hours) == 1
    assert real.ttft_s is not None and real.ttft_s.size == real.summary["completed"] == 9
    sim = load_run_dir(_sim_dir(tmp_path), label="sim")
    assert [r.label for r in sim] == ["sim/adaptive", "sim/eager"]
    assert all(r.ttft_s is not None and r.ttft_s.size == 7 for r in sim)
    with pytest.raises(FileNotFoundError, match=r"summary\.json"):
        load_run_dir(tmp_path / "nothing")


def test_compare_two_dirs_writes_table_and_overlaid_plots(replay_dir: Path, tmp_path: Path) -> None:
    sim = _sim_dir(tmp_path / "sim")
    out = tmp_path / "cmp"
    text = compare([replay_dir, sim], out)
    assert (out / "compare.md").read_text() == text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 4  # header + one row per run
    assert {line.split("|")[1].strip() for line in table[1:]} == {"real/replay", "sim/adaptive", "sim/eager"}
    replay_row = next(line for line in table if "real/replay" in line)
    assert "| 12 | 9 | 3 |" in replay_row  # arrived, completed, rejected
    for png in ("ttft_cdf.png", "ttft_p99_per_hour.png", "goodput_per_hour.png"):
        assert (out / png).stat().st_size > 1000


def test_same_named_dirs_get_their_paths_as_labels(replay_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "b" / "real"
    other.mkdir(parents=True)
    (other / "summary.json").write_text((replay_dir / "summary.json").read_text())
    text = compare([replay_dir, other], tmp_path / "cmp", plot=False)
    assert f"{other}/replay" in text and f"{replay_dir}/replay" in text


def test_cli_registers_replay_compare_and_the_simulator(tmp_path: Path, replay_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tidal")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    assert {"replay", "compare", "simulate", "study"} <= set(sub.choices)
    args = parser.parse_args(["replay", "--url", "http://127.0.0.1:1", "--trace", "azure-conv", "--out", "o",
                              "--duration", "15m", "--time-scale", "0.1", "--endpoint", "chat"])
    assert args.duration == 900.0 and args.time_scale == 0.1 and args.words_per_token is None
    args = parser.parse_args(["compare", str(replay_dir), "--out", str(tmp_path / "c"), "--no-plots"])
    assert args.func(args) == 0 and "real/replay" in capsys.readouterr().out
    bad = parser.parse_args(["replay", "--url", "http://127.0.0.1:1", "--trace", "no-such-trace", "--out", "o",
                             "--model", "m"])
    assert bad.func(bad) == 2


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("1.5h", 5400.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_nonsense() -> None:
    for text in ("", "0", "-3", "5d", "m"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(text)


def test_replay_modules_stay_free_of_the_server_stack() -> None:
    """Works with any OpenAI server: the replay side of loadgen loads none of serve_app, actors, ray, torch."""
    modules = ["loadgen.client", "loadgen.replay", "loadgen.replay_results", "loadgen.progress", "loadgen.compare",
               "loadgen.cli", "loadgen.report", "loadgen.plots", "loadgen.traces"]
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
            "print(','.join(m for m in ('serve_app', 'actors', 'ray', 'torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == ""


def test_no_loadgen_source_outside_sim_imports_the_server() -> None:
    for path in sorted((REPO / "loadgen").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & {"serve_app", "actors"}, f"{path.name} imports {roots}"
