from __future__ import annotations

import pytest

from tidal_core.buckets import CudaGraphBuckets


def test_pad_up_to_nearest_and_eager_above_largest() -> None:
    b = CudaGraphBuckets((1, 2, 4, 8, 16, 32, 64))
    assert [b.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert b.bucket_for(65) is None


def test_steps_of_eight_and_padding_waste() -> None:
    b = CudaGraphBuckets(tuple(range(8, 65, 8)))
    assert b.bucket_for(1) == 8 and b.bucket_for(9) == 16
    b.record(5, b.bucket_for(5))  # 3 padded of 8
    b.record(70, b.bucket_for(70))  # eager: no padding
    assert b.padded_slots == 3
    assert b.padding_waste() == pytest.approx(3 / 78)


def test_invalid_bucket_lists_are_rejected() -> None:
    for sizes in ((4, 2), (0, 1), (1, 1)):
        with pytest.raises(ValueError):
            CudaGraphBuckets(sizes)
    with pytest.raises(ValueError):
        CudaGraphBuckets((1, 2)).bucket_for(0)


def test_no_buckets_means_always_eager() -> None:
    assert CudaGraphBuckets(()).bucket_for(1) is None
