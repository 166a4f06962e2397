"""How many of a prompt's tokens a unit's prefix cache holds, as a front end can estimate it.

Owns: `CachedFit`, the line `cached ~ min(P, fixed_tokens) + share x (P - fixed_tokens)` for a
prompt of P tokens, fitted to the prompts arriving at a unit (each one's cached tokens as the
unit peeks them on arrival), and `uncached_tokens`, the estimate on it. A unit publishes the line
in its `UnitLoad` (`cached_fixed_tokens`, `cached_share`) for a front end that decides before it
tokenizes, so before it can look a prompt up (core/front_admission.py).

Why a line and not a share: what a cache holds depends on how prompts share. A system prompt
shared by every request puts about the same tokens in every prompt's cache whatever its length
(the Mooncake conversation trace: 512 tokens for 9 in 10 requests); a chat's history puts a share
of a long prompt there. A share fitted to the first kind puts 14-22% of a 1,000-token prompt in
the cache where 51% was, and of a 7,000-token one where 7% was: a short prompt's uncached tokens
came out at about 1.8x their number (`benchmarks/cached_estimate.py`), and in Serve the door
refused short prompts behind others that the unit would have served within the target
(benchmarks/RESULTS.md, "What the door assumes cached, and when the work on the way starts"). The
line fits both kinds.

The line is fitted to the last `window` arrivals (256) so that one prompt cannot swing it:
`fixed_tokens` is either 0 or a low quantile (`quantile`, the 10th percentile) of their cached
tokens, what nearly every prompt finds cached whatever its length, whichever estimates their
uncached tokens closer (the mean absolute error); `share` is the rest of their cached tokens over
the rest of their prompt tokens, so the line's estimates add up to about the tokens they found
cached. (A least-squares line was tried first: the few prompts that found most of a long
history cached made its slope swing from 0.003 to 0.1 and its intercept from 512 to 0 within one
trace window.) Before any arrival (and without a cache) both are 0: nothing is assumed cached.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW = 256
DEFAULT_QUANTILE = 0.1
REFIT_EVERY = 32  # arrivals between two fits (one fit is a few hundred microseconds of Python)


class CachedFit:
    __slots__ = ("_arrivals", "_fitted_at", "_line", "num_observed", "quantile")

    def __init__(self, window: int = DEFAULT_WINDOW, quantile: float = DEFAULT_QUANTILE) -> None:
        if window < 1 or not 0.0 <= quantile < 1.0:
            raise ValueError(f"cached fit window={window} must be >= 1 and quantile={quantile} in [0, 1)")
        self.quantile = quantile
        self.num_observed = 0
        self._arrivals: deque[tuple[int, int]] = deque(maxlen=window)
        self._line = (0.0, 0.0)
        self._fitted_at = 0  # `num_observed` when the line was fitted

    def observe(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A prompt of `prompt_tokens` arrived; the cache held `cached_tokens` of them."""
        if prompt_tokens <= 0:
            return
        self._arrivals.append((prompt_tokens, min(max(cached_tokens, 0), prompt_tokens)))
        self.num_observed += 1

    def line(self) -> tuple[float, float]:
        """(fixed_tokens, share): the cached tokens of a prompt of P tokens are about
        min(P, fixed_tokens) + share x (P - fixed_tokens), fitted again as the arrivals double
        (after the 1st, 2nd, 4th, ...) and then after every `REFIT_EVERY`: a unit's first
        arrivals meet a cold cache, and a line fitted to them alone would say nothing is cached."""
        n, at = self.num_observed, self._fitted_at
        if n > at and n - at >= min(at, REFIT_EVERY):
            self._line, self._fitted_at = self._fit(), n
        return self._line

    def _fit(self) -> tuple[float, float]:
        arrivals = self._arrivals
        cached = sorted(c for _, c in arrivals)
        low = cached[min(len(cached) - 1, int(self.quantile * len(cached)))]
        best: tuple[float, float, float] | None = None
        for fixed in {0, low}:  # a share alone, or a fixed part and a share of the rest
            rest_cached = rest_prompt = 0
            for p, c in arrivals:
                base = p if p < fixed else fixed
                rest_cached += c - base if c > base else 0
                rest_prompt += p - base
            share = min(1.0, rest_cached / rest_prompt) if rest_prompt > 0 else 0.0
            error = sum(abs(uncached_tokens(p, fixed, share) - (p - c)) for p, c in arrivals)
            if best is None or error < best[0]:
                best = (error, float(fixed), share)
        assert best is not None
        return best[1], best[2]

    def uncached(self, prompt_tokens: int) -> int:
        """The fit's estimate of a prompt's tokens the cache will not hold."""
        fixed, share = self.line()
        return uncached_tokens(prompt_tokens, fixed, share)


def uncached_tokens(prompt_tokens: float, fixed_tokens: float, share: float, num_prompts: int = 1) -> int:
    """Of `num_prompts` prompts of `prompt_tokens` in all, the tokens a cache fitted to
    min(P, `fixed_tokens`) + `share` x (P - `fixed_tokens`) per prompt will not hold (0 to all)."""
    if prompt_tokens <= 0:
        return 0
    fixed = max(0.0, fixed_tokens) * max(1, num_prompts)
    if prompt_tokens <= fixed:
        return 0
    return int((prompt_tokens - fixed) * (1.0 - min(1.0, max(0.0, share))))
