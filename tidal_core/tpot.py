"""The TPOT governor: how big a step may be so running decodes keep their time-per-token SLO.

Owns: `TpotGovernor` (adaptive policy only, when `admission.target_tpot_s` is set). Every
decode in a step waits for the whole step, so a long prefill chunk or a huge batch makes every
running request's TPOT worse; a small batch wastes the GPU. The governor finds the sweet spot
from the fitted step model (core/load.py) and a slack account:

- **batch cap**: decode-only steps must leave room under the target,
  `max_running = (decode_share * T - overhead) / b`, so the batch never grows past what the
  SLO allows however long the queue is (the queue is admission control's job);
- **prefill allowance**: TPOT is a per-request *mean*, so a step may exceed `T` if earlier
  steps came in under it. Each step with decodes adds `T - step time` to `slack_s`
  (bounded to +-`slack_cap_steps * T`); a step may hold prefill tokens worth
  `slack + T - decode_step - prefill_step` of device time. Without running decodes there is
  nothing to protect and prefill is unlimited;
- **TTFT pressure**: when the oldest prompt has waited half the TTFT target it may borrow
  against future steps (`borrow_steps` x T, scaled by the free batch room: the fewer decodes
  share a long step, the cheaper it is);
- **regime**: in LIGHT and STEADY the `LENIENT` profile aims at the target itself and banks
  more slack (few decodes pay for a long step; TTFT is what waiting risks); in OVERLOAD the
  `STRICT` profile aims 10% under it and banks little (a full batch pays for every long step,
  and admission control sheds the queue instead).

There is no starvation: when the allowance is zero the batch only shrinks (nothing new is
admitted past the cap, decodes finish), steps get faster, slack grows and prefill resumes.

`T` is `target_tpot_s * headroom`. All times come from measurements through the service
model; nothing here is hardware-specific.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal_core.load import ServiceModel


@dataclass(frozen=True, slots=True)
class GovernorProfile:
    """How hard the governor holds the TPOT target (fractions of it, and step counts)."""

    headroom: float  # aim at target x headroom (the step model is an estimate)
    decode_share: float  # a decode-only step may use this share of the aim (batch cap)
    slack_cap_steps: float  # slack banked by fast steps, at most this many aims
    borrow_steps: float  # a prompt at TTFT risk may borrow this many aims (x free batch room)
    min_borrow_steps: float


LENIENT = GovernorProfile(headroom=1.0, decode_share=0.9, slack_cap_steps=40.0, borrow_steps=20.0,
                          min_borrow_steps=4.0)
"""LIGHT and STEADY: few decodes share a long step, and TTFT is what a queue risks."""
STRICT = GovernorProfile(headroom=0.9, decode_share=0.85, slack_cap_steps=8.0, borrow_steps=8.0,
                         min_borrow_steps=2.0)
"""OVERLOAD: a full batch pays for every long step; admission control sheds the queue instead."""
PRESSURE_FRACTION = 0.5


class TpotGovernor:
    __slots__ = ("profile", "slack_s", "target_tpot_s")

    def __init__(self, target_tpot_s: float) -> None:
        self.target_tpot_s = target_tpot_s
        self.profile = LENIENT
        self.slack_s = 0.0

    @property
    def target_s(self) -> float:
        return self.target_tpot_s * self.profile.headroom

    def set_strict(self, strict: bool) -> None:
        self.profile = STRICT if strict else LENIENT

    def max_running(self, svc: ServiceModel) -> int:
        """Largest batch whose decode-only step leaves room for prefill under the target."""
        room = self.profile.decode_share * self.target_s - svc.overhead_s
        per_seq = svc.decode_s_per_seq
        if per_seq <= 0.0:
            return 1 << 30
        return max(1, int(room / per_seq))

    def prefill_allowance(self, svc: ServiceModel, num_decodes: int, oldest_wait_s: float,
                          ttft_target_s: float, max_running: int) -> int:
        """Prefill tokens this step may hold (a large number means no limit)."""
        if num_decodes == 0:
            return 1 << 30
        prof, target = self.profile, self.target_s
        slack = min(self.slack_s, prof.slack_cap_steps * target)
        if oldest_wait_s >= PRESSURE_FRACTION * ttft_target_s:
            # A prompt at risk may borrow against future steps; the fewer decodes share the
            # cost of a long step, the more it may borrow.
            fill = min(1.0, num_decodes / max_running)
            slack += max(prof.min_borrow_steps, prof.borrow_steps * (1.0 - fill)) * target
        avail = slack + target - svc.step_time(0, num_decodes) - svc.prefill_step_s
        return int(avail / svc.prefill_s_per_token) if avail > 0.0 else 0

    def on_step(self, num_decodes: int, step_time_s: float) -> None:
        if num_decodes == 0:
            return
        target = self.target_s
        cap = self.profile.slack_cap_steps * target
        self.slack_s = max(-cap, min(cap, self.slack_s + target - step_time_s))
