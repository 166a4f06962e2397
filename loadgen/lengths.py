"""Request lengths for synthetic traffic: (input, output) pairs resampled from real traces.

Owns `sample_lengths`: draws whole (input, output) pairs with replacement from a real trace, so
the joint distribution (and any input/output correlation) is the trace's own, not two
independent marginals. The pairs of a source are read once per process and cached.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from loadgen.datasets import TRACE_FILES, trace_file
from loadgen.trace_readers import read_trace_file

IntArray = NDArray[np.int64]


@functools.lru_cache(maxsize=16)
def _pairs(source: str, data_dir: str | None) -> tuple[IntArray, IntArray]:
    path = trace_file(source, data_dir) if source in TRACE_FILES else Path(source)
    if not path.is_file():
        raise KeyError(f"unknown length source {source!r}: use one of {', '.join(TRACE_FILES)} or a trace file path")
    trace = read_trace_file(path)
    if len(trace) == 0:
        raise ValueError(f"length source {source!r} has no requests")
    return trace.input_tokens, trace.output_tokens


def sample_length_arrays(n: int, *, source: str = "azure-conv", seed: int, max_input: int | None = None,
                         max_output: int | None = None, data_dir: str | Path | None = None
                         ) -> tuple[IntArray, IntArray]:
    """`n` (input, output) pairs as two arrays; see `sample_lengths`."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    for label, cap in (("max_input", max_input), ("max_output", max_output)):
        if cap is not None and cap < 1:
            raise ValueError(f"{label}={cap} must be >= 1 (or None for no cap)")
    inputs, outputs = _pairs(source, None if data_dir is None else str(data_dir))
    # A stream of its own ([seed, 1]) so lengths never correlate with arrivals drawn from seed.
    idx = np.random.default_rng([seed, 1]).integers(0, inputs.size, size=n)
    inp, out = inputs[idx], outputs[idx]
    if max_input is not None:
        inp = np.minimum(inp, max_input)
    if max_output is not None:
        out = np.minimum(out, max_output)
    return inp, out


def sample_lengths(n: int, *, source: str = "azure-conv", seed: int, max_input: int | None = None,
                   max_output: int | None = None, data_dir: str | Path | None = None) -> list[tuple[int, int]]:
    """`n` empirical (input_tokens, output_tokens) pairs, resampled jointly from a real trace.

    `source` is a shipped trace name ("azure-conv", "azure-code", "mooncake-conv",
    "mooncake-synthetic") or a trace file path. `max_input`/`max_output` clip (cap) the counts,
    for a model whose context is shorter than the trace's longest prompts.
    """
    inp, out = sample_length_arrays(n, source=source, seed=seed, max_input=max_input, max_output=max_output,
                                    data_dir=data_dir)
    return list(zip(inp.tolist(), out.tolist(), strict=True))
