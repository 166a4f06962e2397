"""The engine step: apply a StepPlan's diffs, run the model once, sample, return a StepResult.

Owns: `ModelRunner`, the per-request state of one worker (token ids, computed count, block
table, sampling params) and the contract with the core scheduler (tidal_core/plan.py):
finished ids are dropped first, new requests introduced, block tables extended, then every
scheduled token is computed in one flattened forward; a token is sampled for each request
whose scheduled tokens reach the end of its known tokens, and appended to its state (the
input of its next decode). A prefix-cache hit starts a new request's state at its
`num_computed_tokens`: the KV of those tokens is read from the (shared) blocks another
request computed, and never written. With tensor parallelism all ranks run the same plan; rank 0
samples and broadcasts the tokens so every rank's state stays identical.

Must not import: ray, transformers (the model is built by actors/model_loader.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from actors.block_tables import BlockTableStore
from actors.cuda_graphs import CudaGraphRunner
from actors.input_batch import RequestState, StepInputs, build_inputs
from actors.models import LlamaForCausalLM, cpu_attention, cpu_fused
from actors.models.attention import BACKENDS
from actors.paged_attention import build_prefill
from actors.sampler import Sampler
from actors.step_timing import StepClock
from tidal_core.plan import NewRequestData, StepPlan, StepResult


def _cached_start(step_id: int, new: NewRequestData, block_size: int) -> int:
    """Where a new request's state starts: after the prefix-cache hit its first blocks hold.

    Those blocks were computed by another request and may be shared; this request never writes
    them, so the hit must end on a block boundary, leave at least one token to compute (the
    one whose logits give the next token) and lie inside the block table it arrives with.
    """
    n = new.num_computed_tokens
    if n == 0:
        return 0
    if n < 0 or n >= new.num_tokens or n % block_size or n // block_size > len(new.block_ids):
        raise AssertionError(f"step {step_id}: {new.request_id} reuses {n} cached tokens of {new.num_tokens} "
                             f"with {len(new.block_ids)} blocks of {block_size}: want a whole number of its "
                             f"blocks, fewer than its tokens")
    return n


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 num_blocks: int, sampler_seed: int | None = None, graphs: CudaGraphRunner | None = None,
                 attention_backend: str = "portable", vectorized_tables: bool | None = None,
                 clock: StepClock | None = None, cpu_attention_kernel: bool = True,
                 cpu_fused_ops: bool = True, cpu_decode_layers: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.device = kv_caches[0][0].device
        self.tp = model.tp
        self.sampler = Sampler(sampler_seed, self.device)
        self.graphs = graphs
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={attention_backend!r}: use one of {BACKENDS}")
        self.attention_backend = attention_backend
        # The portable backend on CPU in float32 has C kernels, each used unless asked not to or it
        # cannot be built (then PyTorch's path, after one log line): decodes read the KV blocks in
        # place (models/cpu_attention.py); the ops between the matmuls (norms, SiLU, RoPE) are one
        # C call each (models/cpu_fused.py).
        cpu_float32 = (attention_backend == "portable" and self.device.type == "cpu"
                       and kv_caches[0][0].dtype == torch.float32)
        self.cpu_decode = cpu_float32 and cpu_attention_kernel and cpu_attention.available()
        self.cpu_fused = cpu_float32 and cpu_fused_ops and cpu_fused.available()
        # With both, a decodes-only step of a model on GGUF blocks runs its layers in one C call
        # (models/cpu_decode_layers.py: the same kernels, without the Python between them).
        self.cpu_layers = self.cpu_decode and self.cpu_fused and cpu_decode_layers
        # One gathered tensor of block tables (default on GPU; CPU keeps the per-request lists).
        if vectorized_tables is None:
            vectorized_tables = self.device.type == "cuda"
        self.tables = BlockTableStore(self.scratch_block, self.device) if vectorized_tables else None
        self.clock = clock or StepClock.for_device(self.device)  # every step ends on a device sync
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
            start = _cached_start(plan.step_id, new, self.block_size)
            prompt = new.num_prompt_tokens if new.num_prompt_tokens is not None else new.num_tokens
            states[new.request_id] = RequestState(list(new.token_ids), start, list(new.block_ids), new.sampling,
                                                  prompt)
        for rid, blocks in plan.new_block_ids.items():
            st = states.get(rid)
            if st is None:
                raise AssertionError(f"step {plan.step_id}: blocks for unknown request {rid}")
            st.block_table.extend(blocks)
        if self.tables is not None:
            self.tables.apply(plan)

    # ---- one step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = self.clock.start()
        self.apply_diffs(plan)
        if plan.is_empty:
            return StepResult(plan.step_id, {}, self.clock.elapsed(t0))
        with torch.inference_mode():
            inputs = self._prepare(plan)
            hidden = self._forward(inputs, plan.padded_batch_size, plan.decode_context_tokens)
            sampled, logprobs = self._sample(inputs, hidden)
        states = self.states
        for rid, n in plan.num_scheduled_tokens.items():
            states[rid].num_computed += n
        for rid, tok in sampled.items():
            states[rid].token_ids.append(tok)
        return StepResult(plan.step_id, sampled if self.tp.is_driver else {}, self.clock.elapsed(t0), logprobs)

    def _prepare(self, plan: StepPlan) -> StepInputs:
        gather = self.tables.gather if self.tables is not None else None
        inputs = build_inputs(plan, self.states, self.block_size, self.scratch_block, self.device, None, gather)
        meta = inputs.meta
        meta.backend = self.attention_backend
        meta.cpu_decode = self.cpu_decode
        meta.cpu_fused = self.cpu_fused
        meta.cpu_layers = self.cpu_layers
        if meta.backend == "triton" and meta.prefills:
            attn = self.model.layers[0].self_attn
            meta.triton_prefill = build_prefill(meta.prefills, self.scratch_block,
                                                attn.shard.q_count // attn.shard.kv_count, self.device)
        return inputs

    def _forward(self, inputs: StepInputs, bucket: int | None, kv_tokens: int) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(bucket) and not inputs.meta.prefills:
            assert bucket is not None
            out = self.graphs.run(inputs, bucket, kv_tokens)
            if out is not None:
                return out
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
            histories = None
            if any(p.has_penalties for p in params):  # what the penalties count
                histories = [(self.states[r].token_ids, self.states[r].num_prompt) for r in rids]
            out = self.sampler.sample(logits, params, inputs.sample_positions, histories)
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
