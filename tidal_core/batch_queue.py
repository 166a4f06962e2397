"""The batch class's waiting queue: FIFO, with its prompt-token count kept O(1).

Owns: `BatchQueue`. Requests of the batch class wait here, apart from the interactive FIFO, so
interactive admission, the TTFT predictor and the launch policy never see them. `UnitQueues`
(queues.py) is its only writer; the bound on its tokens is core/batch_lane.py's.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

from collections import deque

from tidal_core.request import Request


class BatchQueue:
    __slots__ = ("num_tokens", "reqs")

    def __init__(self) -> None:
        self.reqs: deque[Request] = deque()
        self.num_tokens = 0  # tokens still to compute over the queued requests

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def append(self, req: Request) -> None:
        self.reqs.append(req)
        self.num_tokens += req.num_tokens

    def appendleft(self, req: Request) -> None:
        """A preempted batch request goes back first: it is the oldest work in the queue."""
        self.reqs.appendleft(req)
        self.num_tokens += req.num_tokens

    def popleft(self) -> Request:
        req = self.reqs.popleft()
        self.num_tokens -= req.num_tokens
        return req

    def remove(self, req: Request) -> None:
        self.reqs.remove(req)
        self.num_tokens -= req.num_tokens

    def check_integrity(self) -> None:
        if self.num_tokens != sum(r.num_tokens for r in self.reqs):
            raise AssertionError("batch queue token count drifted")
        if not all(r.is_batch for r in self.reqs):
            raise AssertionError("an interactive request waits in the batch queue")
