"""Calibration data readers for the cost model (stdlib csv only).

Owns: where the calibration files live (data/ in the repository, or `--data-dir`), the
measured points of SplitwiseSim's perf_model.csv (median of the repeats, the two slices, the
train / held-out split), Vidur's operator, all-reduce and attention profiles as curves, and
the origin and commit of every file (read from each folder's SOURCE.md).

Must not import: ray, torch, numpy (the fit imports numpy; reading data does not need it).
"""

from __future__ import annotations

import csv
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tidal_data import data_dir

DATA_DIR = data_dir()
SPLITWISE = "splitwise-sim-perf"
VIDUR = "vidur-profiling"
HIDDEN = 8192  # Llama-70B hidden size: an all-reduce of T tokens moves T * 8192 * 2 bytes
DECODE_OUTPUT_TOKENS = 128  # the slices' token_size
GPUS = {"a100": ("a100-80gb", "a100", "a100_dgx"), "h100": ("h100-80gb", "h100", "h100_dgx")}
"""Our GPU name -> (splitwise hardware, vidur compute folder, vidur network folder)."""
LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
              "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
"""Every non-attention op of one layer in Vidur's mlp.csv (emb is absent from some files and once per model)."""
MLP_FILE = "compute/{gpu}/meta-llama/Llama-2-70b-hf/mlp.csv"
ALLREDUCE_FILE = "network/{net}/all_reduce.csv"
ATTENTION_FILE = "legacy-2024-05-08/a100/attention.csv"
ATTENTION_TP = 2  # the only attention profile is at TP2 (32 query heads per GPU)
CITE = {SPLITWISE: "Patel et al., Splitwise: Efficient Generative LLM Inference Using Phase Splitting, ISCA 2024",
        VIDUR: "Agrawal et al., Vidur: A Large-Scale Simulation Framework for LLM Inference, MLSys 2024 "
               "(arXiv:2405.05465)"}


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """One (kind, prompt, batch) configuration of perf_model.csv: the median of its repeats.

    A prefill point is one step of `batch` prompts of `prompt` tokens with an empty cache
    (SplitwiseSim's reading of prompt_time); a decode point is one decode iteration of
    `batch` sequences, averaged over the 127 iterations of a 128-token generation.
    """

    kind: str  # "prefill" | "decode"
    prompt: int
    batch: int
    measured_ms: float
    num_repeats: int
    held_out: bool
    graph: bool = False  # a decode replayed from a CUDA graph (`tidal profile` on a GPU); SplitwiseSim's are eager

    @property
    def slice(self) -> str:
        return "prompt" if self.batch == 1 else "batch"

    @property
    def tokens(self) -> int:
        return self.prompt * self.batch if self.kind == "prefill" else self.batch

    @property
    def decode_context_tokens(self) -> int:
        """Summed KV length of the decodes: iteration k attends over prompt + k tokens, k = 1..127."""
        return self.batch * (self.prompt + DECODE_OUTPUT_TOKENS // 2) if self.kind == "decode" else 0

    def step_args(self) -> tuple[tuple[tuple[int, int], ...], int, int, int | None]:
        """Arguments of `CostModel.step_time_s` (eager steps: late-2023 vLLM ran without CUDA graphs;
        a graph decode is padded to its own batch, which is a captured bucket)."""
        if self.kind == "prefill":
            return ((self.prompt, 0),) * self.batch, 0, 0, None
        return (), self.batch, self.decode_context_tokens, self.batch if self.graph else None

    @property
    def label(self) -> str:
        return f"{self.kind} {self.batch}x{self.prompt}"


def splitwise_points(gpu: str, tp: int, data_dir: Path = DATA_DIR, model: str = "llama2-70b") -> list[MeasuredPoint]:
    """The two slices at 128 output tokens: (a) batch 1, every prompt size; (b) prompt 512, every batch.

    Held out (deterministic): every other prompt size of slice (a) and every other batch
    size of slice (b), counting from the second smallest, so the extremes are always fitted.
    """
    hardware = GPUS[gpu][0]
    repeats: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    with (data_dir / SPLITWISE / "perf_model.csv").open() as fh:
        for r in csv.DictReader(fh):
            if (r["model"], r["hardware"], int(r["tensor_parallel"])) != (model, hardware, tp):
                continue
            if int(r["token_size"]) != DECODE_OUTPUT_TOKENS:
                continue
            prompt, batch = int(r["prompt_size"]), int(r["batch_size"])
            if batch == 1 or prompt == 512:
                repeats[(prompt, batch)].append((float(r["prompt_time"]), float(r["token_time"])))
    if not repeats:
        raise ValueError(f"no {model} rows for {hardware} at TP{tp} in {SPLITWISE}/perf_model.csv")
    prompts = sorted(p for p, b in repeats if b == 1)
    batches = sorted(b for p, b in repeats if p == 512)
    points = []
    for (prompt, batch), rows in sorted(repeats.items()):
        held = prompts.index(prompt) % 2 == 1 if batch == 1 else batches.index(batch) % 2 == 1
        # (512, 1) is in both slices (and repeated there): count its distinct repeats once.
        distinct = sorted(set(rows))
        for kind, col in (("prefill", 0), ("decode", 1)):
            points.append(MeasuredPoint(kind, prompt, batch, statistics.median(r[col] for r in distinct),
                                        len(distinct), held))
    return points


def linear_ops_curve(gpu: str, tp: int, data_dir: Path = DATA_DIR) -> list[tuple[int, float]]:
    """(num_tokens, ms per layer per GPU) of every non-attention op, summed (median per op)."""
    path = data_dir / VIDUR / MLP_FILE.format(gpu=GPUS[gpu][1])
    by_tokens: dict[int, list[float]] = defaultdict(list)
    with path.open() as fh:
        for r in csv.DictReader(fh):
            if int(r["num_tensor_parallel_workers"]) == tp:
                by_tokens[int(r["num_tokens"])].append(sum(float(r[f"time_stats.{op}.median"]) for op in LINEAR_OPS))
    return sorted((t, statistics.median(v)) for t, v in by_tokens.items())


def allreduce_curve(gpu: str, tp: int, data_dir: Path = DATA_DIR) -> list[tuple[int, float]]:
    """(tokens, ms) of one NCCL all-reduce of `tokens` fp16 hidden states among `tp` GPUs of one node."""
    path = data_dir / VIDUR / ALLREDUCE_FILE.format(net=GPUS[gpu][2])
    by_tokens: dict[int, list[float]] = defaultdict(list)
    with path.open() as fh:
        for r in csv.DictReader(fh):
            if int(r["num_workers"]) == tp and int(r["devices_per_node"]) == tp:
                tokens = int(r["size"]) // (HIDDEN * 2)
                if tokens >= 1:
                    by_tokens[tokens].append(float(r["time_stats.all_reduce.median"]))
    return sorted((t, statistics.median(v)) for t, v in by_tokens.items())


def attention_rows(data_dir: Path = DATA_DIR) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """Legacy A100 TP2 FlashAttention kernel times, ms per layer.

    Returns (prefill rows (chunk, prior context, ms) at batch 1, decode rows (batch, context, ms)).
    """
    prefill, decode = [], []
    with (data_dir / VIDUR / ATTENTION_FILE).open() as fh:
        for r in csv.DictReader(fh):
            batch, ctx = int(r["batch_size"]), int(r["kv_cache_size"])
            if r["is_prefill"] == "True":
                if batch == 1:
                    prefill.append((int(r["prefill_chunk_size"]), ctx, float(r["time_stats.attn_prefill.median"])))
            else:
                decode.append((batch, ctx, float(r["time_stats.attn_decode.median"])))
    return prefill, decode


def source(folder: str, relpath: str, data_dir: Path = DATA_DIR) -> dict[str, str]:
    """Origin repository and commit of one data file, as its folder's SOURCE.md states them."""
    text = (data_dir / folder / "SOURCE.md").read_text()
    origin = re.search(r"Origin:\s*(\S+)", text)
    lines = text.splitlines()
    commit = None
    for i, line in enumerate(lines):
        if f"`{relpath}`" in line or relpath in line:
            found = re.search(r"\b[0-9a-f]{40}\b", " ".join(lines[i:i + 2]))
            if found:
                commit = found.group(0)
                break
    if commit is None:
        snapshot = re.search(r"Snapshot commit ([0-9a-f]{40})", text)
        commit = snapshot.group(1) if snapshot else "unknown"
    return {"file": f"data/{folder}/{relpath}", "origin": origin.group(1).rstrip(",") if origin else "unknown",
            "commit": commit}
