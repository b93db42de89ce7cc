"""Aspect-ratio buckets: the grid, the limits, and which bucket an image lands in."""

from __future__ import annotations

import math

import pytest

from difftune.data.buckets import assign_bucket, cover_size, make_buckets, square_bucket
from difftune.errors import DataError


@pytest.mark.parametrize(
    "resolution,min_side,max_side,step",
    [(1024, 256, 2048, 16), (512, 256, 1024, 64), (1000, 250, 1999, 16), (64, 16, 128, 8)],
)
def test_bucket_sides_on_grid_within_limits(
    resolution: int, min_side: int, max_side: int, step: int
) -> None:
    buckets = make_buckets(resolution, min_side, max_side, step)
    assert buckets == sorted(set(buckets))
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert min_side <= w <= max_side and min_side <= h <= max_side
        assert w * h <= resolution * resolution
    # symmetric: portrait and landscape alike
    assert {(h, w) for w, h in buckets} == set(buckets)


def test_buckets_close_to_target_area() -> None:
    buckets = make_buckets(1024, 256, 2048, 16)
    assert (1024, 1024) in buckets
    # unclamped buckets (aspect up to 4:1) lose less than one grid row of area
    for w, h in buckets:
        if max(w, h) < 2048:
            assert w * h > 1024 * 1024 - 16 * max(w, h)


def test_no_bucket_fits_is_data_error() -> None:
    with pytest.raises(DataError, match="min_side"):
        make_buckets(256, 250, 255, 16)


def test_assign_wide_tall_square() -> None:
    buckets = make_buckets(1024, 256, 2048, 16)
    assert assign_bucket((3000, 3000), buckets) == (1024, 1024)
    assert assign_bucket((50, 50), buckets) == (1024, 1024)
    wide = assign_bucket((3000, 2000), buckets)
    tall = assign_bucket((2000, 3000), buckets)
    assert wide == tall[::-1]
    assert wide[0] > wide[1]
    assert abs(math.log(wide[0] / wide[1]) - math.log(1.5)) < 0.02
    # extreme ratios go to the most extreme bucket available
    assert assign_bucket((10000, 100), buckets) == max(buckets, key=lambda b: b[0] / b[1])


def test_assign_is_nearest_in_log_ratio() -> None:
    buckets = [(512, 512), (768, 384), (384, 768)]
    # 1.41 is nearer 1 than 2 on a log scale (sqrt 2 is the midpoint)
    assert assign_bucket((141, 100), buckets) == (512, 512)
    assert assign_bucket((142, 100), buckets) == (768, 384)


def test_square_bucket_rounds_to_step() -> None:
    assert square_bucket(1024, 16) == (1024, 1024)
    assert square_bucket(1000, 16) == (992, 992)


@pytest.mark.parametrize("size", [(3000, 2000), (100, 37), (1248, 832), (7, 9000)])
def test_cover_size_covers_bucket(size: tuple[int, int]) -> None:
    bucket = assign_bucket(size, make_buckets(1024, 256, 2048, 16))
    rw, rh = cover_size(size, bucket)
    assert rw >= bucket[0] and rh >= bucket[1]
    assert rw == bucket[0] or rh == bucket[1]  # tight on one side
