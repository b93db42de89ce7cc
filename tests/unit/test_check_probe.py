"""`check`'s report: the sample probe tells a flat image (what NaN latents decode to) from a
real one, and parameter counts read as users compare model sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from difftune.verbs.check import _flat


def test_a_flat_image_is_told_from_a_real_one(tmp_path: Path) -> None:
    Image.new("RGB", (32, 32), (0, 0, 0)).save(tmp_path / "nan.png")
    noise = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "real.png")
    one_band = np.zeros((32, 32, 3), dtype=np.uint8)
    one_band[0, 0, 2] = 1  # a single differing value in one channel is not flat
    Image.fromarray(one_band).save(tmp_path / "almost.png")
    assert _flat(tmp_path / "nan.png")
    assert not _flat(tmp_path / "real.png") and not _flat(tmp_path / "almost.png")


def test_parameter_counts_read_as_users_compare_sizes() -> None:
    from difftune.verbs.check import _amount

    assert _amount(20_430_000_000) == "20.43 B"
    assert _amount(1_234_567) == "1.23 M"
    assert _amount(4_096) == "4.10 K" and _amount(12) == "12"
