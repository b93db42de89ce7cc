"""One decode per image: its upright size, a perceptual hash and a sharpness figure.

Images are decoded reduced (JPEG's DCT scaling via `draft`, then a thumbnail of at most
`SIDE` pixels), which is what makes a thousand images take seconds: neither the hash (made at
32x32) nor the sharpness figure (measured at a fixed scale, so images of any size compare)
needs the full resolution. Decoding runs in threads (PIL releases the GIL while decoding).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import imagehash
import numpy as np
from PIL import Image, ImageOps

from difftune.data.images import strict_decoding

SIDE = 512  # the long side sharpness is measured at
# EXIF orientations that turn the image a quarter (width and height swap).
QUARTER_TURNS = frozenset({5, 6, 7, 8})


@dataclass(frozen=True)
class Measured:
    """An image's upright `size` (width, height), 64-bit perceptual hash `phash`, and
    `sharpness` (variance of the Laplacian of its grayscale at `SIDE` pixels long side; low
    means blurred or featureless); `error` says why it could not be decoded (then the rest is
    empty)."""

    path: Path
    size: tuple[int, int] = (0, 0)
    phash: int = 0
    sharpness: float = 0.0
    error: str | None = None


def laplacian_variance(gray: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian of a 2-D float array (its inner pixels)."""
    g = gray.astype(np.float32)
    lap = (4 * g[1:-1, 1:-1] - g[:-2, 1:-1] - g[2:, 1:-1] - g[1:-1, :-2] - g[1:-1, 2:])
    return float(lap.var()) if lap.size else 0.0


def measure(path: Path) -> Measured:
    """Decode `path` once, reduced, and measure it; a `Measured` with `error` when it fails."""
    try:
        with strict_decoding(), Image.open(path) as raw:
            width, height = raw.size
            turn = raw.getexif().get(0x0112) in QUARTER_TURNS
            raw.draft("L", (SIDE, SIDE))  # JPEG only: decode at 1/2..1/8 scale
            gray = ImageOps.exif_transpose(raw.convert("L") if raw.mode != "L" else raw)
        gray.thumbnail((SIDE, SIDE), Image.Resampling.BILINEAR)
        phash = int(str(imagehash.phash(gray)), 16)
        return Measured(path, (height, width) if turn else (width, height), phash,
                        laplacian_variance(np.asarray(gray)))
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        return Measured(path, error=f"{type(err).__name__}: {err}")


def measure_all(paths: list[Path]) -> list[Measured]:
    """`measure` of every path, in order, decoded in threads."""
    if len(paths) < 4:
        return [measure(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(measure, paths))


def near_pairs(hashes: list[int], distance: int) -> list[tuple[int, int, int]]:
    """(i, j, Hamming distance) of every pair of 64-bit hashes at most `distance` apart, i < j."""
    h = np.array(hashes, dtype=np.uint64)
    out = []
    for i in range(len(h) - 1):
        d = np.bitwise_count(h[i + 1:] ^ h[i])
        for k in np.nonzero(d <= distance)[0]:
            out.append((i, i + 1 + int(k), int(d[k])))
    return out
