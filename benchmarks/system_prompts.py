"""Long system prompts for prefix-cache measurements: distinct, deterministic, about N tokens each.

Owns: `system_prompt(index, words)`, a made-up support-desk policy whose sentences are drawn from
fixed word lists by a seeded generator: prompt `i` is the same text on every run, and two
indices share no opening, so the first request with each one finds nothing cached. About 1.35
SmolLM2 tokens per word: 470 words are ~600 tokens.
"""

from __future__ import annotations

import random

_SUBJECTS = ("the customer", "an agent", "the account", "a refund", "the order", "each invoice", "the warranty",
             "a shipment", "the subscription", "every ticket", "the contract", "a replacement")
_VERBS = ("must be checked", "is reviewed", "can be escalated", "should be logged", "is confirmed",
          "may be delayed", "is recorded", "gets priority", "is closed", "needs approval")
_TAILS = ("within two business days", "before any payment", "by the regional team", "after a phone call",
          "with a written note", "when the stock allows", "under the current policy", "once the form is signed",
          "unless the manager objects", "in the order it arrived")


def system_prompt(index: int, words: int = 470) -> str:
    """Support-desk rules number `index`: a different text (and a different first sentence) per index."""
    rng = random.Random(1_000 + index)
    parts = [f"You are assistant number {index} of the support desk. Follow these rules."]
    count = len(parts[0].split())
    rule = 1
    while count < words:
        sentence = (f"Rule {rule}: {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TAILS)}, and "
                    f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TAILS)}.")
        parts.append(sentence)
        count += len(sentence.split())
        rule += 1
    return " ".join(parts)
