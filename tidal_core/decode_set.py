"""The running decodes, arranged so a step costs O(1) per decode in C, not in Python.

Owns: `DecodeSet`. Every step runs every decode exactly once (decode-first, and the budget is
never smaller than the batch), so all decodes advance in lock step. Two facts follow and keep
the per-step Python work proportional to the requests that *change*, not to all of them:

- a decode needs a new KV block only when its length crosses a block boundary; its position
  within a block, counted against the global decode-step counter, never changes while it
  decodes, so decodes are kept in `block_size` phase groups and only one group allocates
  per step;
- a decode that ends by length does so at a step number known when it starts decoding, so
  length ends are kept in a step-indexed table instead of being checked every step.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import deque

from tidal_core.request import Request


class DecodeSet:
    __slots__ = (
        "_due",
        "_phase_of",
        "_phases",
        "_removed",
        "block_size",
        "context_tokens",
        "max_model_len",
        "ones",
        "outs",
        "reqs",
        "step",
    )

    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reqs: dict[str, Request] = {}
        self.outs: dict[str, list[int]] = {}
        self.ones: dict[str, int] = {}  # {rid: 1}: copied as a plan's decode part (copy is ~10x fromkeys)
        self._removed = 0
        self.step = 0  # decode steps completed
        self.context_tokens = 0  # sum of num_tokens over the set
        self._phases: list[dict[str, Request]] = [{} for _ in range(block_size)]
        self._phase_of: dict[str, int] = {}
        self._due: dict[int, list[Request]] = {}

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.reqs

    def length_limit(self, req: Request) -> int:
        """Output tokens at which `req` ends by length (max_tokens or the context window)."""
        return min(req.sampling.max_tokens, self.max_model_len - req.num_prompt_tokens)

    def add(self, req: Request) -> None:
        """`req` just gained a token and decodes from the next step on."""
        rid = req.request_id
        num_tokens = req.num_tokens
        self.reqs[rid] = req
        self.outs[rid] = req.output_token_ids
        self.ones[rid] = 1
        self.context_tokens += num_tokens
        # The next step computes token index num_tokens-1; it opens a block when that index
        # is a multiple of block_size. That index minus the step counter is invariant.
        phase = (num_tokens - 1 - self.step) % self.block_size
        self._phases[phase][rid] = req
        self._phase_of[rid] = phase
        due_step = self.step + self.length_limit(req) - len(req.output_token_ids)
        self._due.setdefault(due_step, []).append(req)

    def remove(self, rid: str) -> Request:
        req = self.reqs.pop(rid)
        del self.outs[rid]
        del self.ones[rid]
        self._removed += 1
        if self._removed > max(64, len(self.ones)):
            # CPython copies a dict fast only while few of its slots are deleted ones; with
            # decodes leaving and joining every step, rebuild (order kept) now and then.
            self.reqs, self.outs, self.ones = dict(self.reqs), dict(self.outs), dict(self.ones)
            self._removed = 0
        self.context_tokens -= req.num_tokens
        del self._phases[self._phase_of.pop(rid)][rid]
        return req  # a stale `_due` entry is skipped when its step comes

    def needing_block(self) -> list[Request]:
        """Decodes whose next token opens a new block (only one phase group per step)."""
        group = self._phases[(-self.step) % self.block_size]
        return list(group.values()) if group else []

    def append_tokens(self, sampled: dict[str, int]) -> None:
        """Record one step's sampled tokens for the decodes (others are ignored).

        Executors return tokens in plan order, decodes first, and the plan lists the decodes in
        this set's order; when the key prefix confirms that (a C-speed list comparison), the
        appends run as one C-level `map` instead of a Python loop over every decode.
        """
        outs = self.outs
        n = len(outs)
        if list(sampled)[:n] == list(outs):
            deque(map(list.append, outs.values(), sampled.values()), maxlen=0)
        else:
            outs_get = outs.get
            for rid, tok in sampled.items():
                out = outs_get(rid)
                if out is not None:
                    out.append(tok)
        self.context_tokens += n
        self.step += 1

    def due_by_length(self) -> list[Request]:
        """Decodes that reached their length limit at the step just completed."""
        due = self._due.pop(self.step, None)
        if not due:
            return []
        reqs = self.reqs
        out = [r for r in due if reqs.get(r.request_id) is r and len(r.output_token_ids) >= self.length_limit(r)]
        # A request preempted and resumed within one step is listed twice for the same step.
        return list({id(r): r for r in out}.values()) if len(out) > 1 else out

    def check_integrity(self) -> None:
        if not list(self.reqs) == list(self.outs) == list(self.ones) or set(self.reqs) != set(self._phase_of):
            raise AssertionError("decode set indexes disagree")
        total = 0
        for rid, req in self.reqs.items():
            phase = self._phase_of[rid]
            if self._phases[phase].get(rid) is not req:
                raise AssertionError(f"{rid} missing from its phase group {phase}")
            if (req.num_tokens - 1 - self.step) % self.block_size != phase:
                raise AssertionError(f"{rid} is in phase {phase} but its length says otherwise")
            if self.outs[rid] is not req.output_token_ids:
                raise AssertionError(f"{rid} output list is not the request's")
            if not req.output_token_ids:
                raise AssertionError(f"{rid} decodes without a first token")
            total += req.num_tokens
        if sum(len(g) for g in self._phases) != len(self.reqs):
            raise AssertionError("phase groups hold requests that are not decoding")
        if total != self.context_tokens:
            raise AssertionError(f"context sum {self.context_tokens} != {total}")
