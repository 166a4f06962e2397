"""The running decodes, arranged so a step costs O(1) per decode in C, not in Python.

Owns: `DecodeSet`. Every step runs every decode exactly once (decode-first, and the budget is
never smaller than the batch), so all decodes advance in lock step. Two facts follow and keep
the per-step Python work proportional to the requests that *change*, not to all of them:

- a decode needs a new KV block only when its length crosses a block boundary; its position
  within a block, counted against the global decode-step counter, never changes while it
  decodes, so decodes are kept in `block_size` phase groups and only one group allocates
  per step;
- a decode that ends by length does so at a step number known when it starts decoding, so
  length ends are kept in a step-indexed table instead of being checked every step;
- the ids and output lists are also kept as plain lists in decode order, so a step's tokens
  are checked against that order (one list comparison) and appended (one C-level `map`)
  without iterating the dicts. A decode leaving is cut out of them in place: each decode
  carries a sequence number given when it joined, ascending along the lists, so its position
  is a binary search away;
- the decodes' part of each plan's `num_scheduled_tokens` ({id: 1} in decode order) is one
  dict kept across steps (`step_tokens`), brought up to date from a log of joins and
  departures when the next step is built: O(changes) per step, not a copy of the batch.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections import deque
from itertools import islice

from tidal_core.request import Request


class DecodeSet:
    __slots__ = (
        "_due",
        "_ids",
        "_lists",
        "_log",
        "_next_seq",
        "_phase_of",
        "_phases",
        "_seq_of",
        "_seqs",
        "_synced",
        "_tokens",
        "block_size",
        "context_tokens",
        "max_model_len",
        "outs",
        "reqs",
        "step",
    )

    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reqs: dict[str, Request] = {}
        self.outs: dict[str, list[int]] = {}
        # {rid: 1} for the plans (`step_tokens`): the decodes as of the last call, then the keys
        # the caller added for that step's prefill chunks; `_log` holds the joins (True) and
        # departures since, in order.
        self._tokens: dict[str, int] = {}
        self._synced = 0
        self._log: list[tuple[str, bool]] = []
        self.step = 0  # decode steps completed
        self.context_tokens = 0  # sum of num_tokens over the set
        self._phases: list[dict[str, Request]] = [{} for _ in range(block_size)]
        self._phase_of: dict[str, int] = {}
        self._due: dict[int, list[Request]] = {}
        # In decode order (= the dicts' order): ids, output lists, and ascending join numbers.
        self._ids: list[str] = []
        self._lists: list[list[int]] = []
        self._seqs: list[int] = []
        self._seq_of: dict[str, int] = {}
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.reqs

    def length_limit(self, req: Request) -> int:
        """Output tokens at which `req` ends by length (max_tokens or the context window)."""
        return min(req.sampling.max_tokens, self.max_model_len - req.num_prompt_tokens)

    def add(self, req: Request) -> None:
        """`req` just gained a token and decodes from the next step on."""
        rid, out, step = req.request_id, req.output_token_ids, self.step
        num_tokens = req.num_prompt_tokens + len(out)  # req.num_tokens, without the property call
        self.reqs[rid] = req
        self.outs[rid] = out
        self._log.append((rid, True))
        seq = self._next_seq
        self._next_seq = seq + 1
        self._seq_of[rid] = seq
        self._ids.append(rid)
        self._lists.append(out)
        self._seqs.append(seq)
        self.context_tokens += num_tokens
        # The next step computes token index num_tokens-1; it opens a block when that index
        # is a multiple of block_size. That index minus the step counter is invariant.
        phase = (num_tokens - 1 - step) % self.block_size
        self._phases[phase][rid] = req
        self._phase_of[rid] = phase
        self._due.setdefault(step + self.length_limit(req) - len(out), []).append(req)

    def remove(self, rid: str) -> Request:
        req = self.reqs.pop(rid)
        del self.outs[rid]
        self._log.append((rid, False))
        i = bisect_left(self._seqs, self._seq_of.pop(rid))
        del self._ids[i], self._lists[i], self._seqs[i]
        self.context_tokens -= req.num_prompt_tokens + len(req.output_token_ids)
        del self._phases[self._phase_of.pop(rid)][rid]
        return req  # a stale `_due` entry is skipped when its step comes

    def step_tokens(self) -> dict[str, int]:
        """{rid: 1} for every decode, in decode order: the decodes' part of the next plan's
        `num_scheduled_tokens`, to which the caller adds the step's prefill chunks. It is one
        dict kept across steps: this call takes the previous step's chunks out again and applies
        the joins and departures since, so a plan's dict holds only until the next call."""
        tokens = self._tokens
        added = len(tokens) - self._synced
        if added > 0:
            for rid in list(islice(reversed(tokens), added)):
                del tokens[rid]
        if self._log:
            self._replay(tokens)
            self._log.clear()
        self._synced = len(tokens)
        return tokens

    def _replay(self, tokens: dict[str, int]) -> None:
        for rid, joined in self._log:
            if joined:
                tokens[rid] = 1
            else:
                del tokens[rid]

    def needing_block(self) -> list[Request]:
        """Decodes whose next token opens a new block (only one phase group per step)."""
        group = self._phases[(-self.step) % self.block_size]
        return list(group.values()) if group else []

    def needing_block_ids(self) -> list[str]:
        """The ids of `needing_block()`, in the same order."""
        return list(self._phases[(-self.step) % self.block_size])

    def append_tokens(self, sampled: dict[str, int]) -> None:
        """Record one step's sampled tokens for the decodes (others are ignored).

        Executors return tokens in plan order, decodes first, and the plan lists the decodes in
        this set's order; when the key prefix confirms that (a C-speed list comparison), the
        appends run as one C-level `map` instead of a Python loop over every decode.
        """
        ids = self._ids
        n = len(ids)
        keys = list(sampled)
        del keys[n:]
        if keys == ids:
            deque(map(list.append, self._lists, sampled.values()), maxlen=0)
        else:
            outs_get = self.outs.get
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
        if list(self.reqs) != list(self.outs) or set(self.reqs) != set(self._phase_of):
            raise AssertionError("decode set indexes disagree")
        tokens = dict(list(self._tokens.items())[:self._synced])
        self._replay(tokens)
        if list(tokens) != self._ids or set(tokens.values()) - {1}:
            raise AssertionError("the plans' decode tokens would not match the decodes")
        if (self._ids != list(self.outs) or len(self._lists) != len(self.outs) or list(self._seq_of) != self._ids
                or not all(map(operator.is_, self._lists, self.outs.values()))
                or self._seqs != list(self._seq_of.values()) or self._seqs != sorted(set(self._seqs))):
            raise AssertionError("decode set's ordered lists disagree with its dicts")
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
