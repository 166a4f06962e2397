"""A burst that fills the running batch: the requests admitted behind it keep the TTFT target.

2,000 chat requests in 10 s (prompts of 70-620 tokens, 128 output tokens each) into one
simulated A100 70B unit with configs/sim.yaml's scheduler and SLO. The batch reaches the step
sizer's cap within ~3 s, with requests that all started together and none finishes for seconds.
Admission used to price the wait for a slot at the unit's steady-state departure rate and let
requests in that then waited 1-2.7 s for their first token (0.905 of the admitted within 1 s);
the forecast from the running requests' ages (core/departures.py) refuses them instead.
"""

from __future__ import annotations

import numpy as np

from calibration.cost_model import CostModel
from loadgen.records import Trace
from loadgen.report import Slo
from loadgen.sim.runner import RunSpec, sim_config, unit_config
from loadgen.sim.simulation import simulate


def test_requests_admitted_behind_a_young_full_batch_keep_the_ttft_target() -> None:
    cost = CostModel.load("a100-llama70b-tp8")
    n = 2000
    prompts = np.random.default_rng(1).integers(70, 620, n)
    trace = Trace("burst", np.arange(n) * 10.0 / n, prompts, np.full(n, 128), duration_s=10.0)
    run = simulate(trace, sim_config(RunSpec(trace, unit_config(cost), cost, Slo(1.0, 0.1)), "adaptive"))
    ttft = run.outcomes.ttft_s[np.isfinite(run.outcomes.ttft_s)]
    cap = max(run.samples.batch_size)
    assert ttft.size > cap >= 64  # the batch filled, and requests were admitted once it had
    assert (ttft <= 1.0).mean() >= 0.98
    assert ttft.max() <= 1.1
