"""Per-key RPM/TPM token buckets: a minute's burst, steady refill, token debt, exact retry-after."""

from __future__ import annotations

import pytest

from tidal_core.rate_limit import KeyLimits, RateLimiter


def test_requests_burst_to_the_minute_then_refill_at_rpm_over_60() -> None:
    lim = RateLimiter(KeyLimits(rpm=6))
    verdicts = [lim.admit("k", 100.0) for _ in range(8)]
    assert [v.allowed for v in verdicts] == [True] * 6 + [False] * 2
    refused = verdicts[6]
    assert refused.kind == "requests" and refused.limit == 6
    assert refused.retry_after_s == pytest.approx(10.0)  # one request per 10 s
    assert not lim.admit("k", 109.9).allowed
    assert lim.admit("k", 110.0).allowed
    assert not lim.admit("k", 110.0).allowed


def test_keys_have_their_own_buckets_and_overrides() -> None:
    lim = RateLimiter(KeyLimits(rpm=1), {"vip": KeyLimits(rpm=3)})
    assert lim.admit("a", 0).allowed and not lim.admit("a", 0).allowed
    assert lim.admit("b", 0).allowed
    assert [lim.admit("vip", 0).allowed for _ in range(4)] == [True, True, True, False]


def test_tokens_are_charged_after_the_fact_and_debt_blocks_new_requests() -> None:
    lim = RateLimiter(KeyLimits(tpm=600))  # 10 tokens/s
    assert lim.admit("k", 0).allowed
    lim.charge("k", 900, 1.0)  # a long answer: 300 tokens of debt at t=1
    refused = lim.admit("k", 1.0)
    assert not refused.allowed and refused.kind == "tokens" and refused.limit == 600
    assert refused.retry_after_s == pytest.approx(30.1)  # back to one token left
    assert not lim.admit("k", 31.0).allowed
    assert lim.admit("k", 31.2).allowed


def test_unlimited_keys_cost_nothing_and_forget_drops_state() -> None:
    lim = RateLimiter()
    assert all(lim.admit("k", 0).allowed for _ in range(10_000))
    lim = RateLimiter(KeyLimits(rpm=1))
    assert lim.admit("old", 0).allowed and not lim.admit("old", 0).allowed
    lim.forget({"new"})
    assert lim.admit("old", 0).allowed  # a key that comes back starts with a fresh minute


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError, match="whole number"):
        KeyLimits(rpm=bad)  # type: ignore[arg-type]
