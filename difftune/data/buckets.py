"""Aspect-ratio buckets: which (width, height) each training image is resized and cropped to.

A dataset trains at about `resolution²` pixels per image, whatever the image's shape. Candidate
buckets have both sides a multiple of `step` (the family's latent granularity), both sides in
[min_side, max_side] and an area at most `resolution²`; for each width the tallest height that
fits is taken, so every bucket is as close to the target area as the grid allows. An image goes
to the bucket whose aspect ratio is nearest on a log scale (2:1 and 1:2 are equally far from
1:1), is scaled to *cover* the bucket and is cropped.

Upscaling: an image smaller than its bucket is scaled up to cover it (there is no
`bucket_no_upscale`). Every bucket of a dataset then holds about the same number of latent
tokens, which keeps the step cost and the loss scale uniform; `DataSet.summary()` counts the
upscaled images so `difftune check` can point them out.
"""

from __future__ import annotations

import math

from difftune.errors import DataError

Bucket = tuple[int, int]


def _grid(lo: int, hi: int, step: int) -> range:
    """Multiples of `step` within [lo, hi]."""
    first = -(-lo // step) * step  # round lo up to the grid
    return range(max(first, step), hi // step * step + 1, step)


def make_buckets(resolution: int, min_side: int, max_side: int, step: int) -> list[Bucket]:
    """All candidate buckets (width, height) for one dataset, sorted.

    For every width on the grid the height is the largest grid value with
    width * height <= resolution² (clamped to max_side); the transposed bucket is added too so
    portrait and landscape are treated alike. Raises `DataError` when the limits leave no bucket.
    """
    area = resolution * resolution
    sides = _grid(min_side, max_side, step)
    out: set[Bucket] = set()
    for w in sides:
        h = min(max_side, area // w // step * step)
        if h >= min_side and h in sides:
            out.add((w, h))
            out.add((h, w))
    if not out:
        raise DataError(
            f"no bucket fits resolution {resolution} with min_side {min_side}, max_side "
            f"{max_side} and bucket step {step}; widen [min_side, max_side] so it holds a "
            f"multiple of {step}"
        )
    return sorted(out)


def square_bucket(resolution: int, step: int) -> Bucket:
    """The single bucket used when bucketing is off: resolution rounded down to the step grid."""
    side = max(step, resolution // step * step)
    return (side, side)


def assign_bucket(size: tuple[int, int], buckets: list[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest to the image's (|log(w/h) - log(bw/bh)|).

    Ties (equal ratio distance) go to the larger bucket area, then to the smaller bucket tuple,
    so the choice never depends on list order.
    """
    w, h = size
    if w <= 0 or h <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    ratio = math.log(w / h)

    def key(b: Bucket) -> tuple[float, int, Bucket]:
        # round the distance so float noise cannot break an exact tie between equal ratios
        return (round(abs(ratio - math.log(b[0] / b[1])), 12), -(b[0] * b[1]), b)

    return min(buckets, key=key)


def cover_size(size: tuple[int, int], bucket: Bucket) -> tuple[int, int]:
    """The size an image of `size` is resized to so it covers `bucket` (before cropping).

    scale = max(bw / w, bh / h); each side is rounded and never falls below the bucket's side,
    so the crop box always fits.
    """
    w, h = size
    bw, bh = bucket
    scale = max(bw / w, bh / h)
    return (max(bw, round(w * scale)), max(bh, round(h * scale)))
