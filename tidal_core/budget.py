"""The per-step token and sequence budget.

Owns: `StepBudget`, the two limits every step respects: `max_num_batched_tokens` tokens
and `max_batch_size` sequences. "No room" is a zero from `grant`, not an exception.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations


class StepBudget:
    __slots__ = ("seqs_left", "tokens_left")

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.tokens_left = max_tokens
        self.seqs_left = max_seqs

    def grant(self, wanted_tokens: int, allow_partial: bool) -> int:
        """How many of `wanted_tokens` one more sequence may run this step (0 = none)."""
        if self.seqs_left <= 0 or self.tokens_left <= 0:
            return 0
        if wanted_tokens <= self.tokens_left:
            return wanted_tokens
        return self.tokens_left if allow_partial else 0

    def charge(self, num_tokens: int) -> None:
        self.tokens_left -= num_tokens
        self.seqs_left -= 1

    @property
    def exhausted(self) -> bool:
        return self.seqs_left <= 0 or self.tokens_left <= 0
