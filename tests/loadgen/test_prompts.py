"""build_prompt: English text of about the asked token count, deterministic per seed; build_prefixed_prompt:
the same, made of one piece per prefix id, so prompts share what their ids share."""

from __future__ import annotations

import pytest

from loadgen.prompts import PASSAGE_FILE, WORDS_PER_TOKEN, build_prefixed_prompt, build_prompt


@pytest.mark.parametrize("num_tokens", [1, 7, 100, 1000, 20_000])
def test_word_count_follows_the_estimate(num_tokens: int) -> None:
    words = build_prompt(num_tokens, seed=3).split()
    assert len(words) == max(1, round(num_tokens * WORDS_PER_TOKEN))


def test_text_comes_from_the_passage_and_wraps_around() -> None:
    passage = PASSAGE_FILE.read_text(encoding="utf-8").split()
    assert len(" ".join(passage)) > 4000  # a few KB of prose
    long_prompt = build_prompt(4 * len(passage), seed=0).split()
    assert len(long_prompt) > 2 * len(passage)
    n = len(passage)
    starts = [k for k in range(n) if all(long_prompt[i] == passage[(k + i) % n] for i in range(30))]
    assert starts, "the prompt is not a run of the passage"
    # Consecutive words follow the passage cyclically; the seed only picks where to start.
    assert all(word == passage[(starts[0] + i) % n] for i, word in enumerate(long_prompt))


def test_deterministic_per_seed_and_varied_across_seeds() -> None:
    assert build_prompt(200, seed=5) == build_prompt(200, seed=5)
    starts = {tuple(build_prompt(50, seed=s).split()[:3]) for s in range(50)}
    assert len(starts) > 40  # different seeds start at different places: no shared prefixes


def test_edge_cases() -> None:
    assert build_prompt(0, seed=1) == ""
    assert build_prompt(1, seed=1).strip() != ""
    assert len(build_prompt(100, seed=1, words_per_token=0.87).split()) == 87
    with pytest.raises(ValueError):
        build_prompt(-1, seed=1)
    with pytest.raises(ValueError):
        build_prompt(10, seed=1, words_per_token=0.0)


def _shared_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split(), strict=False):
        if x != y:
            break
        n += 1
    return n


def test_prefixed_prompts_share_what_their_ids_share() -> None:
    block = 64  # tokens per id; 48 words at 0.75 words per token
    a = build_prefixed_prompt((1, 2, 3), 192, block)
    assert len(a.split()) == 144 and a == build_prefixed_prompt((1, 2, 3), 192, block)
    assert _shared_words(a, build_prefixed_prompt((1, 2, 9), 192, block)) == 96  # two blocks in common
    assert _shared_words(a, build_prefixed_prompt((1, 7, 3), 192, block)) == 48  # a prefix ends at the first change
    assert _shared_words(a, build_prefixed_prompt((5, 2, 3), 192, block)) < 5  # same later ids, other prefix
    assert _shared_words(a, build_prefixed_prompt((1, 2, 3), 192, block, seed=1)) < 5  # another seed, other text


def test_prefixed_prompt_lengths_partial_blocks_and_extra_ids() -> None:
    block = 64
    full = build_prefixed_prompt((4, 5), 128, block)
    part = build_prefixed_prompt((4, 5), 100, block)  # the last block partly filled
    assert len(part.split()) == 75 and full.startswith(part)
    assert build_prefixed_prompt((4, 5, 6, 7), 100, block) == part  # ids past the prompt are ignored
    longer = build_prefixed_prompt((4,), 128, block)  # more prompt than ids: a tail of its own
    assert len(longer.split()) == 96 and _shared_words(longer, full) == 48
    assert build_prefixed_prompt((), 40, block).split() and build_prefixed_prompt((4,), 0, block) == ""
    with pytest.raises(ValueError):
        build_prefixed_prompt((1,), -1, block)
    with pytest.raises(ValueError):
        build_prefixed_prompt((1,), 10, 0)
