"""The engine step: apply a StepPlan's diffs, run the model once, sample, return a StepResult.

Owns: `ModelRunner`, the per-request state of one worker (token ids, computed count, block
table, sampling params) and the contract with the core scheduler (tidal_core/plan.py):
finished ids are dropped first, new requests introduced, block tables extended, then every
scheduled token is computed in one flattened forward; a token is sampled for each request
whose scheduled tokens reach the end of its known tokens, and appended to its state (the
input of its next decode). With tensor parallelism all ranks run the same plan; rank 0
samples and broadcasts the tokens so every rank's state stays identical.

Must not import: ray, transformers (the model is built by actors/model_loader.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from actors.cuda_graphs import CudaGraphRunner
from actors.input_batch import RequestState, StepInputs, add_flash_metadata, build_inputs
from actors.models import LlamaForCausalLM
from actors.models.attention import HAVE_FLASH_ATTN
from actors.sampler import Sampler
from tidal_core.plan import StepPlan, StepResult


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 num_blocks: int, sampler_seed: int | None = None, graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.device = kv_caches[0][0].device
        self.tp = model.tp
        self.sampler = Sampler(sampler_seed, self.device)
        self.graphs = graphs
        self.use_flash = HAVE_FLASH_ATTN and self.device.type == "cuda" and block_size % 256 == 0
        self.states: dict[str, RequestState] = {}
        # Tests compare logits with a reference model; off in serving (a copy per step).
        self.keep_logits = False
        self.last_logits: dict[str, torch.Tensor] = {}

    # ---- plan diffs ----------------------------------------------------------------------
    def apply_diffs(self, plan: StepPlan) -> None:
        states = self.states
        for rid in plan.finished_ids:
            states.pop(rid, None)
        for new in plan.new_requests:
            if new.request_id in states:
                raise AssertionError(f"step {plan.step_id}: {new.request_id} introduced twice")
            if new.token_ids is None or len(new.token_ids) != new.num_tokens:
                raise AssertionError(f"step {plan.step_id}: {new.request_id} arrives without its token ids")
            states[new.request_id] = RequestState(list(new.token_ids), 0, list(new.block_ids), new.sampling)
        for rid, blocks in plan.new_block_ids.items():
            st = states.get(rid)
            if st is None:
                raise AssertionError(f"step {plan.step_id}: blocks for unknown request {rid}")
            st.block_table.extend(blocks)

    # ---- one step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.apply_diffs(plan)
        if plan.is_empty:
            return StepResult(plan.step_id, {}, time.perf_counter() - t0)
        with torch.inference_mode():
            inputs = self._prepare(plan)
            hidden = self._forward(inputs, plan.padded_batch_size)
            sampled, logprobs = self._sample(inputs, hidden)
        states = self.states
        for rid, n in plan.num_scheduled_tokens.items():
            states[rid].num_computed += n
        for rid, tok in sampled.items():
            states[rid].token_ids.append(tok)
        return StepResult(plan.step_id, sampled if self.tp.is_driver else {}, time.perf_counter() - t0, logprobs)

    def _prepare(self, plan: StepPlan) -> StepInputs:
        width = self.graphs.buffers.table_width if self._use_graph(plan.padded_batch_size) else None
        inputs = build_inputs(plan, self.states, self.block_size, self.scratch_block, self.device, width)
        if self.use_flash:
            add_flash_metadata(inputs, self.scratch_block)
        return inputs

    def _use_graph(self, bucket: int | None) -> bool:
        return self.graphs is not None and self.graphs.can_run(bucket)

    def _forward(self, inputs: StepInputs, bucket: int | None) -> torch.Tensor:
        if bucket is not None and self._use_graph(bucket) and not inputs.meta.prefills:
            assert self.graphs is not None
            return self.graphs.run(inputs, bucket)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor) -> tuple[dict[str, int], dict[str, Any] | None]:
        rids = inputs.sample_rids
        if not rids:
            return {}, None
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
        tokens = torch.empty(len(rids), dtype=torch.long, device=self.device)
        logprobs: dict[str, Any] | None = None
        if logits is not None:  # rank 0
            params = [self.states[r].sampling for r in rids]
            if self.keep_logits:
                self.last_logits = dict(zip(rids, logits.cpu().clone(), strict=True))
            out = self.sampler.sample(logits, params, inputs.sample_positions)
            tokens.copy_(torch.tensor(out.token_ids, device=self.device))
            lps = {r: lp for r, lp in zip(rids, out.logprobs, strict=True) if lp is not None}
            logprobs = lps or None
        if self.tp.size > 1 and self.tp.collectives:
            dist.broadcast(tokens, group=self.tp.group, group_src=0)
        return dict(zip(rids, tokens.tolist(), strict=True)), logprobs

    # ---- introspection -------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.states)

    def context_len(self, request_id: str) -> int:
        return self.states[request_id].num_computed
