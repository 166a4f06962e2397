"""A compact Llama-family decoder (Llama 2/3, SmolLM2, Mistral) written for a paged KV cache.

Owns: `LlamaForCausalLM`: one forward over a flattened batch of tokens (decodes and prefill
chunks mixed, no padding), K/V written into the paged cache, tensor-parallel linears, and a
`weight_shards` table that tells the loader which slice of which checkpoint tensor fills
which slice of which parameter on this rank. QKV and gate/up are fused (fewer matmuls).

Sliding-window attention (Mistral v0.1) is not implemented: configs with a window smaller
than the served context are rejected by the loader.

Must not import: ray, serve_app.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.models import cpu_decode_layers, cpu_fused, fused_ops
from actors.models.attention import AttentionMetadata, attend_in_cache, paged_attention
from actors.models.config import ModelConfig
from actors.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    head_partition,
    split_evenly,
)
from actors.models.rope import RotaryEmbedding, apply_rotary

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class WeightShard:
    """Copy `checkpoint[name]` rows/cols [src_start, src_start+count) along `dim` into
    `param` at [dst_start, dst_start+count) along the same dim."""

    param: str
    dim: int
    src_start: int
    count: int
    dst_start: int


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None,
              on_cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One kernel (Triton's, or the CPU one with `on_cpu`): norm(x + residual) and the sum
        (norm(x) and None without a residual)."""
        return (cpu_fused if on_cpu else fused_ops).rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard = head_partition(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        self.head_dim = cfg.head_dim
        self.q_size = self.shard.q_count * cfg.head_dim
        self.kv_size = self.shard.kv_count * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if meta.backend == "triton":  # fused: RoPE and the K/V cache write in one kernel, attention reads in place
            q = fused_ops.rope_and_cache(self.qkv_proj(x), cos, sin, meta.slot_mapping, kv[0], kv[1],
                                         self.shard.q_count, self.shard.kv_count, self.head_dim)
            return self.o_proj(attend_in_cache(q, kv[0], kv[1], meta, self.scale).reshape(t, self.q_size))
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, -1, self.head_dim)
        if meta.cpu_fused:  # one C call rotates the queries and keys (actors/models/cpu_fused.py)
            q, k = cpu_fused.rope_qk(qkv, cos, sin, self.shard.q_count, self.shard.kv_count, self.head_dim)
        else:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(t, -1, self.head_dim), cos, sin)
            k = apply_rotary(k.view(t, -1, self.head_dim), cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        _, self.local = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * self.local, False, dtype)
        self.down_proj = RowParallelLinear(self.local, cfg.hidden_size, tp, dtype)

    def forward(self, x: torch.Tensor, fused: bool = False, on_cpu: bool = False) -> torch.Tensor:
        if fused:  # one kernel for the gate: Triton's, or the CPU one with `on_cpu`
            return self.down_proj((cpu_fused if on_cpu else fused_ops).silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split([self.local, self.local], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds them, or the next
        layer's norm does (fused on the Triton backend, and on CPU with `meta.cpu_fused`). `residual`
        is None at the first layer."""
        on_cpu = meta.cpu_fused
        if on_cpu or meta.backend == "triton":
            h, res = self.input_layernorm.fused(x, residual, on_cpu)
            residual = x if res is None else res
            h, residual = self.post_attention_layernorm.fused(self.self_attn(h, cos, sin, kv, meta), residual, on_cpu)
            assert residual is not None
            return self.mlp(h, fused=True, on_cpu=on_cpu), residual
        residual = x if residual is None else x + residual
        residual = residual + self.self_attn(self.input_layernorm(residual), cos, sin, kv, meta)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TPContext()
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.tp, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.embed_tokens, cfg.tie_word_embeddings, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, dtype)

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.shard.kv_count

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch (final norm applied)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        layers = cpu_decode_layers.for_step(self, meta, kv_caches, x.shape[0]) if meta.cpu_layers else None
        if layers is not None:  # the same kernels as below, called from C (models/cpu_decode_layers.py)
            return layers.run(x, cos, sin, meta)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        if meta.backend == "triton" or meta.cpu_fused:
            return self.norm.fused(x, residual, meta.cpu_fused)[0]
        return self.norm(x if residual is None else x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab] on rank 0; None on other ranks."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    def weight_shards(self) -> dict[str, list[WeightShard]]:
        """checkpoint tensor name -> where its slice for this rank goes."""
        cfg, tp, hd = self.cfg, self.tp, self.cfg.head_dim
        sh = head_partition(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        inter_start, inter = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
        emb = self.embed_tokens
        table: dict[str, list[WeightShard]] = {
            "model.embed_tokens.weight": [WeightShard("embed_tokens.weight", 0, emb.start, emb.count, 0)],
            "model.norm.weight": [WeightShard("norm.weight", 0, 0, cfg.hidden_size, 0)],
        }
        if not cfg.tie_word_embeddings:
            table["lm_head.weight"] = [WeightShard("lm_head.weight", 0, emb.start, emb.count, 0)]
        q, kv = sh.q_count * hd, sh.kv_count * hd
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
                fused = f"{dst}self_attn.qkv_proj.{kind}"
                table[f"{src}self_attn.q_proj.{kind}"] = [WeightShard(fused, 0, sh.q_start * hd, q, 0)]
                table[f"{src}self_attn.k_proj.{kind}"] = [WeightShard(fused, 0, sh.kv_start * hd, kv, q)]
                table[f"{src}self_attn.v_proj.{kind}"] = [WeightShard(fused, 0, sh.kv_start * hd, kv, q + kv)]
            o_proj = f"{dst}self_attn.o_proj.weight"
            table[f"{src}self_attn.o_proj.weight"] = [WeightShard(o_proj, 1, sh.q_start * hd, q, 0)]
            gate_up = f"{dst}mlp.gate_up_proj.weight"
            table[f"{src}mlp.gate_proj.weight"] = [WeightShard(gate_up, 0, inter_start, inter, 0)]
            table[f"{src}mlp.up_proj.weight"] = [WeightShard(gate_up, 0, inter_start, inter, inter)]
            table[f"{src}mlp.down_proj.weight"] = [WeightShard(f"{dst}mlp.down_proj.weight", 1, inter_start, inter, 0)]
            for norm in ("input_layernorm", "post_attention_layernorm"):
                table[f"{src}{norm}.weight"] = [WeightShard(f"{dst}{norm}.weight", 0, 0, cfg.hidden_size, 0)]
        return table
