"""Turning one StepPlan plus the runner's per-request state into model inputs.

Owns: `RequestState` (what a worker knows of a request: all its token ids, how many have KV,
its block table, its sampling parameters) and `build_inputs` (flat token ids, positions,
KV slots, attention metadata and which rows sample). Contract violations (a plan that
disagrees with the state) raise AssertionError with the request id: they are bugs.

Must not import: ray, transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from actors.models.attention import AttentionMetadata, PrefillSpan


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    sampling: Any  # tidal_core.SamplingParams (duck-typed: see actors/sampler.py)
    num_prompt: int = -1  # leading token ids that are the prompt (-1: all; the rest were generated)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rids: list[str]
    sample_indices: torch.Tensor  # flat index of each sampling request's last token
    sample_positions: list[int]  # position of the token each sampling request produces


def _decode_tables(tables: list[list[int]], pad: int, width: int | None) -> torch.Tensor:
    w = width if width is not None else max(map(len, tables))
    return torch.tensor([t + [pad] * (w - len(t)) for t in tables], dtype=torch.long)


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def decode_groups(widths: list[int], max_groups: int = 4) -> list[tuple[int, int, int]]:
    """(start, end, width) runs of ascending block-table widths, a new run when the width doubles.

    Each run gathers only up to its own widest table, instead of every decode up to the
    batch's widest (decodes of very different lengths would mostly gather padding).
    """
    groups: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(widths) + 1):
        if i == len(widths) or (widths[i] > 2 * widths[start] and len(groups) < max_groups - 1):
            groups.append((start, i, widths[i - 1]))
            start = i
    return groups


TableGather = Callable[[list[str], int], torch.Tensor]  # (request ids, width) -> padded [n, width] tables


def build_inputs(plan: Any, states: dict[str, RequestState], block_size: int, scratch_block: int,
                 device: torch.device, decode_width: int | None = None,
                 tables: TableGather | None = None) -> StepInputs:
    """Decodes first (one token each, by ascending context), then prefill chunks in plan order.

    The runner maps results back by request id, so the flat order is its own choice: sorted
    decodes make the length groups of the decode attention contiguous slices. With `tables`
    (actors/block_tables.py) the decode tables come from one gather instead of padded lists.
    """
    decodes: list[tuple[str, RequestState]] = []
    prefills: list[tuple[str, RequestState, int]] = []
    prefill_ctx = plan.prefill_context
    for rid, n in plan.num_scheduled_tokens.items():
        st = states.get(rid)
        if st is None:
            raise AssertionError(f"step {plan.step_id}: {rid} is scheduled but was never introduced")
        ctx, end = st.num_computed, st.num_computed + n
        if end > len(st.token_ids) or n < 1:
            raise AssertionError(f"step {plan.step_id}: {rid} schedules {n} tokens at {ctx} "
                                 f"but knows {len(st.token_ids)}")
        if -(-end // block_size) > len(st.block_table):
            raise AssertionError(f"step {plan.step_id}: {rid} needs {-(-end // block_size)} blocks, "
                                 f"holds {len(st.block_table)}")
        if rid in prefill_ctx:
            if prefill_ctx[rid] != ctx:
                raise AssertionError(f"step {plan.step_id}: {rid} prefill context {prefill_ctx[rid]} != tracked {ctx}")
            prefills.append((rid, st, n))
        elif prefills or n != 1 or end != len(st.token_ids):
            raise AssertionError(f"step {plan.step_id}: decode {rid} out of order or not at its last token")
        else:
            decodes.append((rid, st))
    decodes.sort(key=lambda item: item[1].num_computed)
    return _assemble(decodes, prefills, block_size, scratch_block, device, decode_width, tables)


def _assemble(decodes: list[tuple[str, RequestState]], prefills: list[tuple[str, RequestState, int]],
              block_size: int, scratch_block: int, device: torch.device, decode_width: int | None,
              tables: TableGather | None = None) -> StepInputs:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    dec_widths: list[int] = []
    spans: list[PrefillSpan] = []
    sample_rids: list[str] = []
    sample_idx: list[int] = []
    sample_pos: list[int] = []
    for rid, st in decodes:
        ctx = st.num_computed
        table = st.block_table
        ids.append(st.token_ids[ctx])
        pos.append(ctx)
        slots.append(table[ctx // block_size] * block_size + ctx % block_size)
        dec_widths.append(ctx // block_size + 1)
        if tables is None:
            dec_tables.append(table[:dec_widths[-1]])
        dec_lens.append(ctx + 1)
        sample_rids.append(rid)
        sample_idx.append(len(ids) - 1)
        sample_pos.append(ctx + 1)
    for rid, st, n in prefills:
        ctx, end, table = st.num_computed, st.num_computed + n, st.block_table
        spans.append(PrefillSpan(len(ids), n, ctx, torch.tensor(table[:-(-end // block_size)], dtype=torch.long,
                                                                  device=device)))
        ids.extend(st.token_ids[ctx:end])
        pos.extend(range(ctx, end))
        slots.extend(_slots(table, ctx, end, block_size))
        if end == len(st.token_ids):
            sample_rids.append(rid)
            sample_idx.append(len(ids) - 1)
            sample_pos.append(end)
    dec_table = None
    if decodes:
        if tables is None:
            dec_table = _decode_tables(dec_tables, scratch_block, decode_width).to(device)
        else:
            dec_table = tables([rid for rid, _ in decodes], decode_width or max(dec_widths))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(decodes),
        decode_block_tables=dec_table,
        decode_context_lens=torch.tensor(dec_lens, dtype=torch.long, device=device) if decodes else None,
        prefills=spans,
        decode_groups=decode_groups(dec_widths) if decodes and decode_width is None else None,
    )
    return StepInputs(torch.tensor(ids, dtype=torch.long, device=device),
                      torch.tensor(pos, dtype=torch.long, device=device), meta, sample_rids,
                      torch.tensor(sample_idx, dtype=torch.long, device=device), sample_pos)
