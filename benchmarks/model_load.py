"""Loading SmolLM2 from the converted cache (issue: model execution, goal <= 5 s).

    .venv/bin/python benchmarks/model_load.py

Times `import torch, transformers`, then `load_model("smollm2-135m-instruct")` twice in the
same process (the first load includes the lazy imports the loader does; the GGUF must already
be converted by `make model`).
"""

from __future__ import annotations

import time

t0 = time.perf_counter()
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401

t1 = time.perf_counter()
from actors.model_loader import load_model  # noqa: E402

t2 = time.perf_counter()
load_model("smollm2-135m-instruct")
t3 = time.perf_counter()
load_model("smollm2-135m-instruct")
t4 = time.perf_counter()
print(f"torch+transformers import {t1 - t0:.2f} s, loader import {t2 - t1:.2f} s, "
      f"first load {t3 - t2:.2f} s, second load {t4 - t3:.2f} s")
