"""One step of the learners that hold a tail at a fraction.

Owns: `track_tail`. Several of the scheduler's settings are learned the same way: an event is
counted against a tail (a first token that missed the TTFT target, a request whose TPOT came near
its target or missed it, a prompt faster than the slow-prompt ratio says), the value moves down by
`gain x (1 - tail)` after each such event and up by `gain x tail` after any other, within
[`lo`, `hi`]. It settles where `tail` of the events are counted (a stochastic quantile tracker).
Its users: the admission aim (`TtftAim`) and the slow-prompt ratio (`AloneFit`) in
core/admission.py, the step sizer's TPOT aim and borrow scale in core/step_sizer.py.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations


def track_tail(value: float, gain: float, tail: float, counted: bool, lo: float, hi: float) -> float:
    """`value` after one event: down by `gain x (1 - tail)` if `counted`, else up by
    `gain x tail`, kept within [`lo`, `hi`]."""
    value = value - gain * (1.0 - tail) if counted else value + gain * tail
    return lo if value < lo else hi if value > hi else value
