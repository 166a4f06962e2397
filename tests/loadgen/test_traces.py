"""Trace readers, the Trace transforms, JSONL round trips and load_trace.

Fixtures are hand-written files under tests/fixtures/traces/; the shipped real traces are read
end to end and checked against the tables in their SOURCE.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadgen.records import Trace, TraceRecord
from loadgen.traces import (
    NAMED_TRACES,
    load_trace,
    read_azure_csv,
    read_burstgpt_csv,
    read_jsonl,
    read_mooncake_jsonl,
    read_trace_file,
    write_jsonl,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def small_trace(**kw: object) -> Trace:
    return Trace("t", [0.0, 1.0, 1.5, 4.0, 9.0], [10, 20, 30, 40, 50], [1, 2, 3, 4, 5], duration_s=10.0,
                 source="test", **kw)  # type: ignore[arg-type]


# -- readers on fixtures ------------------------------------------------------------------------
def test_azure_reader_parses_fractional_seconds_and_time_of_day() -> None:
    trace = read_azure_csv(FIXTURES / "azure_small.csv")
    assert len(trace) == 5
    np.testing.assert_allclose(trace.arrival_s, [0.0, 4.314579, 4.31941, 60.0, 73.5], atol=1e-9)
    assert trace.input_tokens.tolist() == [374, 396, 879, 1200, 91]
    assert trace.output_tokens.tolist() == [44, 109, 31, 250, 7]
    assert trace.duration_s == pytest.approx(73.5)
    assert trace.offset_s == pytest.approx(18 * 3600 + 15 * 60 + 46.68059)  # 18:15:46.68059
    assert "Azure" in trace.source


def test_azure_reader_handles_time_zone_offsets_and_unsorted_rows() -> None:
    trace = read_azure_csv(FIXTURES / "azure_2024_tz.csv")
    # 02:00:01+02:00 is 00:00:01 UTC, so it arrives second.
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.75, 2.75])
    assert trace.input_tokens.tolist() == [100, 200, 300]
    assert trace.offset_s == pytest.approx(0.25)


def test_mooncake_reader_converts_milliseconds() -> None:
    trace = read_mooncake_jsonl(FIXTURES / "mooncake_small.jsonl")
    assert trace.arrival_s.tolist() == [0.0, 0.0, 1.5, 3.25]
    assert trace.input_tokens.tolist() == [6758, 2290, 900, 12000]
    assert trace.output_tokens.tolist() == [500, 316, 1, 77]


def test_burstgpt_reader_drops_failures_and_rebases() -> None:
    trace = read_burstgpt_csv(FIXTURES / "burstgpt_small.csv")
    assert trace.arrival_s.tolist() == [0, 40, 113, 126, 255, 256, 295, 407]
    assert trace.offset_s == 5.0  # the first kept row's own Timestamp
    assert 0 not in trace.output_tokens.tolist()
    assert len(read_burstgpt_csv(FIXTURES / "burstgpt_small.csv", drop_failed=False)) == 10


@pytest.mark.parametrize(("model", "log_type", "expected_arrivals", "expected_inputs"), [
    ("ChatGPT", "conversation", [0, 40, 255, 295], [472, 1087, 35, 1528]),
    (None, "API log", [0, 130, 281], [84, 988, 97]),
    ("gpt-4", "api", [0], [988]),
    ("GPT-4", None, [0, 143], [417, 988]),
])
def test_burstgpt_filters(model: str | None, log_type: str | None, expected_arrivals: list[float],
                          expected_inputs: list[int]) -> None:
    trace = read_burstgpt_csv(FIXTURES / "burstgpt_small.csv", model=model, log_type=log_type)
    assert trace.arrival_s.tolist() == expected_arrivals
    assert trace.input_tokens.tolist() == expected_inputs


def test_burstgpt_filter_matching_nothing_gives_an_empty_trace() -> None:
    trace = read_burstgpt_csv(FIXTURES / "burstgpt_small.csv", model="GPT-5")
    assert len(trace) == 0
    assert trace.stats()["count"] == 0.0


@pytest.mark.parametrize(("fixture", "first_input"), [
    ("azure_small.csv", 374), ("azure_2024_tz.csv", 100), ("burstgpt_small.csv", 472),
    ("mooncake_small.jsonl", 6758), ("tidal_small.jsonl", 12),
])
def test_format_is_sniffed_from_header_or_keys(fixture: str, first_input: int) -> None:
    assert read_trace_file(FIXTURES / fixture).input_tokens[0] == first_input
    assert load_trace(str(FIXTURES / fixture)).input_tokens[0] == first_input


def test_unknown_formats_are_rejected(tmp_path: Path) -> None:
    bad_csv = tmp_path / "x.csv"
    bad_csv.write_text("a,b,c\n1,2,3\n")
    bad_jsonl = tmp_path / "x.jsonl"
    bad_jsonl.write_text('{"t": 1}\n')
    for path in (bad_csv, bad_jsonl, tmp_path / "x.txt"):
        if not path.exists():
            path.write_text("hello")
        with pytest.raises(ValueError):
            read_trace_file(path)
    with pytest.raises(ValueError, match="not an Azure trace"):
        read_azure_csv(FIXTURES / "burstgpt_small.csv")
    with pytest.raises(ValueError, match="not a BurstGPT trace"):
        read_burstgpt_csv(FIXTURES / "azure_small.csv")


# -- the shipped real traces, end to end, against data/*/SOURCE.md ---------------------------------
# (name, requests, mean req/s, input mean/p50/p90/p99, output mean/p50/p90/p99) from SOURCE.md.
SOURCE_TABLES = [
    ("azure-code", 8819, 2.57, (2048, 1469, 5187, 7436), (28, 13, 55, 251)),
    ("azure-conv", 19366, 5.53, (1155, 1020, 2734, 4142), (211, 129, 424, 601)),
    ("mooncake-conv", 12031, 3.40, (12035, 6909, 27367, 85400), (343, 350, 597, 1118)),
    ("mooncake-synthetic", 3993, 3.91, (15325, 11587, 38611, 66456), (149, 69, 389, 768)),
]


@pytest.mark.parametrize(("name", "count", "rate", "inp", "out"), SOURCE_TABLES)
def test_real_traces_match_their_source_tables(name: str, count: int, rate: float, inp: tuple[int, ...],
                                               out: tuple[int, ...]) -> None:
    trace = load_trace(name)
    stats = trace.stats()
    assert stats["count"] == count
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    assert stats["rate_rps"] == pytest.approx(rate, abs=0.01)
    for label, table in (("input", inp), ("output", out)):
        got = [stats[f"{label}_{k}"] for k in ("mean", "p50", "p90", "p99")]
        # The tables round to whole tokens (and may truncate percentiles): allow one token.
        assert got == pytest.approx(table, abs=1.0), label


def test_azure_traces_start_at_their_time_of_day() -> None:
    assert load_trace("azure-conv").offset_s == pytest.approx(18 * 3600 + 15 * 60 + 46.68059)
    assert load_trace("azure-code").duration_s / 60 == pytest.approx(57.3, abs=0.1)


# -- Trace basics ----------------------------------------------------------------------------------
def test_trace_is_immutable_and_sorted() -> None:
    trace = Trace("u", [3.0, 1.0, 2.0], [3, 1, 2], [30, 10, 20], request_ids=["c", "a", "b"])
    assert trace.arrival_s.tolist() == [1.0, 2.0, 3.0]
    assert trace.input_tokens.tolist() == [1, 2, 3]
    assert trace.request_ids == ("a", "b", "c")
    with pytest.raises(ValueError):
        trace.arrival_s[0] = 5.0
    with pytest.raises(AttributeError):
        trace.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("kw", [
    {"arrival_s": [-1.0]}, {"arrival_s": [float("nan")]}, {"input_tokens": [-1]}, {"duration_s": 0.5},
    {"input_tokens": [1, 2]},
])
def test_trace_rejects_bad_input(kw: dict[str, object]) -> None:
    args: dict[str, object] = {"arrival_s": [1.0], "input_tokens": [1], "output_tokens": [1], "duration_s": 1.0}
    args.update(kw)
    with pytest.raises(ValueError):
        Trace("bad", **args)  # type: ignore[arg-type]


def test_records_view_is_lazy_and_complete() -> None:
    trace = small_trace(prompts=[None, "p", None, None, None])
    records = trace.records
    assert len(records) == 5
    assert records[1] == TraceRecord(1.0, 20, 2, "p", None)
    assert records[-1] == TraceRecord(9.0, 50, 5)
    assert list(records) == [trace.record(i) for i in range(5)]
    assert records[1:3] == [trace.record(1), trace.record(2)]
    with pytest.raises(IndexError):
        records[5]
    assert Trace.from_records("t", list(records), duration_s=10.0, source="test") == trace


def test_stats_by_hand() -> None:
    stats = small_trace().stats()
    assert stats["count"] == 5
    assert stats["rate_rps"] == 0.5
    assert stats["input_mean"] == 30.0
    assert stats["input_p50"] == 30.0
    assert stats["output_p90"] == pytest.approx(4.6)


# -- transforms ------------------------------------------------------------------------------------
def test_time_scale_compresses_times_and_duration() -> None:
    trace = small_trace().scaled(time_scale=0.1)
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.1, 0.15, 0.4, 0.9])
    assert trace.duration_s == pytest.approx(1.0)
    assert trace.stats()["rate_rps"] == pytest.approx(5.0)
    assert trace.input_tokens.tolist() == [10, 20, 30, 40, 50]


def test_rate_scale_thins_a_random_seeded_subset() -> None:
    day = load_trace("azure-conv")
    half = day.scaled(rate_scale=0.5, seed=3)
    n = len(day)
    assert abs(len(half) - n / 2) < 5 * np.sqrt(n / 4)  # binomial, 5 sigma
    assert set(half.arrival_s.tolist()) <= set(day.arrival_s.tolist())  # thinning never moves a request
    assert half == day.scaled(rate_scale=0.5, seed=3)
    assert half != day.scaled(rate_scale=0.5, seed=4)
    assert half.duration_s == day.duration_s


def test_rate_scale_replicates_into_the_following_gap() -> None:
    trace = small_trace(request_ids=["a", "b", "c", "d", "e"])
    triple = trace.scaled(rate_scale=3.0, seed=1)
    assert len(triple) == 15
    assert np.all(np.diff(triple.arrival_s) >= 0)
    assert triple.request_ids is not None and sorted(triple.request_ids)[:3] == ["a", "a#1", "a#2"]
    for rid, t in zip(triple.request_ids, triple.arrival_s.tolist(), strict=True):
        i = "abcde".index(rid[0])
        upper = trace.arrival_s[i + 1] if i + 1 < 5 else trace.duration_s
        assert trace.arrival_s[i] <= t <= upper
    assert 10 <= len(trace.scaled(rate_scale=2.5, seed=1)) <= 15


def test_rate_scale_keeps_the_shape() -> None:
    day = load_trace("day-in-life-sharp", peak_rps=2.0, seed=5)
    double = day.scaled(rate_scale=2.0, seed=5)
    edges = np.arange(0, 86401, 3600)
    base, doubled = np.histogram(day.arrival_s, edges)[0], np.histogram(double.arrival_s, edges)[0]
    # Each replica lands in the gap after its original: hourly counts double up to boundary spill.
    assert np.all(np.abs(doubled - 2 * base) <= 0.02 * base + 10)


def test_clipped_caps_lengths_only() -> None:
    trace = small_trace().clipped(25, 3)
    assert trace.input_tokens.tolist() == [10, 20, 25, 25, 25]
    assert trace.output_tokens.tolist() == [1, 2, 3, 3, 3]
    assert np.array_equal(trace.arrival_s, small_trace().arrival_s)
    with pytest.raises(ValueError):
        small_trace().clipped(0, 3)


def test_window_rebases_and_keeps_the_offset() -> None:
    trace = small_trace()
    win = trace.window(1.0, 4.0)
    assert win.arrival_s.tolist() == [0.0, 0.5]  # [1, 4): 4.0 is excluded
    assert win.input_tokens.tolist() == [20, 30]
    assert win.duration_s == 3.0
    assert win.offset_s == 1.0
    tail = trace.window(5.0, 100.0)
    assert tail.arrival_s.tolist() == [4.0] and tail.duration_s == 5.0
    real = load_trace("azure-conv")
    assert len(real.window(0.0, real.duration_s)) == len(real)  # the last instant belongs to the last window
    with pytest.raises(ValueError):
        trace.window(3.0, 3.0)


# -- JSONL -----------------------------------------------------------------------------------------
def test_jsonl_round_trip_is_exact(tmp_path: Path) -> None:
    trace = load_trace("day-in-life", hours=0.5, peak_rps=5.0, seed=2)
    path = tmp_path / "day.jsonl"
    write_jsonl(trace, path)
    assert read_jsonl(path) == trace
    assert load_trace(str(path)) == trace


def test_jsonl_round_trip_with_prompts_and_ids(tmp_path: Path) -> None:
    trace = small_trace(prompts=["a \"quoted\"\nline", None, "", None, "é"], request_ids=["x", None, "y", "z", "w"])
    write_jsonl(trace, tmp_path / "t.jsonl")
    assert read_jsonl(tmp_path / "t.jsonl") == trace


def test_jsonl_fixture_without_header_defaults(tmp_path: Path) -> None:
    trace = read_jsonl(FIXTURES / "tidal_small.jsonl")
    assert (trace.name, trace.duration_s, trace.source) == ("tiny", 10.0, "hand-written fixture")
    assert trace.records[2].prompt == "Hello there."
    assert trace.records[1].request_id == "r1"
    body = (FIXTURES / "tidal_small.jsonl").read_text().splitlines()[1:]
    (tmp_path / "bare.jsonl").write_text("\n".join(body) + "\n")
    bare = read_jsonl(tmp_path / "bare.jsonl")
    assert bare.name == "bare" and bare.duration_s == 2.25 and len(bare) == 3


# -- load_trace ------------------------------------------------------------------------------------
def test_named_traces_are_the_documented_ones() -> None:
    assert set(NAMED_TRACES) == {"azure-code", "azure-conv", "mooncake-conv", "mooncake-synthetic",
                                 "day-in-life", "day-in-life-sharp"}


def test_load_trace_hours_cuts_real_traces_and_refuses_too_long() -> None:
    half = load_trace("azure-conv", hours=0.5)
    assert half.duration_s == 1800.0 and half.arrival_s.max() < 1800.0
    assert len(load_trace("azure-conv", hours=1.0)) == 19366  # 0.97 h trace: 1 h is within slack
    with pytest.raises(ValueError, match="covers only"):
        load_trace("azure-conv", hours=24)


def test_load_trace_common_keywords() -> None:
    trace = load_trace("mooncake-conv", max_input=8192, max_output=1024, time_scale=0.5)
    assert trace.input_tokens.max() == 8192 and trace.output_tokens.max() == 1024
    assert trace.duration_s == pytest.approx(3537.0 * 0.5)
    with pytest.raises(TypeError, match="unknown keyword"):
        load_trace("azure-conv", cv=2.0)
    with pytest.raises(TypeError, match="unknown keyword"):
        load_trace("day-in-life", model="GPT-4")
    with pytest.raises(ValueError, match="neither a named trace"):
        load_trace("no-such-trace")


def test_load_trace_passes_burstgpt_filters() -> None:
    trace = load_trace(str(FIXTURES / "burstgpt_small.csv"), model="ChatGPT", log_type="Conversation log")
    assert len(trace) == 4


def test_synthetic_named_traces_are_deterministic_and_sized() -> None:
    a = load_trace("day-in-life-sharp", hours=2.0, seed=11, peak_rps=10.0)
    assert a == load_trace("day-in-life-sharp", hours=2.0, seed=11, peak_rps=10.0)
    assert a != load_trace("day-in-life-sharp", hours=2.0, seed=12, peak_rps=10.0)
    assert a.duration_s == 7200.0 and a.name == "day-in-life-sharp"
    fast = load_trace("day-in-life-sharp", hours=2.0, seed=11, peak_rps=10.0, time_scale=0.1)
    np.testing.assert_allclose(fast.arrival_s, a.arrival_s * 0.1)
    mean = load_trace("day-in-life", hours=24.0, seed=1, mean_rps=2.0)
    assert mean.stats()["rate_rps"] == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError, match="not both"):
        load_trace("day-in-life", peak_rps=1.0, mean_rps=1.0)


def test_module_command_prints_stats_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadgen.traces import main

    out = tmp_path / "cut.jsonl"
    assert main(["azure-conv", "--hours", "0.1", "--max-input", "2048", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["duration_s"] == 360.0 and printed["input_p99"] <= 2048
    assert len(read_jsonl(out)) == printed["count"]
    assert main(["azure-conv", "--cv", "2"]) == 2
    assert "unknown keyword" in capsys.readouterr().err


def test_loadgen_trace_modules_stay_free_of_the_server_stack() -> None:
    code = ("import sys, loadgen.traces, loadgen.arrivals, loadgen.prompts; "
            "bad = [m for m in ('ray', 'torch', 'transformers', 'serve_app', 'actors', 'pandas') if m in sys.modules]; "
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == ""
