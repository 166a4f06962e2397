"""A batch backlog on top of a day: the trace, which of its requests are batch, and the split summary.

Owns: `with_backlog` (a day's trace plus `n` batch requests submitted at one instant, with
lengths resampled from a real trace, by default Azure code; returns the merged trace and the
indices of the batch requests) and `class_split` (a run's outcomes as the interactive requests'
summary, what the SLO figures mean, plus the backlog's: completed, refused with Retry-After,
lost, when the last one finished, how many finished by a due time, and the batch tokens served),
`clock_s` (an "HH:MM" time of day as seconds from the trace's midnight) and `batch_markdown`
(the backlog's figures of several runs as one table). Used by `tidal simulate --batch-backlog`
and benchmarks/batch_class.py. Must not import serve_app or actors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loadgen.lengths import sample_length_arrays
from loadgen.records import Trace
from loadgen.report import OK, REJECTED, RunOutcomes, Slo, markdown_table, summarize

BATCH_COLUMNS = ("run", "batch_arrived", "batch_completed", "batch_done_by_due", "batch_refused", "batch_lost",
                 "batch_last_done", "batch_tokens", "batch_tok_s")


def clock_s(text: str) -> float:
    """"HH:MM" (00:00 to 48:00, so a due time may fall on the next day) as seconds from midnight."""
    hh, sep, mm = text.partition(":")
    if not sep or not hh.isdigit() or not mm.isdigit() or len(mm) != 2 or int(mm) >= 60 or int(hh) > 48:
        raise ValueError(f"time {text!r} is not HH:MM (e.g. 00:00, 08:30; up to 48:00 for the next day)")
    return int(hh) * 3600.0 + int(mm) * 60.0


def _clock(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    minutes = round(seconds / 60.0)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def with_backlog(day: Trace, n: int, *, seed: int, max_len: int, at_s: float = 0.0,
                 source: str = "azure-code") -> tuple[Trace, frozenset[int]]:
    """`day` plus `n` batch requests arriving at `at_s`; the merged trace and the batch indices."""
    inp, out = sample_length_arrays(n, source=source, seed=seed + 7919, max_input=max_len - 1, max_output=max_len - 1)
    arrival = np.concatenate([day.arrival_s, np.full(n, float(at_s))])
    order = np.argsort(arrival, kind="stable")  # the backlog follows any day request at the same instant
    is_batch = np.concatenate([np.zeros(len(day), bool), np.ones(n, bool)])[order]
    trace = Trace(f"{day.name} + {n} batch requests at {at_s:g}s ({source} lengths)", arrival[order],
                  np.concatenate([day.input_tokens, inp])[order], np.concatenate([day.output_tokens, out])[order],
                  duration_s=day.duration_s, source=f"{day.source}; backlog {n} x {source}, seed {seed}")
    return trace, frozenset(np.flatnonzero(is_batch).tolist())


def batch_mask(n: int, batch_ids: frozenset[int]) -> np.ndarray:
    mask = np.zeros(n, bool)
    mask[list(batch_ids)] = True
    return mask


def class_split(out: RunOutcomes, batch_ids: frozenset[int], slo: Slo, due_s: float | None = None
                ) -> tuple[RunOutcomes, dict[str, Any]]:
    """The interactive outcomes, and their summary with the backlog's figures (`batch_*`) added;
    `batch_done_by_due` counts the batch requests completed by `due_s` (None: the trace's end)."""
    mask = batch_mask(out.status.size, batch_ids)
    interactive = out.select(~mask, out.duration_s, out.gpu_hours)
    summary = summarize(interactive, slo)
    status, finish = out.status[mask], (out.arrival_s + out.e2e_s)[mask]
    done = status == OK
    due = out.duration_s if due_s is None else due_s
    first_arrival = float(out.arrival_s[mask].min()) if mask.any() else 0.0
    last = float(finish[done].max()) if done.any() else None
    tokens = int((out.input_tokens[mask][done] + out.output_tokens[mask][done]).sum())
    summary.update({
        "batch_arrived": int(mask.sum()),
        "batch_completed": int(done.sum()),
        "batch_refused": int((status == REJECTED).sum()),
        "batch_lost": int((~done & (status != REJECTED)).sum()),
        "batch_done_by_due": int((done & (finish <= due)).sum()),
        "batch_due_s": round(float(due), 1),
        "batch_last_done_s": None if last is None else round(last, 1),
        "batch_tokens": tokens,  # prompt + output tokens of the completed batch requests
        "batch_tok_s": round(tokens / (last - first_arrival), 1) if last is not None and last > first_arrival else None,
    })
    return interactive, summary


def batch_markdown(rows: dict[str, dict[str, Any]]) -> str:
    """Run name -> summary (with `batch_*` figures): the backlog's table, times as HH:MM."""
    table = [{"run": name, **s, "batch_last_done": _clock(s.get("batch_last_done_s"))} for name, s in rows.items()]
    return markdown_table(table, BATCH_COLUMNS)


def batch_tokens_by_time(out: RunOutcomes, batch_ids: frozenset[int], bin_s: float, end_s: float) -> np.ndarray:
    """Batch tokens (prompt + output) of the batch requests that completed in each `bin_s` bin."""
    mask = batch_mask(out.status.size, batch_ids) & (out.status == OK)
    finish = (out.arrival_s + out.e2e_s)[mask]
    tokens = (out.input_tokens + out.output_tokens)[mask]
    bins = np.arange(0.0, end_s + bin_s, bin_s)
    hist, _ = np.histogram(finish, bins=bins, weights=tokens)
    return hist
