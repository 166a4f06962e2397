"""A trace: an ordered, immutable list of request arrivals with their token counts.

Owns `TraceRecord` (one request: arrival time, input and output tokens, optional prompt and id)
and `Trace` (the records plus name, duration and a human-readable source) with its transforms:
`scaled` (time compression, seeded thinning/replication), `clipped`, `window` and `stats`.
A trace may carry prefix-block ids (`prefix_ids`, Mooncake's `hash_ids`): per request, one id
per `prefix_block_size` tokens of its prompt, equal ids meaning an equal KV prefix.

Storage: a trace keeps parallel read-only numpy arrays (`arrival_s`, `input_tokens`,
`output_tokens`), so a 24 h day of a million requests costs ~20 MB and transforms are
vectorised. `records` is a lazy `Sequence[TraceRecord]` view that builds a record only when
indexed or iterated; drivers that want speed (the simulator) read the arrays directly.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

PREFIX_SALT = 1 << 40
"""Added (times the copy number) to the prefix ids of a request's replicas in `Trace.scaled`."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float  # seconds from the trace start
    input_tokens: int
    output_tokens: int
    prompt: str | None = None
    request_id: str | None = None


class _RecordView(Sequence[TraceRecord]):
    """Records built on demand from a trace's arrays."""

    __slots__ = ("_trace",)

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def __len__(self) -> int:
        return len(self._trace)

    @overload
    def __getitem__(self, index: int) -> TraceRecord: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[TraceRecord]: ...
    def __getitem__(self, index: int | slice) -> TraceRecord | Sequence[TraceRecord]:
        if isinstance(index, slice):
            return [self._trace.record(i) for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"record {index} out of range for a trace of {n}")
        return self._trace.record(index % n)

    def __iter__(self) -> Iterator[TraceRecord]:
        t = self._trace
        prompts = t.prompts or (None,) * len(t)
        ids = t.request_ids or (None,) * len(t)
        for a, i, o, p, r in zip(t.arrival_s.tolist(), t.input_tokens.tolist(), t.output_tokens.tolist(),
                                 prompts, ids, strict=True):
            yield TraceRecord(a, i, o, p, r)


def _frozen(values: ArrayLike, dtype: type) -> NDArray[Any]:
    arr: NDArray[Any] = np.array(values, dtype=dtype)
    arr.setflags(write=False)
    return arr


class Trace:
    """Requests sorted by arrival (a stable sort is applied if they are not)."""

    __slots__ = ("_arrival", "_input", "_output", "duration_s", "name", "offset_s", "prefix_block_size", "prefix_ids",
                 "prompts", "request_ids", "source")
    _arrival: NDArray[np.float64]
    _input: NDArray[np.int64]
    _output: NDArray[np.int64]
    name: str
    source: str  # human-readable origin
    duration_s: float
    offset_s: float  # where t = 0 falls on the source's own clock (s since 00:00 of its first day, if known)
    prompts: tuple[str | None, ...] | None
    request_ids: tuple[str | None, ...] | None
    prefix_ids: tuple[tuple[int, ...], ...] | None  # per request, one id per prefix_block_size prompt tokens
    prefix_block_size: int

    def __init__(self, name: str, arrival_s: ArrayLike, input_tokens: ArrayLike, output_tokens: ArrayLike, *,
                 duration_s: float | None = None, source: str = "", offset_s: float = 0.0,
                 prompts: Sequence[str | None] | None = None, request_ids: Sequence[str | None] | None = None,
                 prefix_ids: Sequence[Sequence[int]] | None = None, prefix_block_size: int = 512) -> None:
        arrival = np.array(arrival_s, dtype=np.float64).reshape(-1)
        inp = np.array(input_tokens, dtype=np.int64).reshape(-1)
        out = np.array(output_tokens, dtype=np.int64).reshape(-1)
        n = arrival.size
        if inp.size != n or out.size != n or (prompts is not None and len(prompts) != n) or (
                request_ids is not None and len(request_ids) != n) or (prefix_ids is not None and len(prefix_ids) != n):
            raise ValueError("arrival_s, input_tokens, output_tokens (and prompts, request_ids) need equal lengths")
        if not np.all(np.isfinite(arrival)) or (n and arrival.min() < 0.0):
            raise ValueError(f"trace {name!r}: arrival times must be finite and >= 0")
        if n and (inp.min() < 0 or out.min() < 0):
            raise ValueError(f"trace {name!r}: token counts must be >= 0")
        if n > 1 and np.any(np.diff(arrival) < 0):
            order = np.argsort(arrival, kind="stable")
            arrival, inp, out = arrival[order], inp[order], out[order]
            prompts = [prompts[i] for i in order] if prompts is not None else None
            request_ids = [request_ids[i] for i in order] if request_ids is not None else None
            prefix_ids = [prefix_ids[i] for i in order] if prefix_ids is not None else None
        if prefix_block_size < 1:
            raise ValueError(f"trace {name!r}: prefix_block_size={prefix_block_size} must be >= 1")
        last = float(arrival[-1]) if n else 0.0
        duration = last if duration_s is None else float(duration_s)
        if not (math.isfinite(duration) and duration >= last):
            raise ValueError(f"trace {name!r}: duration_s={duration_s} must be >= the last arrival {last}")
        fields = {"_arrival": _frozen(arrival, np.float64), "_input": _frozen(inp, np.int64),
                  "_output": _frozen(out, np.int64), "name": name, "source": source, "duration_s": duration,
                  "offset_s": float(offset_s), "prompts": tuple(prompts) if prompts is not None else None,
                  "request_ids": tuple(request_ids) if request_ids is not None else None,
                  "prefix_ids": tuple(map(tuple, prefix_ids)) if prefix_ids is not None else None,
                  "prefix_block_size": int(prefix_block_size)}
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"Trace is immutable (tried to set {key!r}); derive one with scaled/clipped/window")

    @classmethod
    def from_records(cls, name: str, records: Sequence[TraceRecord], **kw: Any) -> Trace:
        has_prompt = any(r.prompt is not None for r in records)
        has_id = any(r.request_id is not None for r in records)
        return cls(name, [r.arrival_s for r in records], [r.input_tokens for r in records],
                   [r.output_tokens for r in records],
                   prompts=[r.prompt for r in records] if has_prompt else None,
                   request_ids=[r.request_id for r in records] if has_id else None, **kw)

    # -- access ---------------------------------------------------------------------------
    @property
    def arrival_s(self) -> NDArray[np.float64]:
        return self._arrival

    @property
    def input_tokens(self) -> NDArray[np.int64]:
        return self._input

    @property
    def output_tokens(self) -> NDArray[np.int64]:
        return self._output

    @property
    def records(self) -> Sequence[TraceRecord]:
        return _RecordView(self)

    def record(self, i: int) -> TraceRecord:
        return TraceRecord(float(self._arrival[i]), int(self._input[i]), int(self._output[i]),
                           self.prompts[i] if self.prompts else None,
                           self.request_ids[i] if self.request_ids else None)

    def __len__(self) -> int:
        return int(self._arrival.size)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (self.name, self.source, self.duration_s, self.offset_s, self.prompts, self.request_ids,
                self.prefix_ids, self.prefix_block_size) == (
            other.name, other.source, other.duration_s, other.offset_s, other.prompts, other.request_ids,
            other.prefix_ids, other.prefix_block_size) and all(
            np.array_equal(a, b) for a, b in ((self._arrival, other._arrival), (self._input, other._input),
                                              (self._output, other._output)))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking arrays: compare, don't hash

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self)} requests over {self.duration_s:.1f} s, source={self.source!r})"

    def _derived(self, name: str, idx: NDArray[np.intp] | None, *, arrival: NDArray[np.float64] | None = None,
                 inp: NDArray[np.int64] | None = None, out: NDArray[np.int64] | None = None,
                 **kw: Any) -> Trace:
        """A new trace from a subset/reordering `idx` of this one, with fields overridden."""
        def pick(seq: tuple[str | None, ...] | None) -> list[str | None] | None:
            if seq is None:
                return None
            return list(seq) if idx is None else [seq[i] for i in idx]
        def sel(arr: NDArray[Any]) -> NDArray[Any]:
            return arr if idx is None else arr[idx]
        fields: dict[str, Any] = {"duration_s": self.duration_s, "source": self.source, "offset_s": self.offset_s,
                                  "prompts": pick(self.prompts), "request_ids": pick(self.request_ids),
                                  "prefix_block_size": self.prefix_block_size}
        if self.prefix_ids is not None:
            fields["prefix_ids"] = self.prefix_ids if idx is None else [self.prefix_ids[i] for i in idx]
        fields.update(kw)
        return Trace(name, sel(self._arrival) if arrival is None else arrival,
                     sel(self._input) if inp is None else inp, sel(self._output) if out is None else out, **fields)

    # -- transforms -----------------------------------------------------------------------
    def scaled(self, *, time_scale: float = 1.0, rate_scale: float = 1.0, seed: int = 0) -> Trace:
        """Compress time and/or change the request rate while keeping the shape.

        `time_scale` multiplies every time (0.1 = ten times faster, ten times the rate).
        `rate_scale` keeps each request floor(r) times plus once more with probability
        r - floor(r) (seeded): r < 1 thins at random, r > 1 replicates. A replica lands at a
        uniformly random point between its original and the next arrival, so the local rate
        (the shape) is kept and no two requests coincide. Copy k >= 1 of a request gets its
        prefix ids salted by k: the copies form k more user populations, each sharing prefixes
        within itself as the original does, none with another (a copy of a conversation is
        another conversation, not a free cache hit).
        """
        if not (time_scale > 0.0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale={time_scale} must be finite and > 0 (0.1 plays 10x faster)")
        if not (rate_scale >= 0.0 and math.isfinite(rate_scale)):
            raise ValueError(f"rate_scale={rate_scale} must be finite and >= 0 (0.5 halves the rate)")
        n = len(self)
        rng = np.random.default_rng([seed, 0x5CA1E])
        whole = math.floor(rate_scale)
        copies = whole + (rng.random(n) < rate_scale - whole).astype(np.int64)
        idx = np.repeat(np.arange(n), copies)
        # k-th copy of a request: k = 0 stays in place, k >= 1 is jittered into the gap after it.
        k = np.arange(idx.size) - np.repeat(np.cumsum(copies) - copies, copies)
        gaps = np.diff(np.append(self._arrival, self.duration_s))
        jitter = np.where(k > 0, rng.random(idx.size) * gaps[idx], 0.0)
        arrival = (self._arrival[idx] + jitter) * time_scale
        ids = None
        if self.request_ids is not None:
            ids = [f"{self.request_ids[i]}#{c}" if c and self.request_ids[i] is not None else self.request_ids[i]
                   for i, c in zip(idx.tolist(), k.tolist(), strict=True)]
        extra: dict[str, Any] = {}
        if self.prefix_ids is not None:
            salted = self.prefix_ids
            extra["prefix_ids"] = [salted[i] if not c else tuple(h + c * PREFIX_SALT for h in salted[i])
                                   for i, c in zip(idx.tolist(), k.tolist(), strict=True)]
        suffix = "" if (time_scale, rate_scale) == (1.0, 1.0) else f"@t{time_scale:g}r{rate_scale:g}"
        # offset_s stays: t = 0 still falls at the same instant of the source's clock.
        return self._derived(self.name + suffix, idx, arrival=arrival, duration_s=self.duration_s * time_scale,
                             request_ids=ids, **extra)

    def clipped(self, max_input_tokens: int, max_output_tokens: int) -> Trace:
        """Token counts capped (for a model with a short context); arrivals unchanged."""
        if max_input_tokens < 1 or max_output_tokens < 1:
            raise ValueError(f"clip limits must be >= 1, got input {max_input_tokens}, output {max_output_tokens}")
        return self._derived(self.name, None, inp=np.minimum(self._input, max_input_tokens),
                             out=np.minimum(self._output, max_output_tokens))

    def window(self, start_s: float, end_s: float) -> Trace:
        """Requests arriving in `[start_s, end_s)`, re-based so the window starts at 0.

        The duration is the window's length (cut at the trace's end); `offset_s` records where
        the window began on the source's own clock.
        """
        if not 0.0 <= start_s < end_s:
            raise ValueError(f"window needs 0 <= start_s < end_s, got [{start_s}, {end_s})")
        end = min(end_s, self.duration_s)
        lo, hi = np.searchsorted(self._arrival, [start_s, end], side="left")
        if end_s >= self.duration_s:  # the trace's last instant belongs to its final window
            hi = len(self)
        idx = np.arange(lo, hi)
        return self._derived(self.name, idx, arrival=self._arrival[idx] - start_s,
                             duration_s=max(end - start_s, 0.0), offset_s=self.offset_s + start_s)

    def stats(self) -> dict[str, float]:
        """count, duration_s, rate_rps (count / duration), input/output mean, p50, p90, p99."""
        n = len(self)
        out: dict[str, float] = {"count": float(n), "duration_s": self.duration_s,
                                 "rate_rps": n / self.duration_s if self.duration_s > 0 else 0.0}
        for label, arr in (("input", self._input), ("output", self._output)):
            if n:
                p50, p90, p99 = np.percentile(arr, [50, 90, 99])
                values = (float(arr.mean()), float(p50), float(p90), float(p99))
            else:
                values = (0.0, 0.0, 0.0, 0.0)
            out.update(zip((f"{label}_mean", f"{label}_p50", f"{label}_p90", f"{label}_p99"), values, strict=True))
        return out
