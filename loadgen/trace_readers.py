"""Readers and the writer for trace files: Azure 2023, Mooncake, BurstGPT and our own JSONL.

Owns the file formats (columns are documented in each data folder's SOURCE.md and in
docs/traces.md) and `read_trace_file`, which sniffs a file's format from its header or keys.
Every reader returns a `Trace` whose first record arrives at 0.0, whose duration is the span
from the first to the last arrival, and whose `offset_s` keeps where t = 0 fell on the source's
own clock (seconds since 00:00 of the first day where the source says so).

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.records import Trace

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
JSONL_FORMAT_KEY = "tidal_trace"
JSONL_FORMAT_VERSION = 1
_TZ_SUFFIX = re.compile(r"(Z|[+-]\d{2}:?\d{2})$")


def _rebased(name: str, arrival_s: np.ndarray, inp: np.ndarray, out: np.ndarray, *, source: str,
             offset_s: float = 0.0) -> Trace:
    order = np.argsort(arrival_s, kind="stable")
    arrival_s, inp, out = arrival_s[order], inp[order], out[order]
    first = float(arrival_s[0]) if arrival_s.size else 0.0
    return Trace(name, arrival_s - first, inp, out, source=source, offset_s=offset_s + first)


def _parse_timestamps(texts: list[str]) -> np.ndarray:
    """Azure timestamps (`YYYY-MM-DD HH:MM:SS.fffffff`, maybe with a +HH:MM offset) as datetime64[ns] UTC-naive."""
    offsets = np.zeros(len(texts), dtype="timedelta64[m]")
    clean = texts
    if texts and _TZ_SUFFIX.search(texts[0]):
        clean = []
        for i, text in enumerate(texts):
            m = _TZ_SUFFIX.search(text)
            if m and m.group(1) != "Z":
                sign = -1 if m.group(1)[0] == "-" else 1
                hh, mm = m.group(1)[1:3], m.group(1)[-2:]
                offsets[i] = np.timedelta64(sign * (int(hh) * 60 + int(mm)), "m")
            clean.append(text[: m.start()] if m else text)
    # numpy parses "YYYY-MM-DD HH:MM:SS.fffffff" directly; subtracting the offset gives UTC.
    return np.array(clean, dtype="datetime64[ns]") - offsets


def read_azure_csv(path: str | Path, *, name: str | None = None) -> Trace:
    """Azure LLM inference trace 2023 (Splitwise): TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = Path(path)
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = tuple(next(reader, ()))
        if header[:3] != AZURE_HEADER:
            raise ValueError(f"{path.name}: not an Azure trace (header {header}, expected {AZURE_HEADER})")
        rows = [r for r in reader if r]
    stamps = _parse_timestamps([r[0] for r in rows])
    if stamps.size == 0:
        return Trace(name or path.stem, [], [], [], source=f"Azure LLM inference trace 2023 ({path.name})")
    base = stamps.min()
    arrival = (stamps - base).astype(np.int64) / 1e9
    time_of_day = float((base - base.astype("datetime64[D]")).astype(np.int64)) / 1e9
    inp, out = np.array([int(r[1]) for r in rows]), np.array([int(r[2]) for r in rows])
    return _rebased(name or path.stem, arrival, inp, out,
                    source=f"Azure LLM inference trace 2023 ({path.name})", offset_s=time_of_day)


MOONCAKE_BLOCK_TOKENS = 512
"""The block size of the Mooncake traces' `hash_ids` (see data/mooncake-fast25/SOURCE.md)."""


def read_mooncake_jsonl(path: str | Path, *, name: str | None = None) -> Trace:
    """Mooncake FAST'25 trace: timestamp (ms), input_length, output_length, and `hash_ids` (one
    per 512 prompt tokens, equal ids = equal prefix) as the trace's `prefix_ids`."""
    path = Path(path)
    arrival, inp, out, ids = [], [], [], []
    for obj in _json_lines(path):
        arrival.append(float(obj["timestamp"]) / 1000.0)
        inp.append(int(obj["input_length"]))
        out.append(int(obj["output_length"]))
        ids.append(tuple(int(h) for h in obj.get("hash_ids", ())))
    arrival_s = np.array(arrival, dtype=np.float64)
    order = np.argsort(arrival_s, kind="stable")
    first = float(arrival_s[order[0]]) if arrival_s.size else 0.0
    return Trace(name or path.stem, arrival_s[order] - first, np.array(inp, dtype=np.int64)[order],
                 np.array(out, dtype=np.int64)[order], source=f"Mooncake FAST'25 trace ({path.name})",
                 offset_s=first, prefix_ids=[ids[i] for i in order.tolist()],
                 prefix_block_size=MOONCAKE_BLOCK_TOKENS)


def _matches(value: str, wanted: str | None) -> bool:
    # "conversation" matches "Conversation log"; the full value matches too. Case-insensitive.
    return wanted is None or value.strip().lower().startswith(wanted.strip().lower())


def read_burstgpt_csv(path: str | Path, *, model: str | None = None, log_type: str | None = None,
                      drop_failed: bool = True, name: str | None = None) -> Trace:
    """BurstGPT (Azure OpenAI GPT service): Timestamp (s from 00:00 of the first day), Model,
    Request tokens, Response tokens, Total tokens, Log Type.

    `model` ("ChatGPT", "GPT-4") and `log_type` ("Conversation log", "API log", or a prefix such
    as "conversation") filter rows, case-insensitively. A failed request has 0 response tokens;
    `drop_failed` removes those. `offset_s` keeps the first kept row's original Timestamp.
    """
    path = Path(path)
    arrival, inp, out = [], [], []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in BURSTGPT_HEADER if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path.name}: not a BurstGPT trace (missing columns {missing})")
        for row in reader:
            if not (_matches(row["Model"], model) and _matches(row["Log Type"], log_type)):
                continue
            response = int(float(row["Response tokens"]))
            if drop_failed and response == 0:
                continue
            arrival.append(float(row["Timestamp"]))
            inp.append(int(float(row["Request tokens"])))
            out.append(response)
    picked = ", ".join(f"{k}={v}" for k, v in (("model", model), ("log_type", log_type)) if v)
    source = f"BurstGPT ({path.name}{', ' + picked if picked else ''}{', failures dropped' if drop_failed else ''})"
    return _rebased(name or path.stem, np.array(arrival, dtype=np.float64), np.array(inp, dtype=np.int64),
                    np.array(out, dtype=np.int64), source=source)


def write_jsonl(trace: Trace, path: str | Path) -> None:
    """Our format: a header line with the metadata, then one record per line."""
    header = {JSONL_FORMAT_KEY: JSONL_FORMAT_VERSION, "name": trace.name, "duration_s": trace.duration_s,
              "source": trace.source, "offset_s": trace.offset_s}
    if trace.prefix_ids is not None:
        header["prefix_block_size"] = trace.prefix_block_size
    arrival, inp, out = trace.arrival_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist()
    with Path(path).open("w") as fh:
        fh.write(json.dumps(header) + "\n")
        plain = trace.prompts is None and trace.request_ids is None and trace.prefix_ids is None
        for i, (a, n_in, n_out) in enumerate(zip(arrival, inp, out, strict=True)):
            if plain:  # the common case, formatted by hand: ~5x faster than json.dumps per line
                fh.write(f'{{"arrival_s": {a!r}, "input_tokens": {n_in}, "output_tokens": {n_out}}}\n')
                continue
            rec: dict[str, Any] = {"arrival_s": a, "input_tokens": n_in, "output_tokens": n_out}
            if trace.prompts is not None and trace.prompts[i] is not None:
                rec["prompt"] = trace.prompts[i]
            if trace.request_ids is not None and trace.request_ids[i] is not None:
                rec["request_id"] = trace.request_ids[i]
            if trace.prefix_ids is not None:
                rec["prefix_ids"] = list(trace.prefix_ids[i])
            fh.write(json.dumps(rec) + "\n")


def read_jsonl(path: str | Path) -> Trace:
    """Our JSONL format (header line optional); times are kept as written, not re-based."""
    path = Path(path)
    meta: dict[str, Any] = {}
    arrival, inp, out = [], [], []
    prompts: list[str | None] = []
    ids: list[str | None] = []
    prefix: list[tuple[int, ...]] = []
    for obj in _json_lines(path):
        if JSONL_FORMAT_KEY in obj:
            if obj[JSONL_FORMAT_KEY] != JSONL_FORMAT_VERSION:
                raise ValueError(f"{path.name}: trace format version {obj[JSONL_FORMAT_KEY]} is not supported")
            meta = obj
            continue
        arrival.append(float(obj["arrival_s"]))
        inp.append(int(obj["input_tokens"]))
        out.append(int(obj["output_tokens"]))
        prompts.append(obj.get("prompt"))
        ids.append(obj.get("request_id"))
        prefix.append(tuple(obj.get("prefix_ids", ())))
    return Trace(meta.get("name", path.stem), arrival, inp, out, duration_s=meta.get("duration_s"),
                 source=meta.get("source", f"tidalserve JSONL ({path.name})"), offset_s=meta.get("offset_s", 0.0),
                 prompts=prompts if any(p is not None for p in prompts) else None,
                 request_ids=ids if any(i is not None for i in ids) else None,
                 prefix_ids=prefix if "prefix_block_size" in meta else None,
                 prefix_block_size=int(meta.get("prefix_block_size", 512)))


def read_trace_file(path: str | Path, **kw: Any) -> Trace:
    """Any supported file: .csv sniffed as Azure or BurstGPT by header, .jsonl as Mooncake or ours by keys."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            header = tuple(next(csv.reader(fh), ()))
        if header[:3] == AZURE_HEADER:
            return read_azure_csv(path, **kw)
        if all(c in header for c in BURSTGPT_HEADER):
            return read_burstgpt_csv(path, **kw)
        raise ValueError(f"{path.name}: CSV header {header} is neither Azure {AZURE_HEADER} nor BurstGPT")
    if path.suffix == ".jsonl":
        first = next(_json_lines(path), {})
        if JSONL_FORMAT_KEY in first or "arrival_s" in first:
            return read_jsonl(path, **kw)
        if "input_length" in first and "timestamp" in first:
            return read_mooncake_jsonl(path, **kw)
        raise ValueError(f"{path.name}: JSONL keys {sorted(first)} are neither ours (arrival_s) nor Mooncake's")
    raise ValueError(f"{path.name}: unknown trace file type {path.suffix!r} (expected .csv or .jsonl)")


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path.name}:{lineno}: not JSON ({exc.msg})") from None
