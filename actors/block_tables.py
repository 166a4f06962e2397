"""Block tables as one tensor: each request's table lives in a row, and a step's decode tables
are gathered with one `index_select` and one host-to-device copy.

Owns: `BlockTableStore`, a host tensor `[rows, width]` pre-filled with the scratch block, in
which each live request owns a row (written once when the request arrives, extended in place
as the plan appends blocks, handed back when it finishes). `gather(rids, width)` is the
padded `[len(rids), width]` table of those requests, equal to padding each Python list to
`width` with the scratch block (tested), without building a Python row per request per step.
Rows and width grow by doubling when a request needs more. On CUDA the gathered rows land in a
pinned staging buffer so the copy to the device is asynchronous.

Must not import: ray, serve_app.
"""

from __future__ import annotations

import torch


class BlockTableStore:
    def __init__(self, pad: int, device: torch.device, rows: int = 64, width: int = 64) -> None:
        self.pad = pad
        self.device = device
        self._pin = device.type == "cuda"
        self.table = self._new(rows, width)
        self.rows: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._staging = self._new(1, rows * width).view(-1)

    def _new(self, rows: int, width: int) -> torch.Tensor:
        t = torch.full((rows, width), self.pad, dtype=torch.long)
        return t.pin_memory() if self._pin else t

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        new_rows, new_width = max(rows, old.shape[0]), max(width, old.shape[1])
        if (new_rows, new_width) == tuple(old.shape):
            return
        self.table = self._new(new_rows, new_width)
        self.table[:old.shape[0], :old.shape[1]] = old
        self._free = list(range(new_rows - 1, old.shape[0] - 1, -1)) + self._free

    def add(self, rid: str, blocks: list[int]) -> None:
        if rid in self.rows:
            raise AssertionError(f"block table of {rid} added twice")
        if not self._free:
            self._grow(2 * self.table.shape[0], 0)
        row = self._free.pop()
        self.rows[rid] = row
        self.lengths[rid] = 0
        self.extend(rid, blocks)

    def extend(self, rid: str, blocks: list[int]) -> None:
        row, start = self.rows[rid], self.lengths[rid]
        end = start + len(blocks)
        if end > self.table.shape[1]:
            self._grow(0, max(end, 2 * self.table.shape[1]))
        if blocks:
            self.table[row, start:end] = torch.tensor(blocks, dtype=torch.long)
        self.lengths[rid] = end

    def drop(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is None:
            return
        self.table[row, :self.lengths.pop(rid)] = self.pad
        self._free.append(row)

    def apply(self, plan: object) -> None:
        """Mirror a StepPlan's diffs (finished, new requests, appended blocks), in the runner's order."""
        for rid in plan.finished_ids:  # type: ignore[attr-defined]
            self.drop(rid)
        for new in plan.new_requests:  # type: ignore[attr-defined]
            self.add(new.request_id, list(new.block_ids))
        for rid, blocks in plan.new_block_ids.items():  # type: ignore[attr-defined]
            self.extend(rid, blocks)

    def gather(self, rids: list[str], width: int) -> torch.Tensor:
        """The padded tables of `rids` (in that order) on the store's device: [len(rids), width]."""
        if width > self.table.shape[1]:
            self._grow(0, width)
        index = torch.tensor([self.rows[r] for r in rids], dtype=torch.long)
        if self.device.type == "cpu":
            return self.table[:, :width].index_select(0, index)
        # Into a pinned staging buffer, then one asynchronous copy. The buffer is reused by the next
        # step's gather, which comes after this step ended on a synchronize (actors/step_timing.py).
        n = len(rids) * width
        if self._staging.numel() < n:
            self._staging = self._new(1, 2 * n).view(-1)
        out = self._staging[:n].view(len(rids), width)
        torch.index_select(self.table[:, :width], 0, index, out=out)
        return out.to(self.device, non_blocking=self._pin)
