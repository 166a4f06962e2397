"""Loading: the SmolLM2 alias (GGUF -> cached safetensors + config + tokenizer with its chat
template), HF checkpoint directories, and weight sharding for TP ranks from safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors import model_loader
from actors.models import TPContext
from tests.model_helpers import save_tiny_checkpoint, smollm2_path


def test_alias_converts_once_into_the_cache() -> None:
    path = smollm2_path()
    assert path.parent == model_loader.cache_root()
    assert (path / "model.safetensors").exists() and (path / "config.json").exists()
    assert model_loader.prepare("smollm2-135m-instruct") == path  # cached: no second conversion
    cfg = model_loader.load_model_config(path)
    assert cfg.tie_word_embeddings and (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (9, 3, 30)
    tok = model_loader.load_tokenizer(path)
    assert tok.chat_template
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "Hi" in chat and chat != "Hi"
    assert 2 in model_loader.eos_token_ids(path, cfg, tok)


def test_directory_and_tp_shards_reassemble(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path / "ckpt", num_key_value_heads=4)
    assert model_loader.prepare(str(path)) == path
    cfg = model_loader.load_model_config(path)
    full = model_loader.build_model(cfg)
    model_loader.load_weights(full, path)
    shards = []
    for rank in range(2):
        m = model_loader.build_model(cfg, TPContext(rank, 2, None, collectives=False))
        model_loader.load_weights(m, path)
        shards.append(m)
    name = "layers.1.mlp.down_proj.weight"  # row-parallel: split along the input dimension
    joined = torch.cat([dict(s.named_parameters())[name] for s in shards], dim=1)
    assert torch.equal(joined, dict(full.named_parameters())[name])
    name = "layers.0.self_attn.qkv_proj.weight"  # fused: each rank's q, k, v heads
    q_full, k_full, _ = dict(full.named_parameters())[name].split([64, 32, 32])
    q0, k0, _ = dict(shards[0].named_parameters())[name].split([32, 16, 16])
    assert torch.equal(q0, q_full[:32]) and torch.equal(k0, k_full[:16])


def test_missing_checkpoint_pieces_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        model_loader.prepare(str(tmp_path))
    path = save_tiny_checkpoint(tmp_path / "ckpt")
    cfg = model_loader.load_model_config(path)
    bigger = model_loader.build_model(type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                                                   "num_layers": cfg.num_layers + 1}))
    with pytest.raises(ValueError, match="lacks"):
        model_loader.load_weights(bigger, path)
