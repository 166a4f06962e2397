"""A running server's greedy answers against transformers' `generate` on the same weights.

Sends each prompt as a chat request (temperature 0, `--max-tokens`), `--concurrency` at a time so
the server batches them (decodes of different lengths side by side, chunked prefill for the long
ones, prefix-cache hits on a second pass), and compares each answer's text with what
`AutoModelForCausalLM.generate(do_sample=False)` produces from the same chat template on the
model's converted float32 cache. Reports the prompt tokens both sides counted and every
difference. The default prompts are varied on purpose (code, French, Chinese, JSON, a long
repeated question, a ~340-token story); `--prompts FILE` takes one prompt per line instead.

    make serve   # in another terminal
    python benchmarks/vs_transformers.py [--url http://127.0.0.1:8000] [--max-tokens 150] [--passes 2]

Exit status 1 when any answer differs. Greedy decoding in float32 can still part ways where two
tokens' logits tie to within the summation order of two GEMM kernels; a difference is worth
reading, not only counting.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Write a haiku about the ocean at night.",
    "Explain recursion to a ten-year-old in two sentences.",
    "What is 17 times 23? Show your work.",
    "Translate 'Where is the train station?' into Spanish and German.",
    "List three uses of a paperclip.",
    "def fib(n):\n    # complete this python function",
    "Summarize the plot of Romeo and Juliet.",
    "Qu'est-ce que la photosynthèse ?",
    "Give me a JSON object with keys name and age for a fictional cat.",
    "Why is the sky blue? " * 30,
    "Tell me a story about a robot who learns to paint. " + "It had many adventures. " * 60,
    "What are the primary colors?",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
    "Describe the smell of rain.",
    "你好，请介绍一下你自己。",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the served name and the model to load")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2, help="send the prompts this many times (hits the prefix cache)")
    ap.add_argument("--prompts", type=Path, help="one prompt per line, instead of the built-in set")
    args = ap.parse_args()
    prompts = args.prompts.read_text().splitlines() if args.prompts else PROMPTS

    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.model_loader import prepare

    path = prepare(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="unused")

    def served(prompt: str) -> tuple[str, int]:
        r = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=args.max_tokens, temperature=0)
        return r.choices[0].message.content or "", r.usage.prompt_tokens if r.usage else -1

    def reference(prompt: str) -> tuple[str, int]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), int(ids.shape[1])

    expected = [reference(p) for p in prompts]
    differ = 0
    for n in range(args.passes):
        with ThreadPoolExecutor(args.concurrency) as pool:
            got = list(pool.map(served, prompts))
        for prompt, (text, n_tok), (ref, ref_tok) in zip(prompts, got, expected, strict=True):
            same = text.strip() == ref.strip() and n_tok == ref_tok
            differ += not same
            print(f"pass {n + 1} {'same' if same else 'DIFFERS'}  prompt tokens {n_tok} / {ref_tok}  {prompt[:40]!r}")
            if not same:
                print(f"    server:       {text[:200]!r}\n    transformers: {ref[:200]!r}")
    total = len(prompts) * args.passes
    print(f"{total - differ} of {total} answers identical to transformers' greedy output "
          f"({args.max_tokens} tokens max, {args.concurrency} at a time)")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
