"""How faithfully `build_prefixed_prompt` turns shared prefix ids into shared tokens (the replay's
prompts for a trace with prefix ids, loadgen/prompts.py): on SmolLM2's tokenizer (the one
configs/local.yaml and configs/sim.yaml tokenize with), random pairs of prompts of 1-4k tokens whose
ids agree on their first 1-5 blocks of 512 tokens. Reported per words-per-token setting: the shared
token prefix over the shared blocks' nominal tokens, and each prompt's tokens over its asked length
(min .. max).

    python benchmarks/prefix_prompt_tokens.py [--pairs 50] [--words-per-token 0.75 --words-per-token 0.867]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.prompts import build_prefixed_prompt

BLOCK = 512


def measure(tok: object, pairs: int, words_per_token: float) -> dict[str, float]:
    shared, lengths = [], []
    for t in range(pairs):
        rng = random.Random(t)
        k = rng.randint(1, 5)
        ids = [rng.randint(0, 9) for _ in range(8)]
        other = ids[:k] + [100 + rng.randint(0, 9) for _ in range(8 - k)]
        n = rng.randint(BLOCK * k + BLOCK, 4096)
        a = tok.encode(build_prefixed_prompt(ids, n, BLOCK, words_per_token=words_per_token))  # type: ignore[attr-defined]
        b = tok.encode(build_prefixed_prompt(other, n, BLOCK, words_per_token=words_per_token))  # type: ignore[attr-defined]
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        shared.append(common / (BLOCK * k))
        lengths.append(len(a) / n)
    return {"shared_over_nominal_min": round(min(shared), 3), "shared_over_nominal_max": round(max(shared), 3),
            "tokens_over_asked_min": round(min(lengths), 3), "tokens_over_asked_max": round(max(lengths), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=50)
    p.add_argument("--words-per-token", type=float, action="append", help="default: 0.75 and 0.867 (the replay's)")
    args = p.parse_args(argv)
    from actors.model_loader import DEFAULT_MODEL, load_tokenizer, prepare

    tok = load_tokenizer(prepare(DEFAULT_MODEL))
    for wpt in args.words_per_token or [0.75, 0.867]:
        print(json.dumps({"words_per_token": wpt, **measure(tok, args.pairs, wpt)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
