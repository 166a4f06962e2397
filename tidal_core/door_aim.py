"""How much of a unit's TTFT limit a front end lets its own prediction reach, learned from the
verdicts given behind it.

Owns: `DoorAim`. A front end (Serve's proxy, the ingress) predicts from a unit's published
snapshot what the unit will predict when a request arrives (tidal_core/front_admission.py), and
lets the request through unless that prediction passes the unit's limit. The prediction is made
earlier and from less: the snapshot is up to a poll old, the requests on the way are estimates,
and in a burst the way itself is congested. Where it errs low, the request travels one or two
more hops to be refused there, and those are a burst's slowest 429s (docs/reliability.md, the
burst section: with the `openai` client's retries, 11-12% of a burst's refusals were made past
the proxy, 20-70 ms each against the proxy's 2-3).

So each front end learns how far short of the limit to act, from what happened to the requests
it let through: `value` (in [`floor`, 1], from 1) is the fraction of the limit its
`prefill_backlog` rule compares with. A request refused behind it for the same rule (its
`x-tidal-refusal-reason`) lowers it by `gain x (1 - tail)`, a request its unit admitted raises it
by `gain x tail` (`track_tail`), so about `tail` of the requests let through are refused behind
it: as many as the prediction's error makes unavoidable at the margin, and no more. A front end
whose predictions hold never sees the first kind and stays at 1. The floor bounds what a
mistaken signal can cost: at 0.5 the door still lets through every request it predicts within
half the unit's limit, which keeps an overloaded unit's queue from running dry.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from tidal_core.tail_track import track_tail

DOOR_AIM_GAIN = 0.1
DOOR_AIM_TAIL = 0.03  # the share of the requests let through that may be refused behind the door
DOOR_AIM_FLOOR = 0.5


class DoorAim:
    __slots__ = ("floor", "gain", "num_admitted", "num_refused", "tail", "value")

    def __init__(self, gain: float = DOOR_AIM_GAIN, tail: float = DOOR_AIM_TAIL, floor: float = DOOR_AIM_FLOOR) -> None:
        if not 0.0 < gain <= 1.0 or not 0.0 < tail < 1.0 or not 0.0 < floor <= 1.0:
            raise ValueError(f"door aim gain={gain} must be in (0, 1], tail={tail} in (0, 1) and floor={floor} "
                             "in (0, 1]")
        self.gain, self.tail, self.floor = gain, tail, floor
        self.value = 1.0
        self.num_admitted = self.num_refused = 0

    def observe(self, refused_behind: bool) -> None:
        """A request this front end let through was admitted by its unit (False), or refused behind
        the front end because its predicted TTFT passed the limit (True)."""
        if refused_behind:
            self.num_refused += 1
        else:
            self.num_admitted += 1
        self.value = track_tail(self.value, self.gain, self.tail, refused_behind, self.floor, 1.0)
