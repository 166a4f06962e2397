"""How a front gate prices a burst against the unit's own prediction, from an idle unit's snapshot.

One A100 70B TP8 unit of the simulator (configs/sim.yaml's cost model, adaptive, admission wide
open so every prediction is compared): its published snapshot taken idle, then `--n` prompts of
`--tokens` arriving together. For the k-th, the unit's own predicted TTFT against what a front
gate estimates from that snapshot: priced as a burst (`price_per_token`, the shipped rule) and at
the flat price of one prompt alone (`prefill_s_per_token`, the rule before). Pure core, no Ray.

    python benchmarks/burst_price.py [--n 24] [--tokens 400] [--cost-model a100-llama70b-tp8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.cost_model import CostModel
from loadgen.sim.runner import unit_config
from tidal_core import AdmissionConfig, Request, SamplingParams, Scheduler, preset
from tidal_core.front_admission import price_per_token, published_load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--cost-model", default="a100-llama70b-tp8")
    args = ap.parse_args(argv)
    unit = Scheduler(preset("adaptive", unit_config(CostModel.load(args.cost_model)),
                            admission=AdmissionConfig(target_ttft_s=1e6, target_tpot_s=0.1)))
    load = published_load(unit, 0.0)
    print(f"idle snapshot: prefill_s_per_token {load.prefill_s_per_token:.4g}, "
          f"burst_s_per_token {load.burst_s_per_token:.4g}\n")
    print("| k | unit's prediction (s) | burst price (s) | / unit | flat price (s) | / unit |\n"
          "|---|---|---|---|---|---|")
    for k in range(1, args.n + 1):
        req = Request(f"r{k}", args.tokens, SamplingParams(max_tokens=128), 0.0)
        assert unit.add_request(req, 0.0) is None and req.predicted_ttft_s is not None
        unit_s, tokens = req.predicted_ttft_s, args.tokens * k
        burst, flat = tokens * price_per_token(load, k), tokens * load.prefill_s_per_token
        print(f"| {k} | {unit_s:.3f} | {burst:.3f} | {burst / unit_s:.3f} | {flat:.3f} | {flat / unit_s:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
