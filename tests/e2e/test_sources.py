"""Latent lookups by item and variant: flips and crops reach the model, cached or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from difftune.config import parse_config
from difftune.train.setup import fill_caches, prepare


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One wide image with a left/right asymmetric pattern, so flips and crops show."""
    folder = tmp_path_factory.mktemp("wide")
    img = Image.new("RGB", (120, 64), "navy")
    img.paste((250, 200, 0), (0, 0, 30, 64))
    img.save(folder / "wide.png")
    (folder / "wide.txt").write_text("a yellow bar on the left")
    return folder


def _run(folder: Path, latents: str) -> object:
    cfg = parse_config({
        "model": {"flavor": "tiny"},
        "datasets": [{"path": str(folder), "resolution": 64, "min_side": 32, "max_side": 128,
                      "crop": "random", "flip": True}],
        "cache": {"latents": latents},
        "train": {"steps": 1, "device": "cpu"},
        "save": {"dir": str(folder / "out")},
    }, folder)
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    return run


def test_flip_changes_latent_and_is_cached_per_variant(wide: Path) -> None:
    run = _run(wide, "memory")
    plain, flipped = run.latents.get(0, False), run.latents.get(0, True)
    assert not torch.allclose(plain, flipped)
    # Cached: the same variant is the same entry, whatever the per-sample seed.
    assert torch.equal(run.latents.get(0, False, 1), run.latents.get(0, False, 2))


def test_uncached_random_crop_is_new_for_each_sample(wide: Path) -> None:
    run = _run(wide, "none")
    item = run.data.items[0]
    assert item.bucket[0] / item.bucket[1] > 1.2  # a wide bucket with room to crop
    crops = {tuple(run.latents.get(0, False, seed).flatten()[:8].tolist()) for seed in range(6)}
    assert len(crops) > 1
