"""Cross-check the TP4 cost models against LLM-Inference-Bench (Argonne), which the fit never saw.

Those runs are static batches of `b` requests with input = output = L tokens, timed end to
end, on a newer vLLM (2024) than the late-2023 one the models are calibrated to; so this is
an order-of-magnitude check of shape (batch, context), not a fidelity test. Predicted time =
one prefill step of b x L tokens + the L-1 decode steps at growing context.

    .venv/bin/python benchmarks/cost_model_crosscheck.py
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[1]
HARDWARE = {"Nvidia A100 GPU": "a100", "Nvidia H100 GPU": "h100"}


def main() -> int:
    path = ROOT / "data" / "llm-inference-bench" / "All_results.csv"
    print("| GPU | L | batch | measured s | model s | model / measured |")
    print("|---|---|---|---|---|---|")
    with path.open() as fh:
        for r in csv.DictReader(fh):
            gpu = HARDWARE.get(r["Hardware"])
            if gpu is None or r["Framework"] != "vLLM" or r["Model"] != "meta-llama/Llama-2-70b-hf":
                continue
            model = CostModel.load(f"{gpu}-llama70b-tp{int(r['Num of Hardware'])}")
            length, batch, measured = int(r["Input Output Length"]), int(r["Batch Size"]), float(r["Latency"])
            predicted = model.step_time_s(((length, 0),) * batch, 0, 0, None)
            predicted += sum(model.step_time_s((), batch, batch * (length + k), batch if batch <= 64 else None)
                             for k in range(1, length))
            print(f"| {gpu} | {length} | {batch} | {measured:.2f} | {predicted:.2f} | {predicted / measured:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
