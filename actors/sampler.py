"""Token sampling for one step, vectorised over the requests that sample.

Owns: `Sampler`: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs, and
the penalties (`apply_penalties`: vLLM's order, repetition over prompt and output tokens, then
frequency and presence over the output tokens, all before temperature; a penalized greedy
request takes the argmax of the penalized logits; logprobs stay the raw model's).
Stop tokens and max_tokens are the scheduler's (core) business, stop *strings* the ingress's
(where text is detokenized); nothing here looks at them.

Reproducibility: a seeded request draws its noise from a generator seeded with
(seed, position of the token being sampled), so its tokens do not depend on the batch it
shares, on tensor parallelism, or on a preemption that recomputes it. Unseeded requests share
the sampler's generator. Sampling uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1)
is a draw from p), so every request's draw is one batched op.

Must not import: ray, serve_app (SamplingParams is taken duck-typed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

_SEED_STRIDE = 1_000_003  # spreads (seed, position) pairs over generator seeds


class SamplingLike(Protocol):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float

    @property
    def is_greedy(self) -> bool: ...

    @property
    def has_penalties(self) -> bool: ...


History = tuple[list[int], int]
"""A sampling row's token ids so far (prompt, then generated) and how many lead as the prompt."""


def apply_penalties(logits: torch.Tensor, params: list[SamplingLike], histories: list[History]) -> torch.Tensor:
    """`logits` with each row's penalties applied (a new tensor if any row has one).

    repetition_penalty r (transformers' and vLLM's rule): a logit of a token already in the prompt
    or the output is divided by r when positive, multiplied by r when negative. Then OpenAI's
    rule over the output tokens: logit -= frequency_penalty x count + presence_penalty x (count > 0).
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, (ids, num_prompt) = params[i], histories[i]
        row = logits[i]
        rep = p.repetition_penalty
        if rep != 1.0 and ids:
            seen = torch.tensor(sorted(set(ids)), device=logits.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        output = ids[num_prompt:] if num_prompt >= 0 else []
        freq, presence = p.frequency_penalty, p.presence_penalty
        if output and (freq or presence):
            counts = torch.zeros_like(row).scatter_add_(
                0, torch.tensor(output, device=logits.device), torch.ones(len(output), device=logits.device))
            row -= freq * counts + presence * (counts > 0).to(row.dtype)
    return logits


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]] | None]


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
    kmax = int(ks.max())
    if kmax >= vocab:
        rows = [i for i, k in enumerate(top_k) if 0 < k < vocab]
        if not rows:
            return logits
        logits[rows] = _apply_top_k(logits[rows], [top_k[i] for i in rows])
        return logits
    kth = logits.topk(kmax, dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return logits
    sub = logits[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches p (the top one always stays).
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = before >= torch.tensor([top_p[i] for i in rows], device=logits.device).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits[rows] = sub.masked_fill_(drop, float("-inf"))
    return logits


class Sampler:
    """Samples on the device of the logits (no vocabulary-sized copy to the host on GPU)."""

    def __init__(self, seed: int | None = None, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._row_gen = torch.Generator(device=self.device)

    def _noise(self, shape: tuple[int, int], seeds: list[int | None], positions: list[int]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        for i, seed in enumerate(seeds):
            if seed is not None:
                self._row_gen.manual_seed((seed * _SEED_STRIDE + positions[i]) % (2**63))
                noise[i].exponential_(generator=self._row_gen)
        return noise

    def sample(self, logits: torch.Tensor, params: list[SamplingLike], positions: list[int],
               histories: list[History] | None = None) -> SampleOutput:
        """logits: float32 [N, vocab] on the sampler's device; positions: index of the sampled token per row;
        histories: each row's token ids so far, needed when any row has a penalty (`apply_penalties`)."""
        n = logits.shape[0]
        raw = logits
        if histories is not None:
            logits = apply_penalties(logits, params, histories)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
            sub = logits[random_rows] / temps.unsqueeze(1)
            if any(params[i].top_k > 0 for i in random_rows):
                sub = _apply_top_k(sub, [params[i].top_k for i in random_rows])
            if any(params[i].top_p < 1.0 for i in random_rows):
                sub = _apply_top_p(sub, [params[i].top_p for i in random_rows])
            probs = sub.softmax(dim=-1)
            noise = self._noise(tuple(probs.shape), [params[i].seed for i in random_rows],
                                [positions[i] for i in random_rows])
            tokens[random_rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        out: list[list[tuple[int, float]] | None] = [None] * n
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:
            logp = raw[lp_rows].log_softmax(dim=-1)
            for j, i in enumerate(lp_rows):
                out[i] = _top_logprobs(logp[j], token_list[i], int(params[i].logprobs or 0))
        return SampleOutput(token_list, out)


def _top_logprobs(logp: torch.Tensor, sampled: int, num: int) -> list[tuple[int, float]]:
    """The sampled token first, then the `num` most likely others (raw model distribution)."""
    entries = [(sampled, float(logp[sampled]))]
    if num:
        values, ids = logp.topk(num + 1)
        others = [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if t != sampled]
        entries.extend(others[:num])
    return entries
