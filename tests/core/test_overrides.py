"""`key=value` overrides of scheduler fields (what `tidal simulate --set` applies)."""

from __future__ import annotations

import pytest

from tidal_core import preset
from tidal_core.overrides import apply_overrides, parse_pairs


def test_nested_and_top_level_fields_take_typed_values() -> None:
    cfg = apply_overrides(preset("sarathi"), parse_pairs([
        "max_num_batched_tokens=512", "admission.target_ttft_s=2", "admission.target_tpot_s=none",
        "regime.enabled=false", "cuda_graph_buckets=1,2,4", "admission.max_concurrent_requests=64"]))
    assert cfg.max_num_batched_tokens == 512 and cfg.admission.target_ttft_s == 2.0
    assert cfg.admission.target_tpot_s is None and cfg.regime.enabled is False
    assert cfg.cuda_graph_buckets == (1, 2, 4) and cfg.admission.max_concurrent_requests == 64
    assert cfg.policy == "sarathi"


@pytest.mark.parametrize(("pairs", "message"), [
    (["admission.bogus=1"], "AdmissionConfig has no field 'bogus'; known: aim_floor, aim_gain"),
    (["bogus=1"], "SchedulerConfig has no field 'bogus'"),
    (["max_num_batched_tokens=lots"], "expected int"),
    (["admission=1"], "'admission' is a group"),
    (["max_batch_size.x=1"], "is a plain value"),
    (["max_batch_size"], "write key=value"),
    (["max_num_batched_tokens=4"], "must be >= max_batch_size"),  # the config's own validation
])
def test_bad_overrides_fail_clearly(pairs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_overrides(preset("adaptive"), parse_pairs(pairs))
